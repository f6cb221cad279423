"""Gated DeltaNet prefill in Triton: the chunked (WY) gated delta rule over a varlen batch, chunk BT = 64.

Per value head j (key head h = j // (Hv / Hk)), with q, k l2-normalised (fused) and q scaled, the recurrence
    S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t          S: (dk, dv) fp32
is evaluated a chunk of BT tokens at a time (reference/gated_delta.py's `_chunked_one` derives it). In a chunk
with cumulative log-decay G = cumsum(g) and the strictly lower triangular A_ij = beta_i exp(G_i - G_j) (k_i.k_j):
    T     = (I + A)^-1                     unit lower triangular, by 16 x 16 blocks and block doubling
    w     = T (beta exp(G) k),  u = T (beta v),  kd = k exp(G_last - G)                 kernel 1, chunks in parallel
    h     = S;  v_new = u - w S;  S = exp(G_last) S + kd^T v_new                        kernel 2, chunks in order
    o     = exp(G) q h + mask_{i>=j}(exp(G_i - G_j) q_i.k_j) v_new                      kernel 3, chunks in parallel
No exp(-G) is ever formed, so long chunks of strong decay cannot overflow.

Kernel 1 `_chunk_wy_kernel`, grid (chunks, Hv), writes w, u, kd (total, Hv, d) in the io dtype and G (total, Hv)
fp32. Kernel 2 `_chunk_state_kernel`, grid (N, Hv, dv / BV), is the only sequential part: a program carries its
(dk, BV) slice of S in fp32 registers through its sequence's chunks, two products a chunk, storing each chunk's
start state h (chunks, Hv, dk, dv) and v_new (total, Hv, dv) in the io dtype, and finally S in place into
recurrent_states[state_slots[i]], i.e. straight into the decode step's (kernels/gdn_decode.py) slot layout.
A snapshot inside a sequence (the prefix cache's, at snapshot_offsets[i]) restarts the chunks there
(kernels.varlen.token_chunks with cuts), and kernel 2 also stores S as it reaches that token into
recurrent_states[snapshot_slots[i]]: no second pass.
Kernel 3 `_chunk_output_kernel`, grid (chunks, Hv, dv / BV), forms o from h, v_new and the chunk's q, k.
Precision: fp32 io runs every product in exact fp32 ("ieee"; the interpreter always does). 16-bit io runs kernel 1's
products in tf32 and its solve in exact fp32, and the products after it on 16-bit operands (w, kd, v_new, h and
S rounded to the io dtype, fp32 accumulation), as fla's chunked kernels do; S itself stays fp32.

The solve (kernel 1), through a per-program (64, 64) fp32 scratch in global memory (16 KiB; 128 MiB at B1 T16k
Hv 32): A^T goes into its strict upper triangle, then a barrier; the four 16 x 16 diagonal blocks T_ii by forward
substitution, reading A's rows back with plain loads in a (4, 16, 16) layout whose reduction axis stays inside a
warp (15 steps, no barrier); then the off-diagonal blocks by two levels of block doubling,
T = [[T_lo, 0], [-T_hi A_21 T_lo, T_hi]] (the two 32 x 32 diagonal blocks at once by batched 16 x 16 products, then
the 32 x 32 lower-left block), in exact fp32; T fills the lower triangle and is read back as one (64, 64) tile, so
w and u stay single (64 x 64 x d) tensor-core products. A block's own global writes are visible to it after
bar.sync (plain ld.global, not the read-only path). Max |dT| / max |T| against float64: 7.9e-7 on correlated keys.

Bound (H200, B1 T16k Hv 32, dk = dv = 128; fla's chunked prefill: 14.9 Mtok/s, 1.1 ms). Traffic: kernel 1 writes w,
u, kd (768 B a token and head in bf16), kernel 2 reads them and writes h (32 KiB a chunk and head, 512 B a token and
head) and v_new (256 B), kernel 3 reads h, v_new, q, k: about 2.6 KB a token and head, 1.4 GB at T16k H32, 0.33 ms
at 4.2 TB/s. Tensor work: about 0.2 MFLOP a token and head, 6 MFLOP a token at Hv 32, 0.1 TFLOP at T16k: 0.2 ms at
~500 TFLOP/s. The chain: kernel 2 runs N Hv dv / BV programs (B1 Hv 32: BV 16, 256 programs: the launcher halves BV
while fewer than 132) through T / 64 dependent chunks (256 at T16k) of two small products and a 16 KiB store each;
at ~1 us a chunk, 0.26 ms. Predicted before measuring: about 0.6-0.8 ms, 20-27 Mtok/s, if the kernels each ran near
their bound.
Where it stands (H200, B1 T16k H32): about 0.6x fla's chunked prefill with the WY pass capped at 128 registers,
the call the sum of its passes when cu_seqlens_host is given. The WY pass is the limit; ncu puts its time in
shared-memory traffic and the scratch round trips, not math (the history of the solve: FINDINGS). Next: a kkt
kernel, a register-resident 16 x 16 block solve, and a plain w/u product kernel. A Neumann / doubling product on the
diagonal blocks was rejected: 3.1e-4 on correlated keys (N^8 reaches 1.6e3 and cancels).

Not CUDA-graph capturable: the chunk table is built on the host from cu_seqlens (prefill only). state_slots must be
distinct and in range (not checked: that would read them on the host).
"""

import torch
import triton
import triton.language as tl

from kernels import registry
from kernels.causal_conv1d import causal_conv1d_varlen
from kernels.gdn_decode import GdnKey, decode_key, writes_no_positions
from kernels.gdn_pointwise import L2NORM_EPS, gate_values, gated_norm, gated_rms_norm
from kernels.host_math import cdiv, next_power_of_2
from kernels.norms import triton_runs_on
from kernels.registry import Impl, all_of, device_info, triton_unsupported
from kernels.row_buckets import empty_rows
from kernels.varlen import CHUNK, VarlenPlan, chunk_span, host_ints, plan_for, plan_varlen
from reference.checks import check_real, check_tensor

SUB = tl.constexpr(16)  # the WY kernel's sub-block: the chunk's T = (I + A)^-1 by 16 x 16 blocks
IO_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FEW_PROGRAMS = 132  # the H200's SM count: with fewer kernel-2 programs than this, dv is split finer
STATE_BV, OUTPUT_BV = 64, 128  # dv columns a program of kernel 2 (at most) and of kernel 3
STATE_STAGES = 2  # software-pipelining stages of kernel 2's chunk loop (its loads do not depend on S)
# Next to measure (sm_90a compile counts only): at 2 stages the next chunk's loads are waited on at the top of the
# following iteration, so their latency stays on the chain; 3 stages at BV 32 and 4 warps (148 registers) overlap a
# whole iteration. Kernel 3 at 4 warps and BV 128 (240 registers, no spills) fits two CTAs an SM.
# Kernel 1's register cap by io dtype (sm_90a, 8 warps). fp32 io: without a cap ptxas picks 32 registers and spills
# 22 KB a thread; at 255 it spills 3 KB. 16-bit io: 166 registers uncapped (one CTA an SM); capped at 128 (two CTAs
# an SM, 76 bytes spilled) the pass runs faster (FINDINGS; profiles.bench_prefill times the uncapped pass beside it
# as wy_maxnreg255_us).
WY_MAXNREG = {torch.float32: 255, torch.bfloat16: 128, torch.float16: 128}
# Fixed configs for kernels 2 and 3: autotuning them over (BV, warps, stages) was faster but hit an illegal memory
# access on the H200 (varlen GPU tests, ncu) that no single config reproduces under the interpreter (FINDINGS).


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
def _invert_diagonal_blocks(sp):
    """The four diagonal (SUB, SUB) blocks of T = (I + A)^-1 by forward substitution, written into the lower triangle
    (with the diagonal) of the program's (BT, BT) fp32 scratch sp, whose strict upper triangle holds A^T
    (sp[p, q] = A[q, p], written and barriered by the caller). u[b, c, l] = T[16 b + l, 16 b + c] (each block's T^T)
    is loaded contiguous along l, so each step's reduction over l stays inside a warp and its result is column l = i
    of u: no transposes, no barriers. Step i's row x_l = -A[16 b + i, 16 b + l] (l < i) is a load off the chain."""
    b3 = tl.arange(0, 4)[:, None, None]
    c3 = tl.arange(0, SUB)[None, :, None]
    l3 = tl.arange(0, SUB)[None, None, :]
    u = -tl.load(sp + (SUB * b3 + c3) * (4 * SUB) + SUB * b3 + l3)  # u[b, c, l] = -A[16 b + l, 16 b + c]
    for i in tl.static_range(1, SUB):
        x = -tl.load(sp + (SUB * b3 + l3) * (4 * SUB) + SUB * b3 + i, mask=l3 < i, other=0.0)  # (4, 1, SUB)
        x = tl.where(l3 == i, 1.0, x)  # + e_i picks column i of u (-A's row i, not yet overwritten)
        col = tl.sum(x * u, axis=2)  # (4, SUB): row i of T, strictly below the diagonal
        u = tl.where(l3 == i, col[:, :, None], u)
    u += tl.where(c3 == l3, 1.0, 0.0)
    tl.store(sp + (SUB * b3 + l3) * (4 * SUB) + SUB * b3 + c3, u, mask=l3 >= c3)


@triton.jit
def _invert_unit_lower(a, sp):
    """T = (I + a)^-1 of a strictly lower triangular (4 SUB, 4 SUB) fp32 tile, in exact fp32, through the program's
    (4 SUB)^2 fp32 scratch sp: a^T goes into its strict upper triangle, T fills its lower one. The diagonal blocks by
    substitution (_invert_diagonal_blocks), then the rest by two levels of block doubling,
    T = [[T_lo, 0], [-T_hi a_21 T_lo, T_hi]]: the two 32 x 32 diagonal blocks at once (batched 16 x 16 products),
    then the 32 x 32 lower-left block. Four barriers in all."""
    BT: tl.constexpr = 4 * SUB
    H: tl.constexpr = 2 * SUB
    r = tl.arange(0, BT)
    tl.store(sp + r[None, :] * BT + r[:, None], a)  # sp[p, q] = a[q, p]
    tl.debug_barrier()
    _invert_diagonal_blocks(sp)
    tl.debug_barrier()
    p3 = tl.arange(0, 2)[:, None, None]  # level 1: diagonal 32 x 32 block p, its 16 x 16 blocks
    i3 = tl.arange(0, SUB)[None, :, None]
    j3 = tl.arange(0, SUB)[None, None, :]
    t_lo = tl.load(sp + (H * p3 + i3) * BT + H * p3 + j3, mask=i3 >= j3, other=0.0)
    t_hi = tl.load(sp + (H * p3 + SUB + i3) * BT + H * p3 + SUB + j3, mask=i3 >= j3, other=0.0)
    a_21 = tl.load(sp + (H * p3 + j3) * BT + H * p3 + SUB + i3)  # from a^T
    t_21 = -tl.dot(t_hi, tl.dot(a_21, t_lo, input_precision="ieee"), input_precision="ieee")
    tl.store(sp + (H * p3 + SUB + i3) * BT + H * p3 + j3, t_21)
    tl.debug_barrier()
    h = tl.arange(0, H)  # level 2: the 32 x 32 lower-left block
    tri = h[:, None] >= h[None, :]
    t_lo = tl.load(sp + h[:, None] * BT + h[None, :], mask=tri, other=0.0)
    t_hi = tl.load(sp + (H + h[:, None]) * BT + H + h[None, :], mask=tri, other=0.0)
    a_21 = tl.load(sp + h[None, :] * BT + H + h[:, None])  # a[32 + i, j] from a^T
    t_21 = -tl.dot(t_hi, tl.dot(a_21, t_lo, input_precision="ieee"), input_precision="ieee")
    tl.store(sp + (H + h[:, None]) * BT + h[None, :], t_21)
    tl.debug_barrier()
    lower = ((r // SUB)[:, None] >= (r // SUB)[None, :]) & (r[:, None] >= r[None, :])
    return tl.load(sp + r[:, None] * BT + r[None, :], mask=lower, other=0.0)


@triton.jit
def _chunk_wy_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, chunk_ptr, w_ptr, u_ptr, kd_ptr, gcum_ptr,
                     scratch_ptr, sk_t, sk_h, sv_t, sv_h, sg_t, sb_t,
                     HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
                     RAW_GATES: tl.constexpr):
    # grid (chunks, Hv): tokens [start, end) of one sequence (end - start <= BT), value head j; scratch: (BT, BT) fp32
    # a program, for the solve. g, beta: rows t at g_ptr + t * sg_t, beta_ptr + t * sb_t; RAW_GATES: they are the
    # in-projection's a and b, and g, beta = gate_values(a, b, A_log[j], dt_bias[j]).
    tl.static_assert(BT == 4 * SUB)
    c = tl.program_id(0)
    j = tl.program_id(1)
    start, end, _ = chunk_span(chunk_ptr, c)  # an empty piece of a device plan's table: every row masked off
    r, rk, rv = tl.arange(0, BT), tl.arange(0, BK), tl.arange(0, BV)
    t = start + r
    tm = t < end
    k = _load_rows(k_ptr + (j // GROUP) * sk_h, t, tm, sk_t, 0, rk, DK)  # (BT, BK)
    if L2NORM:
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + L2NORM_EPS)[:, None]
    g = tl.load(g_ptr + t * sg_t + j, mask=tm, other=0.0)  # (BT,)
    beta = tl.load(beta_ptr + t * sb_t + j, mask=tm, other=0.0)
    if RAW_GATES:
        g, beta = gate_values(g, beta, tl.load(a_log_ptr + j), tl.load(dt_bias_ptr + j))
        g, beta = tl.where(tm, g, 0.0), tl.where(tm, beta, 0.0)
    G = tl.cumsum(g, 0)
    g_last = tl.sum(tl.where(r == end - start - 1, G, 0.0))
    decay = tl.exp(tl.where(r[:, None] > r[None, :], G[:, None] - G[None, :], float("-inf")))  # exp(G_i - G_j), i > j
    a = beta[:, None] * decay * tl.dot(k, tl.trans(k), input_precision=PREC)  # A, strictly lower triangular
    t_inv = _invert_unit_lower(a, scratch_ptr + (c * HV + j).to(tl.int64) * (BT * BT))  # T = (I + A)^-1
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
def _state_chain(s, lo, hi, c, j, w_ptr, u_ptr, kd_ptr, gcum_ptr, h_ptr, vnew_ptr, r, rk, cols, kmask, vmask, s_off,
                 s_mask, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
    """The chain over tokens [lo, hi) in BT-token pieces, c the first piece's index: h[c] = S; v_new = u - w S;
    S = exp(G_last) S + kd^T v_new (two products a piece, in the workspace dtype). Returns (S, next piece)."""
    ws = h_ptr.dtype.element_ty
    for start in range(lo, hi, BT):
        t = start + r
        tm = t < hi
        row_off = t.to(tl.int64)[:, None] * HV + j
        tl.store(h_ptr + (c * HV + j) * (DK * DV) + s_off, s.to(ws), mask=s_mask)
        w = tl.load(w_ptr + row_off * DK + rk[None, :], mask=tm[:, None] & kmask[None, :], other=0.0)  # (BT, BK)
        u = tl.load(u_ptr + row_off * DV + cols[None, :], mask=tm[:, None] & vmask[None, :], other=0.0)
        kd = tl.load(kd_ptr + row_off * DK + rk[None, :], mask=tm[:, None] & kmask[None, :], other=0.0)
        g_last = tl.load(gcum_ptr + (tl.minimum(start + BT, hi) - 1).to(tl.int64) * HV + j)
        v_new = u.to(tl.float32) - tl.dot(w, s.to(ws), input_precision=PREC)  # (BT, BV)
        v_new = v_new.to(ws)
        tl.store(vnew_ptr + row_off * DV + cols[None, :], v_new, mask=tm[:, None] & vmask[None, :])
        s = tl.exp(g_last) * s + tl.dot(tl.trans(kd), v_new, input_precision=PREC)
        c += 1
    return s, c


@triton.jit
def _chunk_state_kernel(w_ptr, u_ptr, kd_ptr, gcum_ptr, cu_ptr, first_chunk_ptr, cuts_ptr, slots_ptr, snap_slots_ptr,
                        state_ptr, h_ptr, vnew_ptr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                        SNAPSHOT: tl.constexpr):
    # grid (N, Hv, cdiv(DV, BV)): sequence i, value head j, state columns [vb * BV, vb * BV + BV): the chain through
    # its pieces (token_chunks' order). SNAPSHOT: the pieces restart at the sequence's cut (cuts[i]; 0: none),
    # where S (fp32) is also stored into slot snap_slots[i].
    i = tl.program_id(0)
    j = tl.program_id(1)
    vb = tl.program_id(2)
    bos = tl.load(cu_ptr + i)
    eos = tl.load(cu_ptr + i + 1)
    # a sequence without tokens (a device plan's padding) runs no piece, and its slot, not this step's, is masked
    # off: masks, not an early return, which made the pass 14% slower at 1 x 32768, H16 (FINDINGS, one layered house)
    live = bos < eos
    c = tl.load(first_chunk_ptr + i).to(tl.int64)  # int64: the h offsets pass 2^31 at long T
    slot = tl.load(slots_ptr + i).to(tl.int64)
    r, rk, rv = tl.arange(0, BT), tl.arange(0, BK), tl.arange(0, BV)
    cols = vb * BV + rv
    kmask, vmask = rk < DK, cols < DV
    s_off = rk[:, None] * DV + cols[None, :]
    s_mask = kmask[:, None] & vmask[None, :]
    s_ptrs = state_ptr + (slot * HV + j) * (DK * DV) + s_off
    s = tl.load(s_ptrs, mask=s_mask & live, other=0.0)  # (BK, BV) fp32
    if SNAPSHOT:
        cut = tl.load(cuts_ptr + i)
        if (cut > 0) & live:
            s, c = _state_chain(s, bos, cut, c, j, w_ptr, u_ptr, kd_ptr, gcum_ptr, h_ptr, vnew_ptr, r, rk, cols,
                                kmask, vmask, s_off, s_mask, HV, DK, DV, BT, PREC)
            snap = tl.load(snap_slots_ptr + i).to(tl.int64)
            tl.store(state_ptr + (snap * HV + j) * (DK * DV) + s_off, s, mask=s_mask)
            bos = cut
    s, c = _state_chain(s, bos, eos, c, j, w_ptr, u_ptr, kd_ptr, gcum_ptr, h_ptr, vnew_ptr, r, rk, cols, kmask, vmask,
                        s_off, s_mask, HV, DK, DV, BT, PREC)
    tl.store(s_ptrs, s, mask=s_mask & live)


@triton.jit
def _chunk_output_kernel(q_ptr, k_ptr, vnew_ptr, h_ptr, gcum_ptr, chunk_ptr, o_ptr, z_ptr, norm_w_ptr, sq_t, sq_h,
                         sk_t, sk_h, so_t, so_h, sz_t, sz_h, scale, eps, HV: tl.constexpr, GROUP: tl.constexpr,
                         DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         L2NORM: tl.constexpr, PREC: tl.constexpr, GATE: tl.constexpr):
    # grid (chunks, Hv, cdiv(DV, BV)): o = exp(G) q h[c] + mask_{i>=j}(exp(G_i - G_j) q_i.k_j) v_new; with GATE
    # (one program holds the whole dv row: BV >= DV) the GDN output norm, w * rmsnorm(o) * silu(z), is stored instead
    c = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    vb = tl.program_id(2)
    start, end, _ = chunk_span(chunk_ptr, c)  # an empty piece: every row masked off
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
    if GATE:  # o rounds to the io dtype first, as the unfused path stores it
        z = tl.load(z_ptr + t[:, None].to(tl.int64) * sz_t + j * sz_h + cols[None, :], mask=vmask, other=0.0)
        norm_w = tl.load(norm_w_ptr + cols, mask=cols < DV, other=0.0)
        o = gated_norm(o, z, norm_w, eps, DV, o_ptr.dtype.element_ty)
    tl.store(o_ptr + t[:, None].to(tl.int64) * so_t + j * so_h + cols[None, :], o.to(o_ptr.dtype.element_ty),
             mask=vmask)


def _check_args(q, k, v, g, beta, recurrent_states, out, gate_params=None):
    """Raise ValueError naming the first bad argument of a layer's own tensors (the batch's, cu_seqlens, state_slots
    and the snapshots, are checked by kernels.varlen.plan_varlen)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=3, dtype=IO_DTYPES)
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    for name, t in (("g", g), ("beta", beta)):
        check_tensor(name, t, ndim=2, dtype=IO_DTYPES if gate_params is not None else torch.float32)
        if gate_params is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    if gate_params is not None:
        for name, t in zip(("A_log", "dt_bias"), gate_params):
            check_tensor(name, t, ndim=1, dtype=IO_DTYPES)
            if t.shape != (v.shape[1],) or t.stride(0) != 1:
                raise ValueError(f"{name} must be a contiguous ({v.shape[1]},) tensor, got {tuple(t.shape)}")
    check_tensor("recurrent_states", recurrent_states, ndim=4, dtype=torch.float32)
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
    if min(dk, dv) < 16:
        raise ValueError(f"dk and dv must be at least 16 (tl.dot tiles), got {dk} and {dv}")
    if out is not None and (out.shape != v.shape or out.dtype != v.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be a {tuple(v.shape)} {v.dtype} tensor with a contiguous last dim, "
                         f"got {tuple(out.shape)} {out.dtype}")
    dev = q.device
    tensors = dict(k=k, v=v, g=g, beta=beta, recurrent_states=recurrent_states, out=out,
                   **dict(zip(("A_log", "dt_bias"), gate_params or ())))
    if any(t is not None and t.device != dev for t in tensors.values()):
        raise ValueError(f"tensors must share one device, got q on {dev} and "
                         f"{ {n: str(t.device) for n, t in tensors.items() if t is not None} }")
    if not triton_runs_on(dev):
        raise ValueError(f"q must be on a CUDA device (or run with TRITON_INTERPRET=1), got {dev}")


def chunk_gated_delta_rule(q, k, v, g, beta, *, recurrent_states, state_slots, cu_seqlens, cu_seqlens_host=None,
                           scale=None, use_qk_l2norm=True, out=None, snapshot_offsets=None, snapshot_slots=None):
    """The gated delta rule over N sequences packed by cu_seqlens (N+1,). q, k: (total, Hk, dk); v: (total, Hv, dv),
    all of one io dtype; g (log-decay), beta: (total, Hv) fp32. Sequence i starts from the fp32 state
    recurrent_states[state_slots[i]] (slots, Hv, dk, dv) and its final state is written back there in place.
    Returns o (total, Hv, dv) in v's dtype (into `out` when given). cu_seqlens_host, the caller's host copy of
    cu_seqlens (a list or tuple of ints), spares the call its one device read, a sync that leaves the GPU idle while
    the host plans the passes (measured on the H200: total - the passes' sum, ~360 us at B1 T16k H32).
    snapshot_offsets (host ints, one per sequence; 0: none) and snapshot_slots ((N,) ints): sequence i's state after
    its first snapshot_offsets[i] tokens is also written to recurrent_states[snapshot_slots[i]] (its pieces restart
    at that token; the prefix cache's snapshot inside a chunk)."""
    out, passes = prefill_passes(q, k, v, g, beta, recurrent_states=recurrent_states, state_slots=state_slots,
                                 cu_seqlens=cu_seqlens, cu_seqlens_host=cu_seqlens_host, scale=scale,
                                 use_qk_l2norm=use_qk_l2norm, out=out, snapshot_offsets=snapshot_offsets,
                                 snapshot_slots=snapshot_slots)
    for run_pass in passes:
        run_pass()
    return out


def prefill_passes(q, k, v, g, beta, *, recurrent_states, state_slots, cu_seqlens, cu_seqlens_host=None, scale=None,
                   use_qk_l2norm=True, out=None, snapshot_offsets=None, snapshot_slots=None, output_gate=None,
                   gate_params=None, plan: VarlenPlan | None = None):
    """chunk_gated_delta_rule's arguments checked and planned: (out, (wy, state, output)), the three passes as
    zero-argument callables to run in that order, each reading what the one before wrote (profiles time each).
    output_gate (z (total, Hv, dv) in v's dtype with contiguous rows, norm weight (dv,), eps), when the output pass
    holds whole dv rows (dv <= OUTPUT_BV; see fuses_output_gate): out is the GDN output norm of o, weight * rmsnorm(o)
    * silu(z), computed in the output pass (one launch fewer a layer), in a buffer with room for out_proj's padded
    rows (kernels.row_buckets). gate_params (A_log (Hv,), dt_bias (Hv,)): g and beta are the in-projection's raw a
    and b ((total, Hv), io dtype, any row stride), whose gates (kernels.gdn_pointwise.gate_values) the WY pass
    computes itself (one launch fewer a layer than gdn_gates first). plan: the batch already checked and laid out
    (kernels.varlen.plan_varlen of these cu_seqlens, state_slots and snapshots), whose workspaces the passes reuse."""
    _check_args(q, k, v, g, beta, recurrent_states, out, gate_params)
    plan = plan_for(plan, cu_seqlens, q.shape[0], state_slots, q.device, cu_seqlens_host=cu_seqlens_host,
                    snapshot_offsets=snapshot_offsets, snapshot_slots=snapshot_slots)
    if output_gate is not None:
        _check_output_gate(v, out, *output_gate)
        out = empty_rows(v.shape, v.dtype, v.device, row_dims=1)
    if out is None:
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    scale = q.shape[2] ** -0.5 if scale is None else check_real("scale", scale, positive=True)
    if not isinstance(use_qk_l2norm, bool):
        raise ValueError(f"use_qk_l2norm must be a bool, got {use_qk_l2norm!r}")
    common = _constexprs(q, v, k.shape[1], use_qk_l2norm)
    if gate_params is None:
        g, beta = g.contiguous(), beta.contiguous()
    done = {}

    def wy():
        done["ws"] = wy_pass(k, v, g, beta, plan, common, gate_params)

    def state():
        done["h, v_new"] = state_pass(done["ws"], plan, recurrent_states, common)

    def output():
        h, v_new = done["h, v_new"]
        output_pass(q, k, v_new, h, done["ws"][3], plan.chunks, out, scale, common, output_gate)
    return out, (wy, state, output)


def fuses_output_gate(dv: int) -> bool:
    """Whether the output pass can run the GDN output norm (its programs hold whole dv rows)."""
    return dv <= OUTPUT_BV


def _check_output_gate(v, out, z, weight, eps):
    dv = v.shape[2]
    if out is not None:
        raise ValueError("out and output_gate are exclusive (the gated output gets its own buffer)")
    if not fuses_output_gate(dv):
        raise ValueError(f"output_gate needs dv <= {OUTPUT_BV}, got {dv}")
    check_tensor("z", z, ndim=3, dtype=v.dtype, device=v.device)
    check_tensor("weight", weight, ndim=1, device=v.device)
    if z.shape != v.shape or z.stride(2) != 1 or weight.shape != (dv,) or weight.stride(0) != 1:
        raise ValueError(f"z {tuple(z.shape)} (contiguous rows) and weight {tuple(weight.shape)} must match v "
                         f"{tuple(v.shape)}")
    check_real("eps", eps)


def _constexprs(q, v, hk, use_qk_l2norm) -> dict:
    """The meta-parameters the kernels share (and num_warps): head counts, dims, tiles, l2norm, the products'
    precision (fp32 io: exact "ieee"; 16-bit io: tf32 in the WY pass, the workspace's 16-bit type after it)."""
    hv, dk, dv = v.shape[1], q.shape[2], v.shape[2]
    bk, bv = max(16, next_power_of_2(dk)), max(16, next_power_of_2(dv))
    exact = q.dtype == torch.float32 or q.device.type != "cuda"
    return dict(HV=hv, GROUP=hv // hk, DK=dk, DV=dv, BT=CHUNK, BK=bk, L2NORM=bool(use_qk_l2norm),
                PREC="ieee" if exact else "tf32", num_warps=8 if max(bk, bv) >= 128 else 4)  # (64, 128) fp32 tiles


def wy_pass(k, v, g, beta, plan: VarlenPlan, common, gate_params=None):
    """Kernel 1 over every (chunk, value head): the workspaces w, u, kd (in the io dtype) and G (fp32); g, beta as
    prefill_passes takes them."""
    total, hv, dk, dv = k.shape[0], v.shape[1], k.shape[2], v.shape[2]
    ws = tuple(plan.buffer(name, (total, hv, *d), dt) for name, d, dt in (
        ("w", (dk,), v.dtype), ("u", (dv,), v.dtype), ("kd", (dk,), v.dtype), ("G", (), torch.float32)))
    chunks = plan.chunks
    if chunks.shape[0]:
        scratch = plan.buffer("wy_scratch", (chunks.shape[0], hv, CHUNK, CHUNK), torch.float32)  # the solve's
        _chunk_wy_kernel[(chunks.shape[0], hv)](
            k, v, g, beta, *(gate_params or (g, g)), chunks, *ws, scratch, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), g.stride(0), beta.stride(0), BV=max(16, next_power_of_2(dv)),
            RAW_GATES=gate_params is not None, **common, num_stages=1,
            **({"maxnreg": WY_MAXNREG[k.dtype]} if k.dtype in WY_MAXNREG else {}))
    return ws


def state_pass(ws, plan: VarlenPlan, recurrent_states, common):
    """Kernel 2 over every (sequence, value head, dv block): each piece's start state h (pieces, Hv, dk, dv) and
    v_new (total, Hv, dv), both in the io dtype; the final states into their slots, and at the plan's snapshot cuts
    the states there into its snapshot slots."""
    w, u, kd, gcum = ws
    n, hv, dk, dv = plan.num_seqs, u.shape[1], w.shape[2], u.shape[2]
    h = plan.buffer("h", (plan.chunks.shape[0], hv, dk, dv), u.dtype)
    v_new = plan.buffer("v_new", u.shape, u.dtype)
    bv = state_block(plan.split_for_seqs or n, hv, dv)
    snapshot = plan.snapshots
    _chunk_state_kernel[(n, hv, cdiv(dv, bv))](  # slots of either int type: the kernel widens them
        w, u, kd, gcum, plan.cu32, plan.first_chunk, plan.cuts_dev if snapshot else plan.first_chunk,
        plan.state_slots, plan.snapshot_slots if snapshot else plan.state_slots, recurrent_states, h, v_new,
        **{k: common[k] for k in ("HV", "DK", "DV", "BT", "BK", "PREC", "num_warps")}, BV=bv,
        SNAPSHOT=snapshot, num_stages=STATE_STAGES)
    return h, v_new


def state_block(n: int, hv: int, dv: int) -> int:
    """The dv columns of a state-pass program for n sequences: STATE_BV, halved while the programs would not fill
    the card (FEW_PROGRAMS), down to 16."""
    bv = min(STATE_BV, max(16, next_power_of_2(dv)))
    while bv > 16 and n * hv * cdiv(dv, bv) < FEW_PROGRAMS:
        bv //= 2
    return bv


def compile_variants(num_k_heads: int, recurrent_states: torch.Tensor, dtype: torch.dtype) -> int:
    """Compile the state pass for every dv split it picks (by the step's sequence count: state_block), with and
    without snapshot cuts, before requests pay for it (a server's warm-up; a returning turn that snapshots beside
    other prefills otherwise compiles mid-replay). recurrent_states: a real layer's pool (slots, Hv, dk, dv) fp32,
    whose states are left as they were. Returns the number of calls made."""
    slots, hv, dk, dv = recurrent_states.shape
    dev, saved, calls, seen = recurrent_states.device, recurrent_states.clone(), 0, set()
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape, t=dtype: torch.randn(*shape, generator=gen, device=dev).to(t)
    for n in range(1, slots // 2 + 1):  # n sequences of 2 tokens, snapshots into n more slots
        bv = state_block(n, hv, dv)
        if bv in seen:
            continue
        seen.add(bv)
        q, k, v = rnd(2 * n, num_k_heads, dk), rnd(2 * n, num_k_heads, dk), rnd(2 * n, hv, dv)
        g, beta = -rnd(2 * n, hv, t=torch.float32).abs(), rnd(2 * n, hv, t=torch.float32).sigmoid()
        cu = tuple(range(0, 2 * n + 1, 2))
        for snapshots in (False, True):
            chunk_gated_delta_rule(q, k, v, g, beta, recurrent_states=recurrent_states,
                                   state_slots=torch.arange(n, device=dev), cu_seqlens=host_ints(cu, dev),
                                   cu_seqlens_host=cu, snapshot_offsets=(1,) * n if snapshots else None,
                                   snapshot_slots=torch.arange(n, 2 * n, device=dev) if snapshots else None)
            calls += 1
        if bv == min(STATE_BV, max(16, next_power_of_2(dv))):
            break
    recurrent_states.copy_(saved)
    return calls


def output_pass(q, k, v_new, h, gcum, chunks, out, scale, common, gate=None):
    """Kernel 3 over every (chunk, value head, dv block): o into out; with gate (z, norm weight, eps), the GDN
    output norm of o."""
    dv = out.shape[2]
    bv = min(OUTPUT_BV, max(16, next_power_of_2(dv)))
    z, norm_w, eps = gate if gate is not None else (out, out, 0.0)
    if chunks.shape[0]:
        _chunk_output_kernel[(chunks.shape[0], out.shape[1], cdiv(dv, bv))](
            q, k, v_new, h, gcum, chunks, out, z, norm_w, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            out.stride(0), out.stride(1), z.stride(0), z.stride(1), scale, float(eps), **common, BV=bv,
            GATE=gate is not None, num_stages=1)


def step_plan(step, total: int) -> VarlenPlan:
    """The step's batch checked and laid out once (kernels.varlen.plan_varlen), kept in step.plans for its other
    layers; built again where the step's batch changed since."""
    key = _plan_key(step, total)
    held = step.plans.get("varlen")
    if held is not None and all(a is b if torch.is_tensor(a) or torch.is_tensor(b) else a == b
                                for a, b in zip(held[0], key)):
        return held[1]
    plan = plan_varlen(step.cu_seqlens, total, step.state_slots, cu_seqlens_host=step.cu_seqlens_host,
                       snapshot_offsets=step.snapshot_offsets, snapshot_slots=step.snapshot_slots)
    step.plans["varlen"] = (key, plan)
    return plan


def _plan_key(step, total: int) -> tuple:
    return step.cu_seqlens, step.cu_seqlens_host, step.state_slots, step.snapshot_offsets, step.snapshot_slots, total


def hold_plan(step, plan: VarlenPlan) -> None:
    """Make `plan` (a device plan over step's tensors: kernels.varlen.DeviceBatch.plan) the one step_plan gives
    this step's layers: a captured step plans nothing on the host."""
    step.plans["varlen"] = (_plan_key(step, plan.num_tokens), plan)


def gated_deltanet_prefill_op(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, step,
                              num_k_heads, eps):
    """model.ops.gated_deltanet with the delta rule on this kernel, every piece in Triton and free of host syncs
    given step.cu_seqlens_host: the conv (kernels.causal_conv1d; conv_states updated at step.state_slots), the
    chunked delta rule with the gates in its WY pass (recurrent_states updated in place), the gated norm (in the
    output pass when dv <= OUTPUT_BV, else kernels.gdn_pointwise). The step's batch is checked and laid out once for
    all its layers (step_plan), and the conv's output and the passes' workspaces are the plan's, reused by each layer.
    qkv: (N, C); z: (N, Hv, dv); b, a: (N, Hv). Returns (N, Hv, dv) in qkv's dtype."""
    slots = step.state_slots
    n, hv, dv = z.shape
    dk = (qkv.shape[1] - hv * dv) // (2 * num_k_heads)
    plan = step_plan(step, qkv.shape[0])
    batch = dict(cu_seqlens=step.cu_seqlens, snapshot_slots=step.snapshot_slots, plan=plan)
    mixed = causal_conv1d_varlen(qkv, conv_w, conv_states, slots, out=plan.buffer("conv", tuple(qkv.shape), qkv.dtype),
                                 **batch)
    q, k, v = mixed.split([num_k_heads * dk, num_k_heads * dk, hv * dv], dim=-1)
    fused = fuses_output_gate(dv)  # the output norm inside the output pass
    o, passes = prefill_passes(q.view(n, num_k_heads, dk), k.view(n, num_k_heads, dk), v.view(n, hv, dv), a, b,
                               gate_params=(A_log, dt_bias), recurrent_states=recurrent_states, state_slots=slots,
                               output_gate=(z, norm_w, eps) if fused else None, **batch)
    for run_pass in passes:
        run_pass()
    return o if fused else gated_rms_norm(o, z, norm_w, eps)


def gdn_key(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, step, num_k_heads,
            eps) -> GdnKey:
    """The router's key of a GDN mixer call (kernels.gdn_decode.GdnKey): decode steps ask whether the CuTe decode
    takes them; longer chunks are keyed by their tokens a sequence in powers of two."""
    if step.max_seqlen_q == 1:
        return decode_key(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, num_k_heads)
    _, hv, dk, dv = recurrent_states.shape
    return GdnKey(next_power_of_2(step.max_seqlen_q), num_k_heads, hv, dk, dv, qkv.dtype, device_info(qkv.device),
                  False, step.position_slots is not None, step.snapshot_offsets is not None)


registry.define("gated_deltanet", gdn_key)
registry.register("gated_deltanet", Impl("gdn_prefill_chunked", "triton", gated_deltanet_prefill_op,
                                         all_of(triton_unsupported, writes_no_positions), 2.0))
