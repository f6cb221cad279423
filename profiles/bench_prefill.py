"""Prefill benchmark on the GPU: `python -m profiles.bench_prefill [--out DIR] [--only PART] [--quick [WHAT]]`.

1. Attention, bf16: `fa4.flash_attention(backend="triton")` (and "cute" at d128/d256) in TFLOP/s against
   flash-attn-4, cuDNN SDPA and FA2 SDPA on ATTN_CASES (the peers' known H200 rows: B4 S8k H32 d128 causal and
   not, B1 S16k H16/KV4 and B1 S32k H8/KV2 d256 causal; then a d64 GQA row), with each FA4 flag on its own (the
   rescale threshold, the polynomial exp2 fraction), so the table shows what each idea is worth.
   FLOPs: 4 * Sq * Sk * H * D, halved for causal.
2. The chunked Gated DeltaNet prefill (kernels/gdn_prefill.py) in Mtok/s against fla's chunk_gated_delta_rule.
3. `--only sustained`: the CuTe kernel and flash-attn-4 each alone for seconds, with the SM clock and power each
   settles at (near the power cap the clock depends on the kernel; the paired ratios of `--only cute` share one).
Writes prefill.json to --out.

Bounds, before tuning (H200): dense bf16 wgmma ~990 TFLOP/s peak, 670-790 measured on GEMM; exp2 at
16/clk/SM is S^2/2 * H exps, about half the d128 matmul time, which is what the polynomial offloads. GDN:
about 6 MFLOP a token at H32 (kernels/gdn_prefill.py's docstring), ~70 Mtok/s at the tf32 rate.
"""
import argparse
import functools
import json
import time
from pathlib import Path
from unittest import mock

import torch

from profiles.common import (
    ITERS,
    RESULTS,
    bench_us,
    environment,
    interleaved_us,
    paired_ratio,
    peer_attention,
    plot_bars,
    plot_series,
    print_table,
    progress,
    quantile,
    write_result,
)

BF16 = torch.bfloat16
ATTN_CASES = [  # (batch, seqlen, q heads, kv heads, head_dim, causal)
    (4, 8192, 32, 32, 128, False), (4, 8192, 32, 32, 128, True),
    (1, 16384, 16, 4, 256, True), (1, 32768, 8, 2, 256, True), (4, 4096, 32, 8, 64, True),
]
# (label, rescale_threshold, poly_exp2_fraction): the plain online softmax, then each FA4 idea, then both.
# Every case runs MAIN_VARIANTS; the ABLATION_CASES (indices into ATTN_CASES) run them all.
FLAG_VARIANTS = [("rescale8", 8.0, 0.0), ("rescale8+poly1/8", 8.0, 0.125), ("always_rescale", 0.0, 0.0),
                 ("poly1/8", 0.0, 0.125), ("rescale8+poly1/4", 8.0, 0.25)]
MAIN_VARIANTS = FLAG_VARIANTS[:2]
ABLATION_CASES = (1, 2)
GDN_CASES = [(1, 8192, 16), (1, 16384, 32), (1, 32768, 16), (8, 4096, 32)]  # (batch, T, heads); dk = dv = 128
CURVE = (32768, 32, 128)  # TFLOP/s against seqlen: batch * seqlen = 32k tokens, H32 d128, causal
CURVE_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
AGENT_CASE = ("800 new / 50k", 1, 800, 50000)  # H16/KV4 d256 over a paged prefix (profiles/bench_agent_turn.py)
PARTS = ("gdn", "attention", "agent", "curve", "cute", "sustained")
SUSTAIN_S = 2.0  # the sustained part: seconds each kernel runs alone, back to back (after SETTLE_S of the same)
SETTLE_S = 0.3
# The CuTe kernel (issue 5): each FA4 idea and schedule option against the default config (the intra-warpgroup overlap
# on, conditional rescale at 8, no polynomial exp2, one CTA a tile and ping-pong but at dense d128 (non-causal for the
# former)), as head_dim -> config overrides (a head dim left out does not run the variant). pingpong flips the default
# ping-pong of the consumer warpgroups, which take turns issuing their GEMMs with it (at a cost in barrier stalls:
# profiles/FINDINGS.md; fa4.cute.config.default_pingpong). wide_tile:
# FA3's K/V tiles on the H100 (d128 176 keys, d256 80); 3_stages: a deeper K/V ring at d128 (32 + 3 x 64 KiB of smem);
# hoisted_desc: QK^T with our own wgmma descriptors, built once outside the loop (AttentionConfig.hoisted_qk_desc; the
# default at dense d128 causal only, fa4.cute.config.default_hoisted_qk_desc), dsl_desc: QK^T through cute.gemm
# everywhere; persistent: the persistent scheduler everywhere (the default at dense d128 non-causal only,
# fa4.cute.config.default_persistent), cta_a_tile: a CTA a tile everywhere.


def _every_dim(**overrides) -> dict:
    return {128: overrides, 256: overrides}


CUTE_VARIANTS = [("default", _every_dim()), ("no_overlap", _every_dim(intra_wg_overlap=False)),
                 ("always_rescale", _every_dim(rescale_threshold=0.0)),
                 ("poly1/8", _every_dim(poly_exp2_fraction=0.125)), ("poly1/4", _every_dim(poly_exp2_fraction=0.25)),
                 ("persistent", _every_dim(persistent=True)), ("cta_a_tile", _every_dim(persistent=False)),
                 ("pingpong", {128: dict(pingpong=True), 256: dict(pingpong=False)}),
                 ("wide_tile", {128: dict(tile_n=176), 256: dict(tile_n=80)}), ("3_stages", {128: dict(kv_stages=3)}),
                 ("hoisted_desc", _every_dim(hoisted_qk_desc=True)), ("dsl_desc", _every_dim(hoisted_qk_desc=False))]


def select_cute_variants(labels: list[str] | None) -> list[tuple[str, dict]]:
    """CUTE_VARIANTS entries by label (all when labels is None). "a+b" joins entries: their overrides merged, on the
    head dims both have (b's fields win). Raises ValueError naming an unknown label."""
    known = dict(CUTE_VARIANTS)
    if labels is None:
        return list(CUTE_VARIANTS)
    unknown = sorted({part for label in labels for part in label.split("+")} - set(known))
    if unknown:
        raise ValueError(f"--cute-variants: unknown {unknown}; known {list(known)}")
    chosen = []
    for label in labels:
        parts = [known[part] for part in label.split("+")]
        dims = set.intersection(*(set(part) for part in parts))
        chosen.append((label, {d: {k: v for part in parts for k, v in part[d].items()} for d in sorted(dims)}))
    return chosen


def attention_flops(batch, seqlen, heads, dim, causal):
    return 4 * batch * seqlen * seqlen * heads * dim / (2 if causal else 1)


def attention_inputs(batch, seqlen, h, kv, d):
    """Seeded random q (batch, seqlen, h, d) and k, v (batch, seqlen, kv, d), bf16 on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, seqlen, h, d, device="cuda", dtype=BF16, generator=gen)
    k, v = (torch.randn(batch, seqlen, kv, d, device="cuda", dtype=BF16, generator=gen) for _ in range(2))
    return q, k, v


def time_peers(row: dict, peers, q, k, v, causal: bool, flops: float) -> None:
    """row[<peer>_TFLOPs] for each peer on (q, k, v); a peer that cannot run the case is reported, not fatal."""
    for name in peers:
        try:
            row[f"{name}_TFLOPs"] = flops / bench_us(peer_attention(name, q, k, v, causal)) / 1e6
        except Exception as err:
            row[f"{name}_TFLOPs"], row[f"{name}_error"] = None, f"{type(err).__name__}: {err}"[:200]


def bench_attention_case(batch, seqlen, h, kv, d, causal, variants, peers=("fa4", "cudnn", "fa2"), cute=True):
    from fa4 import flash_attention
    q, k, v = attention_inputs(batch, seqlen, h, kv, d)
    flops = attention_flops(batch, seqlen, h, d, causal)
    row = {"B": batch, "S": seqlen, "H/KV": f"{h}/{kv}", "D": d, "causal": causal}
    for label, threshold, frac in variants:
        us = bench_us(functools.partial(flash_attention, q, k, v, causal=causal, backend="triton",
                                        rescale_threshold=threshold, poly_exp2_fraction=frac))
        row[f"{label}_TFLOPs"] = flops / us / 1e6
    if cute and d in (128, 256):
        try:  # the CuTe-DSL kernel (fa4/cute), FA4 flags at their defaults
            row["cute_TFLOPs"] = flops / bench_us(lambda: flash_attention(q, k, v, causal=causal, backend="cute")) / 1e6
        except Exception as err:  # reported, not fatal: the benchmark still shows the rest
            row["cute_TFLOPs"], row["cute_error"] = None, f"{type(err).__name__}: {err}"[:200]
    time_peers(row, peers, q, k, v, causal, flops)
    ours = [row[f"{label}_TFLOPs"] for label, _, _ in variants]
    if ours:
        row["ours_best_TFLOPs"] = max(ours)
        row["ours_best_flags"] = variants[ours.index(max(ours))][0]
    row["vs_fa4"] = row["ours_best_TFLOPs"] / row["fa4_TFLOPs"] if ours and row.get("fa4_TFLOPs") else None
    row["cute_vs_fa4"] = row["cute_TFLOPs"] / row["fa4_TFLOPs"] if row.get("cute_TFLOPs") and row.get("fa4_TFLOPs") \
        else None
    return row


def bench_gdn_case(batch, seqlen, heads, dk=128, dv=128, fla=True):
    from kernels.gdn_prefill import chunk_gated_delta_rule
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = batch * seqlen
    q = torch.randn(n, heads, dk, device="cuda", dtype=BF16, generator=gen)
    k = torch.randn(n, heads, dk, device="cuda", dtype=BF16, generator=gen)
    v = torch.randn(n, heads, dv, device="cuda", dtype=BF16, generator=gen)
    g = -torch.rand(n, heads, device="cuda", generator=gen) * 0.1
    beta = torch.rand(n, heads, device="cuda", generator=gen)
    states = torch.randn(batch, heads, dk, dv, device="cuda", generator=gen) * 0.1
    slots = torch.arange(batch, device="cuda")
    cu = torch.arange(0, n + 1, seqlen, device="cuda", dtype=torch.int32)
    out = torch.empty_like(v)
    cu_host = tuple(range(0, n + 1, seqlen))  # the caller's host copy (serving's steps carry one): no device read
    ours = lambda host: chunk_gated_delta_rule(q, k, v, g, beta, recurrent_states=states, state_slots=slots,
                                               cu_seqlens=cu, cu_seqlens_host=host, out=out)
    row = {"B": batch, "T": seqlen, "H": heads, "ours_Mtok_s": n / bench_us(lambda: ours(cu_host)),
           "device_read_us": bench_us(lambda: ours(None))}  # cu_seqlens read on the host: a sync a call
    # where the time goes: each of the three passes alone (each run once first, for its inputs)
    from kernels import gdn_prefill as G
    _, passes = G.prefill_passes(q, k, v, g, beta, recurrent_states=states, state_slots=slots, cu_seqlens=cu,
                                 cu_seqlens_host=cu_host, out=out)
    for run_pass in passes:
        run_pass()
    row["total_us"] = n / row["ours_Mtok_s"]
    row.update({f"{p.__name__}_us": bench_us(p) for p in passes})  # wy_us, state_us, output_us
    with mock.patch.dict(G.WY_MAXNREG, {BF16: 255}):  # the WY pass at one CTA an SM (the default cap is 128)
        row["wy_maxnreg255_us"] = bench_us(passes[0])
    if not fla:
        return row
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        fq, fk, fv = (t.view(batch, seqlen, heads, -1) for t in (q, k, v))
        fg, fb = g.view(batch, seqlen, heads), beta.to(BF16).view(batch, seqlen, heads)
        peer = lambda: fla_chunk(fq, fk, fv, g=fg, beta=fb, initial_state=states, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)
        row["fla_Mtok_s"] = n / bench_us(peer)
        row["vs_fla"] = row["ours_Mtok_s"] / row["fla_Mtok_s"]
    except Exception as err:
        row["fla_Mtok_s"], row["fla_error"] = None, f"{type(err).__name__}: {err}"[:200]
    return row


def bench_curve_point(seqlen, flags=MAIN_VARIANTS[0]):
    """One point of the TFLOP/s-against-seqlen curve: ours (conditional rescale, no polynomial: the faster
    Triton setting), flash-attn-4 and cuDNN."""
    tokens, h, d = CURVE
    row = bench_attention_case(tokens // seqlen, seqlen, h, h, d, True, [flags], peers=("fa4", "cudnn"), cute=False)
    return {"S": seqlen, "B": row["B"], "ours_TFLOPs": row[f"{flags[0]}_TFLOPs"],
            **{k: row[k] for k in ("fa4_TFLOPs", "cudnn_TFLOPs", "vs_fa4")}}


def bench_agent_row(cute=False):
    """The agent-turn prefill row: a chunk over a paged prefix, ours (fa4.flash_attention's route; with cute, also
    the CuTe kernel) and flash-attn-4 varlen with page_table, in TFLOP/s of visible pairs."""
    from profiles import bench_agent_turn as A
    row = A.bench_case(*AGENT_CASE, cute=cute)
    t_fa4 = A.best(row, "fa4")
    row["fa4_TFLOPs"] = row["GFLOP"] * 1e3 / t_fa4 if t_fa4 else None
    row["vs_fa4"] = row.get("fa4_over_ours")  # our speed over the peer's: t_fa4 / t_ours
    return row


def bench_cute_case(batch, seqlen, h, kv, d, causal, variants=CUTE_VARIANTS, iters=ITERS):
    """The CuTe kernel with each variant (select_cute_variants) against flash-attn-4 and
    cuDNN: TFLOP/s of each call's median time over `iters` interleaved iterations (interleaved_us), and each call's
    speed over flash-attn-4's as the median (and p10-p90) of the iterations' paired ratios (paired_ratio)."""
    from fa4.cute.entry import cute_attention
    q, k, v = attention_inputs(batch, seqlen, h, kv, d)
    flops = attention_flops(batch, seqlen, h, d, causal)
    row = {"B": batch, "S": seqlen, "H/KV": f"{h}/{kv}", "D": d, "causal": causal}
    calls = {f"cute_{label}": functools.partial(cute_attention, q, k, v, causal=causal, softmax_scale=d ** -0.5,
                                                **by_dim[d])
             for label, by_dim in variants if d in by_dim}
    calls.update({name: peer_attention(name, q, k, v, causal) for name in ("fa4", "cudnn")})
    for name, call in list(calls.items()):
        try:
            call()  # compiles; a call that cannot run the case is reported, not fatal
        except Exception as err:
            row[f"{name}_TFLOPs"], row[f"{name}_error"] = None, f"{type(err).__name__}: {err}"[:200]
            del calls[name]
    times = interleaved_us(calls, iters)
    for name in calls:
        row[f"{name}_TFLOPs"] = flops / quantile(times[name], 0.5) / 1e6
        if "fa4" in calls and name != "fa4":
            ratio = paired_ratio(times, name, "fa4")
            row[f"{name}_vs_fa4"] = ratio["median"]
            row[f"{name}_vs_fa4_p10_p90"] = f"{ratio['p10']:.3f}-{ratio['p90']:.3f}"
    ours = {label: row[f"cute_{label}_vs_fa4"] for label, _ in variants if row.get(f"cute_{label}_vs_fa4")}
    if ours:
        row["cute_best"] = max(ours, key=ours.get)
        row["cute_best_vs_fa4"] = ours[row["cute_best"]]
        row["cute_default_vs_fa4"] = ours.get("default", 0.0)
    return row


def bench_sustained_case(batch, seqlen, h, kv, d, causal, rounds: int = 3) -> list[dict]:
    """Our CuTe kernel and flash-attn-4, each alone back to back for SUSTAIN_S a round (the way a prefill's layers
    call one kernel), with the SM clock and board power it settles at (profiles.gpu_clocks): TFLOP/s, MHz, W."""
    from fa4.cute.entry import cute_attention
    from profiles.gpu_clocks import ClockSampler
    q, k, v = attention_inputs(batch, seqlen, h, kv, d)
    calls = {"cute": functools.partial(cute_attention, q, k, v, causal=causal, softmax_scale=d ** -0.5),
             "fa4": peer_attention("fa4", q, k, v, causal)}
    flops = attention_flops(batch, seqlen, h, d, causal)
    rows = []
    with ClockSampler() as clocks:
        for r in range(rounds):
            for name, call in calls.items():
                settle = time.time() + SETTLE_S
                while time.time() < settle:
                    call()
                    torch.cuda.synchronize()
                t0, n = time.time(), 0
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                while time.time() - t0 < SUSTAIN_S:
                    for _ in range(8):
                        call()
                    n += 8
                    torch.cuda.synchronize()
                end.record()
                end.synchronize()
                mhz, watts = clocks.mean(t0, time.time())
                us = 1e3 * start.elapsed_time(end) / n
                rows.append({"B": batch, "S": seqlen, "H/KV": f"{h}/{kv}", "D": d, "causal": causal, "kernel": name,
                             "round": r, "us": us, "TFLOPs": flops / us / 1e6, "sm_MHz": mhz, "W": watts})
    for row in rows:  # each round's ratio to flash-attn-4's time in the same round
        peer = next(p for p in rows if p["round"] == row["round"] and p["kernel"] == "fa4" and p["D"] == row["D"])
        row["vs_fa4"] = peer["us"] / row["us"]
    return rows


def quick(what, case: int = 2):
    """A short run of one case (for ncu): few timed calls, no peers beside it; case indexes ATTN_CASES."""
    if what == "gdn":
        progress(bench_gdn_case(*GDN_CASES[0], fla=False))
        return
    if what == "cute":
        from fa4.cute.entry import cute_attention
        batch, seqlen, h, kv, d, causal = ATTN_CASES[case]
        q, k, v = attention_inputs(batch, seqlen, h, kv, d)
        us = bench_us(lambda: cute_attention(q, k, v, causal=causal, softmax_scale=d ** -0.5))
        progress({"cute_TFLOPs": attention_flops(batch, seqlen, h, d, causal) / us / 1e6})
        return
    fa4 = what == "fa4"
    row = bench_attention_case(*ATTN_CASES[case], variants=[] if fa4 else MAIN_VARIANTS[:1],
                               peers=("fa4",) if fa4 else (), cute=False)
    progress(row)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS), help="folder for prefill.json")
    ap.add_argument("--quick", nargs="?", const="ours", choices=("ours", "fa4", "gdn", "cute"),
                    help="one case for a profiler: the B1 S16k H16/KV4 d256 causal attention (ours, cute or "
                         "flash-attn-4), or the GDN prefill at B1 T16k H32")
    ap.add_argument("--quick-case", type=int, default=2, choices=range(len(ATTN_CASES)), metavar="I",
                    help="--quick's attention case: an index into ATTN_CASES (default 2, the d256 causal row)")
    ap.add_argument("--only", action="append", choices=PARTS,
                    help="run these parts only (repeatable); their keys are merged into an existing prefill.json")
    ap.add_argument("--plot", metavar="JSON", help="only redraw the plots from a prefill.json (into --out)")
    ap.add_argument("--cute-variants", default=None, metavar="A,B",
                    help="the cute part runs only these CUTE_VARIANTS labels (default: all); a+b joins two")
    ap.add_argument("--iters", type=int, default=ITERS,
                    help="the cute part: iterations, each running every variant and peer once, back to back in "
                         "rotated order; medians of times and of paired ratios count")
    args = ap.parse_args(argv)
    labels = args.cute_variants.split(",") if args.cute_variants else None
    try:
        variants = select_cute_variants(labels)
    except ValueError as err:
        ap.error(str(err))
    if args.plot:
        plot_all(json.loads(Path(args.plot).read_text()), Path(args.out))
        return
    if args.quick:
        quick(args.quick, args.quick_case)
        return
    parts = args.only or PARTS
    result = {}
    if "gdn" in parts:
        result["gdn_prefill"] = [progress(bench_gdn_case(*c)) for c in GDN_CASES]
        print("\nGated DeltaNet chunked prefill, dk = dv = 128 (Mtok/s; each pass alone in us)")
        print_table(result["gdn_prefill"], ["B", "T", "H", "ours_Mtok_s", "fla_Mtok_s", "vs_fla", "total_us", "wy_us",
                                            "state_us", "output_us", "wy_maxnreg255_us", "device_read_us"])
    if "attention" in parts:
        result["attention"] = [progress(bench_attention_case(
            *c, variants=FLAG_VARIANTS if i in ABLATION_CASES else MAIN_VARIANTS)) for i, c in enumerate(ATTN_CASES)]
        print("\nprefill attention, bf16, TFLOP/s (ours: fa4.flash_attention(backend='triton') with each flag set)")
        print_table(result["attention"], ["B", "S", "H/KV", "D", "causal", *[f"{v[0]}_TFLOPs" for v in FLAG_VARIANTS],
                                          "cute_TFLOPs", "fa4_TFLOPs", "cudnn_TFLOPs", "fa2_TFLOPs", "vs_fa4",
                                          "cute_vs_fa4"])
    if "agent" in parts:
        result["agent_turn"] = [progress(bench_agent_row())]
        print("\nagent turn: a chunk over a paged prefix, H16/KV4 d256 (TFLOP/s of visible pairs)")
        print_table(result["agent_turn"], ["case", "route", "ours_best_us", "TFLOPs", "fa4_TFLOPs", "vs_fa4"])
    if "curve" in parts:
        result["curve"] = [progress(bench_curve_point(s)) for s in CURVE_SEQLENS]
        print(f"\ncausal H32 d128, {CURVE[0]} tokens a call, TFLOP/s against seqlen")
        print_table(result["curve"], ["S", "B", "ours_TFLOPs", "fa4_TFLOPs", "cudnn_TFLOPs", "vs_fa4"])
    if "cute" in parts:
        result["cute"] = [progress(bench_cute_case(*c, variants=variants, iters=args.iters)) for c in ATTN_CASES[:4]]
        print("\nCuTe-DSL kernel (fa4/cute), bf16, TFLOP/s per variant, against flash-attn-4 and cuDNN")
        print_table(result["cute"], ["B", "S", "H/KV", "D", "causal", *[f"cute_{v[0]}_TFLOPs" for v in variants],
                                     "fa4_TFLOPs", "cudnn_TFLOPs", "cute_best", "cute_best_vs_fa4",
                                     f"cute_{labels[0] if labels else 'default'}_vs_fa4_p10_p90"])
        result["cute_agent_turn"] = [progress(bench_agent_row(cute=True))]
        print_table(result["cute_agent_turn"], ["case", "cute_us", "cute_graph_us", "fa4_us", "fa4_graph_us",
                                                "cute_TFLOPs", "fa4_over_cute", "rel_err_cute_vs_fa4"])
    if "sustained" in parts:
        result["sustained"] = [row for c in ATTN_CASES[:4] for row in bench_sustained_case(*c)]
        print(f"\neach kernel alone for {SUSTAIN_S} s a round: TFLOP/s, and the SM clock and power it settles at")
        print_table(result["sustained"], ["B", "S", "H/KV", "D", "causal", "kernel", "round", "TFLOPs", "vs_fa4",
                                          "sm_MHz", "W"])
    path = Path(args.out) / "prefill.json"
    merged = json.loads(path.read_text()) if args.only and path.exists() else {}
    merged.pop("command", None)
    out = write_result("prefill", {**merged, "env": environment(), "flag_variants": FLAG_VARIANTS, **result}, args.out)
    print(f"\nwrote {out}")
    plot_all(merged | result, Path(args.out))


def plot_all(result: dict, folder: Path) -> None:
    """prefill_tflops.png (the curve) and prefill_cute.png (the CuTe variants against the peers), where the result
    has them; the GPU machine has no matplotlib: redraw there from the JSON with --plot."""
    try:
        if "curve" in result:
            plot_series(folder / "prefill_tflops.png", result["curve"], "S",
                        [("ours_TFLOPs", "ours (Triton)"), ("fa4_TFLOPs", "flash-attn-4"),
                         ("cudnn_TFLOPs", "cuDNN SDPA")], "sequence length", "TFLOP/s")
        if "cute" in result:
            rows = result["cute"]
            labels = [f"S{r['S'] // 1024}k H{r['H/KV']}\nd{r['D']}{' causal' if r['causal'] else ''}" for r in rows]
            variants = [k for k in rows[0] if k.startswith("cute_") and k.endswith("_TFLOPs")]  # as measured
            plot_bars(folder / "prefill_cute.png", labels, rows,
                      [(k, "CuTe " + k[5:-7]) for k in variants]
                      + [("fa4_TFLOPs", "flash-attn-4"), ("cudnn_TFLOPs", "cuDNN SDPA")], "TFLOP/s")
        print(f"plots in {folder}")
    except ImportError:
        print("no matplotlib: redraw later with python -m profiles.bench_prefill --plot prefill.json")


if __name__ == "__main__":
    main()
