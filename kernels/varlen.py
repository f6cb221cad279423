"""Where sequences lie in a flat varlen batch: shared by every varlen kernel.

- `sequence_span` (in a kernel): sequence b's (start, length) from cu_seqlens.
- `token_chunks` (on the host): the batch cut into CHUNK-token pieces that never cross a sequence (and restart at
  a snapshot cut), for kernels whose programs each take one piece; `chunk_span` reads a piece back in a kernel.
- `host_ints`: small host int tables (a step's snapshot offsets) moved once.
"""
import functools

import torch
import triton
import triton.language as tl

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
