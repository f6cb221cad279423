"""Where sequences lie in a flat varlen batch: shared by every varlen kernel.

- `sequence_span` (in a kernel): sequence b's (start, length) from cu_seqlens.
- `token_chunks` (on the host): the batch cut into CHUNK-token pieces that never cross a sequence (and restart at
  a snapshot cut), for kernels whose programs each take one piece; `chunk_span` reads a piece back in a kernel.
- `host_ints`: small host int tables (a step's snapshot offsets) moved once.
- `VarlenPlan` (`plan_varlen`): all of the above for one batch, checked and built once and shared by the layers of
  a model step, with workspaces they reuse.
- `DeviceBatch` (`device_plan`): the same layout built on the device from a captured step's static inputs, for
  every batch of up to max_seqs sequences and rows tokens: a CUDA graph replays it with no host planning. Its
  tables are sized for the worst case; the pieces past the real ones are empty (start == end), the sequences past
  the real ones hold no tokens and name the padding slot.
"""
import functools
import math
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from reference.checks import check_cu_seqlens, check_snapshots, check_tensor, snapshot_cuts

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


def max_pieces(rows: int, max_seqs: int) -> int:
    """An upper bound of token_chunks' pieces for max_seqs sequences (each with at most one cut) of rows tokens."""
    return -(-rows // CHUNK) + 2 * max_seqs


@triton.jit
def _write_pieces(table_ptr, p, lo, hi, seq, BT: tl.constexpr, BLOCK: tl.constexpr):
    """Rows p, p+1, .. of a piece table: tokens [lo, hi) of sequence seq in BT-token pieces. Returns the next row."""
    n = (hi - lo + BT - 1) // BT
    r = tl.arange(0, BLOCK)
    for b in range(0, n, BLOCK):
        k = b + r
        start = lo + k * BT
        row = table_ptr + (p + k) * 3
        tl.store(row, start, mask=k < n)
        tl.store(row + 1, tl.minimum(start + BT, hi), mask=k < n)
        tl.store(row + 2, seq + 0 * k, mask=k < n)
    return p + n


@triton.jit
def _empty_pieces(table_ptr, p, n_pieces, BLOCK: tl.constexpr):
    """Rows p .. n_pieces - 1 of a piece table: empty pieces (start == end == 0 of sequence 0)."""
    r = tl.arange(0, BLOCK)
    for b in range(p, n_pieces, BLOCK):
        k = b + r
        for f in tl.static_range(3):
            tl.store(table_ptr + k * 3 + f, 0 * k, mask=k < n_pieces)


@triton.jit
def _device_plan_kernel(cu_ptr, cuts_ptr, chunk_ptr, first_ptr, plain_ptr, n_seqs, n_pieces, BT: tl.constexpr,
                        BLOCK: tl.constexpr):
    # grid (1,): token_chunks of cu_seqlens with and without the cuts (cuts[i]: 0 or an absolute token strictly
    # inside sequence i), sequences in order, each sequence's pieces in order (the state pass walks them so)
    p = 0
    q = 0
    for i in range(n_seqs):
        lo = tl.load(cu_ptr + i)
        hi = tl.load(cu_ptr + i + 1)
        cut = tl.load(cuts_ptr + i)
        mid = tl.where(cut > 0, cut, hi)
        tl.store(first_ptr + i, p)
        p = _write_pieces(chunk_ptr, p, lo, mid, i, BT, BLOCK)
        p = _write_pieces(chunk_ptr, p, mid, hi, i, BT, BLOCK)
        q = _write_pieces(plain_ptr, q, lo, hi, i, BT, BLOCK)
    _empty_pieces(chunk_ptr, p, n_pieces, BLOCK)
    _empty_pieces(plain_ptr, q, n_pieces, BLOCK)


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
    """A varlen batch's layout (the piece tables, the snapshot cuts) for its kernels, checked and built once. Every
    GDN prefill layer of a model step shares one (model.step.StepInput.plans): checking cu_seqlens, state_slots and
    the snapshots and looking the tables up again in each layer cost more host time than its five launches
    (FINDINGS, serving). Kernels also take their workspaces from it (`buffer`): the step's layers run in order on
    one stream, so each layer's scratch is free again when the next one starts. A host plan (plan_varlen) knows
    cu_seqlens' values; a device plan (DeviceBatch.plan) covers every batch of up to num_seqs sequences and
    num_tokens tokens, its kernels' grids sized for the worst case."""
    cu_seqlens: torch.Tensor  # (N+1,) int32/int64, the tensor the plan was built from
    state_slots: torch.Tensor  # (N,)
    snapshot_slots: torch.Tensor | None  # (N,), where some sequence may snapshot
    num_seqs: int
    num_tokens: int
    chunks: torch.Tensor  # token_chunks(cu, cuts): (pieces, 3) int32, restarting at the cuts
    first_chunk: torch.Tensor  # (N,) int32
    plain_chunks: torch.Tensor  # token_chunks(cu): the pieces without cuts
    cu32: torch.Tensor  # cu_seqlens as int32
    offsets_dev: torch.Tensor | None  # snapshot offsets inside each sequence (0: none) as (N,) int32 on the device
    cuts_dev: torch.Tensor | None  # the same as absolute token positions (check_snapshots)
    buffers: dict = field(default_factory=dict, repr=False)
    # the sequences the GDN state pass sizes its dv split for (kernels.gdn_prefill.state_block); 0: num_seqs. A
    # device plan's grid has room for max_seqs, but its latency case is one returning turn
    split_for_seqs: int = 0

    @property
    def snapshots(self) -> bool:
        """Whether the kernels read snapshot points (offsets_dev, cuts_dev, snapshot_slots)."""
        return self.offsets_dev is not None

    def check_for(self, cu_seqlens, state_slots, total: int, snapshot_slots, device: torch.device) -> None:
        """Raise ValueError unless the plan was built for these tensors and total tokens (a call that passes both a
        plan and the batch's own arguments), on the device of the layer's tensors."""
        if self.cu_seqlens.device != device:
            raise ValueError(f"cu_seqlens and state_slots must be on {device} (the layer's tensors), got "
                             f"{self.cu_seqlens.device}")
        if (cu_seqlens is not self.cu_seqlens or state_slots is not self.state_slots or total != self.num_tokens
                or (self.snapshots and snapshot_slots is not self.snapshot_slots)):
            raise ValueError(f"plan was built for another batch: {self.num_seqs} sequences of {self.num_tokens} "
                             f"tokens (cu_seqlens, state_slots and snapshot_slots must be the plan's tensors), got "
                             f"{total} tokens")

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised workspace of this shape and dtype, the same storage for every layer (and every device
        plan of one DeviceBatch) that asks by name: a view of the first one large enough."""
        numel = math.prod(shape)
        t = self.buffers.get(name)
        if t is None or t.numel() < numel or t.dtype != dtype:
            t = self.buffers[name] = torch.empty(numel, dtype=dtype, device=self.cu_seqlens.device)
        return t[:numel].view(shape)


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
    cu32 = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    return VarlenPlan(cu_seqlens, state_slots, snapshot_slots if cuts else None, len(cu) - 1, cu[-1], chunks,
                      first_chunk, plain, cu32, host_ints(tuple(snapshot_offsets), dev) if cuts else None,
                      host_ints(cuts, dev) if cuts else None)


def plan_for(plan: VarlenPlan | None, cu_seqlens, total: int, state_slots, device: torch.device, *,
             cu_seqlens_host=None, snapshot_offsets=None, snapshot_slots=None) -> VarlenPlan:
    """A varlen kernel's batch on `device` (its layer tensors'): the caller's plan checked against these arguments
    (VarlenPlan.check_for), else a new plan of them (plan_varlen)."""
    if plan is None:
        plan = plan_varlen(cu_seqlens, total, state_slots, cu_seqlens_host=cu_seqlens_host,
                           snapshot_offsets=snapshot_offsets, snapshot_slots=snapshot_slots)
    plan.check_for(cu_seqlens, state_slots, total, snapshot_slots, device)
    return plan


class DeviceBatch:
    """The static varlen inputs of captured steps (up to max_seqs sequences, up to max_rows tokens) and the piece
    tables built from them on the device. `fill` copies a step's batch in (the sequences past its own hold no tokens
    and no cut; kernels skip a sequence without tokens, so its stale slots are never read); `plan(rows)` is the
    VarlenPlan of a graph of `rows` tokens, and `build(rows)`, launched inside that graph, lays its tables out."""

    def __init__(self, max_seqs: int, max_rows: int, device):
        self.max_seqs, self.max_rows = max_seqs, max_rows
        n, dev = max_seqs, torch.device(device)
        self.ints = torch.zeros(3 * n + 1, dtype=torch.int32, device=dev)  # cu_seqlens | offsets | cuts
        self.cu_seqlens, self.offsets, self.cuts = self.ints[:n + 1], self.ints[n + 1:2 * n + 1], self.ints[2 * n + 1:]
        self.state_slots = torch.zeros(n, dtype=torch.int64, device=dev)
        self.snapshot_slots = torch.zeros(n, dtype=torch.int64, device=dev)
        pieces = max_pieces(max_rows, n)
        self.chunks = torch.zeros(pieces, 3, dtype=torch.int32, device=dev)
        self.plain_chunks = torch.zeros(pieces, 3, dtype=torch.int32, device=dev)
        self.first_chunk = torch.zeros(n, dtype=torch.int32, device=dev)
        self.buffers: dict = {}  # the workspaces of every plan: each graph's step runs alone on one stream

    def fill(self, cu: tuple[int, ...], state_slots: torch.Tensor, snapshot_offsets: tuple[int, ...] | None,
             snapshot_slots: torch.Tensor | None) -> None:
        """A step's batch: cu its cu_seqlens' host values (at most max_seqs sequences, max_rows tokens), its state
        slots (B,) and snapshots (kernels.varlen.plan_varlen's arguments, already checked by the step's builder)."""
        b, n = len(cu) - 1, self.max_seqs
        if b > n or cu[-1] > self.max_rows:
            raise ValueError(f"a device batch holds up to {n} sequences of {self.max_rows} tokens, got {b} of {cu[-1]}")
        offsets = list(snapshot_offsets) if snapshot_offsets is not None else [0] * b
        cuts = snapshot_cuts(cu, offsets)
        pad = n - b
        values = [*cu, *[cu[-1]] * pad, *offsets, *[0] * pad, *cuts, *[0] * pad]
        # a fresh pinned tensor a step: the allocator keeps it until the copy ran (a reused one could be rewritten
        # before an earlier step's copy)
        self.ints.copy_(torch.tensor(values, dtype=torch.int32).pin_memory()
                        if self.ints.is_cuda else torch.tensor(values, dtype=torch.int32), non_blocking=True)
        self.state_slots[:b].copy_(state_slots)
        self.snapshot_slots[:b].copy_(snapshot_slots if snapshot_slots is not None else state_slots)

    def plan(self, rows: int) -> VarlenPlan:
        """The plan of a graph of `rows` tokens (rows <= max_rows) over this batch's tensors."""
        pieces = max_pieces(rows, self.max_seqs)
        return VarlenPlan(self.cu_seqlens, self.state_slots, self.snapshot_slots, self.max_seqs, rows,
                          self.chunks[:pieces], self.first_chunk, self.plain_chunks[:pieces], self.cu_seqlens,
                          self.offsets, self.cuts, self.buffers, split_for_seqs=1)

    def build(self, rows: int) -> None:
        """Lay out plan(rows)'s piece tables from the filled batch (one launch)."""
        pieces = max_pieces(rows, self.max_seqs)
        _device_plan_kernel[(1,)](self.cu_seqlens, self.cuts, self.chunks, self.first_chunk, self.plain_chunks,
                                  self.max_seqs, pieces, BT=CHUNK, BLOCK=64)
