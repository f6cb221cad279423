"""The reference projections: y = x @ weight^T, as torch.nn.functional.linear computes it, and SwiGLU's down
projection of silu(gate) * up."""
import torch.nn.functional as F

from reference.moe import silu_and_mul


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
