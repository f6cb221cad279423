"""Reference multi-token prediction (MTP) head of Qwen3.5 over one whole sequence: dense attention, no pages.

Row t joins the embedding of token t+1 with the trunk's hidden state of token t (after the trunk's final norm),
runs one full-attention decoder layer at position t, and predicts token t+2 through the shared lm_head.
"""
import torch
import torch.nn.functional as F

from reference.attention import attention
from reference.moe import moe, swiglu
from reference.norms import rms_norm
from reference.rope import apply_rope, rope_cos_sin


def mtp_hidden(embeddings, hidden, weights: dict, *, num_heads: int, num_kv_heads: int, head_dim: int,
               rotary_dim: int, rope_theta: float, eps: float, top_k: int = 0, positions=None):
    """embeddings: (T, H) of tokens 1..T; hidden: (T, H) the trunk's normed hidden states of tokens 0..T-1;
    weights: the checkpoint's `mtp.*` tensors without the prefix (`fc.weight`, `layers.0.self_attn.q_proj.weight`,
    MoE experts packed as `layers.0.mlp.experts.gate_up_proj`); positions: (T,) int64 (default 0..T-1).
    Returns the head's normed output (T, H): its logits are lm_head(output)."""
    if embeddings.shape != hidden.shape:
        raise ValueError(f"embeddings {tuple(embeddings.shape)} and hidden {tuple(hidden.shape)} must match")
    if positions is None:
        positions = torch.arange(hidden.shape[0], device=hidden.device)
    joined = torch.cat([rms_norm(embeddings, weights["pre_fc_norm_embedding.weight"], eps),
                        rms_norm(hidden, weights["pre_fc_norm_hidden.weight"], eps)], dim=-1)
    x = F.linear(joined, weights["fc.weight"])
    layers = sorted({int(name.split(".")[1]) for name in weights if name.startswith("layers.")})
    for i in layers:
        w = {name[len(f"layers.{i}."):]: t for name, t in weights.items() if name.startswith(f"layers.{i}.")}
        x = x + _attention(rms_norm(x, w["input_layernorm.weight"], eps), w, positions, num_heads, num_kv_heads,
                           head_dim, rotary_dim, rope_theta, eps)
        x = x + _mlp(rms_norm(x, w["post_attention_layernorm.weight"], eps), w, top_k)
    return rms_norm(x, weights["norm.weight"], eps)


def _attention(h, w, positions, num_heads, num_kv_heads, head_dim, rotary_dim, rope_theta, eps):
    # h: (T, H) -> gated causal GQA self-attention, projected back: (T, H)
    t = h.shape[0]
    q, gate = F.linear(h, w["self_attn.q_proj.weight"]).view(t, num_heads, 2 * head_dim).chunk(2, dim=-1)
    k = F.linear(h, w["self_attn.k_proj.weight"]).view(t, num_kv_heads, head_dim)
    v = F.linear(h, w["self_attn.v_proj.weight"]).view(t, num_kv_heads, head_dim)
    cos, sin = rope_cos_sin(positions, rotary_dim, rope_theta)
    q = apply_rope(rms_norm(q, w["self_attn.q_norm.weight"], eps), cos, sin)
    k = apply_rope(rms_norm(k, w["self_attn.k_norm.weight"], eps), cos, sin)
    o = attention(q[None], k[None], v[None], causal=True, softmax_scale=head_dim ** -0.5)[0]
    o = o * torch.sigmoid(gate)
    return F.linear(o.reshape(t, -1), w["self_attn.o_proj.weight"])


def _mlp(h, w, top_k):
    # h: (T, H) -> the layer's SwiGLU MLP, or its routed experts plus the gated shared expert: (T, H)
    if "mlp.gate.weight" not in w:
        return swiglu(h, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])
    shared = (w["mlp.shared_expert.gate_proj.weight"], w["mlp.shared_expert.up_proj.weight"],
              w["mlp.shared_expert.down_proj.weight"], w["mlp.shared_expert_gate.weight"])
    return moe(h, w["mlp.gate.weight"], w["mlp.experts.gate_up_proj"], w["mlp.experts.down_proj"], top_k, shared)
