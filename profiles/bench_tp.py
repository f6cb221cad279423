"""Batch-1 decode speed at several tensor-parallel sizes, in one run on one machine:
`python -m profiles.bench_tp --model qwen3.5-9b --tp 1 2 [--prompt 512] [--tokens 256] [--out DIR]`.

Each size runs in fresh processes (one per rank, spawned; NCCL on cuda:0..N-1, gloo on the CPU) with the engine of
serving.engine on rank 0 and serving.tp_link's worker loop on the others, decode steps from CUDA graphs on GPUs.
One request warms up (kernels, graphs), then a timed one: a random prompt of --prompt tokens and --tokens greedy
new ones (ignore_eos). Decode tok/s = (tokens - 1) / (last token time - first token time); TTFT is the timed request's.
Speedup = tok/s at N / tok/s at 1; scaling efficiency = speedup / N. Prints a table; with --out writes
DIR/tp.json (the card, versions and command with it), e.g. --out profiles/results.
"""
import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def bench_rank(rank: int, world: int, init_method: str, args: argparse.Namespace, out: str) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    from model import ops
    from model.load import load_model
    from model.parallel import init_parallel
    from serving.config import EngineConfig
    from serving.engine import LLMEngine
    from serving.tp_link import serve_worker
    from serving.tp_worker import dist_backend, rank_device
    device = rank_device(args.device, rank)
    ops.set_backend("triton" if args.device == "cuda" else "reference")
    tp = init_parallel(rank, world, init_method, backend=dist_backend(args.device))
    model = load_model(args.model, device, tp=tp)
    common = dict(max_num_seqs=1, max_model_len=args.prompt + args.tokens + 16, snapshot_slots=0,
                  cuda_graphs=not args.eager)
    cfg = (EngineConfig.for_gpu_memory(args.gpu_memory_utilization, **common) if args.device == "cuda"
           else EngineConfig.for_token_budget(args.prompt + args.tokens + 16, **common))
    engine = LLMEngine(model, cfg)
    try:
        if rank == 0:
            try:
                Path(out).write_text(json.dumps(timed_run(engine, args, world)))
            finally:
                engine.close()  # the workers' loops end
        else:
            serve_worker(engine)
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


def timed_run(engine, args: argparse.Namespace, world: int) -> dict:
    from serving.sequence import SamplingParams
    model = engine.model
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    engine.generate([torch.randint(0, vocab, (args.prompt,), generator=gen).tolist()], params)  # warm-up
    prompt = torch.randint(0, vocab, (args.prompt,), generator=gen).tolist()
    start = time.perf_counter()
    engine.add_request(prompt, params)
    times = []
    while engine.has_unfinished:
        n = len(engine.step())
        times += [time.perf_counter()] * n
    return dict(tp=world, decode_tok_s=(len(times) - 1) / (times[-1] - times[0]), ttft_ms=1e3 * (times[0] - start),
                graphs=engine.graphs)


def run(world: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/row.json"
        mp.spawn(bench_rank, args=(world, f"file://{tmp}/rendezvous", args, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.5-9b", help="a preset (random weights) or an HF checkpoint folder")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--out", help="write DIR/tp.json")
    args = ap.parse_args(argv)
    if min(args.tp) < 1:
        raise SystemExit(f"--tp takes sizes >= 1, got {args.tp}")
    if args.device == "cuda" and max(args.tp) > torch.cuda.device_count():
        raise SystemExit(f"--tp {max(args.tp)} needs that many GPUs; {torch.cuda.device_count()} are visible")
    rows = [run(n, args) for n in args.tp]
    base = next((r["decode_tok_s"] for r in rows if r["tp"] == 1), None)
    for r in rows:
        if base:
            r["speedup"] = r["decode_tok_s"] / base
            r["scaling_efficiency"] = r["speedup"] / r["tp"]
        print(json.dumps(r), flush=True)
    result = dict(model=args.model, prompt_tokens=args.prompt, new_tokens=args.tokens, device=args.device, runs=rows)
    if args.out:
        from profiles.common import command_line, environment
        result.update(environment=environment(), command=command_line())
        path = Path(args.out) / "tp.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
