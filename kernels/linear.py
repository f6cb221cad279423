"""Triton GEMV for decode: y = x @ weight^T for a few rows (batch-1..4 decode), with programmatic dependent launch.

At decode the projections are weight-streaming GEMVs: a 2B step reads ~3.7 GB of weights in 97 of them. Each
program owns BLOCK_N output columns (BLOCK_N rows of the weight) for every row of x and walks K in BLOCK_K steps,
holding one weight tile in flight while it multiplies the previous one (fp32 accumulation, output in x's dtype).
With PDL (kernels.pdl) the first weight tile is loaded before waiting for the kernel that produced x, so a
GEMV's DRAM ramp overlaps its predecessor's tail inside the decode graph.

More than MAX_ROWS rows (prefill, large decode batches) go to torch's matmul (cuBLAS), which is then the faster
path. No host syncs and no allocation when `out=` is given: CUDA-graph capturable.
"""
import functools

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.activations import silu_and_mul
from kernels.host_math import cdiv, next_power_of_2
from kernels.norms import FLOATS, check_devices, output_for, rows_view
from reference._checks import check_tensor

MAX_ROWS = 4


@triton.jit
def _linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, x_stride, w_stride, out_stride,
                   ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
                   PDL: tl.constexpr):
    # out[m, n] = sum_k x[m, k] * w[n, k] for the BLOCK_N columns n of this program and the M <= ROWS rows m;
    # GATED: x (M, 2K) is SwiGLU's [gate | up] and the input is silu(gate) * up, rounded to x's dtype.
    # Products accumulate elementwise over K steps and are summed over K once at the end (no per-step reduction).
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                  # (BLOCK_N,)
    kk = tl.arange(0, BLOCK_K)                                               # (BLOCK_K,)
    rows = tl.arange(0, ROWS)                                                # (ROWS,)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * w_stride                     # (BLOCK_N, 1)
    n_ok = (n < N)[:, None]
    # weights are read once a step (evict first: keep L2 for activations); they need no wait
    w = tl.load(w_rows + kk[None, :], mask=n_ok & (kk[None, :] < K), other=0.0, eviction_policy="evict_first")
    pdl.wait_for_producer(PDL)
    pdl.release_dependents(PDL)
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_next = k0 + BLOCK_K + kk
        w_next = tl.load(w_rows + k_next[None, :], mask=n_ok & (k_next[None, :] < K), other=0.0,
                         eviction_policy="evict_first")
        k = k0 + kk
        x_ptrs = x_ptr + rows[:, None] * x_stride + k[None, :]
        x_mask = (rows[:, None] < M) & (k[None, :] < K)
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)                          # (ROWS, BLOCK_K)
        if GATED:
            gate = x.to(tl.float32)
            up = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
            x = (gate * tl.sigmoid(gate) * up).to(x.dtype)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w = w_next
    y = tl.sum(acc, axis=2)                                                  # (ROWS, BLOCK_N)
    out_mask = (rows[:, None] < M) & (n[None, :] < N)
    tl.store(out_ptr + rows[:, None] * out_stride + n[None, :], y.to(out_ptr.dtype.element_ty), mask=out_mask)


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


def linear(x, weight, out=None, *, plan: tuple[int, int, int] | None = None, gated: bool = False):
    """x: (..., K) fp16/bf16/fp32; weight: (N, K), x's dtype, unit stride along K -> (..., N) in x's dtype.
    gated: x is (..., 2K) = [gate | up] and the product takes silu(gate) * up (SwiGLU's down projection, one
    launch instead of two). Up to MAX_ROWS rows run the Triton GEMV, more torch's matmul (cuBLAS; gated: after
    the silu_and_mul kernel); into `out` when given. plan: a (BLOCK_N, BLOCK_K, num_warps) in place of
    launch_plan's (benchmark sweeps)."""
    name = "gate_up" if gated else "x"
    check_tensor(name, x, dtype=FLOATS)
    check_tensor("weight", weight, ndim=2, dtype=x.dtype)
    if x.ndim == 0 or x.shape[-1] != weight.shape[1] * (2 if gated else 1):
        raise ValueError(f"weight {tuple(weight.shape)} does not take {name} of shape {tuple(x.shape)}"
                         + (" (gated: [gate | up] is twice the weight's K)" if gated else ""))
    if weight.stride(1) != 1 and weight.shape[1] > 1:
        raise ValueError(f"weight must have unit stride along K, got strides {weight.stride()}")
    out = output_for(out, (*x.shape[:-1], weight.shape[0]), x)
    check_devices(x=x, weight=weight, out=out)
    x2 = rows_view(name, x)
    m, (n, k) = x2.shape[0], weight.shape
    if m > MAX_ROWS:
        return torch.matmul(silu_and_mul(x) if gated else x, weight.t(), out=out)
    o2 = rows_view("out", out)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block_n, block_k, warps = plan or launch_plan(m, n, k)
    _linear_kernel[(cdiv(n, block_n),)](x2, weight, o2, m, n, k, x2.stride(0), weight.stride(0), o2.stride(0),
                                        ROWS=next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated,
                                        num_warps=warps, **pdl.launch_options(x.device))
    return out


def silu_and_mul_linear(gate_up, weight):
    """gate_up: (..., 2K) = [gate | up]; weight: (N, K) -> silu(gate) * up @ weight^T: (..., N)."""
    return linear(gate_up, weight, gated=True)


OPS = {"linear": linear, "silu_and_mul_linear": silu_and_mul_linear}
