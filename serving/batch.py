"""One engine step's work: the chunks the scheduler picked, flattened into a model.step.StepInput."""
from dataclasses import dataclass

import torch

from model.step import StepInput
from serving.sequence import Sequence


@dataclass
class ScheduledChunk:
    """seq computes its tokens [start, start + num_tokens) this step (start = seq.num_computed_tokens). A speculative
    verify chunk's tokens are seq's last token and then `drafts`, which seq does not hold yet."""
    seq: Sequence
    num_tokens: int
    drafts: tuple[int, ...] = ()

    @property
    def input_ids(self) -> list[int]:
        """The chunk's tokens."""
        return self.seq.token_slice(self.start, self.end - len(self.drafts)) + list(self.drafts)

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
    pages = None if slot_page_table is not None else [c.seq.pages for c in chunks]
    return step_from_lists(flatten_chunks(chunks, page_size), device, slot_page_table, pages)


@dataclass
class StepLists:
    """One step's flat varlen batch as host lists: what build_step_input turns into a StepInput, and what rank 0
    sends to tensor-parallel workers (serving.tp_worker), which build the same StepInput from it."""
    tokens: list[int]
    positions: list[int]
    slot_mapping: list[int]
    cu_seqlens: list[int]
    seqused_k: list[int]
    state_slots: list[int]
    max_seqlen_q: int
    snapshot_offsets: list[int]  # per chunk: its tokens before a snapshot point (0: none), and the point's slot
    snapshot_slots: list[int]
    position_slots: list[int] | None = None  # per token (StepInput.position_slots), in a speculative step


def flatten_chunks(chunks: list[ScheduledChunk], page_size: int, position_slots=None) -> StepLists:
    """position_slots: (state slot) -> the sequence's slots for the states after its first tokens, in a
    speculative step: a verify chunk's tokens but its last keep their states there."""
    tokens, positions, slot_mapping, cu_seqlens = [], [], [], [0]
    offsets, snap_slots = [], []
    per_token = [] if position_slots is not None else None
    for c in chunks:
        pending = c.seq.pending_snapshot_slot
        offsets.append(c.seq.pending_snapshot_tokens - c.start if pending is not None else 0)
        snap_slots.append(pending if pending is not None else c.seq.state_slot)
        if per_token is not None:
            kept = position_slots(c.seq.state_slot)[:len(c.drafts)] if c.drafts else []
            per_token += kept + [-1] * (c.num_tokens - len(kept))
        tokens += c.input_ids
        span = range(c.start, c.end)
        positions += span
        slot_mapping += c.seq.kv_slots(c.start, c.end, page_size)
        cu_seqlens.append(cu_seqlens[-1] + c.num_tokens)
    if per_token is not None and max(per_token, default=-1) < 0:
        per_token = None  # no drafts in the step: the GDN layers keep no per-token states
    return StepLists(tokens, positions, slot_mapping, cu_seqlens, [c.end for c in chunks],
                     [c.seq.state_slot for c in chunks], max(c.num_tokens for c in chunks), offsets, snap_slots,
                     per_token)


def step_from_lists(lists: StepLists, device, slot_page_table: torch.Tensor | None = None,
                    pages: list[list[int]] | None = None) -> StepInput:
    """The StepInput of the lists; its page table: slot_page_table's rows at the state slots, else `pages`
    (each sequence's page list) padded to the longest."""
    pin = torch.device(device).type == "cuda"  # pinned staging: the copies do not wait for the stream
    as_tensor = lambda values, dtype: torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)
    state_slots = as_tensor(lists.state_slots, torch.int64)
    if slot_page_table is None:
        max_pages = max(len(p) for p in pages)
        page_table = as_tensor([p + [0] * (max_pages - len(p)) for p in pages], torch.int32)
    else:
        page_table = slot_page_table.index_select(0, state_slots)  # (B, W)
    return StepInput(
        token_ids=as_tensor(lists.tokens, torch.int64),
        positions=as_tensor(lists.positions, torch.int64),
        cu_seqlens=as_tensor(lists.cu_seqlens, torch.int32),
        max_seqlen_q=lists.max_seqlen_q,
        cu_seqlens_host=tuple(lists.cu_seqlens),
        max_seqlen_k=max(lists.seqused_k),
        snapshot_offsets=tuple(lists.snapshot_offsets) if any(lists.snapshot_offsets) else None,
        snapshot_slots=as_tensor(lists.snapshot_slots, torch.int64) if any(lists.snapshot_offsets) else None,
        seqused_k=as_tensor(lists.seqused_k, torch.int32),
        page_table=page_table,
        slot_mapping=as_tensor(lists.slot_mapping, torch.int64),
        state_slots=state_slots,
        position_slots=as_tensor(lists.position_slots, torch.int64) if lists.position_slots is not None else None)
