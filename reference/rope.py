"""Reference partial NeoX RoPE: only the first rotary_dim dims rotate, pairs (i, i + rotary_dim/2)."""
import torch


def rope_cos_sin(positions, rotary_dim: int, theta: float):
    """positions: (n,) int -> cos, sin: (n, rotary_dim/2) fp32, with inv_freq_i = theta^(-2i/rotary_dim)."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)
                                / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x, cos, sin):
    """x: (n, heads, dim); cos, sin: (n, rotary_dim/2). Rotates x[..., :rotary_dim] NeoX style, in fp32."""
    half = cos.shape[-1]
    if x.shape[0] != cos.shape[0] or 2 * half > x.shape[-1]:
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not fit x {tuple(x.shape)}")
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1).to(x.dtype)
