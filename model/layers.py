"""Qwen3.5 layers. Parameter names mirror transformers', so HF checkpoints map onto them by name, except that the
projections of one input are fused into one matmul (FusedLinear: q|k|v, GDN's qkv|z|b|a, gate|up), whose parts
keep their HF names. Every op with a kernel goes through model.ops.

Tensor parallel (model.parallel): layers are built from the rank's config (ShardPlan.local), so each FusedLinear is
column parallel (every part keeps its rank's rows: heads, key-head groups, intermediate slice) and o_proj, out_proj
and down_proj are row parallel (their input columns split); the row-parallel partial sums of a block half are
added by one all-reduce in DecoderLayer (the MoE's experts and shared-expert slice share it)."""
import torch
from torch import nn

from model import ops
from model.config import Qwen35Config
from model.parallel import SINGLE, ShardPlan, Split
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


class NormedInput:
    """A block half's input, rms_norm(x + residual), before it is computed: the first projection that reads it runs
    the residual add and the norm inside its GEMV (ops.add_rms_norm_linear: two launches fewer per layer at
    decode); any other reader takes `value()`. `residual` is then x + residual, the block's next residual."""

    def __init__(self, x, residual, norm: RMSNorm):
        # x: (N, hidden), the previous half's output; residual: (N, hidden), None in the first layer
        self.x, self.norm = x, norm
        self._residual, self._summed, self._value = residual, False, None

    @property
    def shape(self):
        return self.x.shape

    def project(self, weight):
        # weight (out, hidden) -> (N, out)
        if self._summed:
            return ops.linear(self.value(), weight)
        y, self._residual = ops.add_rms_norm_linear(self.x, self._residual, self.norm.weight, self.norm.eps, weight)
        self._summed = True
        return y

    def value(self):
        # the normed input itself: (N, hidden)
        if self._value is None:
            if self._summed:
                self._value = self.norm(self._residual)
            else:
                self._value, self._residual = ops.add_rms_norm(self.x, self._residual, self.norm.weight,
                                                               self.norm.eps)
            self._summed = True
        return self._value

    @property
    def residual(self):
        if not self._summed:
            self.value()
        return self._residual


class Linear(nn.Linear):
    """A bias-free projection through model.ops.linear (the decode GEMV when the kernels run); a NormedInput is
    normed inside the projection."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        if isinstance(x, NormedInput):
            return x.project(self.weight)
        return ops.linear(x, self.weight)

    def forward_gated(self, gate_up):
        # gate_up: (N, 2 * in) = [gate | up] -> the projection of silu(gate) * up: (N, out)
        return ops.silu_and_mul_linear(gate_up, self.weight)


class FusedLinear(Linear):
    """Several projections of one input in one matmul: the weight stacks `parts` (HF sibling name, rows) in order,
    so the loader fills `<parent>.<name>.weight` into its rows and forward's output splits back into the parts."""

    def __init__(self, in_features: int, parts: dict[str, int]):
        super().__init__(in_features, sum(parts.values()))
        self.parts = dict(parts)


class GatedAttention(nn.Module):
    """Full attention with q/k RMSNorm, partial RoPE, GQA over the paged cache and a sigmoid output gate."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.h, self.kv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        # q_proj gives per head [q | gate]
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q_proj": self.h * self.d * 2, "k_proj": self.kv * self.d,
                                                      "v_proj": self.kv * self.d})
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    @property
    def widths(self) -> tuple[int, int]:
        """(project_in's output width, the output projection's input width)."""
        return self.qkv_proj.out_features, self.o_proj.in_features

    def project_in(self, x):
        # x: (N, hidden) or its NormedInput -> (N, q|gate, k, v widths) in one matmul
        return self.qkv_proj(x)

    def core(self, qkv, step: StepInput, k_pages, v_pages):
        # qkv: project_in's (N, width); k_pages, v_pages: this layer's (num_pages, page_size, KV, D) -> (N, H * D)
        n = qkv.shape[0]
        q_gate, k, v = qkv.split(list(self.qkv_proj.parts.values()), dim=-1)
        q, gate = q_gate.view(n, self.h, 2 * self.d).chunk(2, dim=-1)
        k, v = k.view(n, self.kv, self.d), v.view(n, self.kv, self.d)
        q = ops.attention_prep(q, k, v, self.q_norm.weight, self.k_norm.weight, step, k_pages, v_pages, self.eps)
        o = ops.paged_attention(q, k_pages, v_pages, step, self.d ** -0.5, gate)  # (N, H, D)
        return o.reshape(n, self.h * self.d)

    @property
    def out_weight(self):
        # the output projection's (hidden, width)
        return self.o_proj.weight


class GatedDeltaNet(nn.Module):
    """Linear attention: short conv, gated delta rule with an fp32 state, gated RMSNorm output."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv, self.eps = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.rms_norm_eps
        c = cfg.conv_dim
        self.in_proj = FusedLinear(cfg.hidden_size, {"in_proj_qkv": c, "in_proj_z": self.hv * self.dv,
                                                     "in_proj_b": self.hv, "in_proj_a": self.hv})
        self.conv1d = nn.Conv1d(c, c, cfg.linear_conv_kernel_dim, groups=c, bias=False)  # weight only
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedNormWeight(self.dv)
        self.out_proj = Linear(self.hv * self.dv, cfg.hidden_size)

    @property
    def widths(self) -> tuple[int, int]:
        """(project_in's output width, the output projection's input width)."""
        return self.in_proj.out_features, self.out_proj.in_features

    def project_in(self, x):
        # x: (N, hidden) or its NormedInput -> (N, qkv|z|b|a widths) in one matmul
        return self.in_proj(x)

    @property
    def mixer_weights(self) -> tuple:
        """(the in-projection's part widths, conv_w (C, K), A_log, dt_bias, the output norm's weight)."""
        return (tuple(self.in_proj.parts.values()), self.conv1d.weight[:, 0, :], self.A_log, self.dt_bias,
                self.norm.weight)

    def core(self, proj, step: StepInput, conv_states, recurrent_states):
        # proj: project_in's (N, width); conv_states: (slots, C, K-1); recurrent_states: (slots, Hv, dk, dv) fp32
        # -> (N, Hv * dv)
        return ops.gated_deltanet_of_projection(proj, *self.mixer_weights, conv_states, recurrent_states, step,
                                                self.hk, self.eps)

    def project_and_core(self, x, residual, norm: RMSNorm, step: StepInput, conv_states, recurrent_states):
        # x, residual: as NormedInput's -> (core(project_in(norm(x + residual))), x + residual); the norm always
        # inside the in-projection (the TMA GEMV stages it at batch-1 decode)
        proj, residual = ops.add_rms_norm_linear(x, residual, norm.weight, norm.eps, self.in_proj.weight)
        return self.core(proj, step, conv_states, recurrent_states), residual

    @property
    def out_weight(self):
        # the output projection's (hidden, width)
        return self.out_proj.weight


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate_proj and up_proj stacked into one matmul, gate_up_proj."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = FusedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate})
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x):
        return self.down_proj.forward_gated(self.gate_up_proj(x))


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
    """Top-k routed SwiGLU experts plus a sigmoid-gated shared expert. With `experts` (tensor parallel), this rank
    holds only experts [experts.start, experts.stop) and the router stays whole: forward returns this rank's
    partial sum (its experts' share plus its slice of the shared expert), which the decoder layer all-reduces."""

    def __init__(self, cfg: Qwen35Config, experts: Split | None = None):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.expert_start = experts.start if experts is not None else None
        self.gate = Router(cfg.num_experts, cfg.hidden_size)
        self.experts = Experts(experts.size if experts is not None else cfg.num_experts, cfg.hidden_size,
                               cfg.moe_intermediate_size)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x):
        if isinstance(x, NormedInput):  # the router and the experts read it: computed once
            x = x.value()
        s = self.shared_expert
        gate_w, up_w = s.gate_up_proj.weight.split(s.intermediate)
        shared = (gate_w, up_w, s.down_proj.weight, self.shared_expert_gate.weight)
        return ops.moe(x, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj, self.top_k, shared,
                       self.expert_start)


class DecoderLayer(nn.Module):
    """h += mixer(input_layernorm(h)); h += mlp(post_attention_layernorm(h)), with each residual add and norm fused
    into the following projection (NormedInput). With a sharded `plan` (tensor parallel) the mixer and the MLP hold
    this rank's heads / intermediate slice / experts, and each half ends in one all-reduce of its partial sums."""

    def __init__(self, cfg: Qwen35Config, layer_type: str, plan: ShardPlan | None = None):
        super().__init__()
        self.layer_type = layer_type
        self.tp = plan.tp if plan is not None else SINGLE
        local = plan.local if plan is not None else cfg  # this rank's head counts and intermediate sizes
        if layer_type == "full_attention":
            self.self_attn = GatedAttention(local)
        else:
            self.linear_attn = GatedDeltaNet(local)
        if cfg.is_moe:
            self.mlp = SparseMoE(local, plan.experts if plan is not None and plan.sharded else None)
        else:
            self.mlp = MLP(cfg.hidden_size, local.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def mixer(self) -> GatedAttention | GatedDeltaNet:
        return self.self_attn if self.layer_type == "full_attention" else self.linear_attn

    def forward(self, x, residual, step: StepInput, state_a, state_b):
        # x: the previous layer's output (N, hidden), added to residual (None in layer 0) by the mixer's first
        # projection; state_a/b: this layer's cache views. Returns (this layer's output, its residual).
        if self.layer_type == "linear_attention":
            o, residual = self.linear_attn.project_and_core(x, residual, self.input_layernorm, step, state_a, state_b)
            return self.mixer_out(o, residual)
        proj, residual = self.mixer_in(x, residual)
        return self.mixer_out(self.mixer.core(proj, step, state_a, state_b), residual)

    # The layer in three stretches: mixer_in and mixer_out are row-wise (dense projections, norms, the MLP); the
    # mixer's core between them reads the step's sequences and the caches (serving.prefill_graphs captures the
    # row-wise stretches of consecutive layers as one CUDA graph and runs the cores between them).

    def mixer_in(self, x, residual):
        """(the mixer's input projection of input_layernorm(x + residual), the block's residual x + residual)."""
        h = NormedInput(x, residual, self.input_layernorm)
        return self.mixer.project_in(h), h.residual

    def mixer_out(self, o, residual):
        """o: the mixer core's (N, width) -> (this layer's output: the MLP's, its residual). A dense layer on one
        rank runs it as one op (ops.out_proj_mlp: one launch at batch-1 decode on the H200)."""
        norm = self.post_attention_layernorm
        if isinstance(self.mlp, MLP) and not self.tp.enabled:
            return ops.out_proj_mlp(o, residual, self.mixer.out_weight, norm.weight, norm.eps,
                                    self.mlp.gate_up_proj.weight, self.mlp.down_proj.weight)
        out = self.tp.all_reduce(ops.linear(o, self.mixer.out_weight))  # no-op at world size 1
        h = NormedInput(out, residual, norm)
        out = self.tp.all_reduce(self.mlp(h))
        return out, h.residual
