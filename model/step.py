"""What one forward step needs besides the tokens: a flat varlen batch plus its cache addresses."""
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class CapturedGrid(NamedTuple):
    """A CUDA graph's attention launch, which serves every step of its graph: splits, its KV splits (a host int, the
    most any of those steps asks for: the workspace's layout); used, (1,) int32 on the device, the splits this step
    runs; programs, for graphs of several sequences, the (big, short) work-list programs a KV head (kernels.
    paged_decode_attention's work_programs), or None: one sequence's (M-block, KV, splits) grid."""
    splits: int
    used: torch.Tensor
    programs: tuple[int, int] | None = None


@dataclass
class StepInput:
    """A batch of B sequences, each contributing q_len_b >= 1 new tokens, flattened to N tokens.

    token_ids: (N,) int64        positions: (N,) int64, absolute position of each new token
    cu_seqlens: (B+1,) int32     max_seqlen_q: longest q_len_b (host int)
    seqused_k: (B,) int32        cached tokens of each sequence after this step (prefix + new)
    page_table: (B, max_pages) int32, the KV pages of each sequence in order
    slot_mapping: (N,) int64     flat KV slot (page * page_size + offset) where each new token is written
    state_slots: (B,) int64      GDN state slot (conv window and recurrent state) of each sequence
    cos, sin: (N, rotary_dim/2) fp32, the RoPE of each position, shared by every attention layer
    cu_seqlens_host: cu_seqlens as host ints, when the builder has them: kernels that plan on the host read these
    instead of the device tensor (no sync)
    max_seqlen_k: a host bound of seqused_k when the builder knows one (None: the page table's capacity bounds it);
    attention sizes its KV splits by it
    snapshot_offsets: host ints, one per sequence, or None: sequence b's GDN state (conv window and recurrent
    state) after its first snapshot_offsets[b] new tokens (0 < offset < q_len_b; 0: none) is also written to
    slot snapshot_slots[b] ((B,) int64), for the prefix cache: a snapshot inside a chunk costs no extra step
    embeddings: (N, hidden), the token embeddings when the step builder gathered them together with its other rows
    (a decode step's page-table rows and RoPE rows: kernels.gather_rows, one launch); None: the model embeds token_ids
    position_slots: (N,) int64 or None: a speculative verify step's per-token GDN slots. Where position_slots[i] >= 0,
    the GDN state (conv window and recurrent state) after token i is also written to that slot, so that a step that
    keeps only the first tokens of a sequence can roll back to the state after its last kept one; a sequence's last
    token's state goes to its state slot only where its position slot is -1
    kv_splits: a CapturedGrid or None: a captured step's attention launch (serving.prefill_graphs fills its
    device count each step)
    plans: what kernels lay out on the host once for all the step's layers, by kernel (kernels.gdn_prefill.step_plan)
    """
    token_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen_q: int
    seqused_k: torch.Tensor
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    state_slots: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    cu_seqlens_host: tuple[int, ...] | None = None
    max_seqlen_k: int | None = None
    snapshot_offsets: tuple[int, ...] | None = None
    snapshot_slots: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None
    position_slots: torch.Tensor | None = None
    kv_splits: "CapturedGrid | None" = None
    plans: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.token_ids.numel()

    @property
    def last_token_indices(self) -> torch.Tensor:
        """(B,) index of each sequence's last new token in the flat batch."""
        return (self.cu_seqlens[1:] - 1).long()
