"""Triton gated activations: SwiGLU's silu(gate) * up and the attention output gate x * sigmoid(gate).

Both compute in fp32 and store in the input's dtype. Inputs are rows with unit inner stride and any row
stride (a q_proj slice works as is). No host syncs and no allocation when `out=` is given: CUDA-graph
capturable. Grid: (rows, column blocks), so any number of tokens fits.
"""
import triton
import triton.language as tl

from kernels import pdl, registry
from kernels.host_math import cdiv
from kernels.norms import FLOATS, check_devices, output_for, rows_view
from kernels.registry import Impl
from reference.checks import check_tensor

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, inter, gu_stride, out_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # row r: out[r, c] = silu(gu[r, c]) * gu[r, inter + c] for the BLOCK columns c of this program
    pdl.wait_for_producer(PDL)
    pdl.release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sigmoid_gate_mul_kernel(x_ptr, g_ptr, out_ptr, n, x_stride, g_stride, out_stride, BLOCK: tl.constexpr):
    # row r: out[r, c] = x[r, c] * sigmoid(gate[r, c])
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (x * tl.sigmoid(g)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up, out=None):
    """gate_up: (..., 2I) = [gate | up] -> silu(gate) * up: (..., I), in gate_up's dtype."""
    check_tensor("gate_up", gate_up, dtype=FLOATS)
    if gate_up.ndim == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must have an even last dim, got shape {tuple(gate_up.shape)}")
    inter = gate_up.shape[-1] // 2
    out = output_for(out, (*gate_up.shape[:-1], inter), gate_up)
    check_devices(gate_up=gate_up, out=out)
    gu2, o2 = rows_view("gate_up", gate_up), rows_view("out", out)
    if gu2.shape[0] and inter:
        grid = (gu2.shape[0], cdiv(inter, BLOCK))
        _silu_and_mul_kernel[grid](gu2, o2, inter, gu2.stride(0), o2.stride(0), BLOCK=BLOCK, num_warps=4,
                                   **pdl.launch_options(gate_up.device))
    return out


def sigmoid_gate_mul(x, gate, out=None):
    """x, gate: (..., n), same shape and dtype -> x * sigmoid(gate) in x's dtype."""
    check_tensor("x", x, dtype=FLOATS)
    check_tensor("gate", gate, dtype=x.dtype)
    if gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must match x {tuple(x.shape)}")
    out = output_for(out, x.shape, x)
    check_devices(x=x, gate=gate, out=out)
    x2, g2, o2 = rows_view("x", x), rows_view("gate", gate), rows_view("out", out)
    if x2.shape[0] and x2.shape[1]:
        grid = (x2.shape[0], cdiv(x2.shape[1], BLOCK))
        _sigmoid_gate_mul_kernel[grid](x2, g2, o2, x2.shape[1], x2.stride(0), g2.stride(0), o2.stride(0),
                                       BLOCK=BLOCK, num_warps=4)
    return out



registry.define("silu_and_mul")
registry.register("silu_and_mul", Impl("silu_and_mul", "triton", silu_and_mul))
