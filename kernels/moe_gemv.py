"""One token's MoE in Triton (a batch-1 decode step): each chosen expert, and the shared expert, as GEMVs.

At one token the grouped GEMMs of kernels.moe run each expert's 16-row block with one real row, and route through
the block alignment. Here a unit is one of the token's top-k experts or the shared expert (unit top_k), and a
program computes BLOCK_N output columns of one unit with CUDA-core FMAs over its weight rows, each streamed once:
    route    softmax over the router's logits, top-k, renormalised (kernels.moe's routing, no alignment)
    gate_up  h[u] = silu(x . gate_u[c]) * (x . up_u[c]) for the unit's columns c; the unit's scale beside it (the
             routing weight, the shared expert's sigmoid gate, 0 for an expert of another rank)
    down     y[u] = scale[u] * (h[u] . down_u[c])
    sum      out = the sum of y over the units, in fp32 (kernels.moe)
Bound: the bytes of the 8 + 1 experts' weights (56.6 MB at 35B-A3B) at the read ceiling.

CUDA-graph capturable: no host sync; the expert ids stay on the device.
"""
import torch
import triton
import triton.language as tl

from kernels import registry
from kernels.host_math import cdiv
from kernels.linear import linear
from kernels.moe import MoeKey, _route_tokens, check_moe, sum_slots
from kernels.registry import Impl, all_of, triton_unsupported
from kernels.tuning import MoeGemvPlan


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, n, num_experts, logits_stride, TOP_K: tl.constexpr,
                  K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    _route_tokens(logits_ptr, weights_ptr, ids_ptr, tl.program_id(0) * BLOCK_T, n, num_experts, logits_stride, TOP_K,
                  K_PAD, E_PAD, BLOCK_T)


@triton.jit
def _unit(ids_ptr, u, expert_start, num_local, TOP_K: tl.constexpr):
    # unit u: (whether it is the shared expert, its local expert (0 for the shared one), whether it runs here)
    shared = u == TOP_K
    e = tl.load(ids_ptr + tl.minimum(u, TOP_K - 1)) - expert_start
    here = shared | ((e >= 0) & (e < num_local))
    return shared, tl.where(shared | ~here, 0, e).to(tl.int64), here


@triton.jit
def _dot_rows(x_ptr, w_ptr, rows, ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # (BLOCK_N,) fp32: x (K,) . w[r] for the rows r of w (row stride K) where ok; each weight row read once, the
    # next K step's tile loaded before this one's FMAs, products summed over K once at the end
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    w = tl.load(w_rows + kk[None, :], mask=ok[:, None] & (kk[None, :] < K), other=0.0, eviction_policy="evict_first")
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_next = k0 + BLOCK_K + kk
        w_next = tl.load(w_rows + k_next[None, :], mask=ok[:, None] & (k_next[None, :] < K), other=0.0,
                         eviction_policy="evict_first")
        x = tl.load(x_ptr + k0 + kk, mask=k0 + kk < K, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
    return tl.sum(acc, axis=1)


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, weights_ptr, gate_up_ptr, shared_gate_ptr, shared_up_ptr, shared_logit_ptr,
                    h_ptr, scale_ptr, expert_start, num_local, hidden, inter, shared_inter, h_stride,
                    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    u = tl.program_id(0)
    shared, e, here = _unit(ids_ptr, u, expert_start, num_local, TOP_K)
    width = tl.where(shared, shared_inter, inter)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (cols < width) & here
    if shared:
        gate = _dot_rows(x_ptr, shared_gate_ptr, cols, ok, hidden, BLOCK_N, BLOCK_K)
        up = _dot_rows(x_ptr, shared_up_ptr, cols, ok, hidden, BLOCK_N, BLOCK_K)
    else:
        expert = gate_up_ptr + e * (2 * inter * hidden)
        gate = _dot_rows(x_ptr, expert, cols, ok, hidden, BLOCK_N, BLOCK_K)
        up = _dot_rows(x_ptr, expert + inter * hidden, cols, ok, hidden, BLOCK_N, BLOCK_K)
    y = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + u * h_stride + cols, y.to(h_ptr.dtype.element_ty), mask=cols < width)
    if tl.program_id(1) == 0:  # the unit's scale, once
        if shared:
            one = tl.arange(0, 1)
            logit = _dot_rows(x_ptr, shared_logit_ptr, one, one < 1, hidden, 1, BLOCK_K)
            scale = tl.sum(tl.sigmoid(logit))
        else:
            scale = tl.where(here, tl.load(weights_ptr + tl.minimum(u, TOP_K - 1)), 0.0)
        tl.store(scale_ptr + u, scale)


@triton.jit
def _down_kernel(h_ptr, ids_ptr, scale_ptr, down_ptr, shared_down_ptr, y_ptr, expert_start, num_local, hidden,
                 inter, shared_inter, h_stride, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    u = tl.program_id(0)
    shared, e, here = _unit(ids_ptr, u, expert_start, num_local, TOP_K)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (cols < hidden) & here
    if shared:
        acc = _dot_rows(h_ptr + u * h_stride, shared_down_ptr, cols, ok, shared_inter, BLOCK_N, BLOCK_K)
    else:
        acc = _dot_rows(h_ptr + u * h_stride, down_ptr + e * (hidden * inter), cols, ok, inter, BLOCK_N, BLOCK_K)
    acc = acc * tl.load(scale_ptr + u)
    tl.store(y_ptr + u * hidden + cols, acc.to(y_ptr.dtype.element_ty), mask=cols < hidden)


def _block_k(k: int, block_k: int) -> int:
    return min(block_k, triton.next_power_of_2(k))


def moe_row_gemv_op(x, router_w, gate_up_w, down_w, top_k, shared, expert_start=None):
    """model.ops' moe for one token (the engine built the arguments: nothing is checked): kernels.moe.fused_moe's
    arguments and result, on the active tuning's plan (KernelTuning.moe_row_gemv)."""
    plan: MoeGemvPlan = registry.tuning().moe_row_gemv
    x = x.contiguous()  # the kernels read x's row at unit stride (a no-op on the engine's rows)
    num_local, hidden = gate_up_w.shape[0], x.shape[1]
    num_experts, inter = router_w.shape[0], gate_up_w.shape[1] // 2
    dev = x.device
    logits = linear(x, router_w)  # the routed projection: the Triton GEMV at one row
    weights = torch.empty(top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(top_k, dtype=torch.int32, device=dev)
    _route_kernel[(1,)](logits, weights, ids, 1, num_experts, logits.stride(0), TOP_K=top_k,
                        K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts), BLOCK_T=1)
    units = top_k + (shared is not None)
    shared_gate, shared_up, shared_down, shared_logit = (t.contiguous() for t in shared) if shared is not None \
        else (x, x, x, x)  # .contiguous(): no-ops on the model's weights
    shared_inter = shared_gate.shape[0] if shared is not None else 0
    h = torch.empty(units, max(inter, shared_inter), dtype=x.dtype, device=dev)
    scale = torch.empty(units, dtype=torch.float32, device=dev)
    y = torch.empty(units, hidden, dtype=x.dtype, device=dev)
    start = expert_start or 0
    _gate_up_kernel[(units, cdiv(max(inter, shared_inter), plan.gate_up_n))](
        x, ids, weights, gate_up_w, shared_gate, shared_up, shared_logit, h, scale, start, num_local, hidden, inter,
        shared_inter, h.stride(0), TOP_K=top_k, BLOCK_N=plan.gate_up_n, BLOCK_K=_block_k(hidden, plan.gate_up_k),
        num_warps=plan.warps)
    _down_kernel[(units, cdiv(hidden, plan.down_n))](
        h, ids, scale, down_w, shared_down, y, start, num_local, hidden, inter, shared_inter, h.stride(0),
        TOP_K=top_k, BLOCK_N=plan.down_n, BLOCK_K=_block_k(max(inter, shared_inter), plan.down_k),
        num_warps=plan.warps)
    return sum_slots(y[None])


def _one_row(key: MoeKey, tuning) -> str | None:
    if key.rows != 1:
        return "not one token (the grouped GEMMs read each expert once for all its tokens)"
    if tuning.moe_row_gemv is None:
        return "KernelTuning.moe_row_gemv is None (the grouped GEMMs)"
    return None


def moe_row_gemv(x, router_w, gate_up_w, down_w, top_k: int, shared=None, expert_start: int | None = None):
    """kernels.moe.fused_moe for one token (x: (1, H)), on these GEMVs."""
    check_moe(x, router_w, gate_up_w, down_w, top_k, shared, expert_start)
    if x.shape[0] != 1:
        raise ValueError(f"x must be one token (1, H), got {tuple(x.shape)}: more rows run kernels.moe.fused_moe")
    return moe_row_gemv_op(x, router_w, gate_up_w, down_w, top_k, shared, expert_start)


registry.register("moe", Impl("moe_row_gemv", "triton", moe_row_gemv_op, all_of(triton_unsupported, _one_row), -1.0,
                              checked=moe_row_gemv))
