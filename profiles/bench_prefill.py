"""Prefill benchmark on the GPU: `python -m profiles.bench_prefill [--out DIR] [--quick]`.

1. Attention, bf16: `fa4.flash_attention(backend="triton")` (and "cute" at d128/d256) in TFLOP/s against
   flash-attn-4, cuDNN SDPA and FA2 SDPA on DESIGN.md's shapes, with each FA4 flag on its own (the rescale
   threshold, the polynomial exp2 fraction), so the table shows what each idea is worth.
   FLOPs: 4 * Sq * Sk * H * D, halved for causal.
2. The chunked Gated DeltaNet prefill (kernels/gdn_prefill.py) in Mtok/s against fla's chunk_gated_delta_rule.
Writes prefill.json to --out.

Bounds, before tuning (H200): dense bf16 wgmma ~990 TFLOP/s peak, 670-790 measured on GEMM; exp2 at
16/clk/SM is S^2/2 * H exps, about half the d128 matmul time, which is what the polynomial offloads. GDN:
about 6 MFLOP a token at H32 (kernels/gdn_prefill.py's docstring), ~70 Mtok/s at the tf32 rate.
"""
import argparse
import functools

import torch

from profiles.common import RESULTS, bench_us, environment, peer_attention, print_table, progress, write_result

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
GDN_CASES = [(1, 16384, 32), (1, 32768, 16), (8, 4096, 32)]  # (batch, T, heads); dk = dv = 128


def attention_flops(batch, seqlen, heads, dim, causal):
    return 4 * batch * seqlen * seqlen * heads * dim / (2 if causal else 1)


def bench_attention_case(batch, seqlen, h, kv, d, causal, variants, peers=("fa4", "cudnn", "fa2"), cute=True):
    from fa4 import flash_attention
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, seqlen, h, d, device="cuda", dtype=BF16, generator=gen)
    k = torch.randn(batch, seqlen, kv, d, device="cuda", dtype=BF16, generator=gen)
    v = torch.randn(batch, seqlen, kv, d, device="cuda", dtype=BF16, generator=gen)
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
    for name in peers:
        try:
            row[f"{name}_TFLOPs"] = flops / bench_us(peer_attention(name, q, k, v, causal)) / 1e6
        except Exception as err:  # a peer that cannot run the case is reported, not fatal
            row[f"{name}_TFLOPs"], row[f"{name}_error"] = None, f"{type(err).__name__}: {err}"[:200]
    ours = [row[f"{label}_TFLOPs"] for label, _, _ in variants]
    row["ours_best_TFLOPs"] = max(ours)
    row["ours_best_flags"] = variants[ours.index(max(ours))][0]
    row["vs_fa4"] = row["ours_best_TFLOPs"] / row["fa4_TFLOPs"] if row.get("fa4_TFLOPs") else None
    row["cute_vs_fa4"] = row["cute_TFLOPs"] / row["fa4_TFLOPs"] if row.get("cute_TFLOPs") and row.get("fa4_TFLOPs") \
        else None
    return row


def bench_gdn_case(batch, seqlen, heads, dk=128, dv=128):
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
    ours = lambda: chunk_gated_delta_rule(q, k, v, g, beta, recurrent_states=states, state_slots=slots,
                                          cu_seqlens=cu, out=out)
    row = {"B": batch, "T": seqlen, "H": heads, "ours_Mtok_s": n / bench_us(ours)}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        fq, fk, fv = (t.view(batch, seqlen, heads, -1) for t in (q, k, v))
        fg, fb = g.view(batch, seqlen, heads), beta.to(BF16).view(batch, seqlen, heads)
        fla = lambda: fla_chunk(fq, fk, fv, g=fg, beta=fb, initial_state=states, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
        row["fla_Mtok_s"] = n / bench_us(fla)
        row["vs_fla"] = row["ours_Mtok_s"] / row["fla_Mtok_s"]
    except Exception as err:
        row["fla_Mtok_s"], row["fla_error"] = None, f"{type(err).__name__}: {err}"[:200]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS), help="folder for prefill.json")
    ap.add_argument("--quick", action="store_true", help="one attention case, both flags on, no peers")
    args = ap.parse_args(argv)
    if args.quick:
        row = bench_attention_case(*ATTN_CASES[2], variants=FLAG_VARIANTS[1:2], peers=(), cute=False)
        print_table([row], ["B", "S", "H/KV", "D", "causal", "ours_best_TFLOPs"])
        return
    gdn = [progress(bench_gdn_case(*c)) for c in GDN_CASES]
    attn = [progress(bench_attention_case(*c, variants=FLAG_VARIANTS if i in ABLATION_CASES else MAIN_VARIANTS))
            for i, c in enumerate(ATTN_CASES)]
    print("\nprefill attention, bf16, TFLOP/s (ours: fa4.flash_attention(backend='triton') with each flag set)")
    print_table(attn, ["B", "S", "H/KV", "D", "causal", *[f"{v[0]}_TFLOPs" for v in FLAG_VARIANTS], "cute_TFLOPs",
                       "fa4_TFLOPs", "cudnn_TFLOPs", "fa2_TFLOPs", "vs_fa4", "cute_vs_fa4"])
    print("\nGated DeltaNet chunked prefill, dk = dv = 128 (Mtok/s)")
    print_table(gdn, ["B", "T", "H", "ours_Mtok_s", "fla_Mtok_s", "vs_fla"])
    out = write_result("prefill", {"env": environment(), "flag_variants": FLAG_VARIANTS, "attention": attn,
                                   "gdn_prefill": gdn}, args.out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
