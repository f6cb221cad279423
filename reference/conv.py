"""Reference depthwise causal conv1d (Gated DeltaNet's short convolution), with its state, computed in fp32.

The state of a sequence is its last K-1 inputs: (channels, K-1), oldest first, zeros before the start.
"""
import torch
import torch.nn.functional as F

from reference.checks import check_cu_seqlens, check_tensor


def _conv_one(x, weight, state, activation):
    # x: (T, C); weight: (C, K); state: (C, K-1) -> y: (T, C), new state (C, K-1)
    k = weight.shape[1]
    if x.shape[0] == 0:  # an empty sequence leaves its state as it was
        return x.new_zeros(0, weight.shape[0]), state
    full = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=1)  # (C, K-1+T)
    y = F.conv1d(full.float()[None], weight.float()[:, None, :], groups=weight.shape[0])[0]  # (C, T)
    if activation == "silu":
        y = F.silu(y)
    return y.transpose(0, 1).to(x.dtype), full[:, full.shape[1] - (k - 1):]


def causal_conv1d(x, weight, *, initial_state=None, cu_seqlens=None, activation: str | None = "silu"):
    """x: (batch, T, C) or (total, C) with cu_seqlens; weight: (C, K); initial_state: (batch or N, C, K-1).
    Returns (y like x, final_state (batch or N, C, K-1))."""
    check_tensor("x", x, ndim=2 if cu_seqlens is not None else 3)
    check_tensor("weight", weight, ndim=2)
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    c, k = weight.shape
    if x.shape[-1] != c:
        raise ValueError(f"x has {x.shape[-1]} channels for a weight of {c}")
    if cu_seqlens is None:
        seqs = list(x)
    else:
        check_cu_seqlens("cu_seqlens", cu_seqlens, x.shape[0])
        cu = cu_seqlens.tolist()
        seqs = [x[a:b] for a, b in zip(cu[:-1], cu[1:])]
    if initial_state is not None and tuple(initial_state.shape) != (len(seqs), c, k - 1):
        raise ValueError(f"initial_state must have shape {(len(seqs), c, k - 1)}, got {tuple(initial_state.shape)}")
    ys, states = [], []
    for i, xs in enumerate(seqs):
        s0 = initial_state[i] if initial_state is not None else x.new_zeros(c, k - 1)
        y, s = _conv_one(xs, weight, s0, activation)
        ys.append(y)
        states.append(s)
    y = torch.stack(ys) if cu_seqlens is None else torch.cat(ys)
    return y, torch.stack(states)


def causal_conv1d_update(x, conv_state, weight, activation: str | None = "silu"):
    """One decode step. x: (batch, C); conv_state: (batch, C, K-1), updated in place. Returns y: (batch, C)."""
    check_tensor("x", x, ndim=2)
    check_tensor("conv_state", conv_state, ndim=3)
    y, new_state = causal_conv1d(x[:, None, :], weight, initial_state=conv_state, activation=activation)
    conv_state.copy_(new_state)
    return y[:, 0]


def causal_conv1d_windows(x, weight, *, initial_state, activation: str | None = "silu"):
    """A speculative verify step's conv: x (batch, T, C) from the windows initial_state (batch, C, K-1). Returns
    (y like x, windows (batch, T, C, K-1)): windows[:, i] is the state after token i, where a step that keeps L of
    its T tokens rolls back to windows[:, L - 1]."""
    check_tensor("x", x, ndim=3)
    y, _ = causal_conv1d(x, weight, initial_state=initial_state, activation=activation)
    k = weight.shape[1]
    full = torch.cat([initial_state.to(x.dtype), x.transpose(1, 2)], dim=2)  # (batch, C, K-1+T)
    windows = torch.stack([full[:, :, i + 1:i + k] for i in range(x.shape[1])], dim=1)
    return y, windows
