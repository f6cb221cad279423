"""Gated DeltaNet over a speculative verify step in Triton: each sequence brings 1..8 tokens (its last token and its
drafts), and the state after each token also goes to a slot of its own, so that the engine can roll back to the state
after the last token it keeps (model.step position_slots; serving.speculative).

Per sequence b with tokens rows [cu[b], cu[b+1]) and state slot s, token t runs the decode step of
kernels/gdn_decode.py (the conv over its K-tap window, l2-normed q and k, the gates, S = exp(g) S + k (beta (v -
S^T k))^T, o = S^T q, the gated norm), and then, where position_slots[row] >= 0, writes the state after it there (the
recurrent state and the conv window's last K-1 taps); the last token's goes to s where it has no position slot.

Design. Grid (Hk, B) as the decode step's: a program owns one key head of one sequence and the Hv / Hk value heads
that share it, G at a time, and keeps their states in registers across its tokens, so the state is read once and
written once a token a slot (the per-position writes are the price of rolling back without recompute). Token t's
window is read where it lies: taps before the step from the slot's conv window, later taps from qkv's rows, so no
window moves in registers. The q | k windows written to the slots come from the last pass over the heads, after
every pass has read the slot's window.

CUDA-graph capturable: no host sync. state_slots and position_slots are not checked on the host (that would sync):
they must be distinct and in range, -1 in position_slots meaning none.
"""
import torch
import triton
import triton.language as tl

from kernels import registry
from kernels.gdn_decode import MAX_WARPS, MIN_WARPS, STATE_PER_THREAD, _delta_rule, _heads_at_once, _l2norm
from kernels.gdn_pointwise import gate_values, gated_norm
from kernels.host_math import next_power_of_2
from kernels.registry import Impl, all_of, triton_unsupported

MAX_Q_LEN = 8  # tokens a sequence: the last token and up to 7 drafts (the engine verifies up to 4)


@triton.jit
def _window(conv_row, x_ptr, stride_x, row0, t, ch, mask, K: tl.constexpr, BT: tl.constexpr):
    """Token t's K taps of channels ch (R, N): tap j is item t + j of [the slot's K-1 stored taps, the step's rows],
    as (R, N, BT) in the io dtype."""
    tap = tl.arange(0, BT)[None, None, :]
    m = t + tap
    c3, m3 = ch[:, :, None], mask[:, :, None] & (tap < K)
    old = tl.load(conv_row + c3 * (K - 1) + m, mask=m3 & (m < K - 1), other=0.0)
    new = tl.load(x_ptr + (row0 + m - (K - 1)).to(tl.int64) * stride_x + c3, mask=m3 & (m >= K - 1), other=0.0)
    return tl.where(m < K - 1, old, new)


@triton.jit
def _conv(window, w):
    # silu of the K-tap conv, rounded to the io dtype as the reference does: (R, N) fp32
    y = tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=2)
    return (y * tl.sigmoid(y)).to(window.dtype).to(tl.float32)


@triton.jit
def _store_window(conv_ptr, dst, ch, mask, window, C: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    # conv_states[dst, ch, :] = window[..., 1:K], the window after the token
    tap = tl.arange(0, BT)[None, None, :]
    ptrs = conv_ptr + dst * (C * (K - 1)) + ch[:, :, None] * (K - 1) + tap - 1
    tl.store(ptrs, window, mask=mask[:, :, None] & (tap >= 1) & (tap < K))


@triton.jit
def _gdn_verify_kernel(qkv_ptr, z_ptr, b_ptr, a_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
                       conv_ptr, state_ptr, slots_ptr, cu_ptr, targets_ptr, out_ptr,
                       stride_qkv, stride_z, stride_b, stride_a, scale, eps,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K: tl.constexpr,
                       G: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, T_MAX: tl.constexpr):
    kh = tl.program_id(0)
    seq = tl.program_id(1)
    C: tl.constexpr = 2 * HK * DK + HV * DV
    GROUP: tl.constexpr = HV // HK
    PASSES: tl.constexpr = GROUP // G
    rk, rv, rg, two = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, G), tl.arange(0, 2)
    row0 = tl.load(cu_ptr + seq)
    n = tl.load(cu_ptr + seq + 1) - row0
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    conv_row = conv_ptr + slot * (C * (K - 1))
    s_mask = (rk[None, :, None] < DK) & (rv[None, None, :] < DV) & (rg[:, None, None] < G)  # (G, BK, BV)
    qk_ch = (two[None, :] * HK + kh) * DK + rk[:, None]  # (BK, 2): the q | k channels of key head kh
    qk_mask = (rk[:, None] < DK) & (two[None, :] < 2)
    v_mask = (rv[None, :] < DV) & (rg[:, None] < G)  # (G, BV)
    tap = tl.arange(0, BT)[None, None, :]
    qk_w = tl.load(conv_w_ptr + qk_ch[:, :, None] * K + tap, mask=qk_mask[:, :, None] & (tap < K), other=0.0)
    w = tl.load(norm_w_ptr + rv, mask=rv < DV, other=0.0)
    for c in range(PASSES):
        heads = kh * GROUP + c * G + rg  # (G,)
        v_ch = 2 * HK * DK + heads[:, None] * DV + rv[None, :]  # (G, BV)
        v_w = tl.load(conv_w_ptr + v_ch[:, :, None] * K + tap, mask=v_mask[:, :, None] & (tap < K), other=0.0)
        state_off = heads[:, None, None] * (DK * DV) + rk[None, :, None] * DV + rv[None, None, :]
        s = tl.load(state_ptr + slot * (HV * DK * DV) + state_off, mask=s_mask, other=0.0)
        a_log, dt_bias = tl.load(a_log_ptr + heads), tl.load(dt_bias_ptr + heads)
        for t in range(T_MAX):
            if t < n:
                row = (row0 + t).to(tl.int64)
                qk_window = _window(conv_row, qkv_ptr, stride_qkv, row0, t, qk_ch, qk_mask, K, BT)
                q, k = tl.split(_conv(qk_window, qk_w))
                q = _l2norm(q) * scale
                k = _l2norm(k)
                v_window = _window(conv_row, qkv_ptr, stride_qkv, row0, t, v_ch, v_mask, K, BT)
                v = _conv(v_window, v_w)
                g, beta = gate_values(tl.load(a_ptr + row * stride_a + heads), tl.load(b_ptr + row * stride_b + heads),
                                      a_log, dt_bias)
                s, o = _delta_rule(s, q, k, v, tl.exp(g), beta)
                z = tl.load(z_ptr + row * stride_z + heads[:, None] * DV + rv[None, :], mask=v_mask, other=0.0)
                out = gated_norm(o, z, w, eps, DV, out_ptr.dtype.element_ty)
                tl.store(out_ptr + (row * HV + heads[:, None]) * DV + rv[None, :], out.to(out_ptr.dtype.element_ty),
                         mask=v_mask)
                dst = tl.load(targets_ptr + row)
                dst = tl.where((t == n - 1) & (dst < 0), slot, dst).to(tl.int64)
                tl.debug_barrier()  # every thread has read the slot's window before the last token overwrites it
                if dst >= 0:
                    tl.store(state_ptr + dst * (HV * DK * DV) + state_off, s, mask=s_mask)
                    _store_window(conv_ptr, dst, v_ch, v_mask, v_window, C, K, BT)
                    if c == PASSES - 1:
                        _store_window(conv_ptr, dst, qk_ch, qk_mask, qk_window, C, K, BT)


def launch_verify(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, state_slots,
                  cu_seqlens, position_slots, max_q_len: int, eps: float, out):
    """The verify step on arguments the engine built: qkv (N, C), z (N, Hv, dv), b, a (N, Hv); state_slots (B,);
    cu_seqlens (B+1,) int32; position_slots (N,) int64 (-1: none); max_q_len <= MAX_Q_LEN. Returns out (N, Hv, dv)."""
    _, hv, dv = z.shape
    dk, kw = recurrent_states.shape[2], conv_w.shape[1]
    hk = (qkv.shape[1] - hv * dv) // (2 * dk)
    bsz = state_slots.shape[0]
    bk, bv = next_power_of_2(dk), next_power_of_2(dv)
    g = _heads_at_once(hv // hk, bk * bv, hk * bsz)
    num_warps = max(MIN_WARPS, min(MAX_WARPS, g * bk * bv // STATE_PER_THREAD // 32))
    _gdn_verify_kernel[(hk, bsz)](
        qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, state_slots, cu_seqlens,
        position_slots, out, qkv.stride(0), z.stride(0), b.stride(0), a.stride(0), dk ** -0.5, eps,
        HK=hk, HV=hv, DK=dk, DV=dv, K=kw, G=g, BK=bk, BV=bv, BT=next_power_of_2(kw),
        T_MAX=next_power_of_2(max(max_q_len, 1)), num_warps=num_warps)
    return out


def gated_deltanet_verify_op(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, step,
                             num_k_heads, eps):
    """model.ops.gated_deltanet of a verify step (step.position_slots): the router sends it steps of at most
    MAX_Q_LEN tokens a sequence without snapshot points."""
    out = torch.empty_like(z, memory_format=torch.contiguous_format)
    weights = (t.contiguous() for t in (conv_w, A_log, dt_bias, norm_w))  # no-ops: weights
    return launch_verify(qkv, z, b, a, *weights, conv_states, recurrent_states, step.state_slots, step.cu_seqlens,
                         step.position_slots, step.max_seqlen_q, eps, out)


def _verify_only(key, tuning):
    if not key.per_position:
        return "not a verify step (no per-token states)"
    if key.q_len > MAX_Q_LEN:
        return f"more than {MAX_Q_LEN} tokens a sequence"
    if key.snapshots:
        return "a snapshot point inside a chunk"
    return None


registry.register("gated_deltanet", Impl("gdn_verify", "triton", gated_deltanet_verify_op,
                                         all_of(triton_unsupported, _verify_only), 0.5))
