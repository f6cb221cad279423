"""Plain generation over a SequenceCache: the model's own greedy output, the baseline the engine must equal."""
from collections.abc import Iterator

import torch

from model.cache import SequenceCache
from model.model import Qwen35ForCausalLM


@torch.no_grad()
def greedy(model: Qwen35ForCausalLM, input_ids: torch.Tensor, max_new_tokens: int, *,
           cache: SequenceCache | None = None) -> torch.Tensor:
    """input_ids: (batch, T) -> the next max_new_tokens argmax tokens (batch, max_new_tokens), no early stop.
    Prefill runs once over the prompt, then one decode step per token."""
    b, t = input_ids.shape
    cache = cache or model.new_cache(b, t + max_new_tokens)
    logits = model(input_ids, cache, all_logits=False)[:, -1]
    out = []
    for i in range(max_new_tokens):
        token = logits.argmax(-1)
        out.append(token)
        if i + 1 < max_new_tokens:
            logits = model(token[:, None], cache, all_logits=False)[:, -1]
    return torch.stack(out, dim=1)


@torch.no_grad()
def stream(model: Qwen35ForCausalLM, cache: SequenceCache, new_ids: list[int], max_new_tokens: int,
           stop_ids: tuple[int, ...] = ()) -> Iterator[int]:
    """Append new_ids to a batch-1 cache, then yield greedy tokens until a stop id or max_new_tokens.
    The last token yielded is not in the cache yet: a following turn passes it first in its new_ids."""
    if cache.batch != 1:
        raise ValueError(f"stream needs a batch-1 cache, got batch {cache.batch}")
    logits = model(torch.tensor([new_ids], device=cache.device), cache, all_logits=False)[0, -1]
    for i in range(max_new_tokens):
        token = int(logits.argmax())
        yield token
        if token in stop_ids or i + 1 == max_new_tokens:
            return
        logits = model(torch.tensor([[token]], device=cache.device), cache, all_logits=False)[0, -1]
