"""One MoE layer of Qwen3.5-35B-A3B on the GPU: `python -m profiles.bench_moe [--out DIR] [--rows 1,4,16,64,8192]`.

The layer: H 2048, 256 experts of I 512 with top-8, a shared expert of 512 under a sigmoid gate (random bf16
weights). For each row count it times ours (kernels.moe; up to 64 rows replayed in a CUDA graph, as a decode step
runs it, above that eager, as a prefill chunk), the reference (reference.moe, its per-expert loop, up to 64 rows)
and transformers 5.17's block (Qwen3_5MoeSparseMoeBlock with the same weights) with experts_implementation
"grouped_mm" and "eager", after checking that each gives our result. Bounds, measured in the same run:
- rows <= 64: the bytes of the weights read (router, shared expert, and each expert that some row chose: the
  expected count over random routing, E(1 - (1 - k/E)^rows)) at the card's read ceiling; the batch-1 layer reads
  57.7 MB;
- prefill: FLOPs = 2 x rows x (top-k x 3 x H x I + 3 x H x I_shared + E x H), against cuBLAS's bf16 8192^3
  TFLOP/s.
`--parts 1,8192` breaks one call down by GPU kernel. `--tiles 64x64x64w4s3,128x64x64w8s3` also times ours under
each of these MoE tiles (block x columns x K step, warps, stages: kernels.tuning.MoeTiles; after a slash, the down
kernel's own) as both the decode and the prefill tiles, one KernelTuning each, in this process. `--row-gemv
off,8x256/4x512w4` times the one-token rows under each of these kernels.moe_gemv plans (columns x K step of gate_up,
then of down, warps: kernels.tuning.MoeGemvPlan; off: the grouped GEMMs). Ours runs as the router picks
(kernels.registry).
Results go to profiles/results/moe.json.
"""
import argparse
import re
from dataclasses import replace

import torch
import triton

import kernels.routes  # noqa: F401  (the triton backend's entries, kernels.moe_gemv's among them)
import reference as R
from kernels import registry
from kernels.tuning import MoeGemvPlan, MoeTiles
from profiles.common import RESULTS, bandwidth_ceilings, environment, print_table, write_result

HIDDEN, EXPERTS, TOP_K, INTER, SHARED = 2048, 256, 8, 512, 512


def layer_weights(seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device="cuda") * shape[-1] ** -0.5).to(torch.bfloat16)
    shared = (rand(SHARED, HIDDEN), rand(SHARED, HIDDEN), rand(HIDDEN, SHARED), rand(1, HIDDEN))
    return rand(EXPERTS, HIDDEN), rand(EXPERTS, 2 * INTER, HIDDEN), rand(EXPERTS, HIDDEN, INTER), shared


def hf_block(weights, implementation: str):
    """transformers' Qwen3.5-MoE block holding our weights."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
    cfg = Qwen3_5MoeTextConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                               moe_intermediate_size=INTER, shared_expert_intermediate_size=SHARED)
    cfg._experts_implementation = implementation
    router, gate_up, down, (s_gate, s_up, s_down, s_gate_proj) = weights
    block = Qwen3_5MoeSparseMoeBlock(cfg).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
        block.shared_expert.gate_proj.weight.copy_(s_gate)
        block.shared_expert.up_proj.weight.copy_(s_up)
        block.shared_expert.down_proj.weight.copy_(s_down)
        block.shared_expert_gate.weight.copy_(s_gate_proj)
    return lambda x: block(x[None])[0]


def moe(*args):
    """Ours: the triton backend's choice for the call (kernels.registry)."""
    with registry.use("triton"):
        return registry.run("moe", *args)


def graphed(fn, x):
    """fn(x) captured in a CUDA graph: a callable that replays it."""
    fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x)
    return graph.replay


def time_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def active_bytes(rows: int) -> float:
    experts = EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** rows)
    return 2 * (experts * 3 * HIDDEN * INTER + 3 * HIDDEN * SHARED + EXPERTS * HIDDEN + HIDDEN)


def flops(rows: int) -> float:
    return 2 * rows * (TOP_K * 3 * HIDDEN * INTER + 3 * HIDDEN * SHARED + EXPERTS * HIDDEN)


def cublas_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / time_us(lambda: a @ a) / 1e6


def bench_rows(rows: int, weights, read_tb_s: float, gemm_tflops: float) -> dict:
    router, gate_up, down, shared = weights
    x = (torch.randn(rows, HIDDEN, device="cuda") * 0.5).to(torch.bfloat16)
    ours = lambda t: moe(t, router, gate_up, down, TOP_K, shared)  # noqa: E731
    want = ours(x).float()
    peers = {"hf_grouped_mm": hf_block(weights, "grouped_mm"), "hf_eager": hf_block(weights, "eager")}
    if rows <= 64:
        peers["reference"] = lambda t: R.moe(t, router, gate_up, down, TOP_K, shared)
    row = {"rows": rows}
    for name, fn in peers.items():
        with torch.no_grad():
            err = float((fn(x).float() - want).norm() / want.norm())
        row[f"{name}_rel_err"] = err
        row[f"{name}_us"] = time_us(lambda fn=fn: fn(x))
    row["ours_us"] = time_us(graphed(ours, x) if rows <= 64 else lambda: ours(x))
    if rows <= 64:
        row["bound_us"] = active_bytes(rows) / (read_tb_s * 1e12) * 1e6
        row["ours_over_bound"] = row["ours_us"] / row["bound_us"]
    else:
        row["ours_TFLOPs"] = flops(rows) / row["ours_us"] / 1e6
        row["ours_of_cublas"] = row["ours_TFLOPs"] / gemm_tflops
    for name in peers:
        row[f"{name}_over_ours"] = row[f"{name}_us"] / row["ours_us"]
    return row


def parts_us(rows: int, weights, iters: int = 10) -> list[dict]:
    """One eager call of ours at `rows` rows by GPU kernel (torch.profiler): us per call and share, largest first."""
    router, gate_up, down, shared = weights
    x = (torch.randn(rows, HIDDEN, device="cuda") * 0.5).to(torch.bfloat16)
    moe(x, router, gate_up, down, TOP_K, shared)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            moe(x, router, gate_up, down, TOP_K, shared)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in kernels)
    rows_out = [dict(rows=rows, kernel=e.key[:48], calls=e.count / iters, us=e.device_time_total / iters,
                     share=e.device_time_total / total) for e in kernels]
    return sorted(rows_out, key=lambda r: -r["us"])


TILES = r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)"


def parse_tiles(spec: str) -> MoeTiles:
    """'128x64x64w8s3' -> MoeTiles(128, 64, 64, 8, 3); 'A/B': A for gate_up, B for the down kernel (same block)."""
    m = re.fullmatch(TILES + f"(?:/{TILES})?", spec.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"tiles {spec!r}: write BLOCKxCOLUMNSxK, warps, stages as in 64x64x64w4s3, "
                                         f"and /the down kernel's as in 16x32x128w4s4/16x64x128w4s3")
    values = [int(v) if v is not None else None for v in m.groups()]
    try:
        down = MoeTiles(*values[5:]) if values[5] is not None else None
        return MoeTiles(*values[:5], down=down)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def tiles_name(tiles: MoeTiles) -> str:
    """parse_tiles' spelling of tiles."""
    one = lambda t: f"{t.block_m}x{t.block_n}x{t.block_k}w{t.warps}s{t.stages}"  # noqa: E731
    return one(tiles) + (f"/{one(tiles.down)}" if tiles.down else "")


def bench_tiles(rows: int, weights, tiles: MoeTiles) -> float:
    """ours at `rows` rows with `tiles` as both the decode and the prefill tiles: us (graphed up to 64 rows)."""
    router, gate_up, down, shared = weights
    x = (torch.randn(rows, HIDDEN, device="cuda") * 0.5).to(torch.bfloat16)
    with registry.use(tuning=replace(registry.tuning(), moe_decode=tiles, moe_prefill=tiles)):
        ours = lambda t: moe(t, router, gate_up, down, TOP_K, shared)  # noqa: E731
        return time_us(graphed(ours, x) if rows <= 64 else lambda: ours(x))


def parse_row_gemv(spec: str) -> MoeGemvPlan | None:
    """'off' (the grouped GEMMs) or GATE_UPxK/DOWNxKwWARPS, as in 8x256/4x512w4: a kernels.moe_gemv plan."""
    spec = spec.strip()
    if spec == "off":
        return None
    m = re.fullmatch(r"(\d+)x(\d+)/(\d+)x(\d+)w(\d+)", spec)
    if m is None:
        raise argparse.ArgumentTypeError(f"row gemv {spec!r}: write off or GATE_UPxK/DOWNxKwWARPS as in "
                                         f"8x256/4x512w4")
    try:
        return MoeGemvPlan(*map(int, m.groups()))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"row gemv {spec!r}: {e}") from None


def bench_row_gemv(weights, plan: MoeGemvPlan | None) -> float:
    """ours at one row under this one-token plan (None: the grouped GEMMs), replayed in a CUDA graph: us."""
    router, gate_up, down, shared = weights
    x = (torch.randn(1, HIDDEN, device="cuda") * 0.5).to(torch.bfloat16)
    with registry.use(tuning=replace(registry.tuning(), moe_row_gemv=plan)):
        return time_us(graphed(lambda t: moe(t, router, gate_up, down, TOP_K, shared), x))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS), help="folder for moe.json")
    ap.add_argument("--rows", default="1,4,16,64,1024,8192", help="row counts, comma-separated")
    ap.add_argument("--parts", default="", help="row counts to break down by GPU kernel (torch.profiler), "
                                                "comma-separated")
    ap.add_argument("--tiles", default="", help="MoE tiles to time ours under, comma-separated (64x64x64w4s3; "
                                                "16x32x128w4s4/16x64x128w4s3 gives the down kernel its own)")
    ap.add_argument("--row-gemv", default="", help="one-token plans to time ours under, comma-separated (off: the "
                                                   "grouped GEMMs; 8x256/4x512w4: kernels.tuning.MoeGemvPlan)")
    args = ap.parse_args(argv)
    try:
        variants = [parse_tiles(t) for t in args.tiles.split(",") if t.strip()]
        row_plans = [parse_row_gemv(t) for t in args.row_gemv.split(",") if t.strip()]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    weights = layer_weights()
    ceilings = bandwidth_ceilings(2.0)
    read = ceilings["read_TBps"]
    gemm = cublas_tflops()
    rows = [bench_rows(int(r), weights, read, gemm) for r in args.rows.split(",")]
    columns = ["rows", "ours_us", "bound_us", "ours_over_bound", "ours_TFLOPs", "ours_of_cublas", "hf_grouped_mm_us",
               "hf_grouped_mm_over_ours", "hf_eager_us", "reference_us", "hf_grouped_mm_rel_err"]
    print_table(rows, columns)
    sweep = []
    for r in rows:
        for tiles in variants:
            us = bench_tiles(r["rows"], weights, tiles)
            sweep.append(dict(rows=r["rows"], tiles=tiles_name(tiles), us=us, default_us=r["ours_us"],
                              default_over=r["ours_us"] / us))
    for plan in row_plans:
        default = next((r["ours_us"] for r in rows if r["rows"] == 1), None)
        us = bench_row_gemv(weights, plan)
        sweep.append(dict(rows=1, tiles=f"row gemv {plan}", us=us, default_us=default,
                          default_over=default / us if default else None))
    if sweep:
        print_table(sweep, ["rows", "tiles", "us", "default_us", "default_over"])
    parts = [p for r in args.parts.split(",") if r.strip() for p in parts_us(int(r), weights)]
    if parts:
        print_table(parts, ["rows", "kernel", "calls", "us", "share"])
    result = dict(what="one Qwen3.5-35B-A3B MoE layer (random bf16 weights): ours, reference.moe and transformers' "
                       "block", shapes=dict(hidden=HIDDEN, experts=EXPERTS, top_k=TOP_K, inter=INTER, shared=SHARED),
                  environment=environment(), ceilings=ceilings, cublas_bf16_8192_TFLOPs=gemm, rows=rows,
                  default_tiles={k: str(getattr(registry.tuning(), f"moe_{k}"))
                                 for k in ("decode", "prefill", "row_gemv")},
                  tiles_sweep=sweep, parts=parts)
    path = write_result("moe", result, args.out)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
