"""Plain PyTorch oracles for every kernel in this project, written for clarity, not speed."""
from reference.attention import attention, gather_pages, paged_attention, write_kv_pages
from reference.conv import causal_conv1d, causal_conv1d_update, causal_conv1d_windows
from reference.gated_delta import (
    chunk_gated_delta_rule,
    gdn_gates,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_states,
)
from reference.gather import gather_rows
from reference.linear import add_rms_norm_linear, linear, out_proj_mlp, silu_and_mul_linear
from reference.moe import moe, sigmoid_gate_mul, silu_and_mul, swiglu, topk_route
from reference.mtp import mtp_hidden
from reference.norms import add_rms_norm, gated_rms_norm, l2norm, rms_norm
from reference.rope import apply_rope, rope_cos_sin
from reference.sampling import DecodeAdvance, advance_decode_inputs, argmax
from reference.speculative import greedy_accept, speculative_accept

__all__ = [
    "attention", "gather_pages", "paged_attention", "write_kv_pages",
    "causal_conv1d", "causal_conv1d_update", "causal_conv1d_windows",
    "gather_rows",
    "chunk_gated_delta_rule", "gdn_gates", "recurrent_gated_delta_rule", "recurrent_gated_delta_rule_states",
    "add_rms_norm_linear", "linear", "out_proj_mlp", "silu_and_mul_linear",
    "moe", "sigmoid_gate_mul", "silu_and_mul", "swiglu", "topk_route",
    "mtp_hidden",
    "add_rms_norm", "gated_rms_norm", "l2norm", "rms_norm",
    "apply_rope", "rope_cos_sin",
    "DecodeAdvance", "advance_decode_inputs", "argmax",
    "greedy_accept", "speculative_accept",
]
