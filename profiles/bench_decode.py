"""Decode-path benchmark on the GPU: `python -m profiles.bench_decode [--out DIR] [--quick]`.

Paged decode attention (KV bytes read per second) against cuDNN SDPA, FA2 SDPA and flash-attn-4 on the same
shapes; the Gated DeltaNet decode step against fla's fused_recurrent_gated_delta_rule; the fused small ops
against the copy ceiling. Every bandwidth is also quoted as a fraction of this run's read-only ceiling.
Writes decode.json and decode_bw.png (B1 bandwidth against context length) to --out.
"""
import argparse
import functools
import json
import math
from pathlib import Path

import torch

from profiles.common import (
    RESULTS,
    bandwidth_ceilings,
    bench_us,
    environment,
    peer_attention,
    plot_series,
    print_table,
    progress,
    write_result,
)

BF16 = torch.bfloat16
PAGE = 64
ATTN_CASES = [  # (batch, context, q heads, kv heads, head_dim)
    (1, 32768, 16, 4, 256), (1, 131072, 8, 2, 256), (8, 32768, 16, 4, 256), (64, 8192, 16, 4, 256),
    (1, 32768, 16, 4, 128), (8, 32768, 16, 4, 128), (64, 8192, 16, 4, 128),
]
CURVE_CONTEXTS = [1024, 4096, 16384, 32768, 65536, 131072]
SECTIONS = ("attention", "gdn", "small", "linear")
LINEAR_SHAPES = {  # a decode step's projections (N, K): GDN in/out, attention qkv/o, MLP gate_up/down, lm_head
    "qwen3.5-0.8b": [(6176, 1024), (1024, 2048), (5120, 1024), (1024, 2048), (7168, 1024), (1024, 3584),
                     (248320, 1024)],
    "qwen3.5-2b": [(8224, 2048), (2048, 2048), (5120, 2048), (2048, 2048), (12288, 2048), (2048, 6144),
                   (248320, 2048)],
    "qwen3.5-9b": [(16448, 4096), (4096, 4096), (10240, 4096), (4096, 4096), (24576, 4096), (4096, 12288),
                   (248320, 4096)],
}


# ---- attention ----------------------------------------------------------------------------------------

def make_paged(batch, ctx, h, kv, d, seed=0, page=PAGE):
    """Random q, a shuffled page pool holding each sequence's ctx tokens, and the same K/V contiguous."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages_per_seq = math.ceil(ctx / page)
    n_pages = batch * pages_per_seq
    k_pages = torch.randn(n_pages, page, kv, d, device="cuda", dtype=BF16, generator=gen)
    v_pages = torch.randn(n_pages, page, kv, d, device="cuda", dtype=BF16, generator=gen)
    table = torch.randperm(n_pages, device="cuda", generator=gen).int().view(batch, pages_per_seq)
    q = torch.randn(batch, 1, h, d, device="cuda", dtype=BF16, generator=gen)
    seqused = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    return q, k_pages, v_pages, table, seqused


def contiguous_kv(pages, table, ctx):
    # pages: (num_pages, PAGE, KV, D) -> (B, ctx, KV, D) in each sequence's page order
    return pages[table.long()].flatten(1, 2)[:, :ctx].contiguous()


def bench_attention_case(batch, ctx, h, kv, d, peers=("cudnn", "fa2", "fa4")):
    from kernels.paged_decode_attention import alloc_workspace, choose_num_splits, paged_decode_attention
    q, kp, vp, table, seqused = make_paged(batch, ctx, h, kv, d)
    splits = choose_num_splits(batch, kv, ctx)
    ws = alloc_workspace(batch, h, splits, d, "cuda")
    out = torch.empty_like(q)
    ours = lambda: paged_decode_attention(q, kp, vp, table, seqused, num_splits=splits, out=out, workspace=ws,
                                          check_metadata=False)  # built here; eager timing must not sync
    kv_bytes = 2 * batch * ctx * kv * d * 2
    row = {"B": batch, "ctx": ctx, "H/KV": f"{h}/{kv}", "D": d, "splits": splits, "MB": kv_bytes / 1e6,
           "ours_us": bench_us(ours), "ours_graph_us": bench_us(ours, graph=True)}
    k, v = contiguous_kv(kp, table, ctx), contiguous_kv(vp, table, ctx)
    for name in peers:
        try:
            row[f"{name}_us"] = bench_us(peer_attention(name, q, k, v, causal=False))
        except Exception as err:  # a peer that does not support the case is reported, not fatal
            row[f"{name}_us"], row[f"{name}_error"] = None, f"{type(err).__name__}: {err}"[:200]
    for key in [c for c in row if c.endswith("_us")]:
        row[key.replace("_us", "_TBps")] = kv_bytes / row[key] / 1e6 if row[key] else None
    best = max([row.get(f"{p}_TBps") or 0.0 for p in peers], default=0.0)
    row["vs_best_peer"] = row["ours_graph_TBps"] / best if best else None
    return row


SPLIT_SWEEP = (8, 16, 24, 32, 48, 64, 96, 128)


def sweep_splits(h: int, kv: int, contexts=(4096, 8192, 12288, 16384), cap: int = 24576) -> list[dict]:
    """B1 decode attention (d256) at each split count of SPLIT_SWEEP, in a CUDA graph, beside the count
    choose_num_splits takes for a page table of `cap` tokens (a serving run's max_model_len)."""
    from kernels.paged_decode_attention import choose_num_splits
    rows = []
    for ctx in contexts:
        pools = [make_paged(1, ctx, h, kv, 256)]
        row = {"H/KV": f"{h}/{kv}", "ctx": ctx, "chosen": choose_num_splits(1, kv, cap)}
        row |= {f"s{s}_us": us for s, us in _split_times(pools, h, SPLIT_SWEEP).items()}
        row["best"] = min(SPLIT_SWEEP, key=lambda s: row[f"s{s}_us"])
        rows.append(progress(row))
    return rows


def _call_each(calls) -> None:
    for call in calls:
        call()


def _split_times(pools: list, h: int, splits) -> dict[int, float]:
    """B1 decode attention (d256) at each split count: us a call, in a CUDA graph that calls it once on each of the
    pools (make_paged's tuples) in turn, so that with enough of them every call reads its KV from DRAM."""
    from kernels.paged_decode_attention import alloc_workspace, paged_decode_attention
    out = torch.empty_like(pools[0][0])
    times = {}
    for s in splits:
        ws = alloc_workspace(1, h, s, 256, "cuda")
        calls = [functools.partial(paged_decode_attention, q, kp, vp, table, seqused, num_splits=s, out=out,
                                   workspace=ws, check_metadata=False) for q, kp, vp, table, seqused in pools]
        times[s] = bench_us(functools.partial(_call_each, calls), graph=True) / len(pools)
    return times


def sweep_splits_cold(h: int = 8, kv: int = 2, ctx: int = 8192, pages=(16, 64), splits=(32, 64, 128),
                      ring_bytes: float = 256e6) -> list[dict]:
    """B1 decode attention (d256) with its KV read from DRAM, as inside a decode step (whose weights push the KV out
    of L2 between steps; `sweep_splits` replays one KV, which at 8k stays in the 50 MB L2): a CUDA graph calls it on
    each of enough pools (~ring_bytes in all) that none is still cached when its turn comes back. Per page size
    (16: the engine's) and split count: us a call and the KV bytes' TB/s."""
    kv_bytes = 2 * ctx * kv * 256 * 2
    copies = max(2, min(32, math.ceil(ring_bytes / kv_bytes)))
    rows = []
    for page in pages:
        pools = [make_paged(1, ctx, h, kv, 256, seed=i, page=page) for i in range(copies)]
        for s, us in _split_times(pools, h, splits).items():
            rows.append(progress({"H/KV": f"{h}/{kv}", "ctx": ctx, "page": page, "splits": s, "copies": copies,
                                  "us": us, "TBps": kv_bytes / us / 1e6}))
        del pools
    return rows


# ---- Gated DeltaNet decode ----------------------------------------------------------------------------

def bench_gdn_case(batch, hk=16, hv=32, dk=128, dv=128, kw=4):
    """One layer's decode step, eagerly (launch included) and in a CUDA graph that steps through enough layers'
    states (each its own pool) that they come from DRAM, not the 50 MB L2; graph time is per layer. Where the CuTe
    kernel takes the call (one value head a key head: the router's choice), the Triton kernel's graph time beside it."""
    from kernels import gdn_decode_cute
    from kernels.gdn_decode import gdn_decode_step, launch_decode
    c = 2 * hk * dk + hv * dv
    dev = "cuda"
    qkv = torch.randn(batch, c, device=dev, dtype=BF16)
    z = torch.randn(batch, hv, dv, device=dev, dtype=BF16)
    b, a = torch.randn(batch, hv, device=dev, dtype=BF16), torch.randn(batch, hv, device=dev, dtype=BF16)
    conv_w = torch.randn(c, kw, device=dev, dtype=BF16) * 0.5
    A_log, dt_bias = torch.rand(hv, device=dev), torch.rand(hv, device=dev)
    norm_w = torch.randn(dv, device=dev, dtype=BF16)
    state_bytes = 2 * batch * hv * dk * dv * 4  # read + write of the fp32 state
    layers = max(2, min(64, int(512e6 // state_bytes)))
    conv_states = [torch.randn(batch, c, kw - 1, device=dev, dtype=BF16) for _ in range(layers)]
    states = [torch.randn(batch, hv, dk, dv, device=dev, dtype=torch.float32) * 0.1 for _ in range(layers)]
    slots = torch.arange(batch, device=dev)
    out = torch.empty_like(z)
    one = lambda i: gdn_decode_step(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states[i], states[i], slots,
                                    hk, 1e-6, out=out)
    cute = gdn_decode_cute.supports(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states[0], states[0], hk)
    row = {"B": batch, "Hk/Hv": f"{hk}/{hv}", "kernel": "cute" if cute else "triton", "layers": layers,
           "state_MB": state_bytes / 1e6, "ours_us": bench_us(lambda: one(0)),
           "ours_graph_us": bench_us(lambda: [one(i) for i in range(layers)], graph=True) / layers}
    if cute:
        triton_one = lambda i: launch_decode(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states[i], states[i],
                                             slots, 1e-6, out)
        row["triton_graph_us"] = bench_us(lambda: [triton_one(i) for i in range(layers)], graph=True) / layers
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        q = torch.randn(batch, 1, hv, dk, device=dev, dtype=BF16)
        k, v = torch.randn_like(q), torch.randn(batch, 1, hv, dv, device=dev, dtype=BF16)
        g = -torch.rand(batch, 1, hv, device=dev) * 0.1
        beta = torch.rand(batch, 1, hv, device=dev, dtype=BF16)
        fla = lambda i: fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=states[i],
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        row["fla_us"] = bench_us(lambda: fla(0))
        row["fla_graph_us"] = bench_us(lambda: [fla(i) for i in range(layers)], graph=True) / layers
    except Exception as err:
        row["fla_us"], row["fla_error"] = None, f"{type(err).__name__}: {err}"[:200]
    row["ours_graph_TBps"] = state_bytes / row["ours_graph_us"] / 1e6
    row["speedup_vs_fla"] = row["fla_us"] / row["ours_us"] if row.get("fla_us") else None
    row["graph_speedup_vs_fla"] = row["fla_graph_us"] / row["ours_graph_us"] if row.get("fla_us") else None
    return row


# ---- fused small ops ----------------------------------------------------------------------------------

def bench_small_ops_case(n, hidden=4096, inter=12288):
    """add_rms_norm reads x and residual and writes both outputs; silu_and_mul reads 2I and writes I per row;
    sigmoid_gate_mul reads x and the gate and writes one output."""
    from kernels.activations import sigmoid_gate_mul, silu_and_mul
    from kernels.norms import add_rms_norm
    x = torch.randn(n, hidden, device="cuda", dtype=BF16)
    res, w = torch.randn_like(x), torch.randn(hidden, device="cuda", dtype=BF16)
    out = torch.empty_like(x)
    gu = torch.randn(n, 2 * inter, device="cuda", dtype=BF16)
    o2 = torch.empty(n, inter, device="cuda", dtype=BF16)
    us_norm = bench_us(lambda: add_rms_norm(x, res, w, 1e-6, out=out), graph=True)
    us_act = bench_us(lambda: silu_and_mul(gu, out=o2), graph=True)
    us_gate = bench_us(lambda: sigmoid_gate_mul(x, res, out=out), graph=True)
    return [{"op": "add_rms_norm", "N": n, "width": hidden, "us": us_norm, "GBps": 4 * x.numel() * 2 / us_norm / 1e3},
            {"op": "silu_and_mul", "N": n, "width": inter, "us": us_act, "GBps": 3 * o2.numel() * 2 / us_act / 1e3},
            {"op": "sigmoid_gate_mul", "N": n, "width": hidden, "us": us_gate,
             "GBps": 3 * x.numel() * 2 / us_gate / 1e3}]


# ---- decode projections -------------------------------------------------------------------------------

def bench_linear_case(model: str, rows: int) -> list[dict]:
    """Each projection of a decode step, ours (kernels.linear, PDL on and off) against torch's matmul (cuBLAS),
    timed in CUDA graphs; the chain row runs a step's projections back to back, where PDL can overlap neighbours
    (each kernel still waits for the one before it)."""
    from kernels import registry
    from kernels.linear import linear
    from kernels.tuning import KernelTuning
    shapes = LINEAR_SHAPES[model]
    calls = [(torch.randn(rows, k, device="cuda", dtype=BF16), torch.randn(n, k, device="cuda", dtype=BF16) / k ** 0.5,
              torch.empty(rows, n, device="cuda", dtype=BF16)) for n, k in shapes]
    with_pdl, without = KernelTuning(), KernelTuning(pdl=False)
    impls = {"ours": (linear, with_pdl), "ours_no_pdl": (linear, without),
             "cublas": (lambda x, w, out: torch.matmul(x, w.t(), out=out), without)}
    cases = [((n, k), [c]) for (n, k), c in zip(shapes, calls)] + [(("chain", "-"), calls)]
    found = []
    for (n, k), group in cases:
        row = {"model": model, "rows": rows, "N": n, "K": k}
        for label, (fn, tuning) in impls.items():
            with registry.use(tuning=tuning):
                row[f"{label}_us"] = bench_us(lambda f=fn, g=group: [f(x, w, out=o) for x, w, o in g], graph=True)
        nbytes = sum(w.numel() * 2 for _, w, _ in group)
        row.update(ours_TBps=nbytes / row["ours_us"] / 1e6, cublas_TBps=nbytes / row["cublas_us"] / 1e6,
                   speedup_vs_cublas=row["cublas_us"] / row["ours_us"])
        found.append(row)
    return found


def _weight_ring(n: int, k: int, ring_bytes: float = 256e6) -> list[torch.Tensor]:
    """Copies of an (N, K) weight totalling ~ring_bytes (at most 32): a graph that multiplies each in turn reads
    them from DRAM, as a decode step does, where one weight replayed alone would sit in the 50 MB L2."""
    copies = max(1, min(32, math.ceil(ring_bytes / (n * k * 2))))
    return [torch.randn(n, k, device="cuda", dtype=BF16) / k ** 0.5 for _ in range(copies)]


def sweep_linear_shape(n: int, k: int, rows: int = 1) -> dict:
    """One decode projection (N, K) at `rows` rows under every plan of kernels.linear's kernel for that many rows
    (the GEMV's (BLOCK_N, BLOCK_K, num_warps) with 2K-16K products a step; the skinny GEMM's (BLOCK_N, BLOCK_K,
    STAGES, num_warps, SPLIT) whose ring fits in shared memory, split over K only for narrow outputs): the best
    three, the default plan's time, and cuBLAS's, per weight, in CUDA graphs over a ring of weights read from DRAM."""
    from kernels import split_k
    from kernels.linear import MAX_ROWS, dot_plan, launch_plan, linear
    from kernels.row_buckets import decode_step_rows
    x = torch.randn(rows, k, device="cuda", dtype=BF16)
    ring = _weight_ring(n, k)
    o = torch.empty(rows, n, device="cuda", dtype=BF16)
    if rows <= MAX_ROWS:
        plans = [(bn, bk, nw) for bn in (2, 4, 8, 16, 32) for bk in (128, 256, 512, 1024, 2048) for nw in (4, 8)
                 if 2048 <= bn * bk <= 16384]
        default = launch_plan(rows, n, k)
    else:
        rings = [(bn, bk, st, nw) for bn in (16, 32, 64) for bk in (128, 256, 512) for st in (3, 4, 6)
                 for nw in (1, 2, 4) if nw * 16 <= bn * 2 and st * (bn + 16) * bk * 2 <= 200 * 1024]
        splits = (1, 2, 4, 8) if n <= split_k.MAX_N else (1,)  # split over K: the narrow outputs, 16-column blocks
        plans = [(*r, sp) for r in rings for sp in splits if sp == 1 or r[0] == 16]
        default = dot_plan(n, k)

    def per_weight_us(fn):
        with decode_step_rows():  # the graph's eager warm-up runs the kernel the graph captures (not padded rows)
            return bench_us(lambda: [fn(w) for w in ring], graph=True, rep_ms=40) / len(ring)

    times = {}
    for p in plans:
        try:
            times[p] = per_weight_us(lambda w, p=p: linear(x, w, out=o, plan=p))
        except Exception as e:  # a plan the compiler refuses (resources): skipped
            print(f"plan {p} for ({n}, {k}) failed: {type(e).__name__}")
    best = sorted(times, key=times.get)[:3]
    default_us = times.get(default) or per_weight_us(lambda w: linear(x, w, out=o))
    cublas_us = per_weight_us(lambda w: torch.matmul(x, w.t(), out=o))
    return {"rows": rows, "N": n, "K": k, "best": [list(p) for p in best], "best_us": [times[p] for p in best],
            "best_TBps": n * k * 2 / times[best[0]] / 1e6, "default": list(default), "default_us": default_us,
            "cublas_us": cublas_us, "cublas_TBps": n * k * 2 / cublas_us / 1e6}


# (ring KiB, consumer warps, CTAs an SM) of the TMA-ring GEMV tried by --sweep-tma, beside kernels.tma_gemv's default
TMA_VARIANTS = {"r64w4": (64, 4, 1), "r128w4": (128, 4, 1), "r64w8": (64, 8, 1), "r128w8": (128, 8, 1),
                "r32w4c2": (32, 4, 2), "r48w8c2": (48, 8, 2)}


def tma_variant(n: int, k: int, gated: bool, variant: str):
    """The TmaGemvConfig of a TMA_VARIANTS entry for one projection."""
    from kernels import tma_gemv as T
    ring, warps, ctas = TMA_VARIANTS[variant]
    return T.choose_config(n, k, gated, ring_bytes=ring * 1024, consumer_warps=warps, ctas_per_sm=ctas)


def gemv_impl(n: int, k: int, gated: bool, variant: str):
    """f(x, w, out) of the Triton GEMV (variant "triton") or the TMA-ring GEMV under a TMA_VARIANTS config."""
    from kernels import linear as L
    from kernels import tma_gemv as T
    if variant == "triton":
        return lambda x, w, o: L._gemv(x, w, o, None, L.GATED if gated else L.PLAIN)
    cfg = tma_variant(n, k, gated, variant)
    return lambda x, w, o: T.tma_gemv(x, w, o, gated=gated, config=cfg)


def _each_weight(f, x, ring, out):
    for w in ring:
        f(x, w, out)


def _gemv_layers(layers, inputs, outs, fs):
    # each layer's projections, one launch each: projection j reads inputs[j] and writes outs[j]
    for layer in layers:
        for f, x, w, o in zip(fs, inputs, layer, outs):
            f(x, w, o)


def _chained_layers(layers, inputs, outs, project_in, residual, norm_w):
    # each layer's in-projection, then kernels.linear.out_proj_mlp as the model runs it: the out / gate_up / down
    # projections as one chained launch (gate_up's input is rms_norm(out + residual))
    from kernels import linear as L
    for layer in layers:
        project_in(inputs[0], layer[0], outs[0])
        L.out_proj_mlp(inputs[1], residual, layer[1], norm_w, 1e-6, layer[2], layer[3])


def sweep_tma(model: str) -> list[dict]:
    """Each of MODEL's projections at one row (SwiGLU's down projection gated, reading [gate | up]) on the Triton GEMV
    and the TMA-ring GEMV's variants, per weight over a ring read from DRAM; then a chain of the GDN layers' four
    projections over every layer's own weights, each projection on the Triton GEMV, on its fastest TMA variant,
    and on its fastest of all; and "chained": the in-projection on its fastest TMA variant, then the output
    projection, gate_up (with the residual add and RMSNorm) and the down projection through
    kernels.linear.out_proj_mlp (one tma_gemv_chain launch)."""
    shapes = LINEAR_SHAPES[model]
    down = shapes[5]
    rows, fastest = [], {}
    for n, k in dict.fromkeys(shapes):
        gated = (n, k) == down
        ring = _weight_ring(n, k)
        x = torch.randn(1, 2 * k if gated else k, device="cuda", dtype=BF16)
        o = torch.empty(1, n, device="cuda", dtype=BF16)
        times = {}
        for variant in ["triton", *TMA_VARIANTS]:
            f = gemv_impl(n, k, gated, variant)
            f(x, ring[0], o)  # compile outside the graph
            calls = functools.partial(_each_weight, f, x, ring, o)
            times[variant] = bench_us(calls, graph=True) / len(ring)
        tma_best = min(TMA_VARIANTS, key=times.get)
        fastest[n, k] = {"triton": "triton", "tma": tma_best, "best": min(times, key=times.get)}
        rows.append(progress({"model": model, "N": n, "K": k, "gated": gated,
                              **{f"{v}_us": t for v, t in times.items()}, "tma_best": tma_best,
                              "triton_TBps": n * k * 2 / times["triton"] / 1e6,
                              "tma_best_TBps": n * k * 2 / times[tma_best] / 1e6}))
    four = [shapes[0], shapes[1], shapes[4], down]  # in, out, gate_up, down of a GDN layer
    layers = [[torch.randn(n, k, device="cuda", dtype=BF16) / k ** 0.5 for n, k in four]
              for _ in range(math.ceil(2.5e9 / sum(n * k * 2 for n, k in four)))]
    outs = [torch.empty(1, n, device="cuda", dtype=BF16) for n, _ in four]
    first = torch.randn(1, four[0][1], device="cuda", dtype=BF16)
    # a projection's input is the previous one's output (the down projection's [gate | up] is gate_up's)
    inputs = [first, outs[0][:, :four[1][1]], outs[1][:, :four[2][1]], outs[2][:, :2 * down[1]]]
    nbytes = sum(w.numel() * 2 for layer in layers for w in layer)
    steps = {choice: functools.partial(_gemv_layers, layers, inputs, outs, [
        gemv_impl(n, k, (n, k) == down and j == 3, fastest[n, k][choice]) for j, (n, k) in enumerate(four)])
        for choice in ("triton", "tma", "best")}
    hidden = four[2][1]
    residual = torch.randn(1, hidden, device="cuda", dtype=BF16)
    norm_w = (0.1 * torch.randn(hidden, device="cuda")).to(BF16)
    steps["chained"] = functools.partial(_chained_layers, layers, inputs, outs,
                                         gemv_impl(*four[0], False, fastest[four[0]]["tma"]), residual, norm_w)
    for choice, step in steps.items():
        step()
        us = bench_us(step, graph=True)
        rows.append(progress({"model": model, "N": "chain", "K": choice, "gemvs": 4 * len(layers), "GB": nbytes / 1e9,
                              "chain_us": us, "chain_TBps": nbytes / us / 1e6}))
    return rows


CHAIN_PAUSES = (0, 64, 80, 96, 112)  # kernels.tma_gemv.BOUNDARY_BYTES values in KiB that --sweep-chain times (0: none)


def sweep_chain(model: str, layers: int = 24) -> list[dict]:
    """A dense layer's tail at one row as kernels.linear.out_proj_mlp runs it, over `layers` layers' own weights (read
    from DRAM) in a CUDA graph, us a layer: the chain (one tma_gemv_chain launch) with the producer paused at each
    grid sync after each of CHAIN_PAUSES KiB; "apart": its three TMA GEMVs launched one by one (PDL); "flat": one
    TMA GEMV of the same bytes (N = the three's rows, K = hidden), what the chain would take without its syncs."""
    from kernels import tma_gemv as T
    shapes = LINEAR_SHAPES[model]
    (hidden, width), (wide, _), (_, inter) = shapes[1], shapes[4], shapes[5]  # out, gate_up, down
    tails = [(torch.randn(hidden, width, device="cuda", dtype=BF16) / width ** 0.5,
              torch.randn(wide, hidden, device="cuda", dtype=BF16) / hidden ** 0.5,
              torch.randn(hidden, inter, device="cuda", dtype=BF16) / inter ** 0.5) for _ in range(layers)]
    nbytes = sum(w.numel() * 2 for w in tails[0])
    flat = [torch.randn(nbytes // (2 * hidden), hidden, device="cuda", dtype=BF16) for _ in range(layers)]
    o = torch.randn(1, width, device="cuda", dtype=BF16)
    residual = torch.randn(1, hidden, device="cuda", dtype=BF16)
    norm_w = (0.1 * torch.randn(hidden, device="cuda")).to(BF16)
    out, s = (torch.empty(1, hidden, device="cuda", dtype=BF16) for _ in range(2))
    inputs = (T.GemvInput(width), T.GemvInput(hidden, norm=True, add=True), T.GemvInput(inter, gated=True))

    def chain(pause_kib: int):
        for weights in tails:
            T.tma_gemv_chain(o, weights, inputs, out, norm_weight=norm_w, eps=1e-6, residual=residual, s_out=s,
                             boundary_bytes=pause_kib * 1024)

    def apart():
        for w_out, w_gate_up, w_down in tails:
            gate_up = T.tma_gemv(T.tma_gemv(o, w_out), w_gate_up, norm_weight=norm_w, eps=1e-6, residual=residual,
                                 s_out=s)
            T.tma_gemv(gate_up, w_down, out, gated=True)

    def one_gemv():
        for w in flat:
            T.tma_gemv(residual, w)  # (1, hidden) @ (rows, hidden)^T

    steps = {**{f"chain_pause{p}": functools.partial(chain, p) for p in CHAIN_PAUSES}, "apart": apart,
             "flat": one_gemv}
    rows = []
    for name, step in steps.items():
        step()
        us = bench_us(step, graph=True) / layers
        rows.append(progress({"model": model, "variant": name, "MB": nbytes / 1e6, "us_a_layer": us,
                              "TBps": nbytes / us / 1e6}))
    return rows


# ---- plot and main ------------------------------------------------------------------------------------

def plot_curve(curve, path):
    series = [("ours_graph_TBps", "ours (Triton split-KV)"), ("cudnn_TBps", "cuDNN SDPA"), ("fa2_TBps", "FA2 SDPA"),
              ("fa4_TBps", "flash-attn-4")]
    plot_series(path, curve, "ctx", series, "context tokens (B1, H16/KV4, d256, bf16)", "KV read TB/s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS), help="folder for decode.json and decode_bw.png")
    ap.add_argument("--quick", action="store_true", help="only the first attention case (for ncu)")
    ap.add_argument("--only", action="append", choices=SECTIONS,
                    help="run only this section (repeatable); the JSON is then decode_<sections>.json")
    ap.add_argument("--sweep-linear", metavar="MODEL", nargs="?", const="qwen3.5-2b", choices=sorted(LINEAR_SHAPES),
                    help="only sweep the decode GEMV's launch plans on MODEL's projections (default qwen3.5-2b)")
    ap.add_argument("--rows", type=int, default=1, help="rows of x in --sweep-linear (more than kernels.linear's "
                    "MAX_ROWS sweep its skinny GEMM)")
    ap.add_argument("--shapes", default=None, help="with --sweep-linear: only these of MODEL's projections, as "
                                                    "N:K,N:K (e.g. 2048:2048,2048:6144)")
    ap.add_argument("--sweep-tma", metavar="MODEL", nargs="+", choices=sorted(LINEAR_SHAPES),
                    help="only time the TMA-ring GEMV's variants against the Triton GEMV on MODELs' projections and "
                         "in a chain of their GDN layers (decode_tma_gemv_sweep.json)")
    ap.add_argument("--sweep-chain", metavar="MODEL", nargs="+", choices=sorted(LINEAR_SHAPES),
                    help="only time a dense layer's chained out_proj / gate_up / down at each producer pause, beside "
                         "its GEMVs apart and one GEMV of its bytes (decode_chain_sweep.json)")
    ap.add_argument("--sweep-splits", action="store_true", help="only time B1 decode attention (H16/KV4 and H8/KV2, "
                    "d256) at each KV split count (decode_split_sweep.json)")
    ap.add_argument("--sweep-splits-cold", action="store_true", help="only time B1 decode attention (H8/KV2 d256, "
                    "8k) with its KV from DRAM, per page size and split count (decode_split_cold.json)")
    ap.add_argument("--plot", metavar="JSON", help="only draw decode_bw.png beside an existing decode.json")
    args = ap.parse_args(argv)
    if args.plot:
        path = Path(args.plot)
        plot_curve(json.loads(path.read_text())["attention_curve"], path.with_name("decode_bw.png"))
        return
    if args.sweep_splits_cold:
        rows = sweep_splits_cold()
        print_table(rows, ["H/KV", "ctx", "page", "splits", "copies", "us", "TBps"])
        print(f"wrote {write_result('decode_split_cold', {'env': environment(), 'sweep': rows}, args.out)}")
        return
    if args.sweep_splits:
        rows = sweep_splits(16, 4) + sweep_splits(8, 2)
        print_table(rows, ["H/KV", "ctx", "chosen", *[f"s{s}_us" for s in SPLIT_SWEEP], "best"])
        print(f"wrote {write_result('decode_split_sweep', {'env': environment(), 'sweep': rows}, args.out)}")
        return
    if args.sweep_chain:
        rows = [r for model in args.sweep_chain for r in sweep_chain(model)]
        print_table(rows, ["model", "variant", "MB", "us_a_layer", "TBps"])
        print(f"wrote {write_result('decode_chain_sweep', {'env': environment(), 'sweep': rows}, args.out)}")
        return
    if args.sweep_tma:
        rows = [r for model in args.sweep_tma for r in sweep_tma(model)]
        print_table([r for r in rows if r["N"] != "chain"],
                    ["model", "N", "K", "gated", "triton_us", *[f"{v}_us" for v in TMA_VARIANTS], "triton_TBps",
                     "tma_best", "tma_best_TBps"])
        print_table([r for r in rows if r["N"] == "chain"], ["model", "K", "gemvs", "GB", "chain_us", "chain_TBps"])
        print(f"wrote {write_result('decode_tma_gemv_sweep', {'env': environment(), 'sweep': rows}, args.out)}")
        return
    if args.sweep_linear:
        shapes = dict.fromkeys(LINEAR_SHAPES[args.sweep_linear])
        if args.shapes:
            wanted = {tuple(map(int, s.split(":"))) for s in args.shapes.split(",")}
            shapes = {s: None for s in shapes if s in wanted}
            if not shapes:
                ap.error(f"--shapes {args.shapes}: none of {args.sweep_linear}'s projections")
        sweep = [progress(sweep_linear_shape(n, k, args.rows)) for n, k in shapes]
        name = "decode_linear_sweep" + ("" if args.sweep_linear == "qwen3.5-2b" else "_" + args.sweep_linear)
        write_result(name + ("" if args.rows == 1 else f"_rows{args.rows}") + ("_some" if args.shapes else ""),
                     {"env": environment(), "model": args.sweep_linear, "sweep": sweep}, args.out)
        return
    if args.quick:
        print_table([bench_attention_case(*ATTN_CASES[0], peers=())], ["B", "ctx", "ours_us", "ours_TBps"])
        return
    ceil = bandwidth_ceilings()
    sections = args.only or SECTIONS
    run_attention = "attention" in sections
    attn = [progress(bench_attention_case(*c)) for c in ATTN_CASES] if run_attention else []
    for r in attn:
        r["ours_frac_of_read_ceiling"] = r["ours_graph_TBps"] / ceil["read_TBps"]
    curve = [progress(bench_attention_case(1, ctx, 16, 4, 256)) for ctx in CURVE_CONTEXTS] if run_attention else []
    gdn = [progress(bench_gdn_case(b, hv=hv)) for hv in (32, 16) for b in (1, 8, 64)] if "gdn" in sections else []
    small = [r for n in (1, 64, 4096) for r in bench_small_ops_case(n)] if "small" in sections else []
    for r in small:
        r["frac_of_copy_ceiling"] = r["GBps"] / 1e3 / ceil["copy_TBps"]
    lin = ([progress(r) for m in LINEAR_SHAPES for rows in (1, 4) for r in bench_linear_case(m, rows)]
           if "linear" in sections else [])
    print(f"ceilings: read {ceil['read_TBps']:.2f} TB/s, copy {ceil['copy_TBps']:.2f} TB/s")
    print("\npaged decode attention (TB/s of KV read; ours timed in a CUDA graph)")
    print_table(attn, ["B", "ctx", "H/KV", "D", "splits", "ours_us", "ours_graph_TBps", "cudnn_TBps", "fa2_TBps",
                       "fa4_TBps", "vs_best_peer", "ours_frac_of_read_ceiling"])
    print("\nGated DeltaNet decode step, d128: 9B's Hk16/Hv32 and 2B's Hk16/Hv16 (per layer; graph: layers' states "
          "from DRAM; triton_graph_us: the Triton kernel where the CuTe one runs)")
    print_table(gdn, ["B", "Hk/Hv", "kernel", "layers", "ours_us", "ours_graph_us", "triton_graph_us",
                      "ours_graph_TBps", "fla_us", "fla_graph_us", "speedup_vs_fla", "graph_speedup_vs_fla"])
    print("\nfused small ops (CUDA graph)")
    print_table(small, ["op", "N", "width", "us", "GBps", "frac_of_copy_ceiling"])
    print("\ndecode projections (CUDA graph; chain: one step's projections back to back)")
    print_table(lin, ["model", "rows", "N", "K", "ours_us", "ours_no_pdl_us", "cublas_us", "ours_TBps", "cublas_TBps",
                      "speedup_vs_cublas"])
    name = "decode" if set(sections) == set(SECTIONS) else "_".join(["decode", *sorted(set(sections))])
    out = write_result(name, {"env": environment(), "ceilings": ceil, "attention": attn, "attention_curve": curve,
                                  "gdn_decode": gdn, "small_ops": small, "linear": lin},
                       args.out)
    if not curve:
        print(f"\nwrote {out}")
        return
    try:
        plot_curve(curve, out.with_name("decode_bw.png"))
        print(f"\nwrote {out} and {out.with_name('decode_bw.png')}")
    except ImportError:  # the GPU machine has no matplotlib: plot later from the JSON
        print(f"\nwrote {out}; plot it with: python -m profiles.bench_decode --plot {out}")


if __name__ == "__main__":
    main()
