"""Triton GEMV for decode: y = x @ weight^T for a few rows (batch-1..4 decode), with programmatic dependent launch.

At decode the projections are weight-streaming GEMVs: a 2B step reads ~3.7 GB of weights in 97 of them. Each
program owns BLOCK_N output columns (BLOCK_N rows of the weight) for every row of x and walks K in BLOCK_K steps,
holding one weight tile in flight while it multiplies the previous one (fp32 accumulation, output in x's dtype).
With PDL (kernels.pdl) the first weight tile is loaded before waiting for the kernel that produced x, so a GEMV's
DRAM ramp overlaps its predecessor's tail inside the decode graph. More before the wait lost (H200, session 15, one
process, graph step at batch 1, 0.8B / 2B / 9B): two tiles in registers 0.954 / 1.63 / 5.31 ms against 0.91 / 1.48 /
4.73; all of a program's weight rows queued into L2 (prefetch.global.L2) 0.936 / 1.72 / 5.92 against 0.91 / 1.48 /
4.67, and 2.51 against 2.19 ms for 2B at 16 rows (profiles/results/host_time.json 'gemv_prefetch_session15').
One bf16 row of a wide weight goes to the TMA-ring GEMV in CuTe-DSL instead (kernels/tma_gemv.py, see TMA_GEMV):
its shared-memory ring keeps several times the bytes in flight that this kernel's registers hold.

Decode batches of MAX_ROWS + 1 to DOT_MAX_ROWS rows (CUDA-graph capture, where rows are not padded) run a skinny
GEMM on the tensor cores instead (`_rows_dot_kernel`: 16-row products, weight tiles through a shared-memory ring):
at 16 rows cuBLAS streams a 2B step's projections at 2.7 TB/s and its 2048 x 2048 ones at 1.7 (H200, session 11,
profiles.host_time --decode 16). More rows (prefill) go to torch's matmul (cuBLAS), which is then the faster
path, on rows padded to a bucket outside CUDA-graph capture (kernels.row_buckets: a row count cuBLAS has seen
costs a tenth of the host time). No host syncs and, for the GEMV, no allocation when `out=` is given: CUDA-graph
capturable.
"""
import functools

import torch
import triton
import triton.language as tl

from kernels import pdl, split_k, stamps, tma_gemv
from kernels.activations import silu_and_mul
from kernels.host_math import cdiv, next_power_of_2
from kernels.norms import FLOATS, add_rms_norm, check_devices, output_for, rows_view
from kernels.row_buckets import DOT_MAX_ROWS, GEMV_MAX_ROWS, MATMUL_ROW_BUCKET, padded_operand, padded_rows
from model import ops
from reference._checks import check_real, check_tensor, is_int

MAX_ROWS = GEMV_MAX_ROWS
# what the GEMV multiplies (its INPUT): x, silu(gate) * up of x = [gate | up], rms_norm(x [+ residual])
PLAIN, GATED, NORM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# The pre-norm projection runs its norm inside the GEMV up to this K: every program recomputes the rows' norm, which
# paid at 0.8B (K 1024: decode step 1.19 ms fused against 1.24 in its CUDA graph) and cost at 2B (K 2048: 2.06
# against 1.72 ms, the 48 NORM GEMVs +0.25 ms of kernel time); H200, session 8, profiles.host_time --prenorm
FUSED_NORM_MAX_K = 1024
# Whether skinny GEMMs run split over K where their plan says so (kernels.split_k); off: every one unsplit (A/B:
# `python -m profiles.host_time --decode 16 --ab split_k`)
SPLIT_K = True
# Whether one bf16 row on sm_90 runs the TMA-ring GEMV in CuTe-DSL (kernels/tma_gemv.py) instead of the Triton GEMV:
# weights of at least TMA_MIN_BYTES, and SwiGLU's down projection only from K TMA_GATED_MIN_K (its [gate | up] is
# staged before the first product). Per weight, `python -m profiles.bench_decode --sweep-tma MODEL` (H200, session 16):
# 2048 x 2048 (8.4 MB) 4.0 us against 3.6 on Triton; 2B's down projection (K 6144) 10.7 against 8.6, 9B's (K 12288)
# 27.7 against 28.4; every plain one of 16 MB and more 4-12% faster. The decode step in its CUDA graph (`python -m
# profiles.host_time --model M --decode 1 --ab tma_gemv`, gated ones all on TMA): 9B 4.40 against 4.64 ms, 2B 1.44
# against 1.48, 0.8B 0.899 against 0.910. TMA_MIN_BYTES 8 MiB since session 17 (with the chain and 8 KiB slots; `--ab
# tma_min`): 0.8B 0.807 against 0.817 ms with 16 MiB (its 10-13 MB input projections), 2B and 9B unchanged.
TMA_GEMV = True
TMA_MIN_BYTES = 8 * 2**20
TMA_GATED_MIN_K = 8192
# Whether add_rms_norm_linear (one row, K over FUSED_NORM_MAX_K) runs the residual add and RMSNorm inside the
# TMA-ring GEMV (each CTA stages the normed row once) instead of add_rms_norm and then the plain GEMV. Predicted:
# the 48 (2B) / 64 (9B) rms_norm launches of a step gone at ~2 us each with their ramp, less ~0.3 us of staging a
# GEMV: ~0.08 ms off 2B's step. Measured, the decode step in its CUDA graph (H200, session 17, `python -m
# profiles.host_time --model M --decode 1 --ab tma_norm`): 2B 1.35 against 1.42 ms, 9B 4.29 against 4.40, 0.8B
# 0.875 against 0.899 (its final norm and lm_head).
TMA_NORM = True
# Whether out_proj_mlp (one bf16 row) runs as one chained launch of the TMA-ring GEMV (tma_gemv_chain: output
# projection, then the residual add and RMSNorm staged into gate_up, then the gated down projection, the CTAs
# syncing over the grid between GEMVs while the next weights already stream into their rings), where the TMA GEMV
# takes one row at all (TMA_GEMV). Predicted: each GEMV boundary inside a step costs ~2 us of drained DRAM pipe (2B:
# 88 GEMVs of its GDN layers stream 2.59 GB at 3.2 TB/s in a chain of launches against ~4.3 in one long GEMV); two
# of them fewer a layer, ~0.1 ms off 2B's step. Measured (H200, session 17, `python -m profiles.host_time --model M
# --decode 1 --ab tma_chain`): 2B 1.31 against 1.35 ms, 0.8B 0.819 against 0.877, 9B 4.32 against 4.33. The first
# version (8-row blocks in 4 KiB slots, a consumer pass over a slot half as long) gained nothing on 2B (1.35 both).
TMA_CHAIN = True
# NORM's sums of squares read up to this many elements of the rows per step: 4096-wide rows in one L2 round trip
# (in BLOCK_K steps, 2B's gate_up GEMV waited on 16 dependent round trips before its first FMA: +0.3 ms a step)
NORM_ELEMENTS = 4096


@triton.jit
def _input_tile(x_ptr, res_ptr, rows, k, M, K, x_stride, res_stride, ADD: tl.constexpr):
    # rows x columns k of x, or of x + residual rounded to x's dtype (as torch's add rounds): (ROWS, BLOCK_K)
    mask = (rows[:, None] < M) & (k[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :], mask=mask, other=0.0)
    if ADD:
        res = tl.load(res_ptr + rows[:, None] * res_stride + k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _linear_kernel(x_ptr, w_ptr, out_ptr, res_ptr, norm_w_ptr, sum_ptr, stamps_ptr, M, N, K, x_stride, w_stride,
                   out_stride, res_stride, sum_stride, eps, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr, INPUT: tl.constexpr, ADD: tl.constexpr,
                   STAMPS: tl.constexpr, PDL: tl.constexpr):
    # out[m, n] = sum_k in[m, k] * w[n, k] for the BLOCK_N columns n of this program and the M <= ROWS rows m.
    # INPUT: PLAIN, in = x; GATED, x (M, 2K) is SwiGLU's [gate | up] and in = silu(gate) * up; NORM, in =
    # rms_norm(s) with s = x (+ residual when ADD), each rounded to x's dtype as the unfused ops round, and the
    # first program stores s (the next residual) into sum. Products accumulate elementwise over K steps and are
    # summed over K once at the end (no per-step reduction).
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                  # (BLOCK_N,)
    kk = tl.arange(0, BLOCK_K)                                               # (BLOCK_K,)
    rows = tl.arange(0, ROWS)                                                # (ROWS,)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * w_stride                     # (BLOCK_N, 1)
    n_ok = (n < N)[:, None]
    # weights are read once a step (evict first: keep L2 for activations); they need no wait
    w = tl.load(w_rows + kk[None, :], mask=n_ok & (kk[None, :] < K), other=0.0, eviction_policy="evict_first")
    stamps.wait(stamps_ptr, STAMPS, PDL)
    pdl.release_dependents(PDL)
    if INPUT == NORM:  # a first pass over the rows: their sums of squares (every program; rows are L2-resident)
        squares = tl.zeros((ROWS,), dtype=tl.float32)
        for k0 in range(0, K, NORM_BLOCK):  # one or two steps: each is an L2 round trip before the first FMA
            k = k0 + tl.arange(0, NORM_BLOCK)
            s = _input_tile(x_ptr, res_ptr, rows, k, M, K, x_stride, res_stride, ADD)
            squares += tl.sum(s.to(tl.float32) * s.to(tl.float32), axis=1)
            if ADD:
                first = tl.program_id(0) == 0
                tl.store(sum_ptr + rows[:, None] * sum_stride + k[None, :], s,
                         mask=(rows[:, None] < M) & (k[None, :] < K) & first)
        rstd = tl.rsqrt(squares / K + eps)                                   # (ROWS,)
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_next = k0 + BLOCK_K + kk
        w_next = tl.load(w_rows + k_next[None, :], mask=n_ok & (k_next[None, :] < K), other=0.0,
                         eviction_policy="evict_first")
        k = k0 + kk
        x = _input_tile(x_ptr, res_ptr, rows, k, M, K, x_stride, res_stride, ADD and INPUT == NORM)
        if INPUT == GATED:
            gate = x.to(tl.float32)
            up = tl.load(x_ptr + rows[:, None] * x_stride + K + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                         other=0.0).to(tl.float32)
            x = (gate * tl.sigmoid(gate) * up).to(x.dtype)
        if INPUT == NORM:
            norm_w = tl.load(norm_w_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * rstd[:, None] * (1.0 + norm_w[None, :])).to(x.dtype)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w = w_next
    y = tl.sum(acc, axis=2)                                                  # (ROWS, BLOCK_N)
    out_mask = (rows[:, None] < M) & (n[None, :] < N)
    tl.store(out_ptr + rows[:, None] * out_stride + n[None, :], y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _rows_dot_kernel(x_ptr, w_ptr, out_ptr, part_ptr, ticket_ptr, M, N, K, x_stride, w_stride, out_stride,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                     SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    # out[m, n] = sum_k x[m, k] * w[n, k] for the BLOCK_N columns n of program (i, .) and the M <= ROWS (>= 16)
    # rows on the tensor cores: acc (BLOCK_N, ROWS) += w tile (BLOCK_N, BLOCK_K) @ x tile^T (BLOCK_K, ROWS), both
    # tiles streamed through a STAGES-deep shared-memory ring; program (i, s) takes the s-th of SPLIT runs of K
    # (kernels.split_k: the last of a block's SPLIT programs to finish sums their partials and stores). Weight tiles
    # by TMA (a host tensor descriptor) lost at the default plans: H100 2B 16-row step 2.55 ms against 2.51, session 37
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                  # (BLOCK_N,)
    kk = tl.arange(0, BLOCK_K)                                               # (BLOCK_K,)
    rows = tl.arange(0, ROWS)                                                # (ROWS,)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * w_stride                     # (BLOCK_N, 1)
    n_ok = (n < N)[:, None]
    k_start, k_end = split_k.k_range(K, BLOCK_K, SPLIT)
    pdl.wait_for_producer(PDL)
    pdl.release_dependents(PDL)
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        k = k0 + kk
        w = tl.load(w_rows + k[None, :], mask=n_ok & (k[None, :] < K), other=0.0, eviction_policy="evict_first")
        x = _input_tile(x_ptr, x_ptr, rows, k, M, K, x_stride, x_stride, False)  # (ROWS, BLOCK_K)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
    out_mask = (rows[None, :] < M) & (n[:, None] < N)
    if SPLIT > 1:
        acc, last = split_k.reduce_partials(acc, part_ptr, ticket_ptr, n, rows, N, SPLIT, ROWS)
        out_mask = out_mask & last
    tl.store(out_ptr + rows[None, :] * out_stride + n[:, None], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


# (N, K) -> (BLOCK_N, BLOCK_K, num_warps) for one row: the fastest plan of `python -m profiles.bench_decode
# --sweep-linear MODEL` on the H200 for each projection of the 0.8B, 2B and 9B presets
# (profiles/results/decode_linear_sweep*.json); other shapes take the rule in launch_plan.
SWEPT_PLANS = {
    # 0.8B (hidden 1024)
    (6176, 1024): (4, 512, 4), (1024, 2048): (4, 2048, 4), (5120, 1024): (4, 1024, 4), (7168, 1024): (4, 512, 4),
    (1024, 3584): (4, 2048, 4), (248320, 1024): (16, 128, 4),
    # 2B (hidden 2048)
    (8224, 2048): (4, 512, 4), (2048, 2048): (2, 1024, 4), (5120, 2048): (4, 1024, 4), (12288, 2048): (16, 128, 8),
    (2048, 6144): (4, 1024, 8), (248320, 2048): (16, 128, 4),
    # 9B (hidden 4096)
    (16448, 4096): (32, 128, 8), (4096, 4096): (4, 512, 4), (10240, 4096): (16, 256, 4), (24576, 4096): (16, 128, 8),
    (4096, 12288): (4, 512, 4), (248320, 4096): (16, 128, 4),
}


@functools.cache
def launch_plan(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): the swept plan of (n, k) when there is one, else the sweeps' rule: wide
    outputs (MLP gate_up, lm_head) stream best as 16 rows of 128, the rest as 2-4 rows of 512-1024 (more programs
    keep DRAM busy: a 2048 x 2048 projection in 2.95 us against cuBLAS's 4.96). More rows of x shorten BLOCK_K
    (the accumulator holds ROWS x BLOCK_N x BLOCK_K)."""
    rows = next_power_of_2(m)
    if (n, k) in SWEPT_PLANS:
        block_n, block_k, warps = SWEPT_PLANS[n, k]
    elif n >= 12288:
        block_n, block_k, warps = 16, 128, 8 if n < 65536 else 4
    else:
        block_n, block_k, warps = (2 if n <= 2048 else 4), 1024, 4
    return block_n, max(16, min(next_power_of_2(k), max(128, block_k // rows))), warps


# (N, K) -> (BLOCK_N, BLOCK_K, STAGES, num_warps, SPLIT) of the skinny GEMM at 16 rows: the fastest plan of
# `python -m profiles.bench_decode --sweep-linear MODEL --rows 16` on the H200; other shapes take the rule in dot_plan.
SWEPT_DOT_PLANS = {  # 2B (hidden 2048), sessions 11 and 15 (profiles/results/decode_linear_sweep_rows16*.json)
    (8224, 2048): (64, 128, 6, 4, 1), (2048, 2048): (16, 256, 4, 1, 1), (5120, 2048): (32, 128, 6, 1, 1),
    (12288, 2048): (32, 128, 4, 1, 1), (2048, 6144): (16, 128, 4, 1, 4), (248320, 2048): (64, 128, 3, 4, 1),
}


@functools.cache
def dot_plan(n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, STAGES, num_warps, SPLIT) of the skinny GEMM: the swept plan of (n, k), else narrow
    column blocks where N is small (a program per 16 columns keeps 128 of them streaming a 2048-wide output), and
    K split where such a narrow output has a long K (2B's down projection, 2048 x 6144: 9.3 us split in 4 against
    14.0 unsplit, H200, session 15), into enough programs for ~512 in all."""
    if (n, k) in SWEPT_DOT_PLANS:
        return SWEPT_DOT_PLANS[n, k]
    block_n = 16 if n <= 4096 else 32 if n <= 16384 else 64
    split = min(4, max(1, 512 // cdiv(n, block_n))) if k >= 3 * n else 1
    return block_n, max(16, min(next_power_of_2(k), 256)), 4, max(1, block_n // 16), split


def _check_weight(name, x, weight, k_factor: int = 1):
    check_tensor(name, x, dtype=FLOATS)
    check_tensor("weight", weight, ndim=2, dtype=x.dtype)
    if x.ndim == 0 or x.shape[-1] != weight.shape[1] * k_factor:
        raise ValueError(f"weight {tuple(weight.shape)} does not take {name} of shape {tuple(x.shape)}"
                         + (" ([gate | up] is twice the weight's K)" if k_factor == 2 else ""))
    if weight.stride(1) != 1 and weight.shape[1] > 1:
        raise ValueError(f"weight must have unit stride along K, got strides {weight.stride()}")


def _checked_plan(plan, fields: tuple[str, ...]):
    """A benchmark's plan: None, or a tuple of positive ints, one per field, the block sizes and num_warps powers of
    two."""
    if plan is None:
        return None
    if (not isinstance(plan, tuple) or len(plan) != len(fields)
            or not all(is_int(p) and p > 0 for p in plan)
            or any(p & (p - 1) for p, f in zip(plan, fields) if f.startswith("BLOCK") or f == "num_warps")):
        raise ValueError(f"plan must be None or ({', '.join(fields)}), positive ints (powers of two but STAGES and "
                         f"SPLIT), got {plan!r}"[:300])
    return plan


def _gemv(x2, weight, o2, plan, mode=PLAIN, res2=None, norm_w=None, eps=0.0, s2=None):
    """Launch the GEMV on (m <= MAX_ROWS, K) rows x2 into o2 (m, N); NORM reads res2 and writes s2 when given."""
    m, (n, k) = x2.shape[0], weight.shape
    if m == 0 or n == 0:
        return
    if k == 0:
        o2.zero_()
        return
    block_n, block_k, warps = _checked_plan(plan, ("BLOCK_N", "BLOCK_K", "num_warps")) or launch_plan(m, n, k)
    rows = next_power_of_2(m)
    res2 = x2 if res2 is None else res2
    stamp, stamping = stamps.slot("linear", x2.device, bytes=weight.numel() * weight.element_size())
    _linear_kernel[(cdiv(n, block_n),)](
        x2, weight, o2, res2, x2 if norm_w is None else norm_w, x2 if s2 is None else s2, stamp, m, n, k,
        x2.stride(0), weight.stride(0), o2.stride(0), res2.stride(0), 0 if s2 is None else s2.stride(0), float(eps),
        ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, INPUT=mode.value,
        NORM_BLOCK=max(block_k, min(next_power_of_2(k), NORM_ELEMENTS // rows)), ADD=s2 is not None,
        STAMPS=stamping, num_warps=warps, **pdl.launch_options(x2.device))


def _rows_dot(x2, weight, o2, plan):
    """Launch the skinny GEMM on (MAX_ROWS < m <= DOT_MAX_ROWS, K) rows x2 into o2 (m, N)."""
    m, (n, k) = x2.shape[0], weight.shape
    if n == 0:
        return
    if k == 0:
        o2.zero_()
        return
    fields = ("BLOCK_N", "BLOCK_K", "STAGES", "num_warps", "SPLIT")
    block_n, block_k, stages, warps, split = _checked_plan(plan, fields) or dot_plan(n, k)
    rows = max(16, next_power_of_2(m))
    if not 1 <= split <= split_k.MAX_SPLIT:
        raise ValueError(f"the skinny GEMM's SPLIT must be 1 to {split_k.MAX_SPLIT}, got {split}")
    fits = n <= split_k.MAX_N and rows <= split_k.MAX_ROWS  # the workspace's partials
    space = split_k.workspace(x2.device) if SPLIT_K and split > 1 and fits else None
    if space is None:  # not split: one column block a program (also while capturing before any workspace exists)
        split = 1
    part, tickets = space or (o2, o2)
    _rows_dot_kernel[(cdiv(n, block_n), split)](
        x2, weight, o2, part, tickets, m, n, k, x2.stride(0), weight.stride(0), o2.stride(0), ROWS=rows,
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, SPLIT=split,
        DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", num_warps=warps,
        **pdl.launch_options(x2.device))


def _tma_takes(x2, weight, out, gated=False, norm_weight=None, residual=None) -> bool:
    """Whether a call of x2 (rows, K) runs the TMA-ring GEMV (see TMA_GEMV)."""
    return (x2.shape[0] == 1 and TMA_GEMV and weight.numel() * weight.element_size() >= TMA_MIN_BYTES
            and (not gated or weight.shape[1] >= TMA_GATED_MIN_K) and (out is None or out.is_contiguous())
            and tma_gemv.available(x2, weight, gated, norm_weight=norm_weight, residual=residual))


def linear(x, weight, out=None, *, plan: tuple[int, ...] | None = None, gated: bool = False):
    """x: (..., K) fp16/bf16/fp32; weight: (N, K), x's dtype, unit stride along K -> (..., N) in x's dtype.
    gated: x is (..., 2K) = [gate | up] and the product takes silu(gate) * up (SwiGLU's down projection, one
    launch instead of two). Up to MAX_ROWS rows run the Triton GEMV, up to DOT_MAX_ROWS unpadded rows (see
    kernels.row_buckets) the skinny GEMM, more torch's matmul (cuBLAS); gated, both after the silu_and_mul kernel
    (the skinny GEMM taking [gate | up] itself lost: 2.98 ms against 2.56 a 16-row 2B step, H100, session 36,
    host_time.json 'b16_knobs_session36_h100'); into `out` when given. plan (benchmark sweeps): the GEMV's
    (BLOCK_N, BLOCK_K, num_warps) in place of launch_plan's, or the skinny GEMM's (BLOCK_N, BLOCK_K, STAGES,
    num_warps, SPLIT) in place of dot_plan's."""
    name = "gate_up" if gated else "x"
    _check_weight(name, x, weight, 2 if gated else 1)
    shape = (*x.shape[:-1], weight.shape[0])
    out = None if out is None else output_for(out, shape, x)
    check_devices(x=x, weight=weight, out=out)
    x2 = rows_view(name, x)
    m = x2.shape[0]
    rows = padded_rows(m, x.device)
    a2 = silu_and_mul(x2) if gated and m > MAX_ROWS else x2
    if m > MAX_ROWS and (rows > m or m > DOT_MAX_ROWS):
        y = matmul_rows(a2, weight, None if out is None else rows_view("out", out), rows)
        return y.view(shape) if out is None else out
    if out is None:
        out = output_for(None, shape, x)
    if m > MAX_ROWS:
        _rows_dot(a2, weight, rows_view("out", out), plan)
    elif plan is None and _tma_takes(x2, weight, out, gated):
        tma_gemv.tma_gemv(x2, weight, out.view(1, -1), gated=gated)
    else:
        _gemv(x2, weight, rows_view("out", out), plan, GATED if gated else PLAIN)
    return out


def matmul_rows(a2, weight, out2=None, rows: int | None = None):
    """a2: (M, K) @ weight (N, K)^T -> (M, N) on torch's matmul (cuBLAS), run on `rows` >= M rows (default M; see
    kernels.row_buckets): the output is a view of the product's first M rows, or out2 when given."""
    m = a2.shape[0]
    if rows is None or rows == m:
        return torch.matmul(a2, weight.t(), out=out2)
    y = torch.matmul(padded_operand(a2, rows), weight.t())[:m]
    return y if out2 is None else out2.copy_(y)


def warm_up_row_buckets(weights, max_rows: int) -> None:
    """Run every padded row count up to max_rows once per distinct weight shape, so that cuBLAS has chosen its
    kernel for each before a live prefill step needs it (CUDA only; see kernels.row_buckets)."""
    shapes = {(tuple(w.shape), w.dtype, w.device): w for w in weights if w.is_cuda and w.ndim == 2}
    for w in shapes.values():
        for m in range(MATMUL_ROW_BUCKET, max_rows + MATMUL_ROW_BUCKET, MATMUL_ROW_BUCKET):
            torch.matmul(w.new_empty((m, w.shape[1])), w.t())


def silu_and_mul_linear(gate_up, weight):
    """gate_up: (..., 2K) = [gate | up]; weight: (N, K) -> silu(gate) * up @ weight^T: (..., N)."""
    return linear(gate_up, weight, gated=True)


def add_rms_norm_linear(x, residual, norm_weight, eps, weight, *, plan: tuple[int, int, int] | None = None,
                        fused: bool | None = None):
    """The pre-norm projection of a decoder block: s = x + residual (x when residual is None), rounded to x's
    dtype; returns (rms_norm(s, norm_weight, eps) @ weight^T, s). x, residual: (..., K); norm_weight: (K,)
    zero-centred; weight: (N, K). fused, up to MAX_ROWS rows: one GEMV computes the norm itself (every program
    reads the rows; the first one writes s into a new tensor); else add_rms_norm (s in place in residual), then
    `linear`. Either way `residual` may be overwritten: use the returned s. fused=None: fused when K is at most
    FUSED_NORM_MAX_K (see there), or with TMA_NORM when the TMA-ring GEMV takes the call (see TMA_GEMV): each of
    its CTAs stages the normed row once, in shared memory, before its first product."""
    _check_weight("x", x, weight)
    if residual is not None:
        check_tensor("residual", residual, dtype=x.dtype)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    check_tensor("norm_weight", norm_weight, ndim=1, dtype=FLOATS)
    if norm_weight.shape[0] != x.shape[-1] or norm_weight.stride(0) != 1:
        raise ValueError(f"norm_weight must be contiguous with {x.shape[-1]} entries (x's width), got "
                         f"{norm_weight.shape[0]}")
    check_devices(x=x, residual=residual, norm_weight=norm_weight, weight=weight)
    eps = check_real("eps", eps)
    x2 = rows_view("x", x)
    res2 = None if residual is None else rows_view("residual", residual)
    tma = TMA_NORM and plan is None and fused is not False and _tma_takes(x2, weight, None, False, norm_weight, res2)
    if fused is None:
        fused = x.shape[-1] <= FUSED_NORM_MAX_K or tma
    if x2.shape[0] > MAX_ROWS or not fused:
        h, s = add_rms_norm(x, residual, norm_weight, eps)
        return linear(h, weight, plan=plan), s
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
    s = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tma:
        tma_gemv.tma_gemv(x2, weight, out.view(1, -1), norm_weight=norm_weight, eps=eps, residual=res2,
                          s_out=None if residual is None else s.view(1, -1))
        return out, s
    _gemv(x2, weight, rows_view("out", out), plan, NORM, res2, norm_weight, eps,
          None if residual is None else rows_view("s", s))
    return out, s


def out_proj_mlp(o, residual, out_weight, norm_weight, eps, gate_up_weight, down_weight):
    """reference.out_proj_mlp: (SwiGLU(rms_norm(o @ out_weight^T + residual)), s = o @ out_weight^T + residual).
    One bf16 row with TMA_CHAIN: one launch of three chained TMA-ring GEMVs; else model.ops.out_proj_mlp_by_ops
    (linear, add_rms_norm_linear and silu_and_mul_linear, each on the active backend)."""
    for name, t in (("o", o), ("out_weight", out_weight), ("norm_weight", norm_weight),
                     ("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        check_tensor(name, t)
    weights = (out_weight, gate_up_weight, down_weight)
    inputs = (tma_gemv.GemvInput(out_weight.shape[1]),
              tma_gemv.GemvInput(gate_up_weight.shape[1], norm=True, add=True),
              tma_gemv.GemvInput(down_weight.shape[1], gated=True))
    if (TMA_CHAIN and TMA_GEMV and residual is not None and o.dim() == 2 and o.shape[0] == 1
            and residual.shape == (1, down_weight.shape[0])
            and tma_gemv.chain_available(o, weights, inputs, norm_weight=norm_weight, residual=residual)):
        check_devices(o=o, residual=residual, out_weight=out_weight, norm_weight=norm_weight,
                      gate_up_weight=gate_up_weight, down_weight=down_weight)
        s = torch.empty_like(residual)
        out = torch.empty_like(residual)
        tma_gemv.tma_gemv_chain(o, weights, inputs, out, norm_weight=norm_weight, eps=eps, residual=residual,
                                s_out=s)
        return out, s
    return ops.out_proj_mlp_by_ops(o, residual, out_weight, norm_weight, eps, gate_up_weight, down_weight)


OPS = {"linear": linear, "silu_and_mul_linear": silu_and_mul_linear, "add_rms_norm_linear": add_rms_norm_linear,
       "out_proj_mlp": out_proj_mlp}
