"""One engine step's work: the chunks the scheduler picked, flattened into a model.step.StepInput."""
from dataclasses import dataclass

import torch

from model.step import StepInput
from serving.sequence import Sequence


@dataclass
class ScheduledChunk:
    """seq computes its tokens [start, start + num_tokens) this step (start = seq.num_computed_tokens)."""
    seq: Sequence
    num_tokens: int

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


def build_step_input(chunks: list[ScheduledChunk], page_size: int, device,
                     slot_page_table: torch.Tensor | None = None) -> StepInput:
    """The flat varlen batch of the chunks: N = sum of num_tokens over B = len(chunks) sequences. The page table
    is (B, max pages of the batch) from seq.pages, or the rows of slot_page_table (one row per state slot, kept
    up to date by the caller: serving.model_runner) at the chunks' state slots."""
    tokens, positions, slot_mapping, cu_seqlens = [], [], [], [0]
    for c in chunks:
        prompt, n_prompt = c.seq.prompt_ids, c.seq.num_prompt_tokens
        tokens += prompt[c.start:c.end] if c.end <= n_prompt else c.seq.token_ids[c.start:c.end]
        span = range(c.start, c.end)
        positions += span
        slot_mapping += [c.seq.pages[p // page_size] * page_size + p % page_size for p in span]
        cu_seqlens.append(cu_seqlens[-1] + c.num_tokens)
    pin = torch.device(device).type == "cuda"  # pinned staging: the copies do not wait for the stream
    as_tensor = lambda values, dtype: torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)
    state_slots = as_tensor([c.seq.state_slot for c in chunks], torch.int64)
    if slot_page_table is None:
        max_pages = max(len(c.seq.pages) for c in chunks)
        page_table = as_tensor([c.seq.pages + [0] * (max_pages - len(c.seq.pages)) for c in chunks], torch.int32)
    else:
        page_table = slot_page_table.index_select(0, state_slots)  # (B, W)
    return StepInput(
        token_ids=as_tensor(tokens, torch.int64),
        positions=as_tensor(positions, torch.int64),
        cu_seqlens=as_tensor(cu_seqlens, torch.int32),
        max_seqlen_q=max(c.num_tokens for c in chunks),
        seqused_k=as_tensor([c.end for c in chunks], torch.int32),
        page_table=page_table,
        slot_mapping=as_tensor(slot_mapping, torch.int64),
        state_slots=state_slots)
