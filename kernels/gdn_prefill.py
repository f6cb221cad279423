"""Gated DeltaNet prefill in Triton: the chunked (WY) gated delta rule over a varlen batch, chunk BT = 64.

Per value head j (key head h = j // (Hv / Hk)), with q, k l2-normalised (fused) and q scaled, the recurrence
    S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t          S: (dk, dv) fp32
is evaluated a chunk of BT tokens at a time (reference/gated_delta.py's `_chunked_one` derives it). In a chunk
with cumulative log-decay G = cumsum(g) and the strictly lower triangular A_ij = beta_i exp(G_i - G_j) (k_i.k_j):
    T     = (I + A)^-1                   unit lower triangular, by 16 x 16 blocks (kernel 1, below)
    w     = T (beta exp(G) k)            (BT, dk)    kernel 1, all chunks and heads in parallel
    u     = T (beta v)                   (BT, dv)
    P     = mask_{i>=j}(exp(G_i - G_j) q_i.k_j)  (BT, BT)
    v_new = u - w S                      = U of (I + A) U = beta (V - exp(G) K S), with S the chunk's start state
    o     = exp(G) q S + P v_new                                                    kernel 2, chunks in order
    S     = exp(G_last) S + (k exp(G_last - G))^T v_new
No exp(-G) is ever formed, so long chunks of strong decay cannot overflow.

Kernel 1 `_chunk_wy_kernel`, grid (chunks, Hv): one program per (sequence chunk, value head) writes w, u, P and G to
fp32 workspaces (total, Hv, dk | dv | BT | 1). Kernel 2 `_chunk_state_kernel`, grid (N, Hv, dv / BV): one program
per (sequence, value head, dv block) reads its state from recurrent_states[state_slots[i]], carries S (dk, BV) in
registers through its chunks, writes o and finally S back in place, i.e. straight into the decode step's
(kernels/gdn_decode.py) slot layout. Every product is a tl.dot; fp32 operands with tf32 tensor cores on the GPU
("ieee" under the interpreter, whose tf32 is not emulated).

The solve (kernel 1). T is block lower triangular in 16 x 16 blocks (SUB): the four diagonal blocks
T_ii = (I + A_ii)^-1 by forward substitution, the four held transposed in one (2, 2, 16, 16) tensor so that each of
the 15 steps is two reductions along the last axis (within a warp) for all four and one vector transpose (the only
shared-memory round trip of a step); then T_ij = -T_ii sum_{l=j}^{i-1} A_il T_lj, three rounds of 16 x 16 x 16
products. The blocks come out of A (64, 64) and T goes back into one (64, 64) tile by reshape / permute / split /
join (register shuffles through shared memory), so that kk, w, u and P stay single (64 x 64 x d) tensor-core products
and every value but T is bit for bit what the former row-by-row solve (63 steps on the whole (64, 64) tile) gave.
The solve runs in exact fp32: the substitution in fp32 FMAs, the block products as "ieee" dots (64 K FMA a chunk
and head, against 4 M tf32 FLOP of the four big products), so T differs from the former one by fp32 rounding only
(w, u within 1e-7 of it under the interpreter, the tests' error against the recurrence unchanged or lower).

Bound (H200). The work per token and value head is O(dk dv): kernel 2 does three (BT x dk x BV)-sized products a
chunk (w S, q S, k^T v_new) and P v_new, kernel 1 four (BT x BT x d) products; about 0.2 MFLOP a token and head,
6 MFLOP a token at Hv 32, i.e. about 70 Mtok/s at the dense tf32 rate (~400 TFLOP/s). The fp32 workspace,
4 (dk + dv + BT + 1) bytes a token and head (40 KiB a token at Hv 32), is written once; w and P are read by each
of a head's dv / BV programs (4 at B1), which walk the chunks in step, so mostly from L2: about 80 Mtok/s at
4 TB/s if read once, 26 Mtok/s if every read came from DRAM. The limit of one long sequence is kernel 2's chain:
N Hv dv / BV programs (B1 Hv 32 dv 128: BV 32, 128 programs, about one per SM) each walk T / 64 chunks through
dependent loads and products; about 2 us a chunk would give 32 Mtok/s. The target: fla's chunked prefill,
14.9 Mtok/s (B1 T16k H32) and 23.9 Mtok/s (B1 T32k H16).
Measured on the H200 (profiles.bench_prefill, tf32 state products, before the stage fix, with the former
row-by-row solve): B1 T16k H32 1.94 Mtok/s against fla's 14.9 in the same run, 0.13x. Likely cause, not profiled:
kernel 1's solve, a latency chain with nothing to hide it: 255 registers a thread at 8 warps, so one CTA per SM and
8192 (chunk, head) programs in 62 waves of 132, each a chain of 63 steps x 8 barrier-separated phases (two
cross-warp reductions of the (64, 64) tile, 16 values a thread, and a layout change) = 504 bar.sync, plus ~20 for
the rest. Expected now (not yet measured; counted in the sm_90a PTX compiled on the CPU, straight-line code, so every
bar.sync runs once): 106 bar.sync a program instead of ~525 (8 x 63 in the loop + 21), of which the substitution
takes 30 (2 x 15, against 504), A's block extraction 32, the block products and T's reassembly ~25, the rest
~19; each moves 4 values a thread instead of 16. The solve's CUDA-core work falls from ~0.5 M to ~0.1 M FMA a
program; the tensor-core work is unchanged (64 wgmma: 4.2 MFLOP a program, ~1.4 us at an SM's share of the tf32 rate).
At ~100-150 cycles a barrier phase: ~40 us -> ~8 us a program, kernel 1 from ~2.5 ms to ~0.5 ms at B1 T16k H32
(8192 programs, 62 waves of 132), i.e. ~5x on kernel 1; where the whole 8.4 ms goes (kernel 2's share) is for the
profile to say. Still one CTA per SM: 255 registers (4 bytes spilled) and 81 KiB of shared memory at 8 warps
(4 warps spill more). The next lever is occupancy, so that two programs per SM hide each other's barriers:
WY_MAXNREG = 128 (spills 844 bytes) to try first, then fewer live (64, 128) fp32 tiles (w and u by dk / dv
halves); then kernel 2's chain of 256 chunks.
Tuning left to the GPU: num_warps (8 at d = 128), num_stages, BV, and the state products' precision (tf32x3 now).

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
FEW_PROGRAMS = 132  # the H200's SM count: with fewer kernel-2 programs than this, dv is split finer
IO_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Software-pipelining stages of the state kernel's chunk loop, by io element size. Its shared memory on sm_90a
# (dk = dv = 128, 8 warps, compiled on the CPU): 16-bit io BV 64 takes 197 KB at 2 stages, 263 KB at 3 (over the
# 227 KB an SM has); fp32 io BV 64 takes 115 KB at 1 stage and 262 KB at 2. The WY kernel has no loads in a loop
# (1 stage: 85 KB with the blocked solve and q loaded last, 99 KB before).
STATE_STAGES = {2: 2, 4: 1}
# A register cap for the WY kernel (None: ptxas's choice, 255 a thread at 8 warps, so one CTA per SM). On sm_90a
# (bf16, 8 warps, compiled on the CPU) 168 spills 356 bytes a thread and 128 spills 844 bytes, where two CTAs of
# 81 KiB of shared memory fit an SM and hide each other's barriers: to be measured (profiles.bench_prefill).
WY_MAXNREG = None
# The state kernel's products run as tf32x3 (about fp32 accuracy): with plain tf32 the state carried across the
# chunks of a 4097-token sequence left the H200 test's 1e-3 tolerance against the fp32 recurrence, while the
# 1000-token varlen case passed. The WY kernel's products stay tf32 (they do not compound across chunks).


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
def _chunk_wy_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, chunk_ptr, w_ptr, u_ptr, p_ptr, gcum_ptr,
                     sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, scale,
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
    h = j // GROUP
    k = _load_rows(k_ptr + h * sk_h, t, tm, sk_t, 0, rk, DK)  # (BT, BK)
    if L2NORM:
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + L2NORM_EPS)[:, None]
    g = tl.load(g_ptr + t * HV + j, mask=tm, other=0.0)  # (BT,)
    beta = tl.load(beta_ptr + t * HV + j, mask=tm, other=0.0)
    G = tl.cumsum(g, 0)
    lower = r[:, None] >= r[None, :]
    decay = tl.exp(tl.where(lower, G[:, None] - G[None, :], float("-inf")))  # (BT, BT) exp(G_i - G_j), i >= j
    kk = tl.dot(k, tl.trans(k), input_precision=PREC)
    a = tl.where(r[:, None] > r[None, :], beta[:, None] * decay * kk, 0.0)  # A, strictly lower triangular
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
    q = _load_rows(q_ptr + h * sq_h, t, tm, sq_t, 0, rk, DK)  # (BT, BK), loaded late: fewer live registers
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=1) + L2NORM_EPS)[:, None]
    p = decay * tl.dot(q * scale, tl.trans(k), input_precision=PREC)  # (BT, BT), zero above the diagonal
    tl.store(p_ptr + row_off * BT + r[None, :], p, mask=tm[:, None] & (r[None, :] < BT))
    w = tl.dot(t_inv, k * (beta * tl.exp(G))[:, None], input_precision=PREC)  # (BT, BK)
    tl.store(w_ptr + row_off * DK + rk[None, :], w, mask=tm[:, None] & (rk[None, :] < DK))
    v = _load_rows(v_ptr + j * sv_h, t, tm, sv_t, 0, rv, DV)  # (BT, BV)
    u = tl.dot(t_inv, v * beta[:, None], input_precision=PREC)  # (BT, BV)
    tl.store(u_ptr + row_off * DV + rv[None, :], u, mask=tm[:, None] & (rv[None, :] < DV))
    tl.store(gcum_ptr + t * HV + j, G, mask=tm)


@triton.jit
def _chunk_state_kernel(q_ptr, k_ptr, w_ptr, u_ptr, p_ptr, gcum_ptr, cu_ptr, slots_ptr, state_ptr, o_ptr,
                        sq_t, sq_h, sk_t, sk_h, so_t, so_h, scale,
                        HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                        PREC: tl.constexpr):
    # grid (N, Hv, cdiv(DV, BV)): sequence i, value head j, state columns [vb * BV, vb * BV + BV)
    i = tl.program_id(0)
    j = tl.program_id(1)
    vb = tl.program_id(2)
    bos = tl.load(cu_ptr + i)
    eos = tl.load(cu_ptr + i + 1)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    r, rk, rv = tl.arange(0, BT), tl.arange(0, BK), tl.arange(0, BV)
    cols = vb * BV + rv
    h = j // GROUP
    s_mask = (rk[:, None] < DK) & (cols[None, :] < DV)
    s_ptrs = state_ptr + (slot * HV + j) * (DK * DV) + rk[:, None] * DV + cols[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)  # (BK, BV) fp32
    for start in range(bos, eos, BT):
        t = start + r
        tm = t < eos
        row_off = t.to(tl.int64) * HV + j
        G = tl.load(gcum_ptr + row_off, mask=tm, other=0.0)  # (BT,)
        g_last = tl.load(gcum_ptr + (tl.minimum(start + BT, eos) - 1).to(tl.int64) * HV + j)
        q, k = _load_qk(q_ptr, k_ptr, t, tm, sq_t, sk_t, h * sq_h, h * sk_h, rk, scale, DK, L2NORM)  # (BT, BK)
        w = tl.load(w_ptr + row_off[:, None] * DK + rk[None, :], mask=tm[:, None] & (rk[None, :] < DK), other=0.0)
        u = tl.load(u_ptr + row_off[:, None] * DV + cols[None, :], mask=tm[:, None] & (cols[None, :] < DV),
                    other=0.0)  # (BT, BV)
        p = tl.load(p_ptr + row_off[:, None] * BT + r[None, :], mask=tm[:, None] & (r[None, :] < BT), other=0.0)
        v_new = u - tl.dot(w, s, input_precision=PREC)  # (BT, BV)
        o = tl.exp(G)[:, None] * tl.dot(q, s, input_precision=PREC) + tl.dot(p, v_new, input_precision=PREC)
        o_ptrs = o_ptr + t[:, None].to(tl.int64) * so_t + j * so_h + cols[None, :]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=tm[:, None] & (cols[None, :] < DV))
        k_end = k * tl.where(tm, tl.exp(g_last - G), 0.0)[:, None]  # (BT, BK) k exp(G_last - G)
        s = tl.exp(g_last) * s + tl.dot(tl.trans(k_end), v_new, input_precision=PREC)
    tl.store(s_ptrs, s, mask=s_mask)


def _check_args(q, k, v, g, beta, recurrent_states, state_slots, cu_seqlens, out):
    """Raise ValueError naming the first bad argument; returns (N, Hk, Hv, dk, dv)."""
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
    check_cu_seqlens("cu_seqlens", cu_seqlens, total)
    n = cu_seqlens.numel() - 1
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
    return n, hk, hv, dk, dv


def _chunk_table(cu: list[int], device) -> torch.Tensor:
    """(chunks, 2) int32 [start, end) token ranges: every sequence cut into CHUNK-token pieces."""
    spans = [(s, min(s + CHUNK, e)) for b, e in zip(cu[:-1], cu[1:]) for s in range(b, e, CHUNK)]
    return torch.tensor(spans, dtype=torch.int32).reshape(-1, 2).to(device)


def chunk_gated_delta_rule(q, k, v, g, beta, *, recurrent_states, state_slots, cu_seqlens, scale=None,
                           use_qk_l2norm=True, out=None):
    """The gated delta rule over N sequences packed by cu_seqlens (N+1,). q, k: (total, Hk, dk); v: (total, Hv, dv),
    all of one io dtype; g (log-decay), beta: (total, Hv) fp32. Sequence i starts from the fp32 state
    recurrent_states[state_slots[i]] (slots, Hv, dk, dv) and its final state is written back there in place.
    Returns o (total, Hv, dv) in v's dtype (into `out` when given)."""
    n, hk, hv, dk, dv = _check_args(q, k, v, g, beta, recurrent_states, state_slots, cu_seqlens, out)
    if out is None:
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    total, dev = q.shape[0], q.device
    scale = dk ** -0.5 if scale is None else float(scale)
    g, beta = g.contiguous(), beta.contiguous()
    cu = cu_seqlens.tolist()
    chunks = _chunk_table(cu, dev)
    bk, bv_full = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    prec = "tf32" if dev.type == "cuda" else "ieee"
    state_prec = "tf32x3" if dev.type == "cuda" else "ieee"  # the carried state's error would grow chunk by chunk
    warps = 8 if max(bk, bv_full) >= 128 else 4  # (64, 128) fp32 tiles: 64 values a thread each at 8 warps
    common = dict(HV=hv, GROUP=hv // hk, DK=dk, DV=dv, BT=CHUNK, BK=bk, L2NORM=bool(use_qk_l2norm), PREC=prec)
    w = torch.empty(total, hv, dk, dtype=torch.float32, device=dev)
    u = torch.empty(total, hv, dv, dtype=torch.float32, device=dev)
    p = torch.empty(total, hv, CHUNK, dtype=torch.float32, device=dev)
    gcum = torch.empty(total, hv, dtype=torch.float32, device=dev)
    if chunks.shape[0]:
        _chunk_wy_kernel[(chunks.shape[0], hv)](
            q, k, v, g, beta, chunks, w, u, p, gcum, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), scale, BV=bv_full, **common, num_warps=warps, num_stages=1,
            **({"maxnreg": WY_MAXNREG} if WY_MAXNREG else {}))
    bv = min(64, bv_full)
    while bv > 16 and n * hv * triton.cdiv(dv, bv) < FEW_PROGRAMS:
        bv //= 2
    slots = state_slots.to(torch.int64)
    cu_dev = cu_seqlens.to(torch.int32)
    _chunk_state_kernel[(n, hv, triton.cdiv(dv, bv))](
        q, k, w, u, p, gcum, cu_dev, slots, recurrent_states, out, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), out.stride(0), out.stride(1), scale, BV=bv, **{**common, "PREC": state_prec}, num_warps=warps,
        num_stages=STATE_STAGES[q.element_size()])
    return out


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
