"""The reference projection: y = x @ weight^T, as torch.nn.functional.linear computes it."""
import torch.nn.functional as F


def linear(x, weight):
    """x: (..., K); weight: (N, K) -> (..., N) in x's dtype."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not take x of width {x.shape[-1]}")
    return F.linear(x, weight)
