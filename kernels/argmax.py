"""Greedy sampling's argmax over rows of logits in Triton: each row split over many programs, then one per row.

tokens[b] = the first index of the largest value of logits[b], a NaN counting as the largest (torch.argmax's
answer). Why: a decode step's greedy token is torch.argmax over a (B, 248320) bf16 row (0.5 MB), which took 18 us of
a 2B batch-1 step's 1.29 ms on the H200 (`host_time --decode 1`, session 17). Here stage 1 gives each of P =
cdiv(V, CHUNK) programs a CHUNK of a row (B x P programs: 122 at B1), each writing its chunk's winner (value,
index); stage 2 reduces a row's P winners in one program. Both stages take the first position among equal values,
so ties go where torch sends them. Both launch with PDL. Predicted: a few us in all against 18 (not measured yet:
`python -m profiles.host_time --decode 1 --ab argmax`).
"""
import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.host_math import cdiv, next_power_of_2
from kernels.norms import check_devices
from reference._checks import check_tensor

CHUNK = 2048  # a stage-1 program's columns
MAX_COLS = 2**31 - 2  # positions are int32, and NO_POS must lie past them
NO_POS = tl.constexpr(MAX_COLS + 1)


@triton.jit
def _first_max(x, pos, valid):
    """The position of the first NaN among the valid x, else of the first largest."""
    nan = valid & (x != x)
    first_nan = tl.min(tl.where(nan, pos, NO_POS), axis=0)
    top = tl.max(tl.where(valid & (x == x), x, float("-inf")), axis=0)
    first_top = tl.min(tl.where(valid & (x == top), pos, NO_POS), axis=0)
    return tl.where(first_nan < NO_POS, first_nan, first_top)


@triton.jit
def _chunk_winners(logits, row_stride, n, win_val, win_pos, P, CHUNK: tl.constexpr, PDL: tl.constexpr):
    # grid (B, P): program (b, p) takes columns [p * CHUNK, (p + 1) * CHUNK) of row b
    b, p = tl.program_id(0), tl.program_id(1)
    pdl.wait_for_producer(PDL)
    pdl.release_dependents(PDL)
    cols = p * CHUNK + tl.arange(0, CHUNK)
    row = logits + b.to(tl.int64) * row_stride
    x = tl.load(row + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
    win = _first_max(x, cols, cols < n)
    tl.store(win_val + b * P + p, tl.load(row + win).to(tl.float32))
    tl.store(win_pos + b * P + p, win)


@triton.jit
def _row_winner(win_val, win_pos, tokens, P, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    # grid (B,): a row's P chunk winners, in column order, so the first winner is the first index
    b = tl.program_id(0)
    pdl.wait_for_producer(PDL)
    pdl.release_dependents(PDL)
    parts = tl.arange(0, BLOCK_P)
    x = tl.load(win_val + b * P + parts, mask=parts < P, other=float("-inf"))
    win = _first_max(x, parts, parts < P)
    tl.store(tokens + b, tl.load(win_pos + b * P + win).to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits: (B, V) float, unit stride along V -> (B,) int64, as logits.argmax(-1). No host sync: graph-safe."""
    check_tensor("logits", logits, ndim=2, dtype=(torch.float16, torch.bfloat16, torch.float32))
    check_devices(logits=logits)
    bsz, n = logits.shape
    if not 0 < n <= MAX_COLS:
        raise ValueError(f"logits must have 1 to {MAX_COLS} columns, got {n}")
    if logits.stride(1) != 1:
        raise ValueError(f"logits must have unit stride along its last dim, got strides {logits.stride()}")
    tokens = torch.empty(bsz, dtype=torch.int64, device=logits.device)
    if bsz == 0:
        return tokens
    parts = cdiv(n, CHUNK)
    win_val = torch.empty(bsz, parts, dtype=torch.float32, device=logits.device)
    win_pos = torch.empty(bsz, parts, dtype=torch.int32, device=logits.device)
    launch = pdl.launch_options(logits.device)
    _chunk_winners[(bsz, parts)](logits, logits.stride(0), n, win_val, win_pos, parts, CHUNK=CHUNK, num_warps=4,
                                 **launch)
    _row_winner[(bsz,)](win_val, win_pos, tokens, parts, BLOCK_P=next_power_of_2(parts), num_warps=4, **launch)
    return tokens
