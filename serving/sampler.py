"""Next tokens from logits, each row with its own sampling parameters and random generator.

No host sync per row: the per-row parameters and uniform draws are built on the host (a CPU generator per request,
seeded by its SamplingParams.seed) and reach the device in one non-blocking copy; the caller's single .tolist()
of the result is the step's only sync. Rows with temperature below GREEDY_BELOW (or top_k 1) are the argmax.
"""
import torch

from model import ops
from serving.sequence import SamplingParams
from serving.token_ring import LandedTokens


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs: (B, V) sorted descending; top_k: (B,) int (0 = all); top_p: (B,) -> probs outside the top-k
    and outside the smallest prefix of mass >= top_p zeroed (the most likely token always stays)."""
    rank = torch.arange(probs.shape[1], device=probs.device)[None, :]  # (1, V)
    k = torch.where(top_k > 0, top_k, probs.shape[1])[:, None]  # (B, 1)
    mass_before = probs.cumsum(-1) - probs  # (B, V)
    keep = (rank < k) & ((mass_before < top_p[:, None]) | (rank == 0))
    return probs * keep


# Temperatures below this sample as greedy: logits / 1e-40 overflow fp32, and softmax of infinities is NaN (vLLM
# draws the same line)
GREEDY_BELOW = 1e-5


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature < GREEDY_BELOW or p.top_k == 1


def _to_device(rows: list[list[float]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host table to the device without a sync (pinned staging on CUDA)."""
    return torch.tensor(rows, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)


def _uniform(generator: torch.Generator, device: torch.device):
    """One U[0, 1) draw: a host float from a CPU generator; a device scalar from a CUDA one (no sync either way)."""
    if generator.device.type == "cpu":
        return float(torch.rand((), generator=generator))
    return torch.rand((), generator=generator, device=device)


def sample(logits: torch.Tensor, params: list[SamplingParams | None], generators: list[torch.Generator | None],
           greedy: torch.Tensor | None = None) -> torch.Tensor:
    """logits: (B, V) -> tokens (B,) int64: argmax where the row is greedy (or its params are None: a row the
    caller will not read), else a draw from the filtered softmax(logits / temperature) with that row's generator.
    greedy: the logits' argmax (B,) where the step computed it (a decode graph), else it is computed here."""
    greedy = ops.argmax(logits) if greedy is None else greedy
    drawn_rows = [i for i, p in enumerate(params) if p is not None and not is_greedy(p)]
    if not drawn_rows:
        return greedy
    dev, b = logits.device, logits.shape[0]
    temperature, top_p, u = [1.0] * b, [1.0] * b, [0.0] * b
    top_k = [0] * b
    for i in drawn_rows:
        p = params[i]
        temperature[i], top_p[i], top_k[i] = p.temperature, p.top_p, min(p.top_k, logits.shape[1])
        u[i] = _uniform(generators[i], dev)
    device_draws = [i for i in drawn_rows if isinstance(u[i], torch.Tensor)]
    for i in device_draws:
        u[i] = 0.0
    floats = _to_device([temperature, top_p, u], torch.float32, dev)  # (3, B)
    temperature_t, top_p_t, u_t = floats[0], floats[1], floats[2]
    if device_draws:  # CUDA generators: their draws are device scalars
        u_dev = torch.stack([_uniform(generators[i], dev) for i in device_draws])
        u_t = u_t.index_put((_to_device(device_draws, torch.int64, dev),), u_dev.float())
    probs = torch.softmax(logits.float() / temperature_t[:, None], dim=-1)
    if all(top_k[i] == 0 and top_p[i] >= 1.0 for i in drawn_rows):  # no filter: the plain inverse CDF
        cdf, order = probs.cumsum(-1), None
    else:
        probs, order = probs.sort(dim=-1, descending=True)
        cdf = filter_probs(probs, _to_device(top_k, torch.int64, dev), top_p_t).cumsum(-1)  # (B, V)
    rank = torch.searchsorted(cdf, (u_t * cdf[:, -1])[:, None], right=True).clamp_max(cdf.shape[1] - 1)  # (B, 1)
    drawn = rank[:, 0] if order is None else order.gather(1, rank)[:, 0]
    draw_mask = [False] * b
    for i in drawn_rows:
        draw_mask[i] = True
    return torch.where(_to_device(draw_mask, torch.bool, dev), drawn, greedy)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from for one request: logits (R, V) -> (R, V) fp32 in vocabulary order, rows
    summing to 1; a greedy request's is one-hot at the argmax (speculative sampling compares these)."""
    if is_greedy(params):
        return torch.nn.functional.one_hot(ops.argmax(logits), logits.shape[1]).float()
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_k == 0 and params.top_p >= 1.0:
        return probs
    r, dev = probs.shape[0], probs.device
    ordered, order = probs.sort(dim=-1, descending=True)
    kept = filter_probs(ordered, torch.full((r,), min(params.top_k, probs.shape[1]), device=dev),
                        torch.full((r,), params.top_p, device=dev))
    kept = torch.zeros_like(probs).scatter_(1, order, kept)
    return kept / kept.sum(-1, keepdim=True)


class TokensInFlight:
    """Sampled tokens on their way to the host: on CUDA, a non-blocking copy into pinned memory and an event, so
    that reading them waits for the sampling alone and not for the work launched after it; or, where the step's
    argmax also stored them in host memory (landed: serving.token_ring), no copy."""

    def __init__(self, tokens: torch.Tensor, landed: LandedTokens | None = None):
        self.on_device = tokens  # (B,) int64 where they were sampled: a decode launched ahead reads them there
        self._done = None
        self._host = tokens
        self._landed = landed
        if landed is None and tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()

    def tolist(self) -> list[int]:
        if self._landed is not None:
            return self._landed.read()
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()
