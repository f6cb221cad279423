"""Greedy decoding's reduction: the argmax of each row of logits; and the next decode step's inputs it can write."""
from typing import NamedTuple

import torch


def argmax(logits: torch.Tensor) -> torch.Tensor:
    # logits: (B, V) -> (B,) int64: each row's first maximum, a NaN counting as the largest (torch.argmax)
    return logits.argmax(-1)


class DecodeAdvance(NamedTuple):
    """Where a decode step's greedy argmax also writes the next step's inputs (serving.model_runner's fed decode).
    inputs: (5, B) int32 rows token, position, state slot, KV slot, cached tokens (the step's own, rewritten in
    place); table: (slots, W) int32 page table, a row a state slot; rows whose slot is dummy_slot (padding) stay.
    token_ring: (R, B) int64 or None: each row not of the dummy slot also leaves its token at [p % R, row], p its
    position in this step (serving.token_ring: pinned host memory, so that the host reads the tokens uncopied)."""
    inputs: torch.Tensor
    table: torch.Tensor
    page_size: int
    dummy_slot: int
    token_ring: torch.Tensor | None = None


def advance_decode_inputs(tokens: torch.Tensor, advance: DecodeAdvance) -> None:
    """tokens: (B,) int64, the step's greedy tokens. Each row not of the dummy slot moves one position on: its token
    the greedy one, position p + 1, KV slot table[slot, (p + 1) // page] * page + (p + 1) % page (the column clamped
    to the table), p + 2 cached tokens; and its token lands in the token ring, where there is one."""
    token, position, slot, kv_slot, cached = advance.inputs
    real = slot != advance.dummy_slot
    if advance.token_ring is not None:
        rows = real.nonzero()[:, 0].cpu()
        ring_rows = (position[real].long() % advance.token_ring.shape[0]).cpu()
        advance.token_ring[ring_rows, rows] = tokens[real].to(advance.token_ring)
    nxt = position + 1
    column = torch.clamp(nxt // advance.page_size, max=advance.table.shape[1] - 1)
    page = advance.table[slot.long(), column.long()]
    token.copy_(torch.where(real, tokens.to(token.dtype), token))
    kv_slot.copy_(torch.where(real, page * advance.page_size + nxt % advance.page_size, kv_slot))
    cached.copy_(torch.where(real, nxt + 1, cached))
    position.copy_(torch.where(real, nxt, position))
