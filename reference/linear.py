"""The reference projections: y = x @ weight^T, as torch.nn.functional.linear computes it, SwiGLU's down
projection of silu(gate) * up, a decoder block's pre-norm projection (residual add, RMSNorm, projection), and a
dense layer's second stretch (the mixer's output projection, then the post-attention norm and the SwiGLU MLP)."""
import torch.nn.functional as F

from reference.moe import silu_and_mul
from reference.norms import add_rms_norm


def linear(x, weight):
    """x: (..., K); weight: (N, K) -> (..., N) in x's dtype."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not take x of width {x.shape[-1]}")
    return F.linear(x, weight)


def silu_and_mul_linear(gate_up, weight):
    """gate_up: (..., 2K) = [gate | up]; weight: (N, K) -> linear(silu_and_mul(gate_up), weight): (..., N)."""
    if gate_up.shape[-1] != 2 * weight.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not take gate_up of width {gate_up.shape[-1]}")
    return linear(silu_and_mul(gate_up), weight)


def add_rms_norm_linear(x, residual, norm_weight, eps, weight):
    """s = x + residual (x when residual is None) -> (linear(rms_norm(s, norm_weight, eps), weight), s)."""
    h, s = add_rms_norm(x, residual, norm_weight, eps)
    return linear(h, weight), s


def out_proj_mlp(o, residual, out_weight, norm_weight, eps, gate_up_weight, down_weight):
    """o: the mixer core's (..., width); out_weight: (hidden, width); residual: (..., hidden); gate_up_weight: (2I,
    hidden); down_weight: (hidden, I) -> (the MLP's output (..., hidden), s = linear(o, out_weight) + residual)."""
    gate_up, s = add_rms_norm_linear(linear(o, out_weight), residual, norm_weight, eps, gate_up_weight)
    return silu_and_mul_linear(gate_up, down_weight), s
