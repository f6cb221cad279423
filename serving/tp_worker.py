"""Tensor-parallel serving, the processes: one per rank (GPU), the scheduler on rank 0.

Every rank builds the same LLMEngine over its slice of the model; rank 0's engine sends each step to the others
(serving.tp_link), whose loop (serve_worker) runs it on their slices.

`launch` starts ranks 1..N-1 as spawned processes running `worker_main`, which meet rank 0 at a TCPStore on the
loopback interface; rank 0 joins the group once all have connected (a worker that dies first fails the launch at
once), and a WorkerGroup then watches them (the server stops its engine if one dies). A worker dies with rank 0.
NCCL_NVLS_ENABLE=0 (no NVLink multicast) is set in every process.
"""
import atexit
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import connection as mp_connection

import torch
import torch.distributed as dist

from model import ops
from model.load import load_model
from model.parallel import ParallelContext, init_parallel
from serving.engine import LLMEngine
from serving.tp_link import serve_worker

log = logging.getLogger("serving")


def dist_backend(device_type: str) -> str:
    """NCCL between GPUs, gloo between CPU processes (also on a machine that has GPUs)."""
    return "nccl" if device_type == "cuda" else "gloo"


def rank_device(device_type: str, rank: int) -> torch.device:
    """cuda:rank on GPUs (made the current device), else the CPU."""
    if device_type != "cuda":
        return torch.device(device_type)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device


def worker_main(rank: int, world_size: int, port: int, leader_pid: int, model_spec: str, device_type: str,
                engine_cfg, ops_backend: str) -> None:
    """A worker rank: join the group through rank 0's store, build its slice of the model and the same engine,
    then serve_worker."""
    die_with(leader_pid)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    # Ctrl-C (and a service manager's SIGTERM) reach the whole process group: rank 0 drains its requests, then ends
    # the workers with "stop" (gloo and NCCL notice a rank 0 that dies)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING)
    device = rank_device(device_type, rank)
    ops.set_backend(ops_backend)
    store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=STORE_TIMEOUT)
    store.set(f"{JOINED}{rank}", "1")
    tp = init_parallel(rank, world_size, backend=dist_backend(device_type), store=store)
    try:
        model = load_model(model_spec, device, tp=tp)
        serve_worker(LLMEngine(model, engine_cfg))
    finally:
        dist.destroy_process_group()


def die_with(leader_pid: int) -> None:
    """Have the kernel SIGKILL this process when rank 0 ends (Linux), so that a rank 0 killed while it starts up
    leaves no worker waiting for it; exit at once if rank 0 is already gone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != leader_pid:
        os._exit(1)


def check_splits(model_spec: str, world_size: int) -> None:
    """Raise ValueError naming the dimension that world_size ranks cannot split, before any process is spawned."""
    from pathlib import Path

    from model.config import Qwen35Config, get_preset
    from model.parallel import ParallelContext, ShardPlan
    path = Path(model_spec)
    cfg = Qwen35Config.from_json(path / "config.json") if path.is_dir() else get_preset(model_spec)
    ShardPlan.build(cfg, ParallelContext(0, world_size))


def log_failure(error: Exception) -> None:
    log.critical("%s", error)


class WorkerGroup:
    """Rank 0's handle on the spawned ranks 1..N-1, from the moment they start. A watcher thread reaps them and
    reports the first that exits with a non-zero code (a crash, a kill: the group cannot go on) to
    on_failure(RuntimeError), called in that thread (default: log_failure). A worker exits with 0 only after rank 0's
    "stop". Read exit codes from exit_codes (the watcher is their only reader while it runs). The workers ignore
    SIGTERM, so multiprocessing's exit handler would wait on a live one for ever: they are killed at exit instead."""

    def __init__(self, procs: list, on_failure: Callable[[Exception], None] | None = None):
        self.procs = procs
        self.on_failure = on_failure or log_failure
        self.failure: Exception | None = None
        self.exit_codes: dict[int, int] = {}  # rank -> exit code (negative: the signal)
        atexit.register(self.kill)  # atexit runs last-registered first: before multiprocessing's handler
        self._watcher = threading.Thread(target=self._watch, name="tp-worker-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        pending = {p.sentinel: rank for rank, p in enumerate(self.procs, 1)}
        while pending:
            for sentinel in mp_connection.wait(list(pending)):
                rank = pending.pop(sentinel)
                while self.procs[rank - 1].exitcode is None:  # the sentinel fires just before it can be reaped
                    time.sleep(0.001)
                self.exit_codes[rank] = code = self.procs[rank - 1].exitcode
                if code != 0 and self.failure is None:
                    self.failure = RuntimeError(f"tensor-parallel worker rank {rank} exited with code {code}")
                    try:
                        self.on_failure(self.failure)
                    except Exception:  # noqa: BLE001 - the watcher must go on reaping
                        log.exception("the tensor-parallel failure handler failed")

    def kill(self) -> None:
        """SIGKILL every worker still running (a no-op for those that ended)."""
        for p in self.procs:
            p.kill()

    def join(self, timeout: float) -> None:
        """Wait up to timeout seconds for every worker to end."""
        self._watcher.join(timeout)


LOOPBACK = "127.0.0.1"
JOINED = "tp_worker/joined/"  # store keys the workers set once connected
JOIN_TIMEOUT = timedelta(minutes=5)  # for spawned workers to import torch and reach rank 0's store
STORE_TIMEOUT = timedelta(minutes=30)  # of the store's gets and waits (torch's default for process groups)
PR_SET_PDEATHSIG = 1


def leader_store(world_size: int) -> dist.TCPStore:
    """Rank 0's TCPStore on a free port of the loopback interface only (torch's own server socket would listen on
    every interface), created on a socket bound here, so that no other process can take the port meanwhile."""
    sock = socket.socket()
    sock.bind((LOOPBACK, 0))
    sock.listen()
    port = sock.getsockname()[1]
    return dist.TCPStore(LOOPBACK, port, world_size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def await_workers(store: dist.TCPStore, group: WorkerGroup, timeout: timedelta = JOIN_TIMEOUT,
                  poll_s: float = 0.1) -> None:
    """Wait until every worker has connected to the store. Raises RuntimeError, and kills the workers, if one exits
    first or timeout passes (instead of rank 0 waiting in the rendezvous for half an hour)."""
    keys = [f"{JOINED}{rank}" for rank in range(1, len(group.procs) + 1)]
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(keys):
        dead = dict(group.exit_codes)
        if dead or time.monotonic() > deadline:
            group.kill()
            what = ", ".join(f"rank {r} exited with code {c}" for r, c in sorted(dead.items()))
            raise RuntimeError(f"tensor-parallel workers did not start: {what or f'none joined within {timeout}'}")
        time.sleep(poll_s)


def loopback_only() -> None:
    """Single-host tensor parallelism: gloo's and NCCL's sockets on the loopback interface (unless set already);
    inherited by the spawned workers."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def launch(world_size: int, model_spec: str, device_type: str, engine_cfg, ops_backend: str,
           timeout: timedelta | None = None,
           on_failure: Callable[[Exception], None] | None = None) -> tuple[ParallelContext, WorkerGroup]:
    """Rank 0: spawn ranks 1..world_size-1 (worker_main), wait for them at the store and join the group. Returns
    (ParallelContext, WorkerGroup); rank 0 then builds its model with model.load.load_model(..., tp=) and its
    LLMEngine, and calls engine.close() at the end. timeout: rank 0's for the model's collectives (see init_parallel).
    on_failure: the WorkerGroup's, from the start: a worker that dies once it has joined may leave this process
    blocked in a collective (init_parallel's included), so a server ends the process there. Call launch from a thread
    that lives as long as the process: the workers' parent-death signal follows the thread that spawned them."""
    import torch.multiprocessing as mp
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # inherited by the workers too
    loopback_only()
    store = leader_store(world_size)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(r, world_size, store.port, os.getpid(), model_spec, device_type,
                                                   engine_cfg, ops_backend), daemon=True)
             for r in range(1, world_size)]
    for p in procs:
        p.start()
    group = WorkerGroup(procs, on_failure)
    try:
        rank_device(device_type, 0)
        await_workers(store, group)
        tp = init_parallel(0, world_size, backend=dist_backend(device_type), timeout=timeout, store=store)
    except BaseException:
        group.kill()
        raise
    return tp, group
