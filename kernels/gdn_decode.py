"""Gated DeltaNet decode step in Triton: one launch per layer for B sequences with one new token each.

Per sequence (its state slot s = state_slots[b]) and value head j, with key head h = j // (Hv / Hk):
    x_c      = [conv_states[s, c, :], qkv[b, c]]            the window of channel c, K taps (oldest first)
    y_c      = silu(sum_t conv_w[c, t] x_c[t])               rounded to the io dtype, as the reference does
    conv_states[s, c, :] = x_c[1:]                           the window shift, in place
    q, k, v  = y over the channels of q head h | k head h | v head j
    q        = l2norm(q) / sqrt(dk);  k = l2norm(k)          l2norm(x) = x rsqrt(sum x^2 + 1e-6)
    beta     = sigmoid(b[b, j]);  g = -exp(A_log[j]) softplus(a[b, j] + dt_bias[j])
    S        = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q       S = recurrent_states[s, j] (dk, dv) fp32
    out[b, j] = norm_w * rmsnorm(o) * silu(z[b, j])          o and rmsnorm(o) rounded to the io dtype first

Design. One launch, grid (Hk, B): a program owns one key head of one sequence and the whole states of the Hv / Hk
value heads that share it, G heads at a time. It convolves the q | k channels of its key head (as one (dk, 2)
tile), then for its G heads issues every load at once: the (G, dk, dv) fp32 states, their v conv windows, gates
and z. It updates the states in registers, writes each back once, applies the gated RMSNorm over its full dv rows
and shifts the q | k windows itself. G = 1 when the grid fills the GPU (B64: fastest); with fewer programs than
SMs, G = 2 where the group allows, doubling the bytes each SM has in flight. A barrier separates each tile's last
read from its in-place write, so threads that hold replicated copies of a small tile cannot read bytes already
overwritten.
Small batches do not split dv over more programs: once the states load before the PDL wait, a split's ticket and
parked o cost more than the spread saves (FINDINGS, decode step: GDN decode).

Bound (H200, about 4.2 TB/s): the fp32 state, 64 KiB a head, read and written once. Qwen3.5-9B (Hv 32) moves
4 MiB a sequence: B64 moves 256 MiB, about 64 us. At B1 only Hk = 16 programs run, each streaming 128 KiB each
way through one SM behind two dependent DRAM round trips (the slot, then everything else) and the launch.
Measured on the H200 before the dv split (bf16, 40 layers' states rotated in a CUDA graph, state from DRAM):
  9B:  B1 8.7 us, B8 15.2 us (2.2 TB/s), B64 81 us (3.3 TB/s);   27B (Hv 48): B1 14.6 us, B64 118 us (3.4 TB/s);
  0.8B (Hv 16): B1 6.3 us, B64 49 us (2.75 TB/s).   fla's decode step: 125 us at B1, 146 us at B64.
Eagerly, the host costs about 10 us of checks plus about 30 us of Triton's launch: capture it in a graph.

Calls with one value head a key head in bf16 at dk = dv = 128 (0.8B, 2B) run kernels/gdn_decode_cute.py instead
(the router's choice): the same step with its layout chosen, 2 barriers after the PDL wait where this kernel
has 19.

CUDA-graph capturable: no host sync, shapes fixed by the inputs, `out=` reusable. state_slots are not checked
on the host (that would sync): they must be distinct and in range.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import gdn_decode_cute, pdl, registry, stamps
from kernels.gdn_pointwise import L2NORM_EPS, gate_values, gated_norm
from kernels.host_math import next_power_of_2
from kernels.norms import triton_runs_on
from kernels.registry import DeviceInfo, Impl, device_info, triton_unsupported
from reference.checks import check_real, check_tensor

STATE_PER_PROGRAM = 2 * 128 * 128  # fp32 state values one program holds (128 KiB): 8 warps x 128 a thread
# fp32 state values a thread holds: 128 is 4 warps a 128 x 128 head; 64 tied and 32 lost at batch 1 (FINDINGS)
STATE_PER_THREAD = 128
FEW_PROGRAMS = 132  # the H200's SM count: below it, programs take several value heads at once
MIN_WARPS, MAX_WARPS = 2, 16
IO_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _conv_taps(conv_row, conv_w_ptr, ch, mask, K: tl.constexpr, BT: tl.constexpr):
    """The stored taps 0..K-2 of channels ch (R, N) of one sequence (conv_row: conv_states[slot]) and their conv
    weights, each (R, N, BT)."""
    tap = tl.arange(0, BT)[None, None, :]
    c3, m3 = ch[:, :, None], mask[:, :, None]
    old = tl.load(conv_row + c3 * (K - 1) + tap, mask=m3 & (tap < K - 1), other=0.0)
    w = tl.load(conv_w_ptr + c3 * K + tap, mask=m3 & (tap < K), other=0.0)
    return old, w


@triton.jit
def _conv_apply(x, old, w, K: tl.constexpr, BT: tl.constexpr):
    """x (R, N): the new token's channels; old, w: _conv_taps'. Returns the K-tap window (R, N, BT) in the io dtype
    and silu(conv) (R, N) fp32, rounded to the io dtype."""
    tap = tl.arange(0, BT)[None, None, :]
    window = tl.where(tap == K - 1, x[:, :, None], old)
    y = tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=2)
    return window, (y * tl.sigmoid(y)).to(x.dtype).to(tl.float32)


@triton.jit
def _shift_window(conv_row, ch, mask, window, K: tl.constexpr, BT: tl.constexpr):
    # conv_states[slot, ch, :] = window[..., 1:K]: tap t moves to t - 1
    tap = tl.arange(0, BT)[None, None, :]
    tl.store(conv_row + ch[:, :, None] * (K - 1) + tap - 1, window, mask=mask[:, :, None] & (tap >= 1) & (tap < K))


@triton.jit
def _l2norm(x):
    # x: (n,) fp32, zero past the head dim
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + L2NORM_EPS)


@triton.jit
def _delta_rule(s, q, k, v, decay, beta):
    """s: states (G, BK, BV) fp32; q, k: (BK,); v: (G, BV); decay, beta: (G,). Returns (new s, o = s^T q (G, BV))."""
    s = s * decay[:, None, None]
    u = beta[:, None] * (v - tl.sum(s * k[None, :, None], axis=1))  # (G, BV)
    s += k[None, :, None] * u[:, None, :]
    return s, tl.sum(s * q[None, :, None], axis=1)


@triton.jit
def _state_ptrs(state_ptr, slot, heads, rk, rv, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    # (G, BK, BVS) addresses of rows rk, columns rv of the states of value heads `heads` (G,) in state slot `slot`
    return state_ptr + (slot * HV + heads[:, None, None]) * (DK * DV) + rk[None, :, None] * DV + rv[None, None, :]


@triton.jit
def _gdn_decode_kernel(qkv_ptr, z_ptr, b_ptr, a_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
                       conv_ptr, state_ptr, slots_ptr, out_ptr, stamps_ptr, stride_qkv, stride_z, stride_b, stride_a,
                       scale, eps,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K: tl.constexpr,
                       G: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                       EARLY: tl.constexpr, STAMPS: tl.constexpr, PDL: tl.constexpr):
    # grid (Hk, B): key head kh of sequence seq and its HV // HK value heads' states, G heads at a time. EARLY (one
    # pass of G heads): what no kernel of the step writes (the slot, the states, the conv windows, the weights) is
    # loaded before the PDL wait, so its DRAM round trips overlap the previous kernel's tail; then everything the
    # previous kernel writes (qkv, z, b, a) is loaded at once, before the first reduction, in one round trip.
    stamps.arrive(stamps_ptr, STAMPS)
    kh = tl.program_id(0)
    seq = tl.program_id(1)
    C: tl.constexpr = 2 * HK * DK + HV * DV
    GROUP: tl.constexpr = HV // HK
    rk, rv, rg, two = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, G), tl.arange(0, 2)
    slot = tl.load(slots_ptr + seq).to(tl.int64)  # every state offset below is 64-bit
    s_mask = (rk[None, :, None] < DK) & (rv[None, None, :] < DV) & (rg[:, None, None] < G)  # (G, BK, BV)
    x_row = qkv_ptr + seq * stride_qkv  # the rows of qkv, z, b and a may be views into one projection
    z_row = z_ptr + seq * stride_z
    a_row = a_ptr + seq * stride_a
    b_row = b_ptr + seq * stride_b
    conv_row = conv_ptr + slot * (C * (K - 1))
    qk_ch = (two[None, :] * HK + kh) * DK + rk[:, None]  # (BK, 2): the q | k channels of key head kh
    qk_mask = (rk[:, None] < DK) & (two[None, :] < 2)  # full (BK, 2), like every mask here
    v_mask = (rv[None, :] < DV) & (rg[:, None] < G)  # (G, BV)
    if EARLY:
        heads = kh * GROUP + rg  # the one pass's (G,) value heads
        v_ch = 2 * HK * DK + heads[:, None] * DV + rv[None, :]  # (G, BV)
        s_early = tl.load(_state_ptrs(state_ptr, slot, heads, rk, rv, HV, DK, DV), mask=s_mask, other=0.0)
        qk_old, qk_w = _conv_taps(conv_row, conv_w_ptr, qk_ch, qk_mask, K, BT)
        v_old, v_w = _conv_taps(conv_row, conv_w_ptr, v_ch, v_mask, K, BT)
        a_log, dt_bias = tl.load(a_log_ptr + heads), tl.load(dt_bias_ptr + heads)
        w = tl.load(norm_w_ptr + rv, mask=rv < DV, other=0.0)
    pdl.wait_for_producer(PDL)
    t_go = stamps.go(stamps_ptr, STAMPS)
    pdl.release_dependents(PDL)
    if EARLY:
        x_qk = tl.load(x_row + qk_ch, mask=qk_mask, other=0.0)
        x_v = tl.load(x_row + v_ch, mask=v_mask, other=0.0)
        a_early, b_early = tl.load(a_row + heads), tl.load(b_row + heads)
        z_early = tl.load(z_row + heads[:, None] * DV + rv[None, :], mask=v_mask, other=0.0)
    else:
        qk_old, qk_w = _conv_taps(conv_row, conv_w_ptr, qk_ch, qk_mask, K, BT)
        x_qk = tl.load(x_row + qk_ch, mask=qk_mask, other=0.0)
        w = tl.load(norm_w_ptr + rv, mask=rv < DV, other=0.0)
    qk_window, qk = _conv_apply(x_qk, qk_old, qk_w, K, BT)
    q, k = tl.split(qk)
    q = _l2norm(q) * scale
    k = _l2norm(k)
    for c in range(GROUP // G):
        if not EARLY:
            heads = kh * GROUP + c * G + rg  # (G,)
            v_ch = 2 * HK * DK + heads[:, None] * DV + rv[None, :]
        rows = seq * HV + heads
        s_ptrs = _state_ptrs(state_ptr, slot, heads, rk, rv, HV, DK, DV)
        if EARLY:
            s = s_early
            v_window, v = _conv_apply(x_v, v_old, v_w, K, BT)
            g, beta = gate_values(a_early, b_early, a_log, dt_bias)
            z = z_early
        else:
            s = tl.load(s_ptrs, mask=s_mask, other=0.0)
            v_old, v_w = _conv_taps(conv_row, conv_w_ptr, v_ch, v_mask, K, BT)
            v_window, v = _conv_apply(tl.load(x_row + v_ch, mask=v_mask, other=0.0), v_old, v_w, K, BT)
            g, beta = gate_values(tl.load(a_row + heads), tl.load(b_row + heads), tl.load(a_log_ptr + heads),
                                  tl.load(dt_bias_ptr + heads))
            z = tl.load(z_row + heads[:, None] * DV + rv[None, :], mask=v_mask, other=0.0)
        s, o = _delta_rule(s, q, k, v, tl.exp(g), beta)
        out = gated_norm(o, z, w, eps, DV, out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * DV + rv[None, :], out.to(out_ptr.dtype.element_ty), mask=v_mask)
        tl.debug_barrier()  # every thread has read what the stores below overwrite (small tiles replicate)
        tl.store(s_ptrs, s, mask=s_mask)
        _shift_window(conv_row, v_ch, v_mask, v_window, K, BT)
    _shift_window(conv_row, qk_ch, qk_mask, qk_window, K, BT)  # after the loop's barrier
    stamps.end(stamps_ptr, t_go, STAMPS)


def _expect(name, t, shape, dtypes, contiguous=False) -> None:
    """Raise ValueError naming `name` unless t is a tensor of this shape and one of these dtypes (and contiguous)."""
    if (not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype not in dtypes
            or (contiguous and not t.is_contiguous())):
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {'contiguous ' if contiguous else ''}{shape} tensor of "
                         f"{', '.join(map(str, dtypes))}, got {got}")


def _check_args(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, state_slots,
                num_k_heads, out):
    """Raise ValueError naming the first bad argument; returns (B, Hk, Hv, dk, dv, K). Kept lean: eager decode
    pays for it on every layer."""
    check_tensor("qkv", qkv, ndim=2, dtype=IO_DTYPES)
    check_tensor("z", z, ndim=3, dtype=qkv.dtype)
    check_tensor("recurrent_states", recurrent_states, ndim=4, dtype=torch.float32)
    check_tensor("conv_w", conv_w, ndim=2)
    (bsz, hv, dv), io = z.shape, (qkv.dtype,)
    slots, dk, kw = recurrent_states.shape[0], recurrent_states.shape[2], conv_w.shape[1]
    if dk < 1 or dv < 1:
        raise ValueError(f"recurrent_states and z need head dims dk, dv >= 1, got dk {dk}, dv {dv}")
    if not isinstance(num_k_heads, int) or num_k_heads < 1 or hv % num_k_heads:
        raise ValueError(f"num_k_heads must be a positive int dividing Hv={hv}, got {num_k_heads!r}")
    c = 2 * num_k_heads * dk + hv * dv  # q | k | v channels
    _expect("qkv", qkv, (bsz, c), io)
    _expect("b", b, (bsz, hv), IO_DTYPES)
    _expect("a", a, (bsz, hv), IO_DTYPES)
    for name, t in (("qkv", qkv), ("z", z), ("b", b), ("a", a)):  # rows may be strided (views of one projection)
        if t.stride()[1:] != ((1,) if t.dim() == 2 else (t.shape[2], 1)):  # host arithmetic only: eager hot path
            raise ValueError(f"{name} must be contiguous within a row (any row stride), got strides {t.stride()}")
    _expect("conv_w", conv_w, (c, max(kw, 2)), IO_DTYPES)
    _expect("A_log", A_log, (hv,), IO_DTYPES)
    _expect("dt_bias", dt_bias, (hv,), IO_DTYPES)
    _expect("norm_w", norm_w, (dv,), (*io, torch.float32))
    _expect("conv_states", conv_states, (slots, c, kw - 1), io, contiguous=True)
    _expect("recurrent_states", recurrent_states, (slots, hv, dk, dv), (torch.float32,), contiguous=True)
    _expect("state_slots", state_slots, (bsz,), (torch.int32, torch.int64), contiguous=True)
    if out is not None:
        _expect("out", out, (bsz, hv, dv), io, contiguous=True)
    dev = qkv.device
    tensors = dict(z=z, b=b, a=a, conv_w=conv_w, A_log=A_log, dt_bias=dt_bias, norm_w=norm_w, out=out,
                   conv_states=conv_states, recurrent_states=recurrent_states, state_slots=state_slots)
    if any(t is not None and t.device != dev for t in tensors.values()):
        raise ValueError(f"tensors must share one device, got qkv on {dev} and "
                         f"{ {n: str(t.device) for n, t in tensors.items() if t is not None} }")
    if not triton_runs_on(dev):
        raise ValueError(f"qkv must be on a CUDA device (or run with TRITON_INTERPRET=1), got {dev}")
    return bsz, num_k_heads, hv, dk, dv, kw


def _heads_at_once(group: int, tile: int, programs: int) -> int:
    """Value heads a program updates at once: 1 when the grid fills the GPU (fastest there), else the most heads
    of the group (a power of two dividing it) whose states fit STATE_PER_PROGRAM, for more bytes in flight."""
    g = 1
    while programs < FEW_PROGRAMS and group % (2 * g) == 0 and 2 * g * tile <= STATE_PER_PROGRAM:
        g *= 2
    return g


class GdnKey(NamedTuple):
    """What routes a GDN mixer call (kernels.registry): tokens a sequence (1: decode; longer ones in powers of two),
    heads and head dims, dtype, device, whether a decode meets the CuTe kernel's layout (gdn_decode_cute), whether
    the step also writes the state after each token (a speculative verify step: StepInput.position_slots), and
    whether it has snapshot points inside its chunks."""
    q_len: int
    hk: int
    hv: int
    dk: int
    dv: int
    dtype: torch.dtype
    device: DeviceInfo
    cute_layout: bool
    per_position: bool = False
    snapshots: bool = False


def decode_key(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, num_k_heads) -> GdnKey:
    # qkv: (B, C); z: (B, Hv, dv); recurrent_states: (slots, Hv, dk, dv)
    _, hv, dk, dv = recurrent_states.shape
    cute = qkv.dtype == torch.bfloat16 and qkv.is_cuda and gdn_decode_cute.supports(
        qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, num_k_heads)
    return GdnKey(1, num_k_heads, hv, dk, dv, qkv.dtype, device_info(qkv.device), cute)


def gdn_decode_step(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, state_slots,
                    num_k_heads, eps, out=None):
    """One decode token for each of B sequences. qkv: (B, C); z: (B, Hv, dv); b, a: (B, Hv); conv_w: (C, K);
    A_log, dt_bias: (Hv,); norm_w: (dv,); conv_states: (slots, C, K-1) in qkv's dtype and recurrent_states:
    (slots, Hv, dk, dv) fp32, both updated in place at state_slots (B,) int32 or int64. Returns out (B, Hv, dv).
    The router runs it on the CuTe kernel where that takes the call (kernels.gdn_decode_cute), else here."""
    bsz, hk, *_ = _check_args(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states,
                              state_slots, num_k_heads, out)
    eps = check_real("eps", eps)
    if out is None:
        out = torch.empty_like(z, memory_format=torch.contiguous_format)
    if bsz == 0:
        return out
    conv_w, A_log, dt_bias, norm_w = (t.contiguous() for t in (conv_w, A_log, dt_bias, norm_w))  # no-ops: weights
    args = (qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states)
    impl = registry.choose("gated_deltanet", decode_key(*args, hk), "triton")
    launch = gdn_decode_cute.launch if impl.name == "gdn_decode_cute" else launch_decode
    return launch(*args, state_slots, eps, out)


def launch_decode(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, state_slots, eps,
                  out):
    """The Triton decode step on checked arguments (gdn_decode_step's): returns out (B, Hv, dv)."""
    bsz, hv, dv = z.shape
    hk = (qkv.shape[1] - hv * dv) // (2 * recurrent_states.shape[2])
    dk, kw = recurrent_states.shape[2], conv_w.shape[1]
    bk, bv = next_power_of_2(dk), next_power_of_2(dv)
    g = _heads_at_once(hv // hk, bk * bv, hk * bsz)
    num_warps = max(MIN_WARPS, min(MAX_WARPS, g * bk * bv // STATE_PER_THREAD // 32))
    stamp, stamping = stamps.slot("gdn_decode", qkv.device)
    _gdn_decode_kernel[(hk, bsz)](
        qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, state_slots, out, stamp,
        qkv.stride(0), z.stride(0), b.stride(0), a.stride(0), dk ** -0.5, eps, HK=hk, HV=hv, DK=dk, DV=dv,
        K=kw, G=g, BK=bk, BV=bv, BT=next_power_of_2(kw), EARLY=g == hv // hk, STAMPS=stamping,
        num_warps=num_warps, **pdl.launch_options(qkv.device))
    return out


def decode_op(launch):
    """model.ops.gated_deltanet on a decode launcher (launch_decode, gdn_decode_cute.launch): the router sends it
    steps of one token a sequence, whose arguments the engine built."""
    def op(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, step, num_k_heads, eps):
        out = torch.empty_like(z, memory_format=torch.contiguous_format)
        return launch(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, step.state_slots,
                      eps, out)
    return op


gated_deltanet_op = decode_op(launch_decode)


# ---- the router's entries (kernels.registry): the decode step on the CuTe kernel or this one -------------------

def _gdn_decode_cute(key, tuning):
    if key.q_len != 1 or not key.cute_layout:
        return "not one token a sequence in the CuTe decode's layout (bf16, dk = dv = 128, Hv = Hk, sm_90)"
    return None


def _gdn_decode(key, tuning):
    return triton_unsupported(key) if key.q_len == 1 else f"{key.q_len} tokens a sequence"


def writes_no_positions(key, tuning):
    """A supports predicate of the kernels that write a sequence's state only after its last token."""
    return "the state after every token (a verify step)" if key.per_position else None


registry.define("gated_deltanet")
def _checked_op(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, step, num_k_heads,
                eps):
    return gdn_decode_step(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states,
                           step.state_slots, num_k_heads, eps)


registry.register("gated_deltanet", Impl("gdn_decode_cute", "triton", decode_op(gdn_decode_cute.launch),
                                         _gdn_decode_cute, 0.0, _checked_op))
registry.register("gated_deltanet", Impl("gdn_decode", "triton", gated_deltanet_op, _gdn_decode, 1.0, _checked_op))
