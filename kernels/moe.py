"""Fused MoE for Qwen3.5-MoE in Triton: routing on the device, the token-expert pairs sorted into blocks of one
expert each, one grouped GEMM for gate_up with SwiGLU fused, one for down scaled by the routing weight, and the
top-k sum; the shared expert runs in the same two kernels (a dense mode: its tokens in order, its sigmoid gate in
the down kernel). Up to ROUTE_ALIGN_MAX_PAIRS pairs (decode and verify steps) one program routes and aligns; above,
multi-program launches do (prefill chunks).

A block is block_m pairs of one expert (an expert's pairs padded to whole blocks), so each program reads its
expert's weight tile once for all the tokens that chose it. The pairs are sorted on the device, and the grids are
sized by the shapes' upper bound (every pair its own expert, each padded to a block): programs of blocks past the
real count exit. So nothing syncs with the host, and an MoE decode step captures in a CUDA graph like a dense one.

Expert parallel (expert_start): the weights hold experts [expert_start, expert_start + E_local) of the router's E;
pairs routed elsewhere get nothing here (another rank adds them), as reference.moe.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import registry
from kernels.host_math import cdiv
from kernels.linear import linear
from kernels.registry import DeviceInfo, Impl, device_info, triton_unsupported
from kernels.tuning import KernelTuning, MoeTiles
from reference.checks import check_tensor

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def tiles_for(num_pairs: int, num_local: int, tuning: KernelTuning) -> MoeTiles:
    """The grouped GEMMs' plan: each block reads its expert's weights once, so blocks should be full where experts
    have many pairs (a prefill chunk: 8k tokens x top-8 over 256 experts is 256 pairs an expert): the prefill tiles
    where experts average more than the decode tiles' block, else the decode tiles."""
    decode = tuning.moe_decode
    return tuning.moe_prefill if num_pairs > decode.block_m * num_local else decode


def block_capacity(pairs: int, num_local: int, block_m: int) -> int:
    """Slots for the sorted pairs at most: every pair in a block of its own expert (a static bound: no sync)."""
    return cdiv(pairs + min(pairs, num_local) * (block_m - 1), block_m) * block_m


ROUTE_ALIGN_MAX_PAIRS = 1024  # up to this many pairs (decode steps, verify rows) one program routes and aligns
ROUTE_TOKENS = 16  # tokens routed at once (a (16, E) tile of logits)


@triton.jit
def _route_tokens(logits_ptr, weights_ptr, ids_ptr, t0, n, num_experts, logits_stride, TOP_K: tl.constexpr,
                  K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    # tokens [t0, t0 + BLOCK_T) at once: the softmax over the experts, the top-k (the lowest index among ties) and
    # the weights renormalised. Returns their ids (T, K_PAD) and which are real.
    t = t0 + tl.arange(0, BLOCK_T)
    e_idx = tl.arange(0, E_PAD)
    k_idx = tl.arange(0, K_PAD)
    e_ok = e_idx < num_experts
    row = tl.load(logits_ptr + t[:, None] * logits_stride + e_idx[None, :], mask=(t < n)[:, None] & e_ok[None, :],
                  other=0.0).to(tl.float32)
    row = tl.where(e_ok[None, :], row, float("-inf"))  # (T, E)
    prob = tl.exp(row - tl.max(row, 1)[:, None])
    prob = tl.where(e_ok[None, :], prob / tl.sum(prob, 1)[:, None], -1.0)
    vals = tl.zeros((BLOCK_T, K_PAD), tl.float32)
    ids = tl.zeros((BLOCK_T, K_PAD), tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(prob, 1)  # (T,)
        pick = tl.min(tl.where(prob == best[:, None], e_idx[None, :], E_PAD), 1)
        vals = tl.where(k_idx[None, :] == j, best[:, None], vals)
        ids = tl.where(k_idx[None, :] == j, pick[:, None], ids)
        prob = tl.where(e_idx[None, :] == pick[:, None], -1.0, prob)
    real = (t < n)[:, None] & (k_idx < TOP_K)[None, :]
    at = t[:, None] * TOP_K + k_idx[None, :]
    tl.store(weights_ptr + at, vals / tl.sum(vals, 1)[:, None], mask=real)
    tl.store(ids_ptr + at, ids, mask=real)
    return ids, real


@triton.jit
def _align(counts_ptr, starts_ptr, block_expert_ptr, num_local, num_blocks, E_PAD: tl.constexpr,
           BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    # from the experts' pair counts: each local expert's first slot (its pairs padded to whole blocks) and each
    # block's expert (how many experts end at or before it; -1 past the real blocks), CHUNK blocks at a time
    e_idx = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + e_idx, mask=e_idx < num_local, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(starts_ptr + e_idx, ends - padded, mask=e_idx < num_local)
    ends = tl.where(e_idx < num_local, ends, 2147483647)
    for off in range(0, num_blocks, CHUNK):
        blocks = off + tl.arange(0, CHUNK)
        before = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), 1)  # (CHUNK, E) compared
        tl.store(block_expert_ptr + blocks, tl.where(before < num_local, before, -1), mask=blocks < num_blocks)


@triton.jit
def _route_align_kernel(logits_ptr, weights_ptr, ids_ptr, counts_ptr, starts_ptr, pairs_ptr, block_expert_ptr,
                        n, num_experts, expert_start, num_local, capacity, logits_stride,
                        TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, P_PAD: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr):
    # one program: every token's routing, then the pairs sorted into blocks of their local expert (ranks from
    # atomic counters: a unique slot each)
    e_idx = tl.arange(0, E_PAD)
    tl.store(counts_ptr + e_idx, tl.zeros((E_PAD,), tl.int32), mask=e_idx < num_local)
    for t0 in range(0, n, BLOCK_T):
        _route_tokens(logits_ptr, weights_ptr, ids_ptr, t0, n, num_experts, logits_stride, TOP_K, K_PAD, E_PAD,
                      BLOCK_T)
    tl.debug_barrier()
    p_idx = tl.arange(0, P_PAD)
    num_pairs = n * TOP_K
    local = tl.load(ids_ptr + p_idx, mask=p_idx < num_pairs, other=-1) - expert_start
    mine = (p_idx < num_pairs) & (local >= 0) & (local < num_local)
    rank = tl.atomic_add(counts_ptr + local, 1, mask=mine)
    for off in range(0, capacity, CHUNK):  # every slot padding first
        slots = off + tl.arange(0, CHUNK)
        tl.store(pairs_ptr + slots, tl.zeros((CHUNK,), tl.int32) + num_pairs, mask=slots < capacity)
    tl.debug_barrier()
    _align(counts_ptr, starts_ptr, block_expert_ptr, num_local, capacity // BLOCK_M, E_PAD, BLOCK_M, CHUNK)
    tl.debug_barrier()
    start = tl.load(starts_ptr + local, mask=mine, other=0)
    tl.store(pairs_ptr + start + rank, p_idx, mask=mine)


@triton.jit
def _route_rank_kernel(logits_ptr, weights_ptr, ids_ptr, rank_ptr, counts_ptr, n, num_experts, expert_start,
                       num_local, logits_stride, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                       BLOCK_T: tl.constexpr):
    # BLOCK_T tokens a program: their routing, then their pairs' ranks within their local expert (atomic counters
    # shared by every program, zeroed before)
    t0 = tl.program_id(0) * BLOCK_T
    ids, real = _route_tokens(logits_ptr, weights_ptr, ids_ptr, t0, n, num_experts, logits_stride, TOP_K, K_PAD,
                              E_PAD, BLOCK_T)
    local = ids - expert_start
    mine = real & (local >= 0) & (local < num_local)
    at = (t0 + tl.arange(0, BLOCK_T))[:, None] * TOP_K + tl.arange(0, K_PAD)[None, :]
    tl.store(rank_ptr + at, tl.atomic_add(counts_ptr + local, 1, mask=mine), mask=mine)


@triton.jit
def _align_kernel(counts_ptr, starts_ptr, block_expert_ptr, num_local, num_blocks, E_PAD: tl.constexpr,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    _align(counts_ptr, starts_ptr, block_expert_ptr, num_local, num_blocks, E_PAD, BLOCK_M, CHUNK)


@triton.jit
def _scatter_pairs_kernel(ids_ptr, rank_ptr, starts_ptr, pairs_ptr, num_pairs, expert_start, num_local,
                          BLOCK: tl.constexpr):
    # each pair of a local expert into its slot: the expert's first slot plus its rank
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    local = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1) - expert_start
    mine = (p < num_pairs) & (local >= 0) & (local < num_local)
    start = tl.load(starts_ptr + local, mask=mine, other=0)
    tl.store(pairs_ptr + start + tl.load(rank_ptr + p, mask=mine, other=0), p, mask=mine)


def route_and_align(x, router_w, top_k: int, num_local: int, expert_start: int, block_m: int):
    """reference.moe.topk_route and the pairs sorted into blocks of block_m pairs of one local expert (an expert's
    pairs padded to whole blocks), after the router's projection: one launch up to ROUTE_ALIGN_MAX_PAIRS pairs
    (decode sizes), else a fill of the padding and three (the routing and ranks over token blocks, the expert table,
    the scatter).
    Returns (weights (n, top_k) fp32, sorted_pairs (capacity,) int32: a pair index token * top_k + slot, or
    n * top_k as padding, block_expert (capacity / block_m,) int32: the block's local expert, -1 past the real
    blocks). Pairs outside [expert_start, expert_start + num_local) are dropped. Within an expert's blocks the pairs'
    order is the atomics' (each pair's result is its own row: the output does not depend on it)."""
    n, num_experts = x.shape[0], router_w.shape[0]
    pairs = n * top_k
    logits = linear(x, router_w)  # the routed projection: the Triton GEMV at decode rows (cuBLAS took 5.3 us at 1)
    dev = x.device
    weights = torch.empty(n, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(max(pairs, 1), dtype=torch.int32, device=dev)
    starts = torch.empty(max(num_local, 1), dtype=torch.int32, device=dev)
    capacity = block_capacity(pairs, num_local, block_m)
    sorted_pairs = torch.empty(max(capacity, 1), dtype=torch.int32, device=dev)
    block_expert = torch.empty(max(capacity // block_m, 1), dtype=torch.int32, device=dev)
    e_pad, k_pad = triton.next_power_of_2(num_experts), triton.next_power_of_2(top_k)
    if n and pairs <= ROUTE_ALIGN_MAX_PAIRS:
        counts = torch.empty_like(starts)  # zeroed in the kernel
        _route_align_kernel[(1,)](logits, weights, ids, counts, starts, sorted_pairs, block_expert, n, num_experts,
                                  expert_start, num_local, capacity, logits.stride(0), TOP_K=top_k, K_PAD=k_pad,
                                  E_PAD=e_pad, P_PAD=triton.next_power_of_2(pairs), BLOCK_M=block_m,
                                  BLOCK_T=min(ROUTE_TOKENS, triton.next_power_of_2(n)), CHUNK=64, num_warps=4)
    elif n:
        counts = torch.zeros_like(starts)
        rank = torch.empty_like(ids)
        _route_rank_kernel[(cdiv(n, ROUTE_TOKENS),)](
            logits, weights, ids, rank, counts, n, num_experts, expert_start, num_local, logits.stride(0),
            TOP_K=top_k, K_PAD=k_pad, E_PAD=e_pad, BLOCK_T=ROUTE_TOKENS, num_warps=4)
        sorted_pairs.fill_(pairs)  # padding, before the scatter
        _align_kernel[(1,)](counts, starts, block_expert, num_local, capacity // block_m, E_PAD=e_pad,
                            BLOCK_M=block_m, CHUNK=64, num_warps=4)
        _scatter_pairs_kernel[(cdiv(pairs, 1024),)](ids, rank, starts, sorted_pairs, pairs, expert_start, num_local,
                                                   BLOCK=1024, num_warps=4)
    return weights, sorted_pairs[:capacity], block_expert[:capacity // block_m]


@triton.jit
def _block_rows(pairs_ptr, block_expert_ptr, num_pairs, top_k, BLOCK_M: tl.constexpr, DENSE: tl.constexpr):
    # this program's block: (its expert, its BLOCK_M pairs, which are real, their tokens); DENSE: the shared expert,
    # whose "pairs" are the tokens in order (expert 0, no tables)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if DENSE:  # one return at the end: Triton's compiler refuses a return inside a branch
        e = tl.full([], 0, tl.int32)
        pair = rows
        real = rows < num_pairs
    else:
        e = tl.load(block_expert_ptr + tl.program_id(0))
        pair = tl.load(pairs_ptr + rows)
        real = (pair < num_pairs) & (e >= 0)
    return e, pair, real, (pair // top_k).to(tl.int64)


@triton.jit
def _gate_up_kernel(x_ptr, wg_ptr, wu_ptr, pairs_ptr, block_expert_ptr, h_ptr, num_pairs, top_k, hidden, inter,
                    x_stride, w_expert_stride, w_row_stride, h_stride,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    DENSE: tl.constexpr):
    # block b of one expert e, columns [n0, n0 + BLOCK_N) of I: h[pair] = silu(x[tok] @ gate_e^T) * (x[tok] @ up_e^T)
    e, pair, real, tok = _block_rows(pairs_ptr, block_expert_ptr, num_pairs, top_k, BLOCK_M, DENSE)
    if e < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    offset = e.to(tl.int64) * w_expert_stride
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        xa = tl.load(x_ptr + tok[:, None] * x_stride + ks[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
        w_at = offset + cols[None, :] * w_row_stride + ks[:, None]
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate += tl.dot(xa, tl.load(wg_ptr + w_at, mask=w_mask, other=0.0), input_precision=DOT_PRECISION)
        up += tl.dot(xa, tl.load(wu_ptr + w_at, mask=w_mask, other=0.0), input_precision=DOT_PRECISION)
    y = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + pair.to(tl.int64)[:, None] * h_stride + cols[None, :], y.to(h_ptr.dtype.element_ty),
             mask=real[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, pairs_ptr, block_expert_ptr, weight_ptr, x_ptr, gate_ptr, y_ptr, num_pairs, top_k,
                 hidden, inter, h_stride, w_expert_stride, w_row_stride, x_stride, y_slots, slot,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 DENSE: tl.constexpr):
    # block b of one expert e, columns [n0, n0 + BLOCK_N) of H: y[tok, its slot] = scale * (h[pair] @ down_e^T);
    # the scale is the routing weight, or for the shared expert (DENSE) sigmoid(x[tok] . gate)
    e, pair, real, tok = _block_rows(pairs_ptr, block_expert_ptr, num_pairs, top_k, BLOCK_M, DENSE)
    if e < 0:
        return
    pair = pair.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w = w_ptr + e.to(tl.int64) * w_expert_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        ha = tl.load(h_ptr + pair[:, None] * h_stride + ks[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
        wd = tl.load(w + cols[None, :] * w_row_stride + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(ha, wd, input_precision=DOT_PRECISION)
    if DENSE:
        logit = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            xa = tl.load(x_ptr + tok[:, None] * x_stride + ks[None, :], mask=real[:, None] & k_ok[None, :],
                         other=0.0).to(tl.float32)
            logit += tl.sum(xa * tl.load(gate_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :], 1)
        scale = tl.sigmoid(logit)
        row = tok * y_slots + slot
    else:
        scale = tl.load(weight_ptr + pair, mask=real, other=0.0)
        row = tok * y_slots + pair % top_k
    tl.store(y_ptr + row[:, None] * hidden + cols[None, :], (acc * scale[:, None]).to(y_ptr.dtype.element_ty),
             mask=real[:, None] & col_ok[None, :])


def _launch(tiles: MoeTiles, width: int, precision: str, dense: bool) -> dict:
    # a grouped kernel's launch constants for `width` output columns
    return dict(BLOCK_M=tiles.block_m, BLOCK_N=min(tiles.block_n, triton.next_power_of_2(max(width, 16))),
                BLOCK_K=tiles.block_k, DOT_PRECISION=precision, DENSE=dense, num_warps=tiles.warps,
                num_stages=tiles.stages)


def _expert_gemms(x, wg, wu, down_w, h, y, *, pairs, block_expert, weights, gate, num_pairs, top_k, slot,
                  tiles: MoeTiles, dense):
    # one SwiGLU expert stack's two grouped GEMMs into y (n, top_k + 1, H): the routed experts (slots 0..top_k-1)
    # or, dense, the shared expert (slot top_k)
    hidden, inter = x.shape[1], down_w.shape[-1]
    blocks = cdiv(num_pairs, tiles.block_m) if dense else block_expert.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    expert_stride = 0 if dense else wg.stride(0)
    if not (blocks and inter and hidden):
        return
    up, down = _launch(tiles, inter, precision, dense), _launch(tiles.down_tiles, hidden, precision, dense)
    _gate_up_kernel[(blocks, cdiv(inter, up["BLOCK_N"]))](
        x, wg, wu, pairs, block_expert, h, num_pairs, top_k, hidden, inter, x.stride(0), expert_stride,
        wg.stride(-2), h.stride(0), **up)
    _down_kernel[(blocks, cdiv(hidden, down["BLOCK_N"]))](
        h, down_w, pairs, block_expert, weights, x, gate, y, num_pairs, top_k, hidden, inter, h.stride(0),
        0 if dense else down_w.stride(0), down_w.stride(-2), x.stride(0), y.shape[1], slot, **down)


@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, slots, hidden, SLOTS: tl.constexpr, BLOCK_H: tl.constexpr):
    # out[tok, cols] = sum over the slots of y[tok, slot, cols] in fp32, cast to out's dtype
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    s = tl.arange(0, SLOTS)
    ok = (s < slots)[:, None] & (cols < hidden)[None, :]
    part = tl.load(y_ptr + (tok * slots + s)[:, None] * hidden + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * hidden + cols, tl.sum(part, 0).to(out_ptr.dtype.element_ty), mask=cols < hidden)


def grouped_experts(x, weights, sorted_pairs, block_expert, tiles: MoeTiles, gate_up_w, down_w, shared=None, *,
                    every_pair_here: bool = False):
    """sum_k weights[:, k] * expert(x) over the pairs sorted into expert blocks of tiles.block_m (route_and_align),
    plus sigmoid(x . shared_gate_w) * the shared expert(x) when shared is given: each term in x's dtype, summed in
    fp32, (n, H) in x's dtype.
    x: (n, H); weights: (n, top_k) fp32; gate_up_w: (E_local, 2I, H); down_w: (E_local, H, I); shared: as
    fused_moe's. every_pair_here: all experts are local, so the down kernels write every slot of the per-pair
    outputs (else the pairs routed to another rank's experts read 0)."""
    n, hidden = x.shape
    top_k = weights.shape[1]
    inter = gate_up_w.shape[1] // 2
    # y: (n, top_k [+ 1 for the shared expert], H) in x's dtype (as vLLM's and transformers' per-expert outputs: half
    # the bytes of fp32 at a prefill chunk, where y is larger than the weights); zeroing it is a write as large as
    # the down kernels' own
    y = (torch.empty if every_pair_here else torch.zeros)(n, top_k + (shared is not None), hidden,
                                                          dtype=x.dtype, device=x.device)
    h = torch.empty(n * top_k, inter, dtype=x.dtype, device=x.device)
    _expert_gemms(x, gate_up_w, gate_up_w[:, inter:], down_w, h, y, pairs=sorted_pairs, block_expert=block_expert,
                  weights=weights.reshape(-1), gate=x, num_pairs=n * top_k, top_k=top_k, slot=0, tiles=tiles,
                  dense=False)
    if shared is not None:
        gate_w, up_w, shared_down, shared_gate = shared
        h_shared = torch.empty(n, gate_w.shape[0], dtype=x.dtype, device=x.device)
        _expert_gemms(x, gate_w, up_w, shared_down, h_shared, y, pairs=x, block_expert=x, weights=x,
                      gate=shared_gate, num_pairs=n, top_k=1, slot=top_k, tiles=tiles, dense=True)
    return sum_slots(y)


def sum_slots(y):
    """y: (n, slots, H) per-expert outputs -> (n, H), their sum in fp32, cast to y's dtype."""
    n, slots, hidden = y.shape
    out = y.new_empty(n, hidden)
    if n and hidden:
        block_h = min(1024, triton.next_power_of_2(hidden))
        _sum_slots_kernel[(n, cdiv(hidden, block_h))](y, out, slots, hidden, SLOTS=triton.next_power_of_2(slots),
                                                     BLOCK_H=block_h)
    return out


def fused_moe_op(x, router_w, gate_up_w, down_w, top_k, shared, expert_start=None):
    """model.ops' moe on these kernels (the engine built the arguments: nothing is checked), on the active tuning's
    tiles (tiles_for), routed and aligned on the device (route_and_align)."""
    start, num_local = expert_start or 0, gate_up_w.shape[0]
    tiles = tiles_for(x.shape[0] * top_k, num_local, registry.tuning())
    weights, sorted_pairs, block_expert = route_and_align(x, router_w, top_k, num_local, start, tiles.block_m)
    return grouped_experts(x, weights, sorted_pairs, block_expert, tiles, gate_up_w, down_w, shared,
                           every_pair_here=num_local == router_w.shape[0])


def fused_moe(x, router_w, gate_up_w, down_w, top_k: int, shared=None, expert_start: int | None = None):
    """The sparse MoE block of Qwen3.5-MoE: reference.moe.moe's arguments and result, on the fused kernels.
    x: (n, H); router_w: (E, H); gate_up_w: (E_local, 2I, H); down_w: (E_local, H, I); shared: None or
    (gate_w (I_s, H), up_w (I_s, H), down_w (H, I_s), shared_gate_w (1, H))."""
    check_moe(x, router_w, gate_up_w, down_w, top_k, shared, expert_start)
    return fused_moe_op(x, router_w, gate_up_w, down_w, top_k, shared, expert_start)


def check_moe(x, router_w, gate_up_w, down_w, top_k: int, shared=None, expert_start: int | None = None) -> None:
    """fused_moe's argument checks: a ValueError that names the argument."""
    check_tensor("x", x, ndim=2, dtype=FLOATS)
    for name, t, ndim in (("router_w", router_w, 2), ("gate_up_w", gate_up_w, 3), ("down_w", down_w, 3)):
        check_tensor(name, t, ndim=ndim, dtype=x.dtype, device=x.device, contiguous=True)
    n_local, hidden = gate_up_w.shape[0], x.shape[1]
    if router_w.shape[1] != hidden or gate_up_w.shape[2] != hidden or gate_up_w.shape[1] % 2:
        raise ValueError(f"router_w {tuple(router_w.shape)} and gate_up_w {tuple(gate_up_w.shape)} must be (E, H) "
                         f"and (E_local, 2I, H) for x of hidden size {hidden}")
    if tuple(down_w.shape) != (n_local, hidden, gate_up_w.shape[1] // 2):
        raise ValueError(f"down_w must be {(n_local, hidden, gate_up_w.shape[1] // 2)}, got {tuple(down_w.shape)}")
    start = expert_start or 0
    if not 0 <= start <= router_w.shape[0] - n_local or (expert_start is None and n_local != router_w.shape[0]):
        raise ValueError(f"expert_start {expert_start}: gate_up_w's {n_local} experts must lie inside the router's "
                         f"{router_w.shape[0]}")
    if not 1 <= top_k <= router_w.shape[0]:
        raise ValueError(f"top_k must be in [1, {router_w.shape[0]}], got {top_k}")
    if shared is not None:
        for name, t in zip(("shared gate_w", "shared up_w", "shared down_w", "shared_gate_w"), shared):
            check_tensor(name, t, ndim=2, dtype=x.dtype, device=x.device)


class MoeKey(NamedTuple):
    """What routes the MoE block (kernels.registry): rows, experts here, top-k, dtype and device."""
    rows: int
    experts: int
    top_k: int
    dtype: torch.dtype
    device: DeviceInfo


def moe_key(x, router_w, gate_up_w, down_w, top_k, shared, expert_start=None) -> MoeKey:
    # x: (n, H); gate_up_w: (E_local, 2I, H)
    return MoeKey(x.shape[0], gate_up_w.shape[0], top_k, x.dtype, device_info(x.device))


registry.define("moe", moe_key)
registry.register("moe", Impl("fused_moe", "triton", fused_moe_op, triton_unsupported, checked=fused_moe))
