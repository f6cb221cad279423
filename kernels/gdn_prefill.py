"""Gated DeltaNet prefill in Triton: the chunked (WY) gated delta rule over a varlen batch, chunk BT = 64.

Per value head j (key head h = j // (Hv / Hk)), with q, k l2-normalised (fused) and q scaled, the recurrence
    S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t          S: (dk, dv) fp32
is evaluated a chunk of BT tokens at a time (reference/gated_delta.py's `_chunked_one` derives it). In a chunk
with cumulative log-decay G = cumsum(g) and the strictly lower triangular A_ij = beta_i exp(G_i - G_j) (k_i.k_j):
    T     = (I + A)^-1                     unit lower triangular, by 16 x 16 blocks
    w     = T (beta exp(G) k),  u = T (beta v),  kd = k exp(G_last - G)                 kernel 1, chunks in parallel
    h     = S;  v_new = u - w S;  S = exp(G_last) S + kd^T v_new                        kernel 2, chunks in order
    o     = exp(G) q h + mask_{i>=j}(exp(G_i - G_j) q_i.k_j) v_new                      kernel 3, chunks in parallel
No exp(-G) is ever formed, so long chunks of strong decay cannot overflow.

Kernel 1 `_chunk_wy_kernel`, grid (chunks, Hv), writes w, u, kd (total, Hv, d) in the io dtype and G (total, Hv)
fp32. Kernel 2 `_chunk_state_kernel`, grid (N, Hv, dv / BV), is the only sequential part: a program carries its
(dk, BV) slice of S in fp32 registers through its sequence's chunks, two products a chunk, storing each chunk's
start state h (chunks, Hv, dk, dv) and v_new (total, Hv, dv) in the io dtype, and finally S in place into
recurrent_states[state_slots[i]], i.e. straight into the decode step's (kernels/gdn_decode.py) slot layout.
Kernel 3 `_chunk_output_kernel`, grid (chunks, Hv, dv / BV), forms o from h, v_new and the chunk's q, k.
Precision: fp32 io runs every product in exact fp32 ("ieee"; the interpreter always does). 16-bit io runs kernel 1's
products in tf32 and its solve in exact fp32, and the products after it on 16-bit operands (w, kd, v_new, h and
S rounded to the io dtype, fp32 accumulation), as fla's chunked kernels do; S itself stays fp32.

The solve (kernel 1). T is block lower triangular in 16 x 16 blocks (SUB): the four diagonal blocks
T_ii = (I + A_ii)^-1 by forward substitution, the four held transposed in one (2, 2, 16, 16) tensor so that each of
the 15 steps is two reductions along the last axis (within a warp) for all four and one vector transpose; then
T_ij = -T_ii sum_{l=j}^{i-1} A_il T_lj, three rounds of 16 x 16 x 16 products in exact fp32. The blocks come out
of A (64, 64) and T goes back into one (64, 64) tile by reshape / permute / split / join, so that w and u stay
single (64 x 64 x d) tensor-core products.

Bound (H200, B1 T16k Hv 32, dk = dv = 128; fla's chunked prefill: 14.9 Mtok/s, 1.1 ms). Traffic: kernel 1 writes
w, u, kd (768 B a token and head in bf16), kernel 2 reads them and writes h (32 KiB a chunk and head, 512 B a token
and head) and v_new (256 B), kernel 3 reads h, v_new, q, k: about 2.6 KB a token and head, 1.4 GB at T16k H32,
0.33 ms at 4.2 TB/s. Tensor work: about 0.2 MFLOP a token and head, 6 MFLOP a token at Hv 32, 0.1 TFLOP at T16k:
0.2 ms at ~500 TFLOP/s. The chain: kernel 2 runs N Hv dv / BV
programs (B1 Hv 32: BV 32, 128 programs) through T / 64 dependent chunks (256 at T16k) of two small products and
a 16 KiB store each; at ~1 us a chunk, 0.26 ms. Predicted before measuring: about 0.6-0.8 ms, 20-27 Mtok/s, if the
kernels each ran near their bound.
Measured on the H200 (profiles.bench_prefill, B1 T16k H32): 6.26 Mtok/s against fla's 14.9 in the same run, 0.42x:
kernel 1 1114 us, kernel 2 560 us, kernel 3 434 us, 2617 us a call (the rest is the host: cu_seqlens was read twice,
for its checks and the chunk table, each a sync that drains the queue; now once). Kernel 1 is the limit: 8192
programs at one CTA an SM (236 registers a thread at 8 warps, 64 KB of shared memory), ~18 us each; register caps of
168 and 128 changed nothing (1149, 1117 us). The first version (o inside the sequential kernel, fp32 workspaces,
tf32x3 state products, a row-by-row solve) ran 1.94 Mtok/s, 0.13x.
Where kernel 1's barriers come from (sm_90a PTX compiled on the CPU, straight-line code, so static counts are
executed counts): 103 bar.sync and 33 layout conversions a program, of which the solve takes 83 (_blocks 32, the
15-step substitution 31 (two a step: one vector transpose), the 16 block products 20); the loads, kk and w/u/kd take
the other 20. The next step, prototyped on the CPU but not yet run on the H200: A^T written once to a per-program
fp32 scratch (16 KiB, 128 MiB at B1 T16k H32; its strict upper triangle, T filled into the lower one), one barrier,
then the diagonal inverses by substitution from row loads in a (4, 16, 16) layout whose reduction axis stays inside
a warp (15 steps, no barrier), then the off-diagonal blocks by two levels of block doubling (T = [[T_lo, 0], [-T_hi
A_21 T_lo, T_hi]]: batched (2, 16, 16) then (32, 32) ieee products, four instead of sixteen): 32 bar.sync and 166
registers a thread (from 236), no spills, same shared memory; max |dT| / max |T| against float64 7.9e-7 on
correlated keys (4.2e-7 now). Its fp32-io build needs maxnreg=255 (ptxas otherwise picks 32 registers and spills 22
KB). A Neumann/doubling product on the 16 x 16 diagonal blocks loses too much (3.1e-4: N^8 reaches 1.6e3 and
cancels).

Not CUDA-graph capturable: the chunk table is built on the host from cu_seqlens (prefill only). state_slots must be
distinct and in range (not checked: that would read them on the host).
"""
import os

import torch
import triton
import triton.language as tl

import reference as R
from kernels import gdn_decode
from reference._checks import check_cu_seqlens, check_tensor

CHUNK = 64
SUB = tl.constexpr(16)  # the WY kernel's sub-block: the chunk's T = (I + A)^-1 by 16 x 16 blocks
L2NORM_EPS = tl.constexpr(1e-6)
IO_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FEW_PROGRAMS = 132  # the H200's SM count: with fewer kernel-2 programs than this, dv is split finer
STATE_BV, OUTPUT_BV = 64, 128  # dv columns a program of kernel 2 (at most) and of kernel 3
STATE_STAGES = 2  # software-pipelining stages of kernel 2's chunk loop (its loads do not depend on S)
# Autotuning kernels 2 and 3 over (BV, warps, stages) ran B1 T16k H32 at 7.67 Mtok/s instead of 6.26 (state pass
# 560 -> 402 us, output 434 -> 309 us) but hit an illegal memory access on the H200 in the varlen GPU tests and
# under ncu, not reproduced under the interpreter with any single config: fixed configs until that is found.


@triton.jit
def _load_rows(ptr, t, t_mask, stride_t, col0, cols, n_cols):
    """Rows t (BT,) of a (T, ...) tensor at ptr, columns col0 + cols (BD,) below n_cols; fp32 (BT, BD), 0 outside."""
    c = col0 + cols
    mask = t_mask[:, None] & (c[None, :] < n_cols)
    return tl.load(ptr + t[:, None].to(tl.int64) * stride_t + c[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_qk(q_ptr, k_ptr, t, t_mask, sq_t, sk_t, head_off_q, head_off_k, rk, scale, DK: tl.constexpr,
             L2NORM: tl.constexpr):
    """q (l2-normalised, scaled) and k (l2-normalised) rows of one key head: fp32 (BT, BK) each, 0 outside."""
    q = _load_rows(q_ptr + head_off_q, t, t_mask, sq_t, 0, rk, DK)
    k = _load_rows(k_ptr + head_off_k, t, t_mask, sk_t, 0, rk, DK)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=1) + L2NORM_EPS)[:, None]
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + L2NORM_EPS)[:, None]
    return q * scale, k


@triton.jit
def _inv_unit_lower4(a0, a1, a2, a3):
    """(I + a)^-1 of four strictly lower triangular (SUB, SUB) fp32 tiles by forward substitution in exact fp32:
    row i of T is x_i + sum_{l<i} x_il T_l with x_i = -a_i (and T_l the rows done). The four are held in one
    (2, 2, SUB, SUB) tensor of T^T, u[y, x, c, l] = T[l, c] of tile 2 y + x, so that both reductions of a step run
    along the last axis (within a warp) for all four tiles; the step's row goes in as column i of u."""
    r = tl.arange(0, SUB)[None, None, :, None]
    c = tl.arange(0, SUB)[None, None, None, :]
    r3 = tl.arange(0, SUB)[None, None, :]
    u = -tl.join(tl.join(tl.trans(a0), tl.trans(a1)), tl.join(tl.trans(a2), tl.trans(a3)))  # [c, l, x, y]
    u = tl.permute(u, (3, 2, 0, 1))
    for i in tl.static_range(1, SUB):
        x = tl.sum(tl.where(c == i, u, 0.0), axis=3)  # (2, 2, SUB): x[l] = -a_il, zero from l = i on
        x = tl.where(r3 == i, 1.0, x)  # + e_i: column i of u is x itself
        col = tl.sum(x[:, :, None, :] * u, axis=3)  # sum_l x_l u[:, l] = row i of T
        u = tl.where(c == i, col[:, :, :, None], u)
    u += tl.where(r == c, 1.0, 0.0)
    u01, u23 = tl.split(tl.permute(u, (2, 3, 1, 0)))
    u0, u1 = tl.split(u01)
    u2, u3 = tl.split(u23)
    return tl.trans(u0), tl.trans(u1), tl.trans(u2), tl.trans(u3)


@triton.jit
def _join4(z0, z1, z2, z3):
    """Four tensors of one shape joined on two new last axes (..., 2, 2): z_n at [..., n % 2, n // 2]."""
    return tl.join(tl.join(z0, z1), tl.join(z2, z3))


@triton.jit
def _split4(z):
    """The inverse of _join4."""
    lo, hi = tl.split(z)
    z0, z1 = tl.split(lo)
    z2, z3 = tl.split(hi)
    return z0, z1, z2, z3


@triton.jit
def _blocks(x):
    """The (SUB, SUB) blocks x_IJ of a (4 SUB, 4 SUB) tile, I row block, J column block; returns the four column
    blocks of each block row in turn (x_00, x_01, ..., x_33). x[16 (2 I1 + I0) + r, 16 (2 J1 + J0) + c] is
    y[r, c, I0, I1, J0, J1]; each _split4 peels two axes."""
    y = tl.permute(tl.reshape(x, (2, 2, SUB, 2, 2, SUB)), (2, 5, 1, 0, 4, 3))
    c0, c1, c2, c3 = _split4(y)  # column blocks J: (SUB, SUB, 2, 2)
    x00, x10, x20, x30 = _split4(c0)
    x01, x11, x21, x31 = _split4(c1)
    x02, x12, x22, x32 = _split4(c2)
    x03, x13, x23, x33 = _split4(c3)
    return x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33


@triton.jit
def _unblocks(x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33):
    """The inverse of _blocks: one (4 SUB, 4 SUB) tile."""
    y = _join4(_join4(x00, x10, x20, x30), _join4(x01, x11, x21, x31), _join4(x02, x12, x22, x32),
               _join4(x03, x13, x23, x33))  # y[r, c, I0, I1, J0, J1]
    return tl.reshape(tl.permute(y, (3, 2, 0, 5, 4, 1)), (4 * SUB, 4 * SUB))


@triton.jit
def _chunk_wy_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, chunk_ptr, w_ptr, u_ptr, kd_ptr, gcum_ptr,
                     sk_t, sk_h, sv_t, sv_h,
                     HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr):
    # grid (chunks, Hv): tokens [start, end) of one sequence (end - start <= BT), value head j. x_ij: the (SUB, SUB)
    # block of a (BT, BT) tile x at row block i and column block j.
    tl.static_assert(BT == 4 * SUB)
    c = tl.program_id(0)
    j = tl.program_id(1)
    start = tl.load(chunk_ptr + 2 * c)
    end = tl.load(chunk_ptr + 2 * c + 1)
    r, rk, rv = tl.arange(0, BT), tl.arange(0, BK), tl.arange(0, BV)
    t = start + r
    tm = t < end
    k = _load_rows(k_ptr + (j // GROUP) * sk_h, t, tm, sk_t, 0, rk, DK)  # (BT, BK)
    if L2NORM:
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + L2NORM_EPS)[:, None]
    g = tl.load(g_ptr + t * HV + j, mask=tm, other=0.0)  # (BT,)
    beta = tl.load(beta_ptr + t * HV + j, mask=tm, other=0.0)
    G = tl.cumsum(g, 0)
    g_last = tl.sum(tl.where(r == end - start - 1, G, 0.0))
    decay = tl.exp(tl.where(r[:, None] > r[None, :], G[:, None] - G[None, :], float("-inf")))  # exp(G_i - G_j), i > j
    a = beta[:, None] * decay * tl.dot(k, tl.trans(k), input_precision=PREC)  # A, strictly lower triangular
    a00, _, _, _, a10, a11, _, _, a20, a21, a22, _, a30, a31, a32, a33 = _blocks(a)
    # T = (I + A)^-1, block lower triangular: the diagonal blocks by substitution (independent of each other), the
    # others by block substitution T_ij = -T_ii sum_{l=j}^{i-1} A_il T_lj, all in exact fp32 ("ieee")
    T00, T11, T22, T33 = _inv_unit_lower4(a00, a11, a22, a33)
    T10 = -tl.dot(T11, tl.dot(a10, T00, input_precision="ieee"), input_precision="ieee")
    T21 = -tl.dot(T22, tl.dot(a21, T11, input_precision="ieee"), input_precision="ieee")
    T32 = -tl.dot(T33, tl.dot(a32, T22, input_precision="ieee"), input_precision="ieee")
    T20 = tl.dot(a20, T00, input_precision="ieee")
    T20 = -tl.dot(T22, tl.dot(a21, T10, T20, input_precision="ieee"), input_precision="ieee")
    T31 = tl.dot(a31, T11, input_precision="ieee")
    T31 = -tl.dot(T33, tl.dot(a32, T21, T31, input_precision="ieee"), input_precision="ieee")
    T30 = tl.dot(a31, T10, tl.dot(a30, T00, input_precision="ieee"), input_precision="ieee")
    T30 = -tl.dot(T33, tl.dot(a32, T20, T30, input_precision="ieee"), input_precision="ieee")
    zero = tl.zeros((SUB, SUB), dtype=tl.float32)
    t_inv = _unblocks(T00, zero, zero, zero, T10, T11, zero, zero, T20, T21, T22, zero, T30, T31, T32, T33)
    row_off = t[:, None].to(tl.int64) * HV + j
    ws = w_ptr.dtype.element_ty
    kd = k * tl.where(tm, tl.exp(g_last - G), 0.0)[:, None]  # (BT, BK) k exp(G_last - G)
    tl.store(kd_ptr + row_off * DK + rk[None, :], kd.to(ws), mask=tm[:, None] & (rk[None, :] < DK))
    w = tl.dot(t_inv, k * (beta * tl.exp(G))[:, None], input_precision=PREC)  # (BT, BK)
    tl.store(w_ptr + row_off * DK + rk[None, :], w.to(ws), mask=tm[:, None] & (rk[None, :] < DK))
    v = _load_rows(v_ptr + j * sv_h, t, tm, sv_t, 0, rv, DV)  # (BT, BV)
    u = tl.dot(t_inv, v * beta[:, None], input_precision=PREC)  # (BT, BV)
    tl.store(u_ptr + row_off * DV + rv[None, :], u.to(ws), mask=tm[:, None] & (rv[None, :] < DV))
    tl.store(gcum_ptr + t * HV + j, G, mask=tm)


@triton.jit
def _chunk_state_kernel(w_ptr, u_ptr, kd_ptr, gcum_ptr, cu_ptr, first_chunk_ptr, slots_ptr, state_ptr, h_ptr,
                        vnew_ptr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    # grid (N, Hv, cdiv(DV, BV)): sequence i, value head j, state columns [vb * BV, vb * BV + BV). The chain:
    # h[c] = S; v_new = u - w S; S = exp(G_last) S + kd^T v_new; two products a chunk, in the workspace dtype.
    i = tl.program_id(0)
    j = tl.program_id(1)
    vb = tl.program_id(2)
    bos = tl.load(cu_ptr + i)
    eos = tl.load(cu_ptr + i + 1)
    c = tl.load(first_chunk_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    r, rk, rv = tl.arange(0, BT), tl.arange(0, BK), tl.arange(0, BV)
    cols = vb * BV + rv
    kmask, vmask = rk < DK, cols < DV
    s_off = rk[:, None] * DV + cols[None, :]
    s_mask = kmask[:, None] & vmask[None, :]
    s_ptrs = state_ptr + (slot * HV + j) * (DK * DV) + s_off
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)  # (BK, BV) fp32
    ws = h_ptr.dtype.element_ty
    for start in range(bos, eos, BT):
        t = start + r
        tm = t < eos
        row_off = t.to(tl.int64)[:, None] * HV + j
        tl.store(h_ptr + (c * HV + j) * (DK * DV) + s_off, s.to(ws), mask=s_mask)
        w = tl.load(w_ptr + row_off * DK + rk[None, :], mask=tm[:, None] & kmask[None, :], other=0.0)  # (BT, BK)
        u = tl.load(u_ptr + row_off * DV + cols[None, :], mask=tm[:, None] & vmask[None, :], other=0.0)
        kd = tl.load(kd_ptr + row_off * DK + rk[None, :], mask=tm[:, None] & kmask[None, :], other=0.0)
        g_last = tl.load(gcum_ptr + (tl.minimum(start + BT, eos) - 1).to(tl.int64) * HV + j)
        v_new = u.to(tl.float32) - tl.dot(w, s.to(ws), input_precision=PREC)  # (BT, BV)
        v_new = v_new.to(ws)
        tl.store(vnew_ptr + row_off * DV + cols[None, :], v_new, mask=tm[:, None] & vmask[None, :])
        s = tl.exp(g_last) * s + tl.dot(tl.trans(kd), v_new, input_precision=PREC)
        c += 1
    tl.store(s_ptrs, s, mask=s_mask)


@triton.jit
def _chunk_output_kernel(q_ptr, k_ptr, vnew_ptr, h_ptr, gcum_ptr, chunk_ptr, o_ptr, sq_t, sq_h, sk_t, sk_h, so_t,
                         so_h, scale, HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                         PREC: tl.constexpr):
    # grid (chunks, Hv, cdiv(DV, BV)): o = exp(G) q h[c] + mask_{i>=j}(exp(G_i - G_j) q_i.k_j) v_new
    c = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    vb = tl.program_id(2)
    start = tl.load(chunk_ptr + 2 * c)
    end = tl.load(chunk_ptr + 2 * c + 1)
    r, rk, rv = tl.arange(0, BT), tl.arange(0, BK), tl.arange(0, BV)
    cols = vb * BV + rv
    t = start + r
    tm = t < end
    h = j // GROUP
    ws = h_ptr.dtype.element_ty
    q, k = _load_qk(q_ptr, k_ptr, t, tm, sq_t, sk_t, h * sq_h, h * sk_h, rk, scale, DK, L2NORM)  # (BT, BK)
    q = q.to(ws)
    G = tl.load(gcum_ptr + t * HV + j, mask=tm, other=0.0)  # (BT,)
    decay = tl.exp(tl.where((r[:, None] >= r[None, :]) & tm[:, None], G[:, None] - G[None, :], float("-inf")))
    p = decay * tl.dot(q, tl.trans(k.to(ws)), input_precision=PREC)  # (BT, BT)
    vmask = tm[:, None] & (cols[None, :] < DV)
    v_new = tl.load(vnew_ptr + (t.to(tl.int64)[:, None] * HV + j) * DV + cols[None, :], mask=vmask, other=0.0)
    s = tl.load(h_ptr + (c * HV + j) * (DK * DV) + rk[:, None] * DV + cols[None, :],
                mask=(rk[:, None] < DK) & (cols[None, :] < DV), other=0.0)  # (BK, BV) the chunk's start state
    o = tl.exp(G)[:, None] * tl.dot(q, s, input_precision=PREC) + tl.dot(p.to(ws), v_new, input_precision=PREC)
    tl.store(o_ptr + t[:, None].to(tl.int64) * so_t + j * so_h + cols[None, :], o.to(o_ptr.dtype.element_ty),
             mask=vmask)


def _check_args(q, k, v, g, beta, recurrent_states, state_slots, cu_seqlens, out):
    """Raise ValueError naming the first bad argument; returns cu_seqlens' values (read once, on the host)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=3, dtype=IO_DTYPES)
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    check_tensor("g", g, ndim=2, dtype=torch.float32)
    check_tensor("beta", beta, ndim=2, dtype=torch.float32)
    check_tensor("recurrent_states", recurrent_states, ndim=4, dtype=torch.float32)
    check_tensor("state_slots", state_slots, ndim=1, dtype=(torch.int32, torch.int64))
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtype=(torch.int32, torch.int64))
    total, hk, dk = q.shape
    _, hv, dv = v.shape
    if k.shape != q.shape or k.dtype != q.dtype:
        raise ValueError(f"k must match q {tuple(q.shape)} {q.dtype}, got {tuple(k.shape)} {k.dtype}")
    if v.shape[0] != total or hv % hk or v.dtype != q.dtype:
        raise ValueError(f"v must be a ({total}, Hv, dv) tensor of {q.dtype} with Hv a multiple of Hk={hk}, "
                         f"got {tuple(v.shape)} {v.dtype}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (total, hv):
            raise ValueError(f"{name} must be {(total, hv)}, got {tuple(t.shape)}")
    if not recurrent_states.is_contiguous() or recurrent_states.shape[1:] != (hv, dk, dv):
        raise ValueError(f"recurrent_states must be a contiguous (slots, {hv}, {dk}, {dv}) tensor, "
                         f"got {tuple(recurrent_states.shape)}")
    cu = check_cu_seqlens("cu_seqlens", cu_seqlens, total)
    n = len(cu) - 1
    if state_slots.numel() != n:
        raise ValueError(f"state_slots must have one slot per sequence ({n}), got {state_slots.numel()}")
    if min(dk, dv) < 16:
        raise ValueError(f"dk and dv must be at least 16 (tl.dot tiles), got {dk} and {dv}")
    if out is not None and (out.shape != v.shape or out.dtype != v.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be a {tuple(v.shape)} {v.dtype} tensor with a contiguous last dim, "
                         f"got {tuple(out.shape)} {out.dtype}")
    dev = q.device
    tensors = dict(k=k, v=v, g=g, beta=beta, recurrent_states=recurrent_states, state_slots=state_slots,
                   cu_seqlens=cu_seqlens, out=out)
    if any(t is not None and t.device != dev for t in tensors.values()):
        raise ValueError(f"tensors must share one device, got q on {dev} and "
                         f"{ {n: str(t.device) for n, t in tensors.items() if t is not None} }")
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"q must be on a CUDA device (or run with TRITON_INTERPRET=1), got {dev}")
    return cu


def _chunk_table(cu: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunks, 2) int32 [start, end) token ranges, every sequence cut into CHUNK-token pieces, and (N,) int32 the
    index of each sequence's first chunk."""
    spans, first = [], []
    for b, e in zip(cu[:-1], cu[1:]):
        first.append(len(spans))
        spans += [(s, min(s + CHUNK, e)) for s in range(b, e, CHUNK)]
    as_int = lambda x: torch.tensor(x, dtype=torch.int32).to(device)
    return as_int(spans).reshape(-1, 2), as_int(first)


def chunk_gated_delta_rule(q, k, v, g, beta, *, recurrent_states, state_slots, cu_seqlens, scale=None,
                           use_qk_l2norm=True, out=None):
    """The gated delta rule over N sequences packed by cu_seqlens (N+1,). q, k: (total, Hk, dk); v: (total, Hv, dv),
    all of one io dtype; g (log-decay), beta: (total, Hv) fp32. Sequence i starts from the fp32 state
    recurrent_states[state_slots[i]] (slots, Hv, dk, dv) and its final state is written back there in place.
    Returns o (total, Hv, dv) in v's dtype (into `out` when given)."""
    cu = _check_args(q, k, v, g, beta, recurrent_states, state_slots, cu_seqlens, out)
    if out is None:
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    chunks, first_chunk = _chunk_table(cu, q.device)
    common = _constexprs(q, v, k.shape[1], use_qk_l2norm)
    ws = wy_pass(k, v, g.contiguous(), beta.contiguous(), chunks, common)
    h, v_new = state_pass(ws, cu_seqlens, first_chunk, state_slots, recurrent_states, chunks.shape[0], common)
    output_pass(q, k, v_new, h, ws[3], chunks, out, scale, common)
    return out


def _constexprs(q, v, hk, use_qk_l2norm) -> dict:
    """The meta-parameters the kernels share (and num_warps): head counts, dims, tiles, l2norm, the products'
    precision (fp32 io: exact "ieee"; 16-bit io: tf32 in the WY pass, the workspace's 16-bit type after it)."""
    hv, dk, dv = v.shape[1], q.shape[2], v.shape[2]
    bk, bv = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    exact = q.dtype == torch.float32 or q.device.type != "cuda"
    return dict(HV=hv, GROUP=hv // hk, DK=dk, DV=dv, BT=CHUNK, BK=bk, L2NORM=bool(use_qk_l2norm),
                PREC="ieee" if exact else "tf32", num_warps=8 if max(bk, bv) >= 128 else 4)  # (64, 128) fp32 tiles


def wy_pass(k, v, g, beta, chunks, common):
    """Kernel 1 over every (chunk, value head): the workspaces w, u, kd (in the io dtype) and G (fp32)."""
    total, hv, dk, dv, dev = k.shape[0], v.shape[1], k.shape[2], v.shape[2], k.device
    ws = tuple(torch.empty(total, hv, *d, dtype=dt, device=dev)
               for d, dt in (((dk,), v.dtype), ((dv,), v.dtype), ((dk,), v.dtype), ((), torch.float32)))
    if chunks.shape[0]:
        _chunk_wy_kernel[(chunks.shape[0], hv)](
            k, v, g, beta, chunks, *ws, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            BV=max(16, triton.next_power_of_2(dv)), **common, num_stages=1)
    return ws


def state_pass(ws, cu_seqlens, first_chunk, state_slots, recurrent_states, n_chunks, common):
    """Kernel 2 over every (sequence, value head, dv block): each chunk's start state h (chunks, Hv, dk, dv) and
    v_new (total, Hv, dv), both in the io dtype; the final states into their slots."""
    w, u, kd, gcum = ws
    n, hv, dk, dv = cu_seqlens.numel() - 1, u.shape[1], w.shape[2], u.shape[2]
    h = torch.empty(n_chunks, hv, dk, dv, dtype=u.dtype, device=u.device)
    v_new = torch.empty_like(u)
    bv = min(STATE_BV, max(16, triton.next_power_of_2(dv)))
    while bv > 16 and n * hv * triton.cdiv(dv, bv) < FEW_PROGRAMS:
        bv //= 2
    _chunk_state_kernel[(n, hv, triton.cdiv(dv, bv))](
        w, u, kd, gcum, cu_seqlens.to(torch.int32), first_chunk, state_slots.to(torch.int64), recurrent_states, h,
        v_new, **{k: common[k] for k in ("HV", "DK", "DV", "BT", "BK", "PREC", "num_warps")}, BV=bv,
        num_stages=STATE_STAGES)
    return h, v_new


def output_pass(q, k, v_new, h, gcum, chunks, out, scale, common):
    """Kernel 3 over every (chunk, value head, dv block): o into out."""
    dv = out.shape[2]
    bv = min(OUTPUT_BV, max(16, triton.next_power_of_2(dv)))
    if chunks.shape[0]:
        _chunk_output_kernel[(chunks.shape[0], out.shape[1], triton.cdiv(dv, bv))](
            q, k, v_new, h, gcum, chunks, out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0),
            out.stride(1), scale, **common, BV=bv, num_stages=1)


def gated_deltanet_prefill_op(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, step,
                              num_k_heads, eps):
    """model.ops.gated_deltanet with the delta rule on this kernel: the reference conv (conv_states updated at
    step.state_slots) and gates, chunk_gated_delta_rule (recurrent_states updated in place), the reference gated
    norm. qkv: (N, C); z: (N, Hv, dv); b, a: (N, Hv). Returns (N, Hv, dv) in qkv's dtype."""
    slots = step.state_slots
    n, hv, dv = z.shape
    dk = (qkv.shape[1] - hv * dv) // (2 * num_k_heads)
    mixed, conv_final = R.causal_conv1d(qkv, conv_w, initial_state=conv_states[slots], cu_seqlens=step.cu_seqlens,
                                        activation="silu")
    conv_states[slots] = conv_final.to(conv_states.dtype)
    q, k, v = mixed.split([num_k_heads * dk, num_k_heads * dk, hv * dv], dim=-1)
    g, beta = R.gdn_gates(a, b, A_log, dt_bias)
    o = chunk_gated_delta_rule(q.view(n, num_k_heads, dk), k.view(n, num_k_heads, dk), v.view(n, hv, dv), g, beta,
                               recurrent_states=recurrent_states, state_slots=slots, cu_seqlens=step.cu_seqlens)
    return R.gated_rms_norm(o, z, norm_w, eps)


def gated_deltanet_op(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, step,
                      num_k_heads, eps):
    """model.ops.gated_deltanet: the decode kernel when every sequence has one new token, else the prefill path."""
    op = gdn_decode.gated_deltanet_op if step.max_seqlen_q == 1 else gated_deltanet_prefill_op
    return op(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, step, num_k_heads, eps)


OPS = {"gated_deltanet": gated_deltanet_op}
