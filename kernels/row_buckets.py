"""Row counts padded for cuBLAS: eager prefill projections run on a bucket's rows (row_bucket).

cuBLAS chooses its kernel on the host for each new shape, about ten times the cost of a call of a shape it has seen,
and every prefill step brings new row counts. So kernels.linear runs prefill projections on rows padded to their
bucket (the engine warms every bucket up) and drops the padding rows' products (prefill
steps faster padded than not: FINDINGS).

The padding is free when the operand's storage already has the rows: the elementwise kernels that feed projections
(norms, SwiGLU, the GDN output norm) allocate their outputs with empty_rows, and padded_operand then views the
padded rows in place instead of copying (the rows past the operand's own hold whatever the memory held; their
products are dropped, and a matmul's rows do not mix). Graph capture and the CPU pad nothing, nor does an eager
decode step of at most DOT_MAX_ROWS rows (decode_step_rows), so that it computes what its CUDA graph computes.
"""
import contextlib
import math

import torch

MATMUL_ROW_BUCKET = 64
# past COARSE_ROWS, buckets lie COARSE_ROW_BUCKET apart: a first turn's 8k-token steps need 24 shapes (cuBLAS picks,
# prefill graphs) instead of 96, for at most 12% padding rows
COARSE_ROWS, COARSE_ROW_BUCKET = 2048, 256
# up to this many rows a projection runs kernels.linear's GEMV (its MAX_ROWS), which is not padded
GEMV_MAX_ROWS = 4
# up to this many unpadded rows (CUDA-graph capture: decode batches) it runs kernels.linear's skinny GEMM
DOT_MAX_ROWS = 16
_in_decode_step = [False]


@contextlib.contextmanager
def decode_step_rows():
    """Inside: projections of at most DOT_MAX_ROWS rows are not padded (an eager decode step runs the skinny GEMM,
    as its CUDA graph does)."""
    before, _in_decode_step[0] = _in_decode_step[0], True
    try:
        yield
    finally:
        _in_decode_step[0] = before


def padded_rows(rows: int, device: torch.device) -> int:
    """rows rounded up to MATMUL_ROW_BUCKET when a projection of them runs on cuBLAS in an eager CUDA step (more
    than GEMV_MAX_ROWS, on a CUDA device, outside graph capture, and more than DOT_MAX_ROWS in a decode step), else
    rows."""
    if rows <= GEMV_MAX_ROWS or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return rows
    if rows <= DOT_MAX_ROWS and _in_decode_step[0]:
        return rows
    return row_bucket(rows)


def row_bucket(rows: int) -> int:
    """The bucket of a prefill step's rows: a multiple of MATMUL_ROW_BUCKET up to COARSE_ROWS, of COARSE_ROW_BUCKET
    past it."""
    size = MATMUL_ROW_BUCKET if rows <= COARSE_ROWS else COARSE_ROW_BUCKET
    return -(-rows // size) * size


def row_buckets_up_to(max_rows: int) -> tuple[int, ...]:
    """Every bucket of at most max_rows rows, ascending."""
    fine = range(MATMUL_ROW_BUCKET, min(max_rows, COARSE_ROWS) + 1, MATMUL_ROW_BUCKET)
    return (*fine, *range(COARSE_ROWS + COARSE_ROW_BUCKET, max_rows + 1, COARSE_ROW_BUCKET))


def empty_rows(shape, dtype: torch.dtype, device: torch.device, row_dims: int = -1) -> torch.Tensor:
    """torch.empty(shape), contiguous, in a storage with room for padded_rows of its rows: the product of its first
    row_dims dims (default all but the last) rows of the other dims' size."""
    rows = math.prod(shape[:row_dims])
    room = padded_rows(rows, device)
    if room == rows:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty((room, math.prod(shape[row_dims:])), dtype=dtype, device=device)[:rows].view(shape)


def padded_operand(a2: torch.Tensor, rows: int) -> torch.Tensor:
    """a2: (m, K) -> (rows >= m, K) whose first m rows are a2: a view of a2's storage when it is row-major there and
    has the room, else a copy (the other rows are left as they are)."""
    m, k = a2.shape
    end = (a2.storage_offset() + rows * k) * a2.element_size()
    if a2.stride() == (k, 1) and a2.untyped_storage().nbytes() >= end:
        return a2.as_strided((rows, k), (k, 1))
    padded = a2.new_empty((rows, k))
    padded[:m].copy_(a2)
    return padded
