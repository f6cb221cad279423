"""Fused MoE for Qwen3.5-MoE in Triton: routing on the device, the token-expert pairs sorted into blocks of one
expert each, one grouped GEMM for gate_up with SwiGLU fused, one for down scaled by the routing weight, and the
top-k sum; the shared expert beside it.

A block is BLOCK_M pairs of one expert (an expert's pairs padded to whole blocks), so each program reads its
expert's weight tile once for all the tokens that chose it. The pairs are sorted on the device, and the grids are
sized by the shapes' upper bound (every pair its own expert, each padded to a block): programs of blocks past the
real count exit. So nothing syncs with the host, and an MoE decode step captures in a CUDA graph like a dense one.

Expert parallel (expert_start): the weights hold experts [expert_start, expert_start + E_local) of the router's E;
pairs routed elsewhere get nothing here (another rank adds them), as reference.moe.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import registry
from kernels.host_math import cdiv
from kernels.registry import DeviceInfo, Impl, device_info, triton_unsupported
from reference._checks import check_tensor

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_M = 16  # pairs a block at decode sizes: tl.dot's least M
PREFILL_BLOCK_M = 64  # where experts average more than BLOCK_M pairs: fewer re-reads of each expert's weights


def block_m_for(num_pairs: int, num_local: int) -> int:
    """Pairs a block: each block reads its expert's weights once, so blocks should be full where experts have many
    pairs (a prefill chunk: 8k tokens x top-8 over 256 experts is 256 pairs an expert)."""
    return PREFILL_BLOCK_M if num_pairs > BLOCK_M * num_local else BLOCK_M


def route(x, router_w, top_k: int):
    """Softmax over the experts in fp32, the top_k, renormalised. x: (n, H); router_w: (E, H) -> weights (n, top_k)
    fp32, ids (n, top_k) int64 (as reference.moe.topk_route; torch on the device, no host sync)."""
    probs = torch.softmax(F.linear(x, router_w).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def align_blocks(ids, num_local: int, expert_start: int, block_m: int = BLOCK_M):
    """Sort the pairs by local expert into blocks of block_m (an expert's pairs padded to whole blocks).
    ids: (n, top_k) router expert ids. Returns sorted_pairs (blocks * block_m,) int32 (a pair index = token * top_k
    + slot, or n * top_k as padding) and block_expert (blocks,) int32 (the block's local expert, -1 past the real
    blocks). Pairs outside [expert_start, expert_start + num_local) are dropped."""
    pairs = ids.numel()
    dev = ids.device
    local = ids.reshape(-1) - expert_start
    key = torch.where((local >= 0) & (local < num_local), local, num_local)  # num_local: not ours
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(key, stable=True)  # pairs by expert, ours first
    sorted_key = key[order]
    first = counts.cumsum(0) - counts  # where each expert's pairs start in `order`
    rank = torch.arange(pairs, device=dev) - first[sorted_key]
    starts = torch.cat([ends.new_zeros(1), ends])[:-1]
    capacity = cdiv(pairs + min(pairs, num_local) * (block_m - 1), block_m) * block_m  # every pair its own block
    dest = torch.where(sorted_key < num_local, starts[sorted_key.clamp(max=num_local - 1)] + rank, capacity)
    sorted_pairs = torch.full((capacity + 1,), pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, capacity, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_local, block_expert, -1).to(torch.int32)
    return sorted_pairs[:capacity], block_expert


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, pairs_ptr, block_expert_ptr, h_ptr, num_pairs, top_k, hidden, inter,
                    x_stride, w_expert_stride, w_row_stride, h_stride,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # block b of one expert e, columns [n0, n0 + BLOCK_N) of I: h[pair] = silu(x[tok] @ gate_e^T) * (x[tok] @ up_e^T)
    e = tl.load(block_expert_ptr + tl.program_id(0))
    if e < 0:
        return
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    real = pair < num_pairs
    tok = (pair // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w = w_ptr + e.to(tl.int64) * w_expert_stride
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        xa = tl.load(x_ptr + tok[:, None] * x_stride + ks[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w + cols[None, :] * w_row_stride + ks[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w + (inter + cols)[None, :] * w_row_stride + ks[:, None], mask=w_mask, other=0.0)
        gate += tl.dot(xa, wg, input_precision=DOT_PRECISION)
        up += tl.dot(xa, wu, input_precision=DOT_PRECISION)
    y = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + pair.to(tl.int64)[:, None] * h_stride + cols[None, :], y.to(h_ptr.dtype.element_ty),
             mask=real[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, pairs_ptr, block_expert_ptr, weight_ptr, y_ptr, num_pairs, hidden, inter,
                 h_stride, w_expert_stride, w_row_stride, y_stride,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # block b of one expert e, columns [n0, n0 + BLOCK_N) of H: y[pair] = weight[pair] * (h[pair] @ down_e^T)
    e = tl.load(block_expert_ptr + tl.program_id(0))
    if e < 0:
        return
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    real = pair < num_pairs
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
    scale = tl.load(weight_ptr + pair, mask=real, other=0.0)
    tl.store(y_ptr + pair[:, None] * y_stride + cols[None, :], acc * scale[:, None],
             mask=real[:, None] & col_ok[None, :])


def _block_n(width: int) -> int:
    return min(64, triton.next_power_of_2(max(width, 16)))


def routed_experts(x, weights, ids, gate_up_w, down_w, expert_start: int = 0):
    """sum_k weights[:, k] * expert_{ids[:, k]}(x) over this rank's experts, in fp32: (n, H).
    x: (n, H); weights: (n, top_k) fp32; ids: (n, top_k) router ids; gate_up_w: (E_local, 2I, H); down_w:
    (E_local, H, I), experts from expert_start."""
    n, hidden = x.shape
    top_k = ids.shape[1]
    num_local, inter = gate_up_w.shape[0], gate_up_w.shape[1] // 2
    num_pairs = ids.numel()
    block_m = block_m_for(num_pairs, num_local)
    pairs, block_expert = align_blocks(ids, num_local, expert_start, block_m)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)  # pairs not ours stay 0
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    blocks = block_expert.numel()
    if blocks and inter and hidden:
        _gate_up_kernel[(blocks, cdiv(inter, _block_n(inter)))](
            x, gate_up_w, pairs, block_expert, h, num_pairs, top_k, hidden, inter, x.stride(0),
            gate_up_w.stride(0), gate_up_w.stride(1), h.stride(0), BLOCK_M=block_m, BLOCK_N=_block_n(inter),
            BLOCK_K=64, DOT_PRECISION=precision, num_warps=4)
        _down_kernel[(blocks, cdiv(hidden, _block_n(hidden)))](
            h, down_w, pairs, block_expert, weights.reshape(-1).contiguous(), y, num_pairs, hidden, inter,
            h.stride(0), down_w.stride(0), down_w.stride(1), y.stride(0), BLOCK_M=block_m,
            BLOCK_N=_block_n(hidden), BLOCK_K=64, DOT_PRECISION=precision, num_warps=4)
    return y.view(n, top_k, hidden).sum(1)


def _shared_expert(x, shared):
    gate_w, up_w, down_w, gate_proj = shared
    h = F.silu(F.linear(x, gate_w)) * F.linear(x, up_w)
    return torch.sigmoid(F.linear(x, gate_proj).float()) * F.linear(h, down_w).float()


def fused_moe_op(x, router_w, gate_up_w, down_w, top_k, shared, expert_start=None):
    """model.ops' moe on these kernels (the engine built the arguments: nothing is checked)."""
    weights, ids = route(x, router_w, top_k)
    out = routed_experts(x, weights, ids, gate_up_w, down_w, expert_start or 0)
    if shared is not None:
        out += _shared_expert(x, shared)
    return out.to(x.dtype)


def fused_moe(x, router_w, gate_up_w, down_w, top_k: int, shared=None, expert_start: int | None = None):
    """The sparse MoE block of Qwen3.5-MoE: reference.moe.moe's arguments and result, on the fused kernels.
    x: (n, H); router_w: (E, H); gate_up_w: (E_local, 2I, H); down_w: (E_local, H, I); shared: None or
    (gate_w (I_s, H), up_w (I_s, H), down_w (H, I_s), shared_gate_w (1, H))."""
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
    return fused_moe_op(x, router_w, gate_up_w, down_w, top_k, shared, expert_start)


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
