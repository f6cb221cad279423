"""Reference SwiGLU MLP, top-k routing and the sparse MoE block of Qwen3.5-MoE."""
import torch
import torch.nn.functional as F


def silu_and_mul(gate_up):
    """gate_up: (..., 2I) = [gate | up] -> silu(gate) * up: (..., I), computed in fp32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def sigmoid_gate_mul(x, gate):
    """x * sigmoid(gate), in fp32, returned in x's dtype. x, gate: same shape."""
    if x.shape != gate.shape:
        raise ValueError(f"x {tuple(x.shape)} and gate {tuple(gate.shape)} must match")
    return (x.float() * torch.sigmoid(gate.float())).to(x.dtype)


def swiglu(x, gate_w, up_w, down_w):
    """down(silu(gate(x)) * up(x)). x: (n, H); gate_w, up_w: (I, H); down_w: (H, I)."""
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


def topk_route(x, router_w, top_k: int):
    """p = softmax(router(x)) in fp32; keep the top_k and renormalise.
    x: (n, H); router_w: (E, H) -> weights (n, top_k) fp32, ids (n, top_k) int64."""
    if not 1 <= top_k <= router_w.shape[0]:
        raise ValueError(f"top_k must be in [1, {router_w.shape[0]}], got {top_k}")
    probs = torch.softmax(F.linear(x, router_w).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def moe(x, router_w, gate_up_w, down_w, top_k: int, shared=None, expert_start=None):
    """Sparse MoE: sum_k w_k expert_{id_k}(x) (+ sigmoid(shared_gate(x)) * shared_swiglu(x)).
    x: (n, H); router_w: (E, H); gate_up_w: (E, 2I, H); down_w: (E, H, I);
    shared: None or (gate_w, up_w, down_w, shared_gate_w (1, H)).
    expert_start (expert parallel): gate_up_w/down_w hold only experts [expert_start, expert_start + E_local) of
    the router's E; tokens routed elsewhere get nothing from them (another rank adds those)."""
    n_local = gate_up_w.shape[0]
    start = 0 if expert_start is None else expert_start
    if (down_w.shape[0] != n_local or (expert_start is None and n_local != router_w.shape[0])
            or not 0 <= start <= router_w.shape[0] - n_local):
        raise ValueError("router, gate_up and down weights disagree on the number of experts")
    weights, ids = topk_route(x, router_w, top_k)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        if not start <= e < start + n_local:
            continue
        tok, slot = torch.where(ids == e)
        h = F.linear(silu_and_mul(F.linear(x[tok], gate_up_w[e - start])), down_w[e - start])
        out.index_add_(0, tok, (h * weights[tok, slot, None]).to(x.dtype))
    if shared is not None:
        gate_w, up_w, down_w_s, shared_gate_w = shared
        out = out + torch.sigmoid(F.linear(x, shared_gate_w)) * swiglu(x, gate_w, up_w, down_w_s)
    return out
