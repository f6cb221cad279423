"""Qwen3.5 layers. Parameter names mirror transformers', so HF checkpoints map onto them by name.
Every op with a kernel goes through model.ops; the projections are plain nn.Linear."""
import torch
from torch import nn

from model import ops
from model.config import Qwen35Config
from model.step import StepInput


class RMSNorm(nn.Module):
    """Zero-centred: x * rsqrt(mean(x^2) + eps) * (1 + weight)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


class GatedNormWeight(nn.Module):
    """Holds the plain (not 1 + w) weight of the GDN output norm, as `linear_attn.norm.weight`."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class GatedAttention(nn.Module):
    """Full attention with q/k RMSNorm, partial RoPE, GQA over the paged cache and a sigmoid output gate."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.h, self.kv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d * 2, bias=False)  # per head: [q | gate]
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def forward(self, x, step: StepInput, k_pages, v_pages):
        # x: (N, hidden); k_pages, v_pages: this layer's (num_pages, page_size, KV, D)
        n = x.shape[0]
        q, gate = self.q_proj(x).view(n, self.h, 2 * self.d).chunk(2, dim=-1)
        k = self.k_proj(x).view(n, self.kv, self.d)
        v = self.v_proj(x).view(n, self.kv, self.d)
        q = ops.attention_prep(q, k, v, self.q_norm.weight, self.k_norm.weight, step, k_pages, v_pages, self.eps)
        o = ops.paged_attention(q, k_pages, v_pages, step, self.d ** -0.5, gate=gate)  # (N, H, D)
        return self.o_proj(o.reshape(n, self.h * self.d))


class GatedDeltaNet(nn.Module):
    """Linear attention: short conv, gated delta rule with an fp32 state, gated RMSNorm output."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv, self.eps = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.rms_norm_eps
        c = cfg.conv_dim
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, c, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.hv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.hv, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.hv, bias=False)
        self.conv1d = nn.Conv1d(c, c, cfg.linear_conv_kernel_dim, groups=c, bias=False)  # weight only
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedNormWeight(self.dv)
        self.out_proj = nn.Linear(self.hv * self.dv, cfg.hidden_size, bias=False)

    def forward(self, x, step: StepInput, conv_states, recurrent_states):
        # x: (N, hidden); conv_states: (slots, C, K-1); recurrent_states: (slots, Hv, dk, dv) fp32
        n = x.shape[0]
        o = ops.gated_deltanet(self.in_proj_qkv(x), self.in_proj_z(x).view(n, self.hv, self.dv),
                               self.in_proj_b(x), self.in_proj_a(x), self.conv1d.weight[:, 0, :], self.A_log,
                               self.dt_bias, self.norm.weight, conv_states, recurrent_states, step, self.hk,
                               self.eps)
        return self.out_proj(o.reshape(n, self.hv * self.dv))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). gate_proj and up_proj are stacked into one matmul,
    gate_up_proj (2I, H); the loader stacks HF's separate tensors into it."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))


class Experts(nn.Module):
    """All experts fused: gate_up_proj (E, 2I, H) and down_proj (E, H, I), as transformers keeps them."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, intermediate))


class SparseMoE(nn.Module):
    """Top-k routed SwiGLU experts plus a sigmoid-gated shared expert."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = Router(cfg.num_experts, cfg.hidden_size)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x):
        s = self.shared_expert
        gate_w, up_w = s.gate_up_proj.weight.split(s.intermediate)
        shared = (gate_w, up_w, s.down_proj.weight, self.shared_expert_gate.weight)
        return ops.moe(x, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj, self.top_k, shared)


class DecoderLayer(nn.Module):
    """h += mixer(input_layernorm(h)); h += mlp(post_attention_layernorm(h)), with the residual adds fused
    into the following norm (add_rms_norm)."""

    def __init__(self, cfg: Qwen35Config, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "full_attention":
            self.self_attn = GatedAttention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg)
        self.mlp = SparseMoE(cfg) if cfg.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, step: StepInput, state_a, state_b):
        # x: the previous layer's output (N, hidden), added to residual here; state_a/b: this layer's cache views
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = ops.add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        mixer = self.self_attn if self.layer_type == "full_attention" else self.linear_attn
        h = mixer(h, step, state_a, state_b)
        h, residual = ops.add_rms_norm(h, residual, self.post_attention_layernorm.weight,
                                       self.post_attention_layernorm.eps)
        return self.mlp(h), residual
