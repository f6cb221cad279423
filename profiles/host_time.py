"""Where an engine step's time goes: `python -m profiles.host_time --model qwen3.5-2b --ctx 50000 --new 800`.

A returning agent turn (ctx cached tokens, then `new` more) is one eager prefill step. This builds the engine
(random weights), warms it up (LLMEngine.warm_up), caches the context, then times the returning turn's step
with torch.profiler: the step's wall time, the GPU's busy time, and the host time by operator (self CPU), with
the kernel launches counted by name. A step whose wall time is far above its GPU time is host-bound: its
launches and the Python around them are the cost (on the H200 a 2B step of 800 tokens runs ~12 ms of kernels).

`--decode B` profiles a decode step of B sequences over ctx tokens instead: once eagerly (every kernel's GPU time,
largest first) and as a CUDA-graph replay (the step's time per token). The gap between the graph's step time and
the eager kernels' sum is what launches and kernel ramps cost inside the graph. `--ab KNOB` (AB_KNOBS) times a
decode knob's variants in one process, alternated, through the CUDA graph only: each variant is a config (a
kernels.tuning.KernelTuning and EngineConfig fields), set for the life of the engines it builds.
"""
import argparse
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

import torch
import triton

from kernels import registry
from kernels.tuning import KernelTuning
from model import ops
from model.load import describe_model, load_model
from profiles.common import host_cpu, print_table
from serving.config import EngineConfig
from serving.device import pick_device
from serving.engine import LLMEngine
from serving.sequence import SamplingParams


def returning_step(engine: LLMEngine, ctx: int, new: int, seed: int = 0) -> int:
    """Cache a ctx-token conversation, queue its returning turn (new tokens), and schedule it; returns the queued
    request's id after the context is cached (the caller runs engine.step())."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    history = torch.randint(vocab, (ctx,), generator=gen).tolist()
    out = engine.generate([history], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    turn = history + out.output_ids + torch.randint(vocab, (new,), generator=gen).tolist()
    return engine.add_request(turn, SamplingParams(max_tokens=1, ignore_eos=True))


def returning_walls(engine: LLMEngine, ctx: int, new: int, turns: int = 5) -> list[float]:
    """Wall ms of the returning turn's step (returning_step), unprofiled and synchronised, for `turns` turns."""
    walls = []
    for seed in range(10, 10 + turns):
        seq_id = returning_step(engine, ctx, new, seed=seed)
        walls.append(time_steps(engine, 1))
        while engine.has_unfinished:
            engine.step()
        engine.pop_output(seq_id)
    return walls


def decoding_batch(engine: LLMEngine, batch: int, ctx: int, seed: int = 0) -> None:
    """Prefill `batch` ctx-token prompts that then decode 240 tokens, so that the next engine.step() is a decode."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    for _ in range(batch):
        engine.add_request(torch.randint(vocab, (ctx,), generator=gen).tolist(),
                           SamplingParams(max_tokens=240, ignore_eos=True))
    sched = engine.scheduler
    while sched.waiting or any(s.num_uncomputed_tokens > 1 for s in sched.running):
        engine.step()
    engine.step()  # the first decode (the graphs' page-table rows get synced)


def time_steps(engine: LLMEngine, steps: int) -> float:
    """Mean wall ms of `steps` engine steps (decodes), synchronised."""
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / steps


def python_profile(engine: LLMEngine, top: int) -> tuple[float, list[dict]]:
    """One engine step under cProfile (no CUDA hooks, so launches cost what they cost): (wall ms, the top functions
    by own time). A large own time in `tolist` is the host waiting for the GPU; in a launch or a torch op, host cost."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.runcall(engine.step)
    wall = 1e3 * (time.perf_counter() - start)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, prim calls, own s, cumulative s, callers)
    rows = [{"function": f"{name} ({file.rsplit('/', 1)[-1]}:{line})"[:70], "calls": v[0], "own_ms": 1e3 * v[2],
             "cumulative_ms": 1e3 * v[3]} for (file, line, name), v in stats.items()]
    return wall, sorted(rows, key=lambda r: -r["own_ms"])[:top]


def profile_step(engine: LLMEngine) -> tuple[float, list[dict], Counter]:
    """One engine step under torch.profiler: (wall ms, the top operators by self CPU time, kernels by name)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - start)
    events = prof.key_averages()
    rows = sorted(({"op": e.key[:60], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                    "gpu_ms": getattr(e, "self_device_time_total", 0) / 1e3} for e in events),
                  key=lambda r: -r["self_cpu_ms"])
    kernels = Counter({e.key[:60]: e.count for e in events if getattr(e, "self_device_time_total", 0) > 0})
    return wall, rows, kernels


def launch_costs(reps: int = 40) -> list[dict]:
    """On the GPU: host time to enqueue one call (no sync inside the loop) against the call's total, for the Triton
    rms_norm (our wrapper and Triton's launcher), its kernel launched bare (Triton's JITFunction.run: binding,
    specialisation, cache key) and by its compiled handle (Triton's C launcher alone), and cuBLAS projections at
    decode and prefill row counts. The gaps between the three rms_norm rows say what a launch path that skips our
    checks, or Triton's binding, would save."""
    import torch.nn.functional as F

    from kernels import norms
    dev, bf16 = "cuda", torch.bfloat16
    w = torch.randn(8224, 2048, device=dev, dtype=bf16)
    x, nw, o = (torch.randn(800, 2048, device=dev, dtype=bf16), torch.randn(2048, device=dev, dtype=bf16),
                torch.empty(800, 2048, device=dev, dtype=bf16))
    block_n, rows_per, warps = norms._launch_shape(2048)
    grid = (triton.cdiv(800, rows_per), 1, 1)
    args = (x, x, nw, o, 800, 2048, 2048, 2048, 2048, 1e-6, x, False, block_n, rows_per, False, False)
    compiled = norms._rms_norm_kernel[grid](*args, num_warps=warps)

    def bare():
        norms._rms_norm_kernel[grid](*args, num_warps=warps)

    def handle():
        stream = torch.cuda.current_stream().cuda_stream
        compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)

    calls = [("rms_norm (Triton) 800 x 2048", norms.rms_norm, (x, nw, 1e-6)),
             ("  its kernel[grid] (Triton's run)", bare, ()), ("  its compiled handle (C launcher)", handle, ())]
    calls += [(f"F.linear (cuBLAS) {m} x 2048 @ 8224 x 2048", F.linear,
               (torch.randn(m, 2048, device=dev, dtype=bf16), w)) for m in (16, 800, 2048)]
    rows = []
    for name, fn, fn_args in calls:
        fn(*fn_args)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn(*fn_args)
        queued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        rows.append({"call": name, "host_us": 1e6 * (queued - start) / reps, "total_us": 1e6 * (done - start) / reps})
    return rows


def admission_keys(ctx: int, new: int, page_size: int = 16, reps: int = 5) -> list[dict]:
    """Host ms to compute a returning turn's prefix-cache keys (ctx tokens of a finished request, then new ones):
    every page hashed, against the keys taken from serving.page_key_memo. Best of reps; no model, no device."""
    from serving.page_key_memo import PageKeyMemo
    from serving.sequence import SamplingParams, Sequence
    gen = torch.Generator().manual_seed(0)
    history = torch.randint(248_320, (ctx,), generator=gen).tolist()
    memo = PageKeyMemo(page_size)
    done = Sequence(0, history, SamplingParams(), torch.Generator())
    done.page_hashes(ctx // page_size, page_size)
    memo.remember(done)
    rows = []
    for label, seeded in (("hash every page", False), ("memo of the finished request", True)):
        best = float("inf")
        for rep in range(reps):
            turn = Sequence(1 + rep, history + [1] * new, SamplingParams(), torch.Generator())
            start = time.perf_counter()
            if seeded:
                memo.seed(turn)
            turn.page_hashes((turn.num_tokens - 1) // page_size, page_size)
            best = min(best, 1e3 * (time.perf_counter() - start))
        rows.append({"keys": label, "pages": (ctx + new - 1) // page_size, "host_ms": best})
    return rows


@dataclass(frozen=True)
class Variant:
    """One side of an A/B: the kernel tuning it runs under and the EngineConfig fields of the engines it builds."""
    tuning: KernelTuning = KernelTuning()
    engine: tuple[tuple[str, object], ...] = ()


MIB = 2**20
UNBOUNDED_K = 2**30
# --ab knobs: name -> {variant name: Variant}; each variant is a config, set for its engines' life (graphs capture
# the kernels chosen under it)
AB_KNOBS = {
    # the pre-norm projection's norm inside the Triton GEMV (up to 4 rows) at every K, by the K rule, or never
    "prenorm": {"fused": Variant(KernelTuning(fused_norm_max_k=UNBOUNDED_K)), "rule": Variant(),
                "unfused": Variant(KernelTuning(fused_norm_max_k=0))},
    # the smallest weight one bf16 row streams through the TMA-ring GEMV
    "tma_min": {"16m": Variant(KernelTuning(tma_min_bytes=16 * MIB)), "8m": Variant(),
                "4m": Variant(KernelTuning(tma_min_bytes=4 * MIB))},
    # the chained TMA GEMV's producer pause before each grid sync
    "tma_pause": {"80k": Variant(), "96k": Variant(KernelTuning(chain_pause_bytes=96 * 2**10)),
                  "off": Variant(KernelTuning(chain_pause_bytes=0))},
    # projections of 2-4 rows (a speculative verify step's, batch 2-4 decode) on the skinny GEMM or the Triton GEMV
    "verify_rows": {"skinny": Variant(), "gemv": Variant(KernelTuning(gemv_max_rows=4))},
    # the decode step's inputs written by the last step's argmax, no copy before a fed graph
    "fed_decode": {"off": Variant(engine=(("fed_decode", False),)), "on": Variant(engine=(("fed_decode", True),))},
    # a fed decode's argmax also stores its tokens in pinned host memory: no copy between two graphs
    "token_ring": {"off": Variant(engine=(("token_ring", False),)), "on": Variant(engine=(("token_ring", True),))},
}
# EngineConfig fields every engine built here takes: the active variant's
ENGINE_FIELDS: dict = {}


def ab_knob(name: str) -> str:
    """argparse type of --ab: a knob of AB_KNOBS, or several joined by '+' (every combination of their variants)."""
    unknown = [k for k in name.split("+") if k not in AB_KNOBS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown knob {unknown[0]!r}; one of {', '.join(sorted(AB_KNOBS))}")
    return name


def combined(first: Variant, second: Variant) -> Variant:
    """Both variants at once: second's tuning fields that differ from the defaults over first's."""
    default = KernelTuning()
    changed = {f.name: getattr(second.tuning, f.name) for f in fields(KernelTuning)
               if getattr(second.tuning, f.name) != getattr(default, f.name)}
    return Variant(replace(first.tuning, **changed), first.engine + second.engine)


def knob_variants(knob: str) -> dict[str, Variant]:
    """{variant name: Variant} of one of AB_KNOBS; of 'A+B', every pair of A's and B's variants, named 'a/b'."""
    if "+" in knob:
        first, second = (knob_variants(k) for k in knob.split("+", 1))
        return {f"{a}/{b}": combined(va, vb) for a, va in first.items() for b, vb in second.items()}
    return dict(AB_KNOBS[knob])


@contextmanager
def running(variant: Variant):
    """Engines built and stepped inside run under the variant's tuning and EngineConfig fields."""
    held = dict(ENGINE_FIELDS)
    ENGINE_FIELDS.update(variant.engine)
    try:
        with registry.use(tuning=variant.tuning):
            yield
    finally:
        ENGINE_FIELDS.clear()
        ENGINE_FIELDS.update(held)


def decode_ab(model, args, knob: str, repeats: int = 2) -> list[dict]:
    """The decode step through its CUDA graph under each variant of a knob, alternated; the knob's default after."""
    rows = []
    for r in range(repeats):
        for name, variant in knob_variants(knob).items():
            with running(variant):
                engine = decoding_engine(model, args, cuda_graphs=True)
                rows.append({knob: name, "repeat": r, "graph_ms": time_steps(engine, 150)})
                engine.close()
    return rows


def make_engine(model, max_num_seqs: int, max_len: int, **fields) -> LLMEngine:
    """An engine whose KV pool holds what the profile needs (2 x max_num_seqs x max_len tokens), on either device:
    profile_decode builds two in turn, and a pool sized from free memory would leave the second none."""
    cfg = EngineConfig.for_token_budget(2 * max_num_seqs * max_len, max_num_seqs=max_num_seqs, max_model_len=max_len,
                                        snapshot_slots=4, **{**ENGINE_FIELDS, **fields})
    return LLMEngine(model, cfg)


def decoding_engine(model, args, cuda_graphs: bool, page_size: int = 16) -> LLMEngine:
    """An engine whose next steps decode args.decode sequences over args.ctx tokens, after 5 warm-up steps."""
    engine = make_engine(model, args.decode, args.ctx + 256, cuda_graphs=cuda_graphs, page_size=page_size)
    decoding_batch(engine, args.decode, args.ctx)
    time_steps(engine, 5)
    return engine


def profile_decode(model, what: str, device: torch.device, args) -> dict:
    """A decode step of args.decode sequences: eager (kernels by GPU time) and from its CUDA graph (ms a step)."""
    found = {}
    for graphs in (False, True):
        engine = decoding_engine(model, args, cuda_graphs=graphs)
        found[graphs] = time_steps(engine, 50), profile_step(engine)
        engine.close()
    (eager_ms, (_, rows, kernels)), (graph_ms, _) = found[False], found[True]
    kernel_rows = sorted((r for r in rows if r["op"] in kernels), key=lambda r: -r["gpu_ms"])
    busy = sum(r["gpu_ms"] for r in kernel_rows)
    print(f"{what} on {device}: a decode step of {args.decode} over {args.ctx}: eager {eager_ms:.3f} ms, CUDA graph "
          f"{graph_ms:.3f} ms, eager kernels' GPU sum {busy:.3f} ms over {sum(kernels.values())} kernels")
    print_table(kernel_rows[:args.top], ["op", "calls", "gpu_ms", "self_cpu_ms"])
    return dict(eager_ms=eager_ms, graph_ms=graph_ms, kernel_sum_ms=busy, num_kernels=sum(kernels.values()),
                kernels=kernel_rows)


def critical_path(kernels: list[tuple[str, float, float]]) -> list[dict]:
    """kernels: (name, start_us, end_us) of one step -> per name: count, its critical-path share and its mean
    duration. Each stretch of the step between two consecutive start or end times goes to the running kernel that
    ends first (with PDL a kernel starts early and waits in griddepcontrol: that stretch is its predecessor's), and to
    '(idle)' when none runs; the shares sum to the step's span."""
    rows: dict[str, dict] = {}

    def row(name: str) -> dict:
        return rows.setdefault(name, {"kernel": name, "count": 0, "critical_us": 0.0, "duration_us": 0.0})
    for name, start, end in kernels:
        r = row(name)
        r["count"] += 1
        r["duration_us"] += end - start
    times = sorted({t for _, start, end in kernels for t in (start, end)})
    for t0, t1 in zip(times, times[1:]):
        running = [k for k in kernels if k[1] <= t0 and k[2] >= t1]
        row(min(running, key=lambda k: k[2])[0] if running else "(idle)")["critical_us"] += t1 - t0
    for r in rows.values():
        r["duration_us"] /= max(r["count"], 1)
    return sorted(rows.values(), key=lambda r: -r["critical_us"])


def decode_timeline(model, args) -> dict:
    """One engine step (a decode graph's replay) under torch.profiler: its GPU records (kernels and the input copies)
    by critical-path share. '(idle)' holds the profiler's gaps and the host's before the replay: the tool ranks the
    kernels, it does not price the step (time that with --ab or a plain --decode run)."""
    from torch.profiler import ProfilerActivity, profile
    engine = decoding_engine(model, args, cuda_graphs=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    engine.close()
    kernels = [(e.name.removeprefix("kernel_cutlass_kernel_")[:60], e.time_range.start, e.time_range.end)
               for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows = critical_path(kernels)
    span = max(k[2] for k in kernels) - min(k[1] for k in kernels)
    print(f"decode step of {args.decode} over {args.ctx}, one graph replay: {len(kernels)} kernels, span "
          f"{span:.1f} us, critical-path sum {sum(r['critical_us'] for r in rows):.1f} us")
    print_table(rows, ["kernel", "count", "critical_us", "duration_us"])
    return {"span_us": span, "kernels": len(kernels), "rows": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="preset (random weights); default qwen3.5-2b on the GPU, tiny on "
                                                  "the CPU")
    ap.add_argument("--ctx", type=int, default=8192, help="cached tokens before the turn")
    ap.add_argument("--new", type=int, default=800, help="new tokens of the returning turn")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--top", type=int, default=20, help="operators (kernels with --decode) to list")
    ap.add_argument("--decode", type=int, default=0, metavar="B", help="profile a decode step of B sequences over "
                                                                       "ctx tokens instead of a returning turn")
    ap.add_argument("--launch-costs", action="store_true", help="only the host cost of one Triton launch and of "
                                                                     "cuBLAS projections")
    ap.add_argument("--admission", action="store_true", help="only the host cost of a returning turn's "
                                                              "prefix-cache keys (ctx cached + new tokens)")
    ap.add_argument("--timeline", action="store_true", help="with --decode: one graph replay's kernels by their "
                                                             "increments of the step's critical path")
    ap.add_argument("--ab", type=ab_knob, action="append", default=None, metavar="KNOB[+KNOB]",
                    help="with --decode: time this knob's variants in one process, alternated (repeatable: each "
                         "knob in turn, on one loaded model; A+B: every pair of variants): "
                         f"{', '.join(sorted(AB_KNOBS))}")
    args = ap.parse_args(argv)
    if args.admission:
        rows = admission_keys(args.ctx, args.new)
        print_table(rows, ["keys", "pages", "host_ms"])
        return {"admission": rows}
    device = pick_device(args.device)
    if args.launch_costs:
        if device.type != "cuda":
            raise SystemExit("--launch-costs needs the GPU (it times CUDA launches)")
        rows = launch_costs()
        print_table(rows, ["call", "host_us", "total_us"])
        return {"launch_costs": rows}
    ops.set_backend("triton" if device.type == "cuda" else "reference")
    if (args.ab or args.timeline) and not args.decode:
        raise SystemExit("--ab and --timeline look at decode steps: give --decode B")
    if args.timeline and (args.ab or device.type != "cuda"):
        raise SystemExit("--timeline reads the GPU's kernel records of one decode step: it needs CUDA, without --ab")
    spec = args.model or ("qwen3.5-2b" if device.type == "cuda" else "tiny")
    model, what = load_model(spec, device), describe_model(spec)
    if args.ab:
        found = {}
        for knob in args.ab:
            found[knob] = decode_ab(model, args, knob)
            print(f"{what} on {device}: a decode step of {args.decode} over {args.ctx}, each {knob} variant")
            print_table(found[knob], [knob, "repeat", "graph_ms"])
        return {"ab": found}
    if args.timeline:
        return decode_timeline(model, args)
    if args.decode:
        return profile_decode(model, what, device, args)
    engine = make_engine(model, 1, args.ctx + args.new + 64)
    engine.warm_up()
    plain = returning_walls(engine, args.ctx, args.new)
    print(f"host: {host_cpu()}")
    print(f"{what} on {device}: a step of {args.new} new tokens over {args.ctx} cached, unprofiled: wall "
          + ", ".join(f"{ms:.1f}" for ms in plain) + " ms")
    returning_step(engine, args.ctx, args.new, seed=1)
    py_wall, py_rows = python_profile(engine, args.top)
    print(f"{what} on {device}: one step of {args.new} new tokens over {args.ctx} cached under cProfile: wall "
          f"{py_wall:.1f} ms")
    print_table(py_rows, ["function", "calls", "own_ms", "cumulative_ms"])
    returning_step(engine, args.ctx, args.new)
    wall, rows, kernels = profile_step(engine)
    busy = sum(r["gpu_ms"] for r in rows)
    print(f"{what} on {device}: one step of {args.new} new tokens over {args.ctx} cached: wall {wall:.1f} ms, "
          f"GPU busy {busy:.1f} ms, {sum(kernels.values())} kernels, {sum(r['calls'] for r in rows)} operator calls")
    print_table(rows[:args.top], ["op", "calls", "self_cpu_ms", "gpu_ms"])
    by_gpu = sorted((r for r in rows if r["gpu_ms"] > 0), key=lambda r: -r["gpu_ms"])[:args.top]
    print("the same step's operators and kernels by GPU time:")
    print_table(by_gpu, ["op", "calls", "gpu_ms"])
    return dict(unprofiled_wall_ms=plain, by_gpu=by_gpu, wall_ms=wall, gpu_busy_ms=busy, kernels=dict(kernels),
                ops=rows[:args.top], python_wall_ms=py_wall, python=py_rows)


if __name__ == "__main__":
    main()
