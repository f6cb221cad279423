"""Triton attention prep for Qwen3.5's gated full attention, in one launch.

From the raw projections q (N, H, D), k, v (N, KV, D) it
  - applies the zero-centred RMSNorm over D to every q and k head (fp32, rounded to the io dtype, as the
    reference's rms_norm returns it),
  - applies partial NeoX RoPE to the first R = 2 * cos.shape[1] dims (pairs (i, i + R/2), fp32, rounded),
  - writes q_out (N, H, D), and the normed, rotated k and the raw v into the paged cache at slot_mapping
    (flat slot = page * page_size + offset; a negative slot skips the token's write).

Grid: (N, cdiv(H + KV, HEADS)): a program takes HEADS consecutive heads of one token (about 2048 elements),
counting the H q heads first and then the KV k heads, each of which also copies its v head. q, k, v may be
strided views (unit stride in D only), e.g. q as the first D of each (N, H, 2D) q_proj head.
No host syncs and no allocation when `out=` is given: CUDA-graph capturable.
"""
import torch
import triton
import triton.language as tl

from kernels import pdl, registry, stamps
from kernels.host_math import cdiv, next_power_of_2
from kernels.norms import FLOATS, check_devices
from kernels.registry import Impl
from reference.checks import check_no_self_overlap, check_real, check_tensor


@triton.jit
def _load_heads(q_ptr, k_ptr, q_off, k_off, cols, q_rows, k_rows):
    # (HEADS, BLOCK_D) fp32 tile: q rows from q, k rows from k, at columns cols (BLOCK_D,); 0 elsewhere
    xq = tl.load(q_ptr + q_off + cols[None, :], mask=q_rows, other=0.0)
    xk = tl.load(k_ptr + k_off + cols[None, :], mask=k_rows, other=0.0)
    return tl.where(q_rows, xq, xk).to(tl.float32)


@triton.jit
def _load_weights(qw_ptr, kw_ptr, cols, is_q, mask):
    # (HEADS, BLOCK_D) fp32: 1 + the q_norm weight on q rows, 1 + the k_norm weight on k rows
    wq = tl.load(qw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wk = tl.load(kw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return 1.0 + tl.where(is_q[:, None], wq[None, :], wk[None, :])


@triton.jit
def rope_coefficients(cos_row, sin_row, d, HALF: tl.constexpr):
    """Partial NeoX RoPE of one token (cos_row, sin_row: its R/2 = HALF values) at columns d (BD,): returns c, s
    (1, BD) and partner (BD,) such that out = y c + y[partner] s. Dim d < HALF pairs with d + HALF (y c - y' s),
    HALF <= d < 2 HALF with d - HALF (y c + y' s); dims >= 2 HALF pass through (c = 1, s = 0, partner = d)."""
    rotated = d < 2 * HALF
    first = d < HALF
    j = tl.where(first, d, d - HALF)
    c = tl.load(cos_row + j, mask=rotated, other=1.0)[None, :]
    s = tl.load(sin_row + j, mask=rotated, other=0.0)
    s = tl.where(first, -s, s)[None, :]
    return c, s, tl.where(first, d + HALF, tl.where(rotated, d - HALF, d))


@triton.jit
def norm_rope(x, xp, w, wp, c, s, eps, D: tl.constexpr, io: tl.constexpr):
    """rope(rms_norm(x)) of rows x (R, BD) fp32, zero past D: xp holds x at each column's rope partner, w and wp
    1 + the zero-centred norm weight at the columns and at their partners, c and s rope_coefficients'. The normed
    rows are rounded to io before the rope, and the result to io, as the reference rounds."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # (R, 1)
    y = (x * rstd * w).to(io).to(tl.float32)
    yp = (xp * rstd * wp).to(io).to(tl.float32)
    return (y * c + yp * s).to(io)


@triton.jit
def _attention_prep_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slot_ptr,
                           q_out_ptr, k_pages_ptr, v_pages_ptr, stamps_ptr,
                           sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, so_n, so_h, cos_stride, sin_stride, eps,
                           H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_D: tl.constexpr, HEADS: tl.constexpr, STAMPS: tl.constexpr, PDL: tl.constexpr):
    # token n, HEADS consecutive heads of the H + KV (q heads first, then k heads with their v heads)
    t_go = stamps.wait(stamps_ptr, STAMPS, PDL)
    pdl.release_dependents(PDL)
    n = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)              # (HEADS,)
    d = tl.arange(0, BLOCK_D)                                           # (BLOCK_D,)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    is_q = head < H
    kvh = head - H                                                      # k/v head of k rows
    dm = (d < D)[None, :]
    q_rows = is_q[:, None] & dm                                         # (HEADS, BLOCK_D) masks
    k_rows = ((head >= H) & (kvh < KV) & (slot >= 0))[:, None] & dm
    q_off = n * sq_n + head[:, None] * sq_h                             # (HEADS, 1) row offsets
    k_off = n * sk_n + kvh[:, None] * sk_h
    c, s, partner = rope_coefficients(cos_ptr + n * cos_stride, sin_ptr + n * sin_stride, d, HALF)
    x = _load_heads(q_ptr, k_ptr, q_off, k_off, d, q_rows, k_rows)
    xp = _load_heads(q_ptr, k_ptr, q_off, k_off, partner, q_rows, k_rows)
    out = norm_rope(x, xp, _load_weights(qw_ptr, kw_ptr, d, is_q, d < D),
                    _load_weights(qw_ptr, kw_ptr, partner, is_q, d < D), c, s, eps, D, q_ptr.dtype.element_ty)
    tl.store(q_out_ptr + n * so_n + head[:, None] * so_h + d[None, :], out, mask=q_rows)
    dst = slot * (KV * D) + kvh[:, None] * D + d[None, :]               # pages: contiguous (pages, page_size, KV, D)
    tl.store(k_pages_ptr + dst, out, mask=k_rows)
    v = tl.load(v_ptr + n * sv_n + kvh[:, None] * sv_h + d[None, :], mask=k_rows)
    tl.store(v_pages_ptr + dst, v, mask=k_rows)
    stamps.end(stamps_ptr, t_go, STAMPS)


def _check_heads(name: str, t, n: int | None, d: int | None) -> None:
    """t: (n, heads, d) float with unit stride in d."""
    check_tensor(name, t, ndim=3, dtype=FLOATS)
    if (n is not None and t.shape[0] != n) or (d is not None and t.shape[2] != d):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n}, heads, {d})")
    if t.stride(2) != 1 and t.shape[2] > 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {t.stride()}")


def check_args(q, k, v, q_norm_w, k_norm_w, cos, sin, k_pages, v_pages, slot_mapping, out):
    _check_heads("q", q, None, None)
    n, h, d = q.shape
    _check_heads("k", k, n, d)
    _check_heads("v", v, n, d)
    if v.shape != k.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} must match each other "
                         f"and q's dtype {q.dtype}")
    if k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"q's {h} heads are not a multiple of k's {k.shape[1]}")
    for name, w in (("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w)):
        check_tensor(name, w, ndim=1, dtype=FLOATS)
        if w.shape[0] != d or w.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous ({d},) vector, got {tuple(w.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, ndim=2, dtype=torch.float32)
        if t.shape != cos.shape or t.shape[0] != n or 2 * t.shape[1] > d or t.stride(1) != 1:
            raise ValueError(f"{name} must be ({n}, R/2) with R <= {d} and unit inner stride, "
                             f"got {tuple(t.shape)} (cos {tuple(cos.shape)})")
    for name, p in (("k_pages", k_pages), ("v_pages", v_pages)):
        check_tensor(name, p, ndim=4, dtype=k.dtype)
        if p.shape != k_pages.shape or p.shape[2:] != k.shape[1:] or not p.is_contiguous():
            raise ValueError(f"{name} must be contiguous (pages, page_size, {k.shape[1]}, {d}), got "
                             f"{tuple(p.shape)} (k_pages {tuple(k_pages.shape)})")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtype=(torch.int32, torch.int64), contiguous=True)
    if slot_mapping.shape[0] != n:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {n} tokens")
    check_tensor("out", out, dtype=q.dtype)
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with unit inner stride, got {tuple(out.shape)}")
    check_no_self_overlap("out", out)
    check_devices(q=q, k=k, v=v, q_norm_w=q_norm_w, k_norm_w=k_norm_w, cos=cos, sin=sin, k_pages=k_pages,
                  v_pages=v_pages, slot_mapping=slot_mapping, out=out)


def attention_prep(q, k, v, q_norm_w, k_norm_w, cos, sin, k_pages, v_pages, slot_mapping, eps, out=None):
    """q: (N, H, D), k, v: (N, KV, D) raw projections; q_norm_w, k_norm_w: (D,) zero-centred weights;
    cos, sin: (N, R/2) fp32; k_pages, v_pages: (pages, page_size, KV, D) in k's dtype, written in place at
    slot_mapping (N,) int32/int64 (negative: skipped; the caller keeps slots below pages * page_size, which is not
    checked, to stay free of host syncs). Returns q_out (N, H, D) in q's dtype (into `out` when given)."""
    if out is None and isinstance(q, torch.Tensor):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    check_args(q, k, v, q_norm_w, k_norm_w, cos, sin, k_pages, v_pages, slot_mapping, out)
    return _launch(q, k, v, q_norm_w, k_norm_w, cos, sin, k_pages, v_pages, slot_mapping, check_real("eps", eps), out)


def _launch(q, k, v, q_norm_w, k_norm_w, cos, sin, k_pages, v_pages, slot_mapping, eps, out):
    """attention_prep on checked arguments (or the engine's own): the launch."""
    n, h, d = q.shape
    kv = k.shape[1]
    if n == 0:
        return out
    block_d = next_power_of_2(d)
    heads = min(next_power_of_2(h + kv), max(1, 2048 // block_d))
    stamp, stamping = stamps.slot("attention_prep", q.device)
    _attention_prep_kernel[(n, cdiv(h + kv, heads))](
        q, k, v, q_norm_w, k_norm_w, cos, sin, slot_mapping, out, k_pages, v_pages, stamp,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), sin.stride(0), eps,
        H=h, KV=kv, D=d, HALF=cos.shape[1], BLOCK_D=block_d, HEADS=heads, STAMPS=stamping, num_warps=4,
        **pdl.launch_options(q.device))
    return out


def attention_prep_op(q, k, v, q_norm_w, k_norm_w, step, k_pages, v_pages, eps):
    """model.ops' attention_prep: cos, sin and slot_mapping from the StepInput the engine built, not checked again."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return _launch(q, k, v, q_norm_w, k_norm_w, step.cos, step.sin, k_pages, v_pages, step.slot_mapping, float(eps),
                   out)


def _checked_op(q, k, v, q_norm_w, k_norm_w, step, k_pages, v_pages, eps):
    return attention_prep(q, k, v, q_norm_w, k_norm_w, step.cos, step.sin, k_pages, v_pages, step.slot_mapping, eps)


registry.define("attention_prep")
registry.register("attention_prep", Impl("attention_prep_op", "triton", attention_prep_op, checked=_checked_op))
