"""Next tokens from logits, each row with its own sampling parameters and random generator."""
import torch

from serving.sequence import SamplingParams


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs: (B, V) sorted descending; top_k: (B,) int (0 = all); top_p: (B,) -> probs outside the top-k
    and outside the smallest prefix of mass >= top_p zeroed (the most likely token always stays)."""
    rank = torch.arange(probs.shape[1], device=probs.device)[None, :]  # (1, V)
    k = torch.where(top_k > 0, top_k, probs.shape[1])[:, None]  # (B, 1)
    mass_before = probs.cumsum(-1) - probs  # (B, V)
    keep = (rank < k) & ((mass_before < top_p[:, None]) | (rank == 0))
    return probs * keep


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    """logits: (B, V) -> tokens (B,) int64: argmax where temperature is 0, else a draw from the filtered
    softmax(logits / temperature) with that row's generator."""
    greedy = logits.argmax(-1)
    if all(p.temperature == 0 for p in params):
        return greedy
    dev = logits.device
    temperature = torch.tensor([p.temperature or 1.0 for p in params], device=dev)
    top_k = torch.tensor([p.top_k for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    probs, order = torch.softmax(logits.float() / temperature[:, None], dim=-1).sort(dim=-1, descending=True)
    cdf = filter_probs(probs, top_k, top_p).cumsum(-1)  # (B, V)
    u = torch.stack([torch.rand((), generator=g, device=dev) for g in generators])  # (B,)
    rank = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_max(cdf.shape[1] - 1)  # (B, 1)
    drawn = order.gather(1, rank)[:, 0]
    is_greedy = torch.tensor([p.temperature == 0 for p in params], device=dev)
    return torch.where(is_greedy, greedy, drawn)
