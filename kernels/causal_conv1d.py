"""Gated DeltaNet's short depthwise causal conv over a varlen prefill batch, with per-sequence states, in Triton.

Sequence i (tokens cu_seqlens[i] .. cu_seqlens[i+1] of x) starts from the window conv_states[state_slots[i]]
(C, K-1), its last K-1 inputs before the chunk, oldest first:
    y[t, c] = silu(sum_j w[c, j] x'[t - (K-1) + j, c])     x' = the window followed by the sequence's tokens
and the window becomes the last K-1 entries of x'. Same math and rounding as reference.causal_conv1d: the window
is taken in x's dtype, products and sums in fp32, y rounded to x's dtype.

Two launches, no host sync (the reference reads cu_seqlens on the host and loops over sequences):
1. `_conv_kernel`, grid (chunks, C / BLOCK_C): each program convolves up to CHUNK tokens of one sequence
   (kernels.varlen.token_chunks, planned from the host copy of cu_seqlens) over BLOCK_C channels; taps before
   the sequence's first token come from its window. Only a sequence's first chunk reads the window, so the others
   take a path with plain tile loads; the first chunk sums the same taps in the same order, so a sequence split
   over two calls (a prefix-cache hit) gives the outputs of one call bit for bit. The channels' taps come in one
   contiguous (BLOCK_C, K) load: a load per tap, strided by K, set the tiles' layout, and every x tile went through
   shared memory (4,588 PTX lines and 27 barriers a program at 2B's shapes, and several times the bound a layer).
2. `_window_kernel`, grid (N, C / BLOCK_C): the new windows, written in place after every read of the old ones
   (a sequence shorter than K-1 keeps part of its old window).
Bound: x read about once (K taps hit L1/L2) and y written once: at 800 tokens x 6144 channels in bf16, 20 MB,
about 5 us at 4 TB/s.
"""
import torch
import triton
import triton.language as tl

from kernels.host_math import cdiv, next_power_of_2
from kernels.norms import check_devices
from kernels.varlen import CHUNK, VarlenPlan, chunk_span, plan_for
from reference.checks import check_tensor

BLOCK_C = 128
IO_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _tap(taps, j: tl.constexpr):
    # column j of taps (BLOCK_C, KP) fp32: (BLOCK_C,), exactly (one nonzero term a row)
    return tl.sum(tl.where(tl.arange(0, taps.shape[1])[None, :] == j, taps, 0.0), axis=1)


@triton.jit
def _conv_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, cu_ptr, chunk_ptr, y_ptr, C, stride_x, stride_y,
                 stride_slot, stride_ch, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
                 BLOCK_C: tl.constexpr, SILU: tl.constexpr):
    # grid (chunks, cdiv(C, BLOCK_C)); x, y: (N, C) rows; states: (slots, C, K-1); w: (C, K)
    start, end, seq = chunk_span(chunk_ptr, tl.program_id(0))
    if start >= end:  # an empty piece of a device plan's table
        return
    seq_start = tl.load(cu_ptr + seq)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    t = start + tl.arange(0, BT)  # (BT,) tokens
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BLOCK_C,) channels
    ok = (t < end)[:, None] & (ch < C)[None, :]
    kk = tl.arange(0, KP)
    # (BLOCK_C, KP) the channels' taps in one contiguous load (a load per tap, strided by K, sets the tile's layout
    # and costs a shared-memory transpose of every x tile)
    taps = tl.load(w_ptr + ch[:, None] * K + kk[None, :], mask=(ch < C)[:, None] & (kk < K)[None, :],
                   other=0.0).to(tl.float32)
    acc = tl.zeros((BT, BLOCK_C), dtype=tl.float32)
    if start >= seq_start + K - 1:  # every tap a token of the sequence (all chunks but a sequence's first)
        for j in tl.static_range(K):
            src = t - (K - 1) + j  # (BT,) the input of tap j
            xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + ch[None, :], mask=ok, other=0.0)
            acc += xv.to(tl.float32) * _tap(taps, j)[None, :]
    else:  # the first taps of the first tokens read the window; the same sums in the same order
        # (BLOCK_C, KP) the window, oldest first, in one contiguous load, its entries spread to rows below
        window = tl.load(state_ptr + slot * stride_slot + ch[:, None] * stride_ch + kk[None, :],
                         mask=(ch < C)[:, None] & (kk < K - 1)[None, :], other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            src = t - (K - 1) + j  # (BT,) the input of tap j: a token of the sequence, or an entry of its window
            in_x = (src >= seq_start)[:, None]
            xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + ch[None, :], mask=ok & in_x, other=0.0)
            wi = (K - 1) + (src - seq_start)  # (BT,) window index, in [0, K-1) where ~in_x
            sv = tl.zeros((BT, BLOCK_C), dtype=tl.float32)
            for i in tl.static_range(K - 1):
                sv = tl.where((wi == i)[:, None], _tap(window, i)[None, :], sv)
            v = tl.where(in_x, xv, sv.to(xv.dtype)).to(tl.float32)
            acc += v * _tap(taps, j)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * stride_y + ch[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _window_kernel(x_ptr, state_ptr, slots_ptr, dst_slots_ptr, cu_ptr, lens_ptr, C, stride_x, stride_slot,
                   stride_ch, K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr, PREFIX: tl.constexpr):
    # grid (N, cdiv(C, BLOCK_C)): the window after n tokens of sequence seq, x' = its old window (slot slots[seq])
    # then its tokens: window[dst, c, i] = x'[n + i] for i < K-1. n = all its tokens, into its own slot; PREFIX: n =
    # lens[seq] (0: skip), into dst_slots[seq] (snapshots, written before the final windows overwrite the old ones)
    seq = tl.program_id(0)
    seq_start = tl.load(cu_ptr + seq)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    if PREFIX:
        n = tl.load(lens_ptr + seq)
        dst = tl.load(dst_slots_ptr + seq).to(tl.int64)
    else:
        n = tl.load(cu_ptr + seq + 1) - seq_start
        dst = slot
    if n == 0:  # no snapshot, or a sequence without tokens (a device plan's padding): the window stays
        return
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    i = tl.arange(0, KP)  # (KP,) window entries
    src = n - (K - 1) + i  # position in the sequence; < 0: entry K-1 + src of the old window
    ok = (ch < C)[:, None] & (i < K - 1)[None, :]
    in_x = (src >= 0)[None, :]
    xv = tl.load(x_ptr + (seq_start + src).to(tl.int64)[None, :] * stride_x + ch[:, None], mask=ok & in_x, other=0.0)
    offs = slot * stride_slot + ch[:, None] * stride_ch + (K - 1 + src)[None, :]
    old = tl.load(state_ptr + offs, mask=ok & ~in_x, other=0.0)
    new = tl.where(in_x, xv.to(state_ptr.dtype.element_ty), old)
    tl.debug_barrier()  # entry i moves to i - n: every thread's read of the old window precedes any write
    tl.store(state_ptr + dst * stride_slot + ch[:, None] * stride_ch + i[None, :], new, mask=ok)


def _check(x, weight, conv_states):
    """The layer's own tensors (the batch's are the plan's: kernels.varlen.plan_varlen)."""
    check_tensor("x", x, ndim=2, dtype=IO_DTYPES)
    check_tensor("weight", weight, ndim=2, dtype=IO_DTYPES, device=x.device)
    check_tensor("conv_states", conv_states, ndim=3, dtype=IO_DTYPES, device=x.device)
    c, k = weight.shape
    if x.shape[1] != c or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous ({x.shape[1]}, K) tensor for x's channels, "
                         f"got {tuple(weight.shape)} with strides {weight.stride()}")
    if conv_states.shape[1:] != (c, k - 1) or conv_states.stride(2) != 1:
        raise ValueError(f"conv_states must be (slots, {c}, {k - 1}) with a contiguous last dim, "
                         f"got {tuple(conv_states.shape)} with strides {conv_states.stride()}")
    if x.stride(1) != 1:
        raise ValueError(f"x must be contiguous along its channels, got strides {x.stride()}")
    check_devices(x=x)


def causal_conv1d_varlen(x, weight, conv_states, state_slots, cu_seqlens, *, cu_seqlens_host=None,
                         activation: str | None = "silu", out=None, snapshot_offsets=None, snapshot_slots=None,
                         plan: VarlenPlan | None = None):
    """x: (N, C) tokens of the sequences packed by cu_seqlens (B+1,); weight: (C, K); conv_states: (slots, C, K-1),
    sequence i's window at conv_states[state_slots[i]], updated in place. Returns y (N, C) in x's dtype (into
    `out` when given). cu_seqlens_host, the caller's host copy of cu_seqlens, spares the one device read (a sync).
    snapshot_offsets (host ints; 0: none) and snapshot_slots ((B,) ints): the window after sequence i's first
    snapshot_offsets[i] tokens also goes to conv_states[snapshot_slots[i]]. Slots must be distinct (not checked:
    that would read them on the host). plan: the batch already checked and laid out (kernels.varlen.plan_varlen
    of these cu_seqlens, state_slots and snapshots, shared by a model step's layers)."""
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    _check(x, weight, conv_states)
    plan = plan_for(plan, cu_seqlens, x.shape[0], state_slots, x.device, cu_seqlens_host=cu_seqlens_host,
                    snapshot_offsets=snapshot_offsets, snapshot_slots=snapshot_slots)
    n_tok, c = x.shape
    k = weight.shape[1]
    if out is None:
        out = torch.empty(n_tok, c, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be a {tuple(x.shape)} {x.dtype} tensor with contiguous rows, "
                         f"got {tuple(out.shape)} {out.dtype}")
    chunks = plan.plain_chunks
    blocks = cdiv(c, BLOCK_C)
    if chunks.shape[0]:
        _conv_kernel[(chunks.shape[0], blocks)](
            x, weight, conv_states, state_slots, cu_seqlens, chunks, out, c, x.stride(0), out.stride(0),
            conv_states.stride(0), conv_states.stride(1), K=k, KP=next_power_of_2(k), BT=CHUNK, BLOCK_C=BLOCK_C,
            SILU=activation == "silu", num_warps=4)
    n = plan.num_seqs
    if k > 1 and n:
        windows = dict(K=k, KP=next_power_of_2(k - 1), BLOCK_C=BLOCK_C, num_warps=4)
        strides = (c, x.stride(0), conv_states.stride(0), conv_states.stride(1))
        if plan.snapshots:  # before the final windows replace the old ones they may read
            _window_kernel[(n, blocks)](x, conv_states, state_slots, plan.snapshot_slots, cu_seqlens,
                                        plan.offsets_dev, *strides, PREFIX=True, **windows)
        _window_kernel[(n, blocks)](x, conv_states, state_slots, state_slots, cu_seqlens, cu_seqlens,
                                    *strides, PREFIX=False, **windows)
    return out
