"""Triton GEMV for decode: y = x @ weight^T for a few rows (batch-1..4 decode), with programmatic dependent launch.

At decode the projections are weight-streaming GEMVs: a 2B step reads ~3.7 GB of weights in 97 of them. Each
program owns BLOCK_N output columns (BLOCK_N rows of the weight) for every row of x and walks K in BLOCK_K steps,
holding one weight tile in flight while it multiplies the previous one (fp32 accumulation, output in x's dtype).
With PDL (kernels.pdl) the first weight tile is loaded before waiting for the kernel that produced x, so a GEMV's
DRAM ramp overlaps its predecessor's tail inside the decode graph; loading more before the wait lost (FINDINGS,
decode step: GEMV). One bf16 row of a wide weight goes to the TMA-ring GEMV in CuTe-DSL instead
(kernels/tma_gemv.py): its shared-memory ring keeps several times the bytes in flight that registers hold.

Decode batches of MAX_ROWS + 1 to DOT_MAX_ROWS rows (CUDA-graph capture, where rows are not padded) run a skinny
GEMM on the tensor cores (`_rows_dot_kernel`: 16-row products, weight tiles through a shared-memory ring), where
cuBLAS streams a 2B step's narrow projections well under the read ceiling. More rows (prefill) go to torch's
matmul (cuBLAS), on rows padded to a bucket outside CUDA-graph capture (kernels.row_buckets: a row count cuBLAS
has seen costs a tenth of the host time). Which of these runs a call is the router's choice (the entries at the
bottom). No host syncs and, for the GEMV, no allocation when `out=` is given: CUDA-graph capturable.
"""
import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import pdl, registry, row_buckets, split_k, stamps, tma_gemv
from kernels.activations import silu_and_mul
from kernels.host_math import cdiv, next_power_of_2
from kernels.norms import FLOATS, add_rms_norm, check_devices, output_for, rows_view
from kernels.registry import DeviceInfo, Impl, all_of, device_info, triton_unsupported
from kernels.row_buckets import DOT_MAX_ROWS, GEMV_MAX_ROWS, empty_rows, padded_operand, padded_rows
from reference.checks import check_real, check_tensor, is_int

MAX_ROWS = GEMV_MAX_ROWS
# what the GEMV multiplies (its INPUT): x, silu(gate) * up of x = [gate | up], rms_norm(x [+ residual])
PLAIN, GATED, NORM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
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
    # by TMA (a host tensor descriptor) lost at the default plans (FINDINGS, serving: the 16-row step)
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
SWEPT_DOT_PLANS = {  # 2B (hidden 2048; profiles/results/decode_linear_sweep_rows16*.json)
    (8224, 2048): (64, 128, 6, 4, 1), (2048, 2048): (16, 256, 4, 1, 1), (5120, 2048): (32, 128, 6, 1, 1),
    (12288, 2048): (32, 128, 4, 1, 1), (2048, 6144): (16, 128, 4, 1, 4), (248320, 2048): (64, 128, 3, 4, 1),
}


@functools.cache
def dot_plan(n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, STAGES, num_warps, SPLIT) of the skinny GEMM: the swept plan of (n, k), else narrow
    column blocks where N is small (a program per 16 columns keeps 128 of them streaming a 2048-wide output), and
    K split where such a narrow output has a long K (2B's down projection, 2048 x 6144, runs a third faster split in
    4), into enough programs for ~512 in all."""
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
    space = split_k.workspace(x2.device) if split > 1 and fits else None
    if space is None:  # not split: one column block a program (also while capturing before any workspace exists)
        split = 1
    part, tickets = space or (o2, o2)
    _rows_dot_kernel[(cdiv(n, block_n), split)](
        x2, weight, o2, part, tickets, m, n, k, x2.stride(0), weight.stride(0), o2.stride(0), ROWS=rows,
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, SPLIT=split,
        DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", num_warps=warps,
        **pdl.launch_options(x2.device))


class LinearKey(NamedTuple):
    """What routes a projection (kernels.registry): rows, the rows cuBLAS would run (kernels.row_buckets: padded
    outside graph capture), the weight's (N, K), dtype, device, SwiGLU's gated input, and whether one bf16 row
    meets the TMA-ring GEMV's layout (tma_gemv.available)."""
    rows: int
    padded: int
    n: int
    k: int
    dtype: torch.dtype
    device: DeviceInfo
    gated: bool
    tma_layout: bool


def linear_key(x, weight, out=None, gated: bool = False) -> LinearKey:
    # x: (..., K or 2K); weight: (N, K)
    m = math.prod(x.shape[:-1])
    tma = (m == 1 and x.dtype == torch.bfloat16 and x.is_cuda and (out is None or out.is_contiguous())
           and tma_gemv.available(x.view(1, -1), weight, gated))
    return LinearKey(m, padded_rows(m, x.device), weight.shape[0], weight.shape[1], x.dtype, device_info(x.device),
                     gated, tma)


def _rows_out(x, weight, out):
    # x: (..., K) -> its (rows, K) view and the (rows, N) view of out (a new tensor when None)
    shape = (*x.shape[:-1], weight.shape[0])
    out = empty_rows(shape, x.dtype, x.device) if out is None else out
    return x.view(-1, x.shape[-1]), out, out.view(-1, weight.shape[0])


def run_gemv(x, weight, out=None, gated: bool = False):
    x2, out, o2 = _rows_out(x, weight, out)
    _gemv(x2, weight, o2, None, GATED if gated else PLAIN)
    return out


def run_tma_gemv(x, weight, out=None, gated: bool = False):
    x2, out, o2 = _rows_out(x, weight, out)
    tma_gemv.tma_gemv(x2, weight, o2, gated=gated)
    return out


def run_skinny_gemm(x, weight, out=None, gated: bool = False):
    x2, out, o2 = _rows_out(x, weight, out)
    _rows_dot(silu_and_mul(x2) if gated else x2, weight, o2, None)
    return out


def run_cublas(x, weight, out=None, gated: bool = False):
    x2 = x.view(-1, x.shape[-1])
    a2 = silu_and_mul(x2) if gated else x2
    shape = (*x.shape[:-1], weight.shape[0])
    y = matmul_rows(a2, weight, None if out is None else out.view(-1, weight.shape[0]), padded_rows(a2.shape[0],
                                                                                                   x.device))
    return y.view(shape) if out is None else out


def linear(x, weight, out=None, *, plan: tuple[int, ...] | None = None, gated: bool = False):
    """x: (..., K) fp16/bf16/fp32; weight: (N, K), x's dtype, unit stride along K -> (..., N) in x's dtype.
    gated: x is (..., 2K) = [gate | up] and the product takes silu(gate) * up (SwiGLU's down projection, one
    launch instead of two). The router (kernels.registry) picks the kernel by rows and weight: the Triton GEMV up to
    MAX_ROWS rows, the TMA-ring GEMV for one bf16 row of a wide weight, the skinny GEMM up to DOT_MAX_ROWS unpadded
    rows (graph capture), torch's matmul (cuBLAS) beyond; into `out` when given. plan (benchmark sweeps): the
    GEMV's (BLOCK_N, BLOCK_K, num_warps) or the skinny GEMM's (BLOCK_N, BLOCK_K, STAGES, num_warps, SPLIT), which
    forces that kernel."""
    name = "gate_up" if gated else "x"
    _check_weight(name, x, weight, 2 if gated else 1)
    shape = (*x.shape[:-1], weight.shape[0])
    out = None if out is None else output_for(out, shape, x)
    check_devices(x=x, weight=weight, out=out)
    x2 = rows_view(name, x)
    out2 = None if out is None else rows_view("out", out)
    if plan is not None and x2.shape[0] <= DOT_MAX_ROWS:
        out = output_for(out, shape, x)
        if x2.shape[0] <= MAX_ROWS:
            _gemv(x2, weight, rows_view("out", out), plan, GATED if gated else PLAIN)
        else:
            _rows_dot(silu_and_mul(x2) if gated else x2, weight, rows_view("out", out), plan)
        return out
    y = registry.choose("linear", linear_key(x2, weight, out, gated), "triton").run(x2, weight, out2, gated)
    return y.view(shape) if out is None else out


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
        for m in row_buckets.row_buckets_up_to(row_buckets.row_bucket(max_rows)):
            torch.matmul(w.new_empty((m, w.shape[1])), w.t())


def silu_and_mul_linear(gate_up, weight):
    """gate_up: (..., 2K) = [gate | up]; weight: (N, K) -> silu(gate) * up @ weight^T: (..., N)."""
    return linear(gate_up, weight, gated=True)


class NormLinearKey(NamedTuple):
    """What routes a pre-norm projection: rows, the weight's (N, K), dtype, device, whether a residual is added,
    and whether one bf16 row meets the TMA-ring GEMV's layout with the norm staged in."""
    rows: int
    n: int
    k: int
    dtype: torch.dtype
    device: DeviceInfo
    tma_layout: bool


def norm_linear_key(x, residual, norm_weight, eps, weight) -> NormLinearKey:
    # x, residual: (..., K); weight: (N, K)
    m = math.prod(x.shape[:-1])
    tma = (m == 1 and x.dtype == torch.bfloat16 and x.is_cuda
           and tma_gemv.available(x.view(1, -1), weight, norm_weight=norm_weight,
                                  residual=None if residual is None else residual.view(1, -1)))
    return NormLinearKey(m, weight.shape[0], weight.shape[1], x.dtype, device_info(x.device), tma)


def _norm_outputs(x, residual, weight):
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
    s = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out, s


def run_tma_norm_gemv(x, residual, norm_weight, eps, weight):
    out, s = _norm_outputs(x, residual, weight)
    tma_gemv.tma_gemv(x.view(1, -1), weight, out.view(1, -1), norm_weight=norm_weight, eps=eps,
                      residual=None if residual is None else residual.view(1, -1),
                      s_out=None if residual is None else s.view(1, -1))
    return out, s


def run_norm_gemv(x, residual, norm_weight, eps, weight, plan=None):
    out, s = _norm_outputs(x, residual, weight)
    x2 = x.view(-1, x.shape[-1])
    _gemv(x2, weight, out.view(-1, weight.shape[0]), plan, NORM, None if residual is None else residual.view(x2.shape),
          norm_weight, eps, None if residual is None else s.view(x2.shape))
    return out, s


def run_norm_then_linear(x, residual, norm_weight, eps, weight):
    h, s = add_rms_norm(x, residual, norm_weight, eps)
    return _routed_linear(h, weight), s


def _routed_linear(x, weight, gated: bool = False):
    return registry.choose("linear", linear_key(x, weight, None, gated), "triton").run(x, weight, None, gated)


def add_rms_norm_linear(x, residual, norm_weight, eps, weight, *, plan: tuple[int, int, int] | None = None,
                        fused: bool | None = None):
    """The pre-norm projection of a decoder block: s = x + residual (x when residual is None), rounded to x's
    dtype; returns (rms_norm(s, norm_weight, eps) @ weight^T, s). x, residual: (..., K); norm_weight: (K,)
    zero-centred; weight: (N, K). The router picks: one bf16 row staged into the TMA-ring GEMV, the GEMV computing
    the norm itself up to MAX_ROWS rows and K of KernelTuning.fused_norm_max_k (every program reads the rows; the
    first writes s into a new tensor), else add_rms_norm (s in place in residual) and then `linear`. Either way
    `residual` may be overwritten: use the returned s. fused (benchmarks): True forces the GEMV with the norm (up to
    MAX_ROWS rows), False the two launches; plan: that GEMV's (BLOCK_N, BLOCK_K, num_warps)."""
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
    rows = rows_view("x", x).shape[0]
    if residual is not None:
        rows_view("residual", residual)
    if fused is None and plan is None:
        key = norm_linear_key(x, residual, norm_weight, eps, weight)
        return registry.choose("add_rms_norm_linear", key, "triton").run(x, residual, norm_weight, eps, weight)
    if rows > MAX_ROWS or fused is False or (fused is None and x.shape[-1] > registry.tuning().fused_norm_max_k):
        h, s = add_rms_norm(x, residual, norm_weight, eps)
        return linear(h, weight, plan=plan), s
    return run_norm_gemv(x, residual, norm_weight, eps, weight, plan)


class ChainKey(NamedTuple):
    """What routes a dense layer's out-proj + MLP: rows and whether one bf16 row meets the chain's layout."""
    rows: int
    dtype: torch.dtype
    device: DeviceInfo
    chain_layout: bool


def _chain_inputs(out_weight, gate_up_weight, down_weight):
    return (tma_gemv.GemvInput(out_weight.shape[1]),
            tma_gemv.GemvInput(gate_up_weight.shape[1], norm=True, add=True),
            tma_gemv.GemvInput(down_weight.shape[1], gated=True))


def chain_key(o, residual, out_weight, norm_weight, eps, gate_up_weight, down_weight) -> ChainKey:
    # o: (N, H*D) attention output; residual: (N, hidden)
    rows = o.shape[0] if o.dim() == 2 else -1
    weights = (out_weight, gate_up_weight, down_weight)
    fits = (rows == 1 and o.dtype == torch.bfloat16 and o.is_cuda and residual is not None
            and residual.shape == (1, down_weight.shape[0])
            and tma_gemv.chain_available(o, weights, _chain_inputs(*weights), norm_weight=norm_weight,
                                         residual=residual))
    return ChainKey(rows, o.dtype, device_info(o.device), fits)


def run_tma_chain(o, residual, out_weight, norm_weight, eps, gate_up_weight, down_weight):
    weights = (out_weight, gate_up_weight, down_weight)
    s = torch.empty_like(residual)
    out = torch.empty_like(residual)
    tma_gemv.tma_gemv_chain(o, weights, _chain_inputs(*weights), out, norm_weight=norm_weight, eps=eps,
                            residual=residual, s_out=s, boundary_bytes=registry.tuning().chain_pause_bytes)
    return out, s


def out_proj_mlp_by_ops(o, residual, out_weight, norm_weight, eps, gate_up_weight, down_weight):
    """out_proj_mlp as its three ops, each on the router's choice: (SwiGLU(rms_norm(o @ out_weight^T + residual)),
    s = o @ out_weight^T + residual)."""
    y = _routed_linear(o, out_weight)
    gate_up, s = registry.choose("add_rms_norm_linear", norm_linear_key(y, residual, norm_weight, eps, gate_up_weight),
                                 "triton").run(y, residual, norm_weight, eps, gate_up_weight)
    return _routed_linear(gate_up, down_weight, gated=True), s


def out_proj_mlp(o, residual, out_weight, norm_weight, eps, gate_up_weight, down_weight):
    """reference.out_proj_mlp on the kernels: one bf16 row in one launch of three chained TMA-ring GEMVs where the
    router takes it, else out_proj_mlp_by_ops."""
    for name, t in (("o", o), ("out_weight", out_weight), ("norm_weight", norm_weight),
                    ("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        check_tensor(name, t)
    check_devices(o=o, residual=residual, out_weight=out_weight, norm_weight=norm_weight,
                  gate_up_weight=gate_up_weight, down_weight=down_weight)
    args = (o, residual, out_weight, norm_weight, eps, gate_up_weight, down_weight)
    return registry.choose("out_proj_mlp", chain_key(*args), "triton").run(*args)


# ---- the router's entries (kernels.registry): which kernel runs a projection -----------------------------------

def _gemv_rows(key, tuning):
    return None if key.rows <= tuning.gemv_max_rows else f"{key.rows} rows > tuning.gemv_max_rows"


def _tma_ring(key, tuning):
    # the TMA-ring GEMV, alone or with the norm staged in: one bf16 row in its layout, a weight worth the ring
    if not (key.rows == 1 and key.tma_layout and key.device.sm90):
        return "not one bf16 row in the TMA-ring GEMV's layout on sm_90"
    if key.n * key.k * key.dtype.itemsize < tuning.tma_min_bytes:
        return f"the weight is under tuning.tma_min_bytes ({tuning.tma_min_bytes})"
    return None


def _tma_gemv(key, tuning):
    if key.gated and key.k < tuning.tma_gated_min_k:
        return f"a gated K under tuning.tma_gated_min_k ({tuning.tma_gated_min_k})"
    return _tma_ring(key, tuning)


def _skinny_rows(key, tuning):
    if not tuning.gemv_max_rows < key.rows <= DOT_MAX_ROWS or key.padded != key.rows:
        return f"{key.rows} rows (padded {key.padded}) outside the skinny GEMM's unpadded " \
               f"{tuning.gemv_max_rows + 1}-{DOT_MAX_ROWS}"
    return None


def _cublas_rows(key, tuning):
    return None if key.rows > GEMV_MAX_ROWS else f"{key.rows} rows: the GEMV's or the skinny GEMM's"


def _norm_gemv(key, tuning):
    # the norm inside the GEMV up to GEMV_MAX_ROWS (measured at 0.8B's K on its own; gemv_max_rows is the plain one's)
    if key.rows > GEMV_MAX_ROWS or key.k > tuning.fused_norm_max_k:
        return f"{key.rows} rows, K {key.k}: over the GEMV's rows or tuning.fused_norm_max_k"
    return None


def _tma_chain(key, tuning):
    if not (key.chain_layout and key.device.sm90):
        return "not one bf16 row in the chain's layout on sm_90"
    return None


def _checked_linear(x, weight, out=None, gated: bool = False):
    return linear(x, weight, out, gated=gated)


def _register() -> None:
    registry.define("linear", linear_key)
    registry.define("add_rms_norm_linear", norm_linear_key)
    registry.define("out_proj_mlp", chain_key)
    triton = "triton"
    for name, run, supports, cost in (
            ("tma_gemv", run_tma_gemv, _tma_gemv, 0.0),
            ("gemv", run_gemv, all_of(_gemv_rows, triton_unsupported), 1.0),
            ("skinny_gemm", run_skinny_gemm, all_of(_skinny_rows, triton_unsupported), 1.0),
            ("cublas", run_cublas, _cublas_rows, 2.0)):
        registry.register("linear", Impl(name, triton, run, supports, cost, checked=_checked_linear))
    for name, run, supports, cost in (
            ("tma_norm_gemv", run_tma_norm_gemv, _tma_ring, 0.0),
            ("norm_gemv", run_norm_gemv, all_of(_norm_gemv, triton_unsupported), 1.0),
            ("norm_then_linear", run_norm_then_linear, triton_unsupported, 2.0)):
        registry.register("add_rms_norm_linear", Impl(name, triton, run, supports, cost, checked=add_rms_norm_linear))
    registry.register("out_proj_mlp", Impl("tma_chain", triton, run_tma_chain, _tma_chain, 0.0, out_proj_mlp))
    registry.register("out_proj_mlp", Impl("by_ops", triton, out_proj_mlp_by_ops, triton_unsupported, 1.0,
                                           out_proj_mlp))


_register()
