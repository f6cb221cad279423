"""Gated DeltaNet's per-token math around the delta rule, in Triton: the gates and the gated output norm.

    g    = -exp(A_log) softplus(a + dt_bias)       (log-decay, fp32)      beta = sigmoid(b)   (fp32)
    out  = norm_w * rmsnorm(o) * silu(z)          o and rmsnorm(o) rounded to the io dtype first (as transformers)

The jit functions (`gate_values`, `gated_norm`) are what the decode kernel (kernels/gdn_decode.py) inlines, and
the prefill's output pass inlines `gated_norm` where its programs hold whole dv rows; otherwise the prefill path
runs them as kernels of their own (`gdn_gates`, `gated_rms_norm`), one launch each where the reference takes about
eight and twelve small torch ops (at 18-48 GDN layers a step, the host's launch time).
Same math and rounding as reference.gdn_gates and reference.gated_rms_norm. No host sync: CUDA-graph capturable.
"""
import torch
import triton
import triton.language as tl

from kernels.host_math import cdiv, next_power_of_2
from kernels.norms import check_devices
from kernels.row_buckets import empty_rows
from reference.checks import check_real, check_tensor

SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch.nn.functional.softplus returns x above it
L2NORM_EPS = tl.constexpr(1e-6)  # the q / k L2 norms' eps (reference.norms.l2norm's)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
TILE = 2048  # elements a program of either kernel takes


@triton.jit
def gate_values(a, b, a_log, dt_bias):
    """(g, beta) fp32 from loaded a, b, A_log, dt_bias (any matching shapes)."""
    x = a.to(tl.float32) + dt_bias.to(tl.float32)
    softplus = tl.where(x > SOFTPLUS_THRESHOLD, x, tl.log(1.0 + tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))))
    return -tl.exp(a_log.to(tl.float32)) * softplus, tl.sigmoid(b.to(tl.float32))


@triton.jit
def gated_norm(o, z, w, eps, DV: tl.constexpr, io: tl.constexpr):
    """w * rmsnorm(o) * silu(z) per row: o (R, BV) and z (R, BV), zero past DV; w (BV,). Returns fp32."""
    o = o.to(io).to(tl.float32)
    y = (o * tl.rsqrt(tl.sum(o * o, axis=1) / DV + eps)[:, None]).to(io)
    wy = (w[None, :].to(tl.float32) * y.to(tl.float32)).to(w.dtype)  # torch's w * y: rounded to promote(w, io)
    z = z.to(tl.float32)
    return wy.to(tl.float32) * (z * tl.sigmoid(z))


@triton.jit
def _gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, n_tokens, stride_a, stride_b,
                  H: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr):
    # grid (cdiv(N, BT),): tokens t of a, b (N, H) rows -> g, beta (N, H) contiguous fp32
    t = tl.program_id(0) * BT + tl.arange(0, BT)  # (BT,)
    h = tl.arange(0, HP)  # (HP,)
    ok = (t < n_tokens)[:, None] & (h < H)[None, :]
    t64 = t.to(tl.int64)[:, None]
    a = tl.load(a_ptr + t64 * stride_a + h[None, :], mask=ok, other=0.0)
    b = tl.load(b_ptr + t64 * stride_b + h[None, :], mask=ok, other=0.0)
    a_log = tl.load(a_log_ptr + h, mask=h < H, other=0.0)[None, :]
    dt_bias = tl.load(dt_bias_ptr + h, mask=h < H, other=0.0)[None, :]
    g, beta = gate_values(a, b, a_log, dt_bias)
    tl.store(g_ptr + t64 * H + h[None, :], g, mask=ok)
    tl.store(beta_ptr + t64 * H + h[None, :], beta, mask=ok)


@triton.jit
def _gated_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, eps, n_rows, sx_t, sx_h, sz_t, sz_h, so_t, so_h,
                       H: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, ROWS: tl.constexpr):
    # grid (cdiv(N * H, ROWS),): rows r = (token r // H, head r % H) of x, z, out (N, H, DV), each row's DV
    # columns contiguous
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BV)
    ok = (r < n_rows)[:, None] & (cols < DV)[None, :]
    tok, head = (r // H).to(tl.int64)[:, None], (r % H)[:, None]
    o = tl.load(x_ptr + tok * sx_t + head * sx_h + cols[None, :], mask=ok, other=0.0)
    z = tl.load(z_ptr + tok * sz_t + head * sz_h + cols[None, :], mask=ok, other=0.0)
    w = tl.load(w_ptr + cols, mask=cols < DV, other=0.0)
    y = gated_norm(o, z, w, eps, DV, out_ptr.dtype.element_ty)
    tl.store(out_ptr + tok * so_t + head * so_h + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


def gdn_gates(a, b, A_log, dt_bias):
    """a, b: (N, Hv) with contiguous rows; A_log, dt_bias: (Hv,). Returns g, beta: (N, Hv) fp32, contiguous."""
    check_tensor("a", a, ndim=2, dtype=FLOATS)
    check_tensor("b", b, ndim=2, dtype=FLOATS)
    check_tensor("A_log", A_log, ndim=1, dtype=FLOATS)
    check_tensor("dt_bias", dt_bias, ndim=1, dtype=FLOATS)
    check_devices(a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    n, h = a.shape
    if b.shape != a.shape or A_log.shape != (h,) or dt_bias.shape != (h,):
        raise ValueError(f"b {tuple(b.shape)}, A_log {tuple(A_log.shape)} and dt_bias {tuple(dt_bias.shape)} must "
                         f"match a {tuple(a.shape)}")
    for name, t in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dim, got strides {t.stride()}")
    g = torch.empty(n, h, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    hp = next_power_of_2(h)
    bt = max(1, TILE // hp)
    if n:
        _gates_kernel[(cdiv(n, bt),)](a, b, A_log, dt_bias, g, beta, n, a.stride(0), b.stride(0), H=h, HP=hp, BT=bt,
                                      num_warps=4)
    return g, beta


def gated_rms_norm(x, z, weight, eps):
    """x, z: (N, H, DV) of one dtype, each row's DV entries contiguous (tokens and heads may be strided);
    weight: (DV,). Returns weight * rmsnorm(x) * silu(z), (N, H, DV) contiguous in x's dtype."""
    check_tensor("x", x, ndim=3, dtype=FLOATS)
    check_tensor("z", z, ndim=3, dtype=x.dtype)
    check_tensor("weight", weight, ndim=1, dtype=FLOATS)
    check_devices(x=x, z=z, weight=weight)
    eps = check_real("eps", eps)
    n, h, dv = x.shape
    if z.shape != x.shape or weight.shape != (dv,):
        raise ValueError(f"z {tuple(z.shape)} and weight {tuple(weight.shape)} must match x {tuple(x.shape)}")
    for name, t in (("x", x), ("z", z), ("weight", weight)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dim, got strides {t.stride()}")
    out = empty_rows((n, h, dv), x.dtype, x.device, row_dims=1)  # out_proj's input (n, h * dv): room to pad it
    bv = next_power_of_2(dv)
    rows = max(1, TILE // bv)
    if n:
        _gated_norm_kernel[(cdiv(n * h, rows),)](
            x, z, weight, out, eps, n * h, x.stride(0), x.stride(1), z.stride(0), z.stride(1),
            out.stride(0), out.stride(1), H=h, DV=dv, BV=bv, ROWS=rows, num_warps=4)
    return out
