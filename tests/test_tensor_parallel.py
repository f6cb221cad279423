"""Tensor parallelism (model.parallel, serving.tp_link, serving.tp_worker) on the CPU with gloo: two spawned ranks
(tests/tp_scenarios.py, run once per module) against world size 1 in this process. forward_step logits equal
(dense, MoE, replicated KV heads), the engine's greedy output through the rank-0 scheduler and a worker equals
TP=1 (batching, chunked prefill, padded decode, a prefix-cache hit), and checkpoints written by transformers'
save_pretrained load sharded, reading only each rank's slices. Bad splits raise ValueError naming the dimension.
The NCCL test (CUDA graphs with the collectives inside) needs >= 2 GPUs."""
import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import tp_scenarios as S
from conftest import rel_err
from hf_oracle import hf_text_model, small_config
from http_request import request

import model.loader as loader_module
from model.loader import load_checkpoint, load_state_dict
from model.model import Qwen35ForCausalLM, _FullShapes
from model.parallel import ParallelContext, ShardPlan
from serving.engine import LLMEngine
from serving.server import parse_args

TOL = 1e-5
CHECKPOINTS = {"dense": small_config(vocab_size=509, tie_word_embeddings=True, head_dim=64),  # last shard padded
               "moe": small_config(moe=True, head_dim=64)}


def write_checkpoints(workdir) -> None:
    for name, cfg in CHECKPOINTS.items():
        hf_text_model(cfg, seed=5).save_pretrained(workdir / f"ckpt-{name}")


def spawn_ranks(workdir, device_type: str) -> list[dict]:
    """Both ranks' results (the checkpoints must be in workdir)."""
    mp.spawn(S.run_rank, args=(2, str(workdir), device_type), nprocs=2, join=True)
    return [torch.load(workdir / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder with the checkpoints written by save_pretrained."""
    path = tmp_path_factory.mktemp("tp")
    write_checkpoints(path)
    return path


@pytest.fixture(scope="module")
def ranks(workdir) -> list[dict]:
    """Both ranks' results, from one spawn for the whole module (process start-up dominates)."""
    return spawn_ranks(workdir, "cpu")


def assert_same_logits(tp_out: list[torch.Tensor], ref: list[torch.Tensor], what: str, tol: float = TOL) -> None:
    for i, (a, b) in enumerate(zip(tp_out, ref)):
        assert a.shape == b.shape, f"{what} step {i}: {tuple(a.shape)} vs {tuple(b.shape)}"
        err = rel_err(a, b)
        assert err < tol, f"{what} step {i}: rel err {err:.2e} at TP=2 vs TP=1"


# ---- world size 2 against world size 1 -----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(S.CONFIGS))
def test_forward_step_logits_tp2_equal_tp1(ranks, name):
    ref = S.step_logits(S.build(name, "cpu", None), "cpu")
    for r in range(2):  # every rank ends with the whole (gathered) logits
        assert_same_logits(ranks[r]["logits"][name], ref, f"{name} rank {r}")


@pytest.mark.parametrize("case", list(S.ENGINE_CASES))
def test_engine_greedy_tp2_equals_tp1(ranks, case):
    name, padded, pages = S.ENGINE_CASES[case]
    ref = S.run_engine(S.build(name, "cpu", None), padded, pages, "cpu")
    got = ranks[0]["engine"][case]
    assert ranks[1]["engine"][case] is None  # the worker rank only served
    assert all(len(o) == S.NEW_TOKENS for o in got["outputs"])
    assert got["outputs"] == ref["outputs"]
    assert got["cached"] == ref["cached"] and got["cached"][-1] > 0  # the last request hit the prefix cache
    assert (got["eager_steps"], got["preemptions"]) == (ref["eager_steps"], ref["preemptions"])
    assert (got["preemptions"] > 0) == (pages < 64)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_sharded_checkpoint_logits_equal_tp1(ranks, workdir, name):
    ref = S.step_logits(load_checkpoint(workdir / f"ckpt-{name}", dtype=torch.float32, progress=False), "cpu")
    for r in range(2):
        assert_same_logits(ranks[r]["loaded"][name], ref, f"loaded {name} rank {r}")


def test_launch_serves_through_a_spawned_worker(workdir):
    """serving.tp_worker.launch (what `python -m serving.server --tp 2` runs): this process is rank 0 over a loaded
    checkpoint, one spawned worker_main serves; the greedy output equals TP=1 and the worker exits on close."""
    import torch.distributed as dist

    from model.load import load_model
    from serving.tp_worker import launch
    path, cfg = str(workdir / "ckpt-dense"), S.engine_config("cpu")
    prompts = S.prompts()[:2]
    params = S.SamplingParams(max_tokens=6, ignore_eos=True)
    ref = [o.output_ids for o in LLMEngine(load_model(path, "cpu"), cfg).generate(prompts, params)]
    tp, workers = launch(2, path, "cpu", cfg, "reference", timeout=timedelta(seconds=120))  # a dead worker fails it
    failures = []
    workers.on_failure = failures.append
    try:
        engine = LLMEngine(load_model(path, "cpu", tp=tp), cfg)
        assert [o.output_ids for o in engine.generate(prompts, params)] == ref
        engine.close()
        workers.join(timeout=60)
        assert workers.exit_codes == {1: 0} and not failures
    finally:
        dist.destroy_process_group()


def listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* write them) of the sockets listening on port."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_rendezvous_store_listens_on_loopback_only():
    """Rank 0's rendezvous store listens on 127.0.0.1 only; torch's own TCPStore server, the control, listens on
    every interface."""
    from serving.tp_worker import leader_store
    assert listening_addresses(leader_store(2).port) == ["0100007F"]
    default = torch.distributed.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    assert listening_addresses(default.port) != ["0100007F"]


def test_a_worker_that_dies_before_joining_fails_the_launch_at_once():
    """A worker that exits before it reaches the store (a crash at import) fails rank 0's wait in well under a
    second of polling, naming the rank and exit code, instead of a half-hour rendezvous timeout."""
    import time

    from serving.tp_worker import WorkerGroup, await_workers, leader_store
    store = leader_store(3)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=time.sleep, args=(60,), daemon=True), ctx.Process(target=os._exit, args=(3,))]
    for p in procs:
        p.start()
    failures = []
    group = WorkerGroup(procs, failures.append)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 2 exited with code 3"):
        await_workers(store, group)
    assert time.monotonic() - start < 30
    group.join(timeout=10)
    assert group.exit_codes[1] == -9, "the other worker was not killed"


def test_a_worker_that_never_joins_times_out():
    import time

    from serving.tp_worker import WorkerGroup, await_workers, leader_store
    store = leader_store(2)
    proc = mp.get_context("spawn").Process(target=time.sleep, args=(60,), daemon=True)
    proc.start()
    group = WorkerGroup([proc], lambda error: None)
    with pytest.raises(RuntimeError, match="none joined within"):
        await_workers(store, group, timeout=timedelta(seconds=1))
    group.join(timeout=10)
    assert group.exit_codes == {1: -9}


def test_a_worker_that_dies_after_joining_is_reported():
    """Between a worker's check-in and the group's forming, rank 0 waits in init_process_group: the watcher, which
    runs from the workers' start, reports a death there (before, rank 0 waited for good)."""
    import threading

    from serving.tp_worker import WorkerGroup, await_workers, leader_store
    store = leader_store(2)
    proc = mp.get_context("spawn").Process(target=S.join_then_exit, args=(store.port, 7), daemon=True)
    proc.start()
    reported = threading.Event()
    group = WorkerGroup([proc], lambda error: reported.set())
    try:
        await_workers(store, group)  # it may also see the exit first: then it raises, naming it
    except RuntimeError as error:
        assert "rank 1 exited with code 7" in str(error)
    assert reported.wait(timeout=30) and group.exit_codes == {1: 7}


def test_rank_0_exits_though_a_worker_ignores_sigterm(tmp_path):
    """multiprocessing's exit handler sends daemon children SIGTERM, which the workers ignore, then joins them
    without a timeout; the WorkerGroup kills them first, so a rank 0 that fails at startup still exits."""
    import subprocess
    script = ("import multiprocessing as mp, sys, time; import tp_scenarios\n"
              "from serving.tp_worker import WorkerGroup\n"
              "p = mp.get_context('spawn').Process(target=tp_scenarios.stubborn_worker, daemon=True); p.start()\n"
              "WorkerGroup([p]); time.sleep(2); sys.exit(3)")
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                          timeout=60, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr[-2000:]


def process_alive(pid: int) -> bool:
    """Whether pid runs (a zombie, ended but not yet reaped, does not)."""
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "\nState:\tZ" not in status.read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_worker_dies_with_rank_0(tmp_path):
    """A rank 0 that is SIGKILLed (e.g. while it starts up) leaves no worker behind waiting for it."""
    import signal
    import subprocess
    import time
    pid_file = tmp_path / "worker.pid"
    leader = subprocess.Popen([sys.executable, "-c", (
        "import multiprocessing as mp, os, sys, time; import tp_scenarios\n"
        f"mp.get_context('spawn').Process(target=tp_scenarios.orphan_probe, args=(os.getpid(), {str(pid_file)!r}))"
        ".start(); time.sleep(120)")], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and leader.poll() is None, "the stand-in worker did not start"
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        assert process_alive(worker)
        leader.send_signal(signal.SIGKILL)
        leader.wait(timeout=10)
        deadline = time.monotonic() + 10
        while process_alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_alive(worker), "the worker outlived a SIGKILLed rank 0"
    finally:
        leader.kill()


def test_worker_group_reports_a_worker_that_dies_not_one_that_stops():
    """WorkerGroup's watcher: an exit with code 0 (after "stop") is quiet; a killed worker is reported once, by
    rank and exit code."""
    import threading
    import time

    from serving.tp_worker import WorkerGroup
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=time.sleep, args=(0,), daemon=True),
             ctx.Process(target=time.sleep, args=(60,), daemon=True)]
    for p in procs:
        p.start()
    reported = threading.Event()
    failures = []
    group = WorkerGroup(procs, lambda error: (failures.append(error), reported.set()))
    deadline = time.monotonic() + 30
    while 1 not in group.exit_codes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group.exit_codes == {1: 0} and not failures
    procs[1].kill()
    assert reported.wait(timeout=30)
    group.join(timeout=30)
    assert len(failures) == 1 and str(failures[0]) == "tensor-parallel worker rank 2 exited with code -9"
    assert group.failure is failures[0] and group.exit_codes == {1: 0, 2: -9}


# ---- sharded loading, in this process (no collectives needed) -------------------------------------------------

class ReadLog:
    """Wraps safetensors' safe_open to record which tensors are read whole and which through slices."""

    def __init__(self, real):
        self.real, self.whole, self.sliced = real, [], []

    def __call__(self, *args, **kwargs):
        log = self

        class Handle:
            def __init__(self):
                self.f = log.real(*args, **kwargs)

            def __enter__(self):
                self.inner = self.f.__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def keys(self):
                return self.inner.keys()

            def get_tensor(self, name):
                log.whole.append(name)
                return self.inner.get_tensor(name)

            def get_slice(self, name):
                log.sliced.append(name)
                return self.inner.get_slice(name)

        return Handle()


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_loader_slices_equal_the_full_tensors(tmp_path, monkeypatch, name):
    """Each rank's parameters are exactly its slices of the TP=1 load (padding rows zero); nothing is read whole and
    experts of the other rank are never opened."""
    cfg = CHECKPOINTS[name]
    hf_text_model(cfg, seed=6).save_pretrained(tmp_path)
    full = dict(load_checkpoint(tmp_path, dtype=torch.float32, progress=False).named_parameters())
    shapes = _FullShapes(cfg)
    for r in range(2):
        reads = ReadLog(loader_module.safe_open)
        monkeypatch.setattr(loader_module, "safe_open", reads)
        model = load_checkpoint(tmp_path, dtype=torch.float32, progress=False, tp=ParallelContext(r, 2))
        monkeypatch.undo()
        assert reads.whole == [] and reads.sliced
        if cfg.is_moe:
            other = range(3, 6) if r == 0 else range(0, 3)
            assert not [n for n in reads.sliced if any(f".experts.{e}." in n for e in other)]
        for pname, p in model.named_parameters():
            torch.testing.assert_close(p, shapes.take(model.plan, pname, full[pname]), rtol=0, atol=0,
                                       msg=lambda m, pname=pname, r=r: f"rank {r} {pname}: {m}")
        if name == "dense":
            assert model.model.embed_tokens.weight.shape[0] == 255
            assert r == 0 or model.model.embed_tokens.weight[-1].abs().sum() == 0  # row 509 is padding
            assert model.lm_head.weight is model.model.embed_tokens.weight


def test_fused_experts_in_memory_load_sharded():
    """transformers' in-memory MoE (experts fused: gate_up_proj (E, 2I, H)) through load_state_dict at TP=2: each
    rank's experts are its rows of the fused tensors."""
    cfg = CHECKPOINTS["moe"]
    state = hf_text_model(cfg, seed=7).state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    full = dict(load_state_dict(Qwen35ForCausalLM.empty(cfg), state).named_parameters())
    for r in range(2):
        model = load_state_dict(Qwen35ForCausalLM.empty(cfg, tp=ParallelContext(r, 2)), state)
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.shape[0] == 3
        torch.testing.assert_close(experts.down_proj, full["model.layers.0.mlp.experts.down_proj"][3 * r:3 * r + 3],
                                   rtol=0, atol=0)
        torch.testing.assert_close(experts.gate_up_proj,
                                   full["model.layers.0.mlp.experts.gate_up_proj"][3 * r:3 * r + 3], rtol=0, atol=0)


def test_step_messages_round_trip():
    from serving.batch import StepLists
    from serving.tp_link import decode, encode
    edits = [("table", [1, 2], [0, 1], [5, 6]), ("reset", [3]), ("copy", 4, 9), ("table", [7], [3], [8])]
    for kind, payload in [("decode", (4, 3, list(range(12)))), ("stop", None),
                          ("eager", StepLists([1, 2, 3], [0, 1, 2], [8, 9, 10], [0, 2, 3], [2, 1], [5, 6], 2,
                                                 [1, 0], [11, 6]))]:
        for e in (edits, []):
            assert decode(encode(kind, e, payload)) == (kind, e, payload)


# ---- the plan --------------------------------------------------------------------------------------------------

def test_plan_slices_gdn_channels_by_key_head_groups():
    cfg = small_config(linear_num_key_heads=2, linear_num_value_heads=4)  # dk = dv = 16: q 32 | k 32 | v 64
    plan = ShardPlan.build(cfg, ParallelContext(1, 2))
    assert plan.pieces("model.layers.0.linear_attn.in_proj_qkv.weight") == (0, [(16, 32), (48, 64), (96, 128)])
    assert plan.pieces("model.layers.0.linear_attn.conv1d.weight") == (0, [(16, 32), (48, 64), (96, 128)])
    assert plan.pieces("model.layers.0.linear_attn.in_proj_z.weight") == (0, [(32, 64)])
    assert plan.pieces("model.layers.0.linear_attn.A_log") == (0, [(2, 4)])
    assert plan.pieces("model.layers.0.linear_attn.out_proj.weight") == (1, [(32, 64)])
    assert plan.pieces("model.layers.0.linear_attn.norm.weight") is None
    assert plan.local.conv_dim == 64 and plan.local.linear_num_value_heads == 2


def test_plan_replicates_kv_heads_when_fewer_than_ranks():
    cfg = small_config(num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8)
    for rank, kv in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        plan = ShardPlan.build(cfg, ParallelContext(rank, 4))
        assert (plan.kv_heads.start, plan.kv_heads.size) == (kv, 1)
        assert plan.pieces("model.layers.3.self_attn.k_proj.weight") == (0, [(kv * 32, kv * 32 + 32)])
        assert plan.pieces("model.layers.3.self_attn.q_proj.weight") == (0, [(rank * 64, rank * 64 + 64)])


def test_world_size_one_is_the_plain_model():
    cfg = small_config()
    model = Qwen35ForCausalLM.random(cfg, seed=0)
    assert not model.plan.sharded and model.cache_config is cfg
    assert model.model.embed_tokens.weight.shape[0] == cfg.vocab_size
    assert model.tp.all_reduce(x := torch.ones(3)) is x


GDN4 = dict(linear_num_key_heads=4, linear_num_value_heads=8)  # splits over 4 ranks


@pytest.mark.parametrize("overrides, world, match", [
    (dict(num_attention_heads=4, num_key_value_heads=2), 3, "num_attention_heads \\(4\\) is not divisible"),
    (dict(num_attention_heads=4, num_key_value_heads=1), 8, "num_attention_heads \\(4\\) is fewer than the tensor"),
    (dict(num_attention_heads=6, num_key_value_heads=3), 2, "num_key_value_heads \\(3\\) is not divisible"),
    (dict(num_attention_heads=12, num_key_value_heads=3), 4, "cannot be replicated evenly"),
    (dict(linear_num_key_heads=2, linear_num_value_heads=4), 4, "linear_num_key_heads \\(2\\).*whole key-head"),
    (dict(GDN4, intermediate_size=90), 4, "intermediate_size \\(90\\)"),
    (dict(GDN4, moe=True), 4, "num_experts \\(6\\).*experts are split"),
    (dict(GDN4, moe=True, num_experts=8, shared_expert_intermediate_size=50), 4, "shared_expert_intermediate_size"),
])
def test_bad_splits_raise_value_error(overrides, world, match):
    cfg = small_config(**overrides)
    with pytest.raises(ValueError, match=match):
        Qwen35ForCausalLM(cfg, ParallelContext(0, world))


def test_bad_rank_raises():
    with pytest.raises(ValueError, match="rank 2 of world size 2"):
        ParallelContext(2, 2)


def test_server_takes_tp():
    assert parse_args(["--tp", "2"]).tp == 2 and parse_args([]).tp == 1


@pytest.mark.parametrize("tp, message", [(3, "num_attention_heads"), (4, "linear_num_key_heads")])
def test_a_split_the_model_cannot_take_is_refused_before_spawning(monkeypatch, tp, message):
    from serving import server, tp_worker
    monkeypatch.setattr(tp_worker, "launch", lambda *a, **k: pytest.fail("spawned workers"))
    with pytest.raises(SystemExit, match=f"--tp {tp}: {message}"):
        server.main(["--model", "tiny", "--device", "cpu", "--tp", str(tp)])


def test_tp1_engine_has_no_link():
    engine = LLMEngine(Qwen35ForCausalLM.random(small_config(), seed=0), S.engine_config("cpu"))
    assert engine.link is None and engine.runner.link is None and type(engine.pools).__name__ == "CachePools"


# ---- NCCL on two GPUs (the lead's nvidia-h200-x2 run) ----------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_tp2_equals_tp1_with_cuda_graphs(tmp_path):
    """The same scenarios with NCCL on cuda:0/1, the triton ops and decode CUDA graphs (collectives captured)."""
    from model import ops
    got = spawn_ranks(tmp_path, "cuda")  # the checkpoint loads are the CPU test's (transformers may be absent)
    with ops.use_backend("triton"):
        for name in S.CONFIGS:
            ref = S.step_logits(S.build(name, "cuda", None), "cuda")
            assert_same_logits(got[0]["logits"][name], ref, f"{name} on GPUs", tol=1e-4)
        for case, (name, padded, pages) in S.ENGINE_CASES.items():
            ref = S.run_engine(S.build(name, "cuda", None), padded, pages, "cuda")
            assert got[0]["engine"][case]["outputs"] == ref["outputs"], case
            if not S.CONFIGS[name].is_moe:
                assert got[0]["engine"][case]["graph_steps"] > 0, "decode steps did not replay graphs at TP=2"


def children(pid: int) -> list[int]:
    """The direct child processes of pid (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the worker through Linux's /proc")
def test_server_tp2_serves_then_stops_when_a_worker_dies(tmp_path):
    """`python -m serving.server --tp 2` end to end on the CPU: it serves; a SIGKILLed worker makes /health say
    "engine stopped" and requests fail at once with the rank named; Ctrl-C then ends the server with exit code 1
    (the group failed) and leaves no process behind."""
    import signal
    import socket
    import subprocess
    import time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "serving.server", "--model", "tiny", "--device", "cpu",
                               "--tp", "2", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if request("GET", url + "/health").status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3}
        assert request("POST", url + "/v1/completions", body).status == 200
        workers = children(server.pid)
        assert workers, "no worker process"
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (reply := request("GET", url + "/health")).status != 503 or reply.json()["status"] != "engine stopped":
            assert time.monotonic() < deadline, "the engine did not stop"
            time.sleep(0.2)
        reply = request("POST", url + "/v1/completions", body)
        assert reply.status == 500 and "exited with code -9" in reply.json()["error"]["message"]
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 1
        assert not [pid for pid in workers if process_alive(pid)]
    finally:
        server.kill()
        server.wait(timeout=30)
        log.close()
