"""Several row gathers in one launch: out_k = tables_k[indices_k] for up to four (table, indices) pairs.

Why a kernel: a decode step's graph began with four small torch launches before its first projection: the
token embeddings, the sequences' page-table rows and the RoPE cos and sin of their positions (each an
index_select), none of them with programmatic dependent launch, so the first GEMV could start streaming its
weights only once the last had exited. Here one grid (B, chunks) copies every row in CHUNK-element pieces and lets
its dependents launch at once. Bound: bytes are nothing (an embedding row is 2-8 KiB); predicted saving about
three launch gaps, 3-6 us a decode step.

Indices must lie in [0, rows of their table): the graph cannot check them on the host, so the kernel clamps them
(memory safety, not a result); the eager reference (`reference.gather_rows`) raises on them.
"""
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels import pdl, registry, stamps
from kernels.host_math import cdiv
from kernels.norms import triton_runs_on
from kernels.registry import Impl
from reference.gather import check_pairs

MAX_TABLES = 4
CHUNK = 1024  # elements a program copies
NUM_WARPS = 4


@triton.jit
def _copy_piece(table_ptr, stride, rows, index_ptr, out_ptr, width, b, piece, CHUNK: tl.constexpr):
    # out[b, piece * CHUNK : ...] = table[index[b], same columns]
    row = tl.load(index_ptr + b).to(tl.int64)
    row = tl.minimum(tl.maximum(row, 0), rows - 1)
    cols = piece * CHUNK + tl.arange(0, CHUNK)
    mask = cols < width
    values = tl.load(table_ptr + row * stride + cols, mask=mask)
    tl.store(out_ptr + b.to(tl.int64) * width + cols, values, mask=mask)


@triton.jit
def _gather_rows_kernel(t0, s0, r0, i0, o0, w0, t1, s1, r1, i1, o1, w1, t2, s2, r2, i2, o2, w2,
                        t3, s3, r3, i3, o3, w3, first1, first2, first3, stamps_ptr, CHUNK: tl.constexpr,
                        STAMPS: tl.constexpr, PDL: tl.constexpr):
    # grid (B, chunks): chunk c belongs to table k where first_k <= c < first_{k+1} (first0 = 0)
    b, c = tl.program_id(0), tl.program_id(1)
    stamps.wait(stamps_ptr, STAMPS, PDL)
    pdl.release_dependents(PDL)
    if c < first1:
        _copy_piece(t0, s0, r0, i0, o0, w0, b, c, CHUNK)
    elif c < first2:
        _copy_piece(t1, s1, r1, i1, o1, w1, b, c - first1, CHUNK)
    elif c < first3:
        _copy_piece(t2, s2, r2, i2, o2, w2, b, c - first2, CHUNK)
    else:
        _copy_piece(t3, s3, r3, i3, o3, w3, b, c - first3, CHUNK)


def _check(tables: Sequence[torch.Tensor], indices: Sequence[torch.Tensor]) -> int:
    """reference.gather.check_pairs, plus what the kernel needs: at most MAX_TABLES pairs, rows contiguous, a device
    Triton runs on. Returns the batch (rows each output has)."""
    batch = check_pairs(tables, indices)
    if len(tables) > MAX_TABLES:
        raise ValueError(f"tables and indices must be 1..{MAX_TABLES} pairs, got {len(tables)}")
    for k, table in enumerate(tables):
        if table.shape[0] < 1 or table.stride(1) != 1:
            raise ValueError(f"tables[{k}] must have rows and be contiguous within a row, got shape "
                             f"{tuple(table.shape)} and strides {table.stride()}")
    if not triton_runs_on(tables[0].device):
        raise ValueError(f"tables must be on a CUDA device (or run with TRITON_INTERPRET=1), got {tables[0].device}")
    return batch


def gather_rows(tables: Sequence[torch.Tensor], indices: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """tables[k]: (rows_k, width_k), indices[k]: (B,) int -> [(B, width_k) = tables[k][indices[k]]], one launch."""
    batch = _check(tables, indices)
    outs = [torch.empty(batch, t.shape[1], device=t.device, dtype=t.dtype) for t in tables]
    if batch == 0:
        return outs
    pieces = [cdiv(t.shape[1], CHUNK) for t in tables]
    # the chunk index where table k starts (past the last chunk for the unused slots)
    firsts = [sum(pieces[:k]) if k < len(tables) else sum(pieces) for k in range(1, MAX_TABLES)]
    args = []
    for k in range(MAX_TABLES):
        j = min(k, len(tables) - 1)  # unused slots repeat the last pair: no chunk reaches them
        t = tables[j]
        args += [t, t.stride(0), t.shape[0], indices[j], outs[j], t.shape[1]]
    stamp, stamping = stamps.slot("gather_rows", tables[0].device)
    _gather_rows_kernel[(batch, sum(pieces))](*args, *firsts, stamp, CHUNK=CHUNK, STAMPS=stamping,
                                               num_warps=NUM_WARPS, **pdl.launch_options(tables[0].device))
    return outs



registry.define("gather_rows")
registry.register("gather_rows", Impl("gather_rows", "triton", gather_rows))
