"""Speculative decoding's verify step: which of K drafted tokens a target model keeps, and the token after them.

A verify step runs the target on a sequence's last token and its K drafts: K+1 positions, position i predicting the
token after draft i (draft 0 is predicted by position 0, the last accepted token's). With its output at each
position (greedy: the argmax; sampled: the distribution p_i), the step emits L tokens, 1 <= L <= K+1: the drafts up
to the first one the target rejects, then one token of the target's own (a correction, or the bonus after K kept
drafts).

- Greedy (`greedy_accept`): keep draft i while it equals the target's argmax at position i; the emitted tokens are
  then the target's argmax at positions 0..L-1, so speculative greedy output equals plain greedy token for token.
- Sampled (`speculative_accept`): keep draft i, drawn from the drafter's q_i, with probability min(1, p_i/q_i) at
  it; at the first rejection emit a draw from the residual max(p_i - q_i, 0) normalised; after K kept drafts, a
  draw from p_K. Each emitted token is then distributed as the target's p (Leviathan et al., 2023; Chen et al.,
  2023), whatever q is.
"""
import torch


def greedy_accept(drafts: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts: (B, K) token ids; target: (B, K+1) the target's argmax at each verified position. Returns (L (B,)
    int64 in 1..K+1, tokens (B, K+1) int64: the first L of each row emitted, the rest -1)."""
    b, k = drafts.shape
    if target.shape != (b, k + 1):
        raise ValueError(f"target must be (B, K+1) = {(b, k + 1)} for drafts {tuple(drafts.shape)}, "
                         f"got {tuple(target.shape)}")
    kept = (drafts == target[:, :k]).long().cumprod(1).sum(1)  # (B,) drafts kept before the first mismatch
    lengths = kept + 1
    cols = torch.arange(k + 1, device=drafts.device)
    tokens = torch.where(cols[None, :] < lengths[:, None], target.long(), -1)
    return lengths, tokens


def speculative_accept(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts: (B, K) drawn from q (B, K, V), the drafter's distributions; p: (B, K+1, V) the target's at the K+1
    verified positions (rows of each sum to 1). Returns (L (B,) int64 in 1..K+1, tokens (B, K+1) int64, the first L
    emitted, the rest -1), each emitted token distributed as p."""
    b, k = drafts.shape
    v = p.shape[-1]
    if q.shape != (b, k, v) or p.shape != (b, k + 1, v):
        raise ValueError(f"q must be (B, K, V) and p (B, K+1, V) for drafts {tuple(drafts.shape)}, got "
                         f"{tuple(q.shape)} and {tuple(p.shape)}")
    d = drafts.long()[:, :, None]
    p_d, q_d = p[:, :k].gather(2, d)[:, :, 0], q.gather(2, d)[:, :, 0]  # (B, K)
    u = torch.rand(b, k, generator=generator, device=p.device, dtype=p.dtype)
    kept = (u * q_d < p_d).long().cumprod(1).sum(1)  # u < p/q, without dividing by a zero q
    rows = torch.arange(b, device=p.device)
    last = p[rows, kept]  # (B, V): the target's distribution where the step ends
    residual = (last - torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, kept]).clamp(min=0)
    # after a rejection: the residual (zero only when p = q there, where nothing is rejected); after K kept: p_K
    mass = residual.sum(1, keepdim=True)
    rejected = (kept < k)[:, None] & (mass > 0)
    final = torch.where(rejected, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), last)
    own = torch.multinomial(final, 1, generator=generator)[:, 0]
    cols = torch.arange(k + 1, device=p.device)
    padded = torch.cat([drafts.long(), own[:, None]], 1)
    tokens = torch.where(cols[None, :] < kept[:, None], padded, -1)
    tokens[rows, kept] = own
    return kept + 1, tokens
