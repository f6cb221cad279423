"""What each rank of tests/test_tensor_parallel.py runs (a spawned process per rank): forward_step logits, engine
greedy outputs and sharded checkpoint loads at world size N, saved by every rank to workdir/rank{r}.pt for the
test process to compare with world size 1 (computed there by the same functions with tp=None)."""
import os

import torch
import torch.distributed as dist
from hf_oracle import small_config

from model import ops
from model.loader import load_checkpoint
from model.model import Qwen35ForCausalLM
from model.parallel import ParallelContext, init_parallel
from serving import tp_link
from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.sequence import SamplingParams
from serving.tp_link import serve_worker

VOCAB = 500  # token ids drawn below every config's vocabulary (the dense checkpoint's is 509: padded shards)
SEED = 3
# name -> config: dense, MoE, and fewer KV heads than ranks (replicated); head_dim 64 as the kernels' CPU tests use
CONFIGS = {"dense": small_config(head_dim=64), "moe": small_config(moe=True, head_dim=64),
           "kv-replicated": small_config(num_key_value_heads=1, head_dim=64)}
# case -> (config, decode padded to the graph ladder, KV pages of 8 tokens: 12 forces preemption and recompute)
ENGINE_CASES = {"dense-padded": ("dense", True, 64), "moe": ("moe", False, 64), "dense-preempted": ("dense", False, 12)}
NEW_TOKENS = 16


def step_logits(model: Qwen35ForCausalLM, device) -> list[torch.Tensor]:
    """Prefill of 2 x 9 tokens (all logits), then two decode steps (last logits): through forward_step."""
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1)).to(device)
    cache = model.new_cache(2, 16)
    out = [model(ids[:, :9], cache)]
    out += [model(ids[:, i:i + 1], cache, all_logits=False) for i in (9, 10)]
    return [o.float().cpu() for o in out]


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    first = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (21, 5, 40)]
    return first + [first[2][:32] + [1, 2, 3]]  # the last one hits the third's prefix (KV pages and GDN snapshot)


def engine_outputs(engine: LLMEngine) -> tuple[list[list[int]], list[int]]:
    """Greedy NEW_TOKENS per prompt: three prompts batched (chunked prefill, mixed steps), then a prefix hit.
    Returns the outputs and each request's cached prompt tokens."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ps = prompts()
    done = engine.generate(ps[:3], params) + engine.generate(ps[3:], params)
    return [o.output_ids for o in done], [o.cached_tokens for o in done]


def engine_config(device_type: str, num_pages: int = 64) -> EngineConfig:
    return EngineConfig(num_pages=num_pages, page_size=8, max_num_seqs=4, snapshot_slots=8, max_num_batched_tokens=32,
                        cuda_graphs=device_type == "cuda")


def build(name: str, device, tp: ParallelContext | None) -> Qwen35ForCausalLM:
    return Qwen35ForCausalLM.random(CONFIGS[name], seed=SEED, device=device, tp=tp)


def run_engine(model: Qwen35ForCausalLM, padded: bool, num_pages: int, device_type: str) -> dict | None:
    """Rank 0 (or world size 1): the outputs and the runner's step counts; workers serve until rank 0 closes."""
    engine = LLMEngine(model, engine_config(device_type, num_pages), pad_decode=padded)
    if model.tp.rank != 0:  # a worker replays rank 0's inputs: it feeds itself nothing and reads no tokens
        assert not engine.runner.fed_decode and engine.runner.token_ring is None
        serve_worker(engine)
        return None
    outs, cached = engine_outputs(engine)
    engine.close()
    r = engine.runner
    return dict(outputs=outs, cached=cached, graph_steps=r.num_graph_steps, eager_steps=r.num_eager_steps,
                preemptions=engine.scheduler.num_preemptions)


def run_rank(rank: int, world_size: int, workdir: str, device_type: str = "cpu") -> None:
    torch.set_num_threads(1)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
        ops.set_backend("triton")
    tp = init_parallel(rank, world_size, f"file://{workdir}/rendezvous",
                       backend="nccl" if device_type == "cuda" else "gloo")
    try:
        results = {"logits": {n: step_logits(build(n, device, tp), device) for n in CONFIGS}}
        results["engine"] = {}
        for case, (n, padded, pages) in ENGINE_CASES.items():
            # the preempted case sends every message longer than 16 ints in a second broadcast
            tp_link.CAPACITY = 16 if pages < 64 else tp_link.CAPACITY
            results["engine"][case] = run_engine(build(n, device, tp), padded, pages, device_type)
        results["loaded"] = {}
        for name in ("dense", "moe"):
            if not os.path.isdir(f"{workdir}/ckpt-{name}"):  # no transformers to write them (a GPU machine)
                continue
            model = load_checkpoint(f"{workdir}/ckpt-{name}", device=device, dtype=torch.float32, progress=False,
                                    tp=tp)
            results["loaded"][name] = step_logits(model, device)
        torch.save(results, f"{workdir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def orphan_probe(leader_pid: int, pid_file: str) -> None:
    """A stand-in worker (test_a_worker_dies_with_rank_0): die_with its leader, write its pid, then wait."""
    import os
    import time
    from pathlib import Path

    from serving.tp_worker import die_with
    die_with(leader_pid)
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(120)


def join_then_exit(port: int, code: int) -> None:
    """A stand-in worker that checks in at rank 0's store, then dies before the group forms."""
    import os

    import torch.distributed as dist

    from serving.tp_worker import JOINED, LOOPBACK
    dist.TCPStore(LOOPBACK, port, 2, is_master=False).set(f"{JOINED}1", "1")
    os._exit(code)


def stubborn_worker() -> None:
    """A stand-in worker that ignores SIGTERM, as worker_main does, and waits."""
    import signal
    import time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(120)
