"""Where sequences lie in a flat varlen batch: shared by every varlen kernel.

- `sequence_span` (in a kernel): sequence b's (start, length) from cu_seqlens.
- `token_chunks` (on the host): the batch cut into CHUNK-token pieces that never cross a sequence, for kernels
  whose programs each take one piece; `chunk_span` reads a piece back in a kernel.
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
def token_chunks(cu: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(pieces, 3) int32 rows [start, end, sequence]: every sequence cut into CHUNK-token pieces, in order; and
    (N,) int32 the index of each sequence's first piece. Built from the host copy of cu_seqlens, vectorised on
    the CPU (a Python loop costs about 1 us a piece, ~0.25 ms at 16k tokens, while the GPU waits) and moved by
    one pinned non-blocking copy. Cached: the layers of a model step plan the same cu_seqlens (kernels only
    read the tables)."""
    cu_t = torch.tensor(cu, dtype=torch.int64)
    n_chunks = (cu_t[1:] - cu_t[:-1] + CHUNK - 1) // CHUNK  # (N,)
    first = torch.cumsum(n_chunks, 0) - n_chunks
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1), n_chunks)  # (pieces,) the sequence of each piece
    start = cu_t[seq] + (torch.arange(seq.numel()) - first[seq]) * CHUNK
    table = torch.stack([start, torch.minimum(start + CHUNK, cu_t[seq + 1]), seq], 1).flatten()
    both = torch.cat([table, first]).to(torch.int32)
    if torch.device(device).type == "cuda":  # pinned and non-blocking: no wait for the work queued before it
        both = both.pin_memory().to(device, non_blocking=True)
    return both[:3 * seq.numel()].view(-1, 3), both[3 * seq.numel():]
