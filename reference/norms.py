"""Reference norms of Qwen3.5, computed in fp32 and returned in the input's dtype."""
import torch
import torch.nn.functional as F


def rms_norm(x, weight, eps: float = 1e-6):
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight). x: (..., n); weight: (n,)."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"weight has {weight.shape[-1]} entries for x of width {x.shape[-1]}")
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm(x, residual, weight, eps: float = 1e-6):
    """The fused residual step: residual = x + residual; returns (rms_norm(residual), residual). residual None (a
    first layer): (rms_norm(x), x)."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must match")
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def gated_rms_norm(x, z, weight, eps: float = 1e-6):
    """Gated DeltaNet's output norm: weight * rmsnorm(x) * silu(z), with a plain weight (not 1 + w).
    x, z: (..., n); weight: (n,). Rounds rmsnorm(x) to x's dtype before the weight, as transformers does."""
    if x.shape != z.shape:
        raise ValueError(f"x {tuple(x.shape)} and z {tuple(z.shape)} must match")
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * y).float() * F.silu(z.float())).to(x.dtype)


def l2norm(x, eps: float = 1e-6):
    """x / sqrt(sum(x^2) + eps) over the last dim, in x's dtype (callers pass fp32)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
