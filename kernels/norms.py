"""Triton zero-centred RMSNorm, alone and fused with the residual add, one read and one write per row.

y = x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32, stored in x's dtype. Rows are the last dim of x (its
stride must be 1; other dims may be strided as long as they flatten to one row stride). Small rows are
packed several per program. No host syncs and no allocation when `out=` is given: CUDA-graph capturable.

Also holds the argument helpers the other elementwise kernels share (`rows_view`, `check_devices`).
"""
import torch
import triton
import triton.language as tl

from kernels import pdl, registry, stamps
from kernels.host_math import cdiv, next_power_of_2
from kernels.interpreter_compat import INTERPRET
from kernels.registry import Impl
from kernels.row_buckets import empty_rows
from reference.checks import check_no_self_overlap, check_real, check_same_device, check_tensor

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def triton_runs_on(device: torch.device) -> bool:
    """Where the Triton kernels run: a CUDA device, or the CPU under Triton's interpreter (TRITON_INTERPRET=1)."""
    return device.type == "cuda" or (device.type == "cpu" and INTERPRET)


def check_devices(**tensors) -> None:
    """One device for all; a CUDA one unless Triton runs in its CPU interpreter (one device read a tensor: this runs
    at every launch of an eager step)."""
    check_same_device(**tensors)
    first = next((t for t in tensors.values() if t is not None), None)
    if first is not None and not triton_runs_on(first.device):
        name = next(n for n, t in tensors.items() if t is first)
        raise ValueError(f"{name} must be on a CUDA device (or the CPU with TRITON_INTERPRET=1), got {first.device}")


def rows_view(name: str, t: torch.Tensor) -> torch.Tensor:
    """t: (..., n) with unit stride in its last dim -> a (rows, n) view of the same memory (one row stride)."""
    if t.ndim == 0 or (t.stride(-1) != 1 and t.shape[-1] > 1):
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {t.stride()}")
    if t.ndim == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name} {tuple(t.shape)} with strides {t.stride()} does not flatten to rows") from None


def output_for(out, shape, like: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous output (with room for padded rows: kernels.row_buckets), or the caller's `out` after
    checking its shape, dtype and device."""
    if out is None:
        return empty_rows(shape, like.dtype, like.device)
    check_tensor("out", out, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    check_no_self_overlap("out", out)
    return out


def _launch_shape(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS per program, num_warps) for rows of width n."""
    block_n = next_power_of_2(n)
    rows = max(1, 1024 // block_n)
    return block_n, rows, min(16, max(1, rows * block_n // 256))


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_rows, n, x_stride, res_stride, out_stride, eps,
                     stamps_ptr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                     STAMPS: tl.constexpr, PDL: tl.constexpr):
    # rows [pid*ROWS, pid*ROWS + ROWS) of x (n_rows, n); with HAS_RES, s = x + res is stored into res first
    stamps.wait(stamps_ptr, STAMPS, PDL)
    pdl.release_dependents(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)                     # (ROWS,)
    cols = tl.arange(0, BLOCK_N)                                             # (BLOCK_N,)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n)                   # (ROWS, BLOCK_N)
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * x_stride + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        res_ptrs = res_ptr + rows64 * res_stride + cols[None, :]
        s = (x.to(tl.float32) + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_ptrs, s, mask=mask)
        x = s
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n + eps)                       # (ROWS,)
    w = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)       # (BLOCK_N,)
    y = xf * rstd[:, None] * (1.0 + w[None, :])
    tl.store(out_ptr + rows64 * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _norm(x, residual, weight, eps, out):
    """Shared checks and launch; residual is None for the plain norm."""
    check_tensor("x", x, dtype=FLOATS)
    if x.ndim == 0:
        raise ValueError("x must have at least 1 dim (..., n), got a 0-dim tensor")
    check_tensor("weight", weight, ndim=1, dtype=FLOATS)
    if residual is not None:
        check_tensor("residual", residual, dtype=x.dtype)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        check_no_self_overlap("residual", residual)  # x + residual is written into it
    check_real("eps", eps)
    if weight.shape[0] != x.shape[-1] or weight.stride(0) != 1:
        raise ValueError(f"weight must be contiguous with {x.shape[-1]} entries (x's width), got {weight.shape[0]}")
    out = output_for(out, x.shape, x)  # fresh: a projection's input, with room for its padded rows
    check_devices(x=x, residual=residual, weight=weight, out=out)
    x2, o2 = rows_view("x", x), rows_view("out", out)
    r2 = None if residual is None else rows_view("residual", residual)
    return _launch(x2, r2, weight, eps, o2, out)


def _launch(x2, r2, weight, eps, o2, out):
    """The norm of rows x2 (n_rows, n) (+ r2 when given, the sum written back into it) into o2; returns out."""
    res = x2 if r2 is None else r2
    n_rows, n = x2.shape
    if n_rows == 0 or n == 0:
        return out
    block_n, rows, warps = _launch_shape(n)
    stamp, stamping = stamps.slot("rms_norm", x2.device)
    _rms_norm_kernel[(cdiv(n_rows, rows),)](
        x2, res, weight, o2, n_rows, n, x2.stride(0), res.stride(0), o2.stride(0), float(eps), stamp,
        HAS_RES=r2 is not None, BLOCK_N=block_n, ROWS=rows, STAMPS=stamping, num_warps=warps,
        **pdl.launch_options(x2.device))
    return out


def rms_norm(x, weight, eps, out=None):
    """x: (..., n) fp16/bf16/fp32; weight: (n,) -> (..., n) in x's dtype, written into `out` when given."""
    return _norm(x, None, weight, eps, out)


def add_rms_norm(x, residual, weight, eps, out=None):
    """x, residual: (..., n), same dtype -> (rms_norm(x + residual), residual).

    IN PLACE: the sum x + residual (rounded to the io dtype, as torch's add does) is written into
    `residual`, which is returned as the second result. The norm is computed from that rounded sum.
    residual None (a first layer): (rms_norm(x), x)."""
    return _norm(x, residual, weight, eps, out), (x if residual is None else residual)



def rms_norm_op(x, weight, eps):
    # x: (..., n) from the model: launched without the public checks (the engine built it)
    out = empty_rows(x.shape, x.dtype, x.device)
    return _launch(rows_view("x", x), None, weight, eps, out.view(-1, x.shape[-1]), out)


def add_rms_norm_op(x, residual, weight, eps):
    # x, residual: (..., n) from the model; residual None: a first layer
    out = empty_rows(x.shape, x.dtype, x.device)
    r2 = None if residual is None else rows_view("residual", residual)
    return (_launch(rows_view("x", x), r2, weight, eps, out.view(-1, x.shape[-1]), out),
            x if residual is None else residual)


registry.define("rms_norm")
registry.register("rms_norm", Impl("rms_norm", "triton", rms_norm_op, checked=rms_norm))
registry.define("add_rms_norm")
registry.register("add_rms_norm", Impl("add_rms_norm", "triton", add_rms_norm_op, checked=add_rms_norm))
