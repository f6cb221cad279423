"""Where sequences lie in a flat varlen batch: shared by every varlen kernel.

- `sequence_span` (in a kernel): sequence b's (start, length) from cu_seqlens.
- `token_chunks` (on the host): the batch cut into CHUNK-token pieces that never cross a sequence (and restart at
  a snapshot cut), for kernels whose programs each take one piece; `chunk_span` reads a piece back in a kernel.
- `host_ints`: small host int tables (a step's snapshot offsets) moved once.
- `VarlenPlan` (`plan_varlen`): all of the above for one batch, checked and built once and shared by the layers of
  a model step, with workspaces they reuse.
"""
import functools
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from reference._checks import check_cu_seqlens, check_snapshots, check_tensor

CHUNK = 64  # tokens per piece of token_chunks


@triton.jit
def sequence_span(cu_seqlens_ptr, b, fixed_len, VARLEN: tl.constexpr):
    """(start, length) of sequence b: from cu_seqlens when VARLEN, else b * fixed_len and fixed_len."""
    if VARLEN:
        start = tl.load(cu_seqlens_ptr + b)
        length = tl.load(cu_seqlens_ptr + b + 1) - start
    else:
        start = b * fixed_len
        length = fixed_len
    return start, length


@triton.jit
def chunk_span(chunk_ptr, c):
    """(start, end, sequence) of piece c of a token_chunks table: tokens [start, end) of that sequence."""
    return tl.load(chunk_ptr + 3 * c), tl.load(chunk_ptr + 3 * c + 1), tl.load(chunk_ptr + 3 * c + 2)


@functools.lru_cache(maxsize=8)
def token_chunks(cu: tuple[int, ...], device, cuts: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(pieces, 3) int32 rows [start, end, sequence]: every sequence cut into CHUNK-token pieces, in order, restarting
    at its cut (cuts[i]: an absolute token position strictly inside sequence i where a kernel stops for a
    snapshot; 0: none); and (N,) int32 the index of each sequence's first piece. Built from the host copy of
    cu_seqlens, vectorised on the CPU (a Python loop costs about 1 us a piece, ~0.25 ms at 16k tokens, while the
    GPU waits) and moved by one pinned non-blocking copy. Cached: the layers of a model step plan the same
    cu_seqlens (kernels only read the tables)."""
    n = len(cu) - 1
    cuts = cuts or (0,) * n
    seg_lo, seg_hi, seg_seq = [], [], []  # segments: a sequence, or its two halves around its cut
    for i in range(n):
        bounds = [cu[i], cuts[i], cu[i + 1]] if cuts[i] else [cu[i], cu[i + 1]]
        for lo, hi in zip(bounds, bounds[1:]):
            seg_lo.append(lo), seg_hi.append(hi), seg_seq.append(i)
    lo, hi, owner = (torch.tensor(v, dtype=torch.int64) for v in (seg_lo, seg_hi, seg_seq))
    n_pieces = (hi - lo + CHUNK - 1) // CHUNK  # (segments,)
    seg_first = torch.cumsum(n_pieces, 0) - n_pieces
    seg = torch.repeat_interleave(torch.arange(len(seg_lo)), n_pieces)  # (pieces,) the segment of each piece
    start = lo[seg] + (torch.arange(seg.numel()) - seg_first[seg]) * CHUNK
    table = torch.stack([start, torch.minimum(start + CHUNK, hi[seg]), owner[seg]], 1).flatten()
    first = seg_first[torch.searchsorted(owner, torch.arange(n))]  # each sequence's first segment's first piece
    # `first` starts 16-byte aligned (Triton compiles a kernel again for each pointer alignment it meets)
    gap = -3 * seg.numel() % 4
    both = torch.cat([table, table.new_zeros(gap), first]).to(torch.int32)
    if torch.device(device).type == "cuda":  # pinned and non-blocking: no wait for the work queued before it
        both = both.pin_memory().to(device, non_blocking=True)
    return both[:3 * seg.numel()].view(-1, 3), both[3 * seg.numel() + gap:]


@functools.lru_cache(maxsize=8)
def host_ints(values: tuple[int, ...], device) -> torch.Tensor:
    """(len,) int32 on device from host ints, one pinned non-blocking copy, cached (a step's layers share it)."""
    t = torch.tensor(values, dtype=torch.int32)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t


@dataclass
class VarlenPlan:
    """A varlen batch's host-side layout (cu_seqlens' values, the snapshot cuts, the piece tables), checked and built
    once. Every GDN prefill layer of a model step shares one (model.step.StepInput.plans): checking cu_seqlens,
    state_slots and the snapshots and looking the tables up again in each layer cost more host time than its five
    launches (FINDINGS, serving). Kernels also take their workspaces from it (`buffer`): the
    step's layers run in order on one stream, so each layer's scratch is free again when the next one starts."""
    cu_seqlens: torch.Tensor  # (N+1,) int32/int64, the tensor the plan was built from
    state_slots: torch.Tensor  # (N,)
    snapshot_slots: torch.Tensor | None  # (N,), where some sequence snapshots
    cu: tuple[int, ...]  # cu_seqlens' values (host)
    offsets: tuple[int, ...] | None  # snapshot offsets inside each sequence (0: none); None: no snapshot
    cuts: tuple[int, ...] | None  # the same as absolute token positions (check_snapshots)
    chunks: torch.Tensor  # token_chunks(cu, cuts): (pieces, 3) int32, restarting at the cuts
    first_chunk: torch.Tensor  # (N,) int32
    plain_chunks: torch.Tensor  # token_chunks(cu): the pieces without cuts
    cu32: torch.Tensor  # cu_seqlens as int32
    offsets_dev: torch.Tensor | None  # offsets as (N,) int32 on the device
    cuts_dev: torch.Tensor | None  # cuts as (N,) int32 on the device
    buffers: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.cu) - 1

    @property
    def num_tokens(self) -> int:
        return self.cu[-1]

    def check_for(self, cu_seqlens, state_slots, total: int, snapshot_slots, device: torch.device) -> None:
        """Raise ValueError unless the plan was built for these tensors and total tokens (a call that passes both a
        plan and the batch's own arguments), on the device of the layer's tensors."""
        if self.cu_seqlens.device != device:
            raise ValueError(f"cu_seqlens and state_slots must be on {device} (the layer's tensors), got "
                             f"{self.cu_seqlens.device}")
        if (cu_seqlens is not self.cu_seqlens or state_slots is not self.state_slots or total != self.num_tokens
                or (self.offsets is not None and snapshot_slots is not self.snapshot_slots)):
            raise ValueError(f"plan was built for another batch: {self.num_seqs} sequences of {self.num_tokens} "
                             f"tokens (cu_seqlens, state_slots and snapshot_slots must be the plan's tensors), got "
                             f"{total} tokens")

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised workspace of this shape and dtype, the same tensor for every layer that asks by name."""
        t = self.buffers.get(name)
        if t is None or t.shape != shape or t.dtype != dtype:
            t = self.buffers[name] = torch.empty(shape, dtype=dtype, device=self.cu_seqlens.device)
        return t


def plan_varlen(cu_seqlens: torch.Tensor, total: int, state_slots: torch.Tensor, *, cu_seqlens_host=None,
                snapshot_offsets=None, snapshot_slots=None) -> VarlenPlan:
    """Check a varlen batch (cu_seqlens (N+1,) over `total` tokens; its host copy cu_seqlens_host spares a device
    read; one state slot a sequence; the snapshot offsets and slots of model.step.StepInput) and lay it out."""
    index = dict(ndim=1, dtype=(torch.int32, torch.int64), contiguous=True)
    check_tensor("state_slots", state_slots, **index)
    check_tensor("cu_seqlens", cu_seqlens, **index, device=state_slots.device)
    cu = tuple(check_cu_seqlens("cu_seqlens", cu_seqlens, total, cu_seqlens_host))
    if state_slots.numel() != len(cu) - 1:
        raise ValueError(f"state_slots must have one slot per sequence ({len(cu) - 1}), got {state_slots.numel()}")
    cuts = check_snapshots(list(cu), snapshot_offsets, snapshot_slots, state_slots)
    dev = cu_seqlens.device
    chunks, first_chunk = token_chunks(cu, dev, cuts)
    plain = token_chunks(cu, dev)[0] if cuts else chunks
    offsets = tuple(snapshot_offsets) if cuts else None
    return VarlenPlan(cu_seqlens, state_slots, snapshot_slots if cuts else None, cu, offsets, cuts, chunks,
                      first_chunk, plain, cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32),
                      host_ints(offsets, dev) if cuts else None, host_ints(cuts, dev) if cuts else None)


def plan_for(plan: VarlenPlan | None, cu_seqlens, total: int, state_slots, device: torch.device, *,
             cu_seqlens_host=None, snapshot_offsets=None, snapshot_slots=None) -> VarlenPlan:
    """A varlen kernel's batch on `device` (its layer tensors'): the caller's plan checked against these arguments
    (VarlenPlan.check_for), else a new plan of them (plan_varlen)."""
    if plan is None:
        plan = plan_varlen(cu_seqlens, total, state_slots, cu_seqlens_host=cu_seqlens_host,
                           snapshot_offsets=snapshot_offsets, snapshot_slots=snapshot_slots)
    plan.check_for(cu_seqlens, state_slots, total, snapshot_slots, device)
    return plan
