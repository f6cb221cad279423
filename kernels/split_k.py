"""Split-K for the skinny decode GEMM: several programs share one output block, each over a run of K's tiles.

A 16-row decode product with a narrow output (2B's 2048-wide projections: 128 column blocks of 16) has fewer
programs than the H200 has SMs, so each streams a long run of weights with little in flight. Split over K, each
column block's SPLIT programs park their fp32 partial sums in a per-device workspace and take a ticket; the
program that draws the last ticket adds the partials in split order (the same bits whatever order they finished
in), writes the output and resets the ticket, so the next launch (or CUDA-graph replay) finds it at zero.

The ticket (last_to_arrive, reset_ticket) is also how kernels.argmax's chunks of one row elect the one that reduces
their maxima.

The workspace is one per device, allocated outside CUDA-graph capture (an engine warms its decode step up
eagerly first; while capturing without one, callers fall back to SPLIT 1). Launches that use it must not overlap:
one stream at a time per device, as the engine runs.
"""
import torch
import triton
import triton.language as tl

MAX_SPLIT = 8
MAX_ROWS = 16
MAX_N = 4096  # widest output that is split (9B's hidden size)
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(partials (MAX_SPLIT * MAX_N * MAX_ROWS,) fp32, tickets (MAX_N,) int32 at zero) of `device`, allocated on
    first use; None while the current stream is capturing a graph and there is none yet."""
    if device not in _workspaces:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _workspaces[device] = (torch.empty(MAX_SPLIT * MAX_N * MAX_ROWS, dtype=torch.float32, device=device),
                               torch.zeros(MAX_N, dtype=torch.int32, device=device))
    return _workspaces[device]


@triton.jit
def k_range(K, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """The [start, end) of K that program (., split) multiplies: its share of K's BLOCK_K tiles."""
    per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
    start = tl.program_id(1) * per
    return start, tl.minimum(K, start + per)


@triton.jit
def last_to_arrive(ticket_ptr, arrivals: tl.constexpr):
    """Draw this program's ticket at ticket_ptr (acquire-release, after a barrier: every thread's earlier stores are
    released with it): whether it is the last of `arrivals` programs. That one must put the ticket back to zero
    (reset_ticket) for the next launch, once it has read what the others stored."""
    tl.debug_barrier()
    return tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == arrivals - 1


@triton.jit
def reset_ticket(ticket_ptr):
    tl.atomic_xchg(ticket_ptr, 0)


@triton.jit
def reduce_partials(acc, part_ptr, ticket_ptr, n, rows, N, SPLIT: tl.constexpr, ROWS: tl.constexpr):
    """acc: this program's partial (BLOCK_N, ROWS) of columns n (SPLIT > 1). Returns (the sum over all SPLIT
    partials, whether this program drew the last ticket and must store it); the others' sums are not to be stored."""
    block = tl.program_id(0)
    mask = (n < N)[:, None]
    offsets = n[:, None] * ROWS + rows[None, :]                                  # (BLOCK_N, ROWS)
    tl.store(part_ptr + tl.program_id(1) * N * ROWS + offsets, acc, mask=mask)
    last = last_to_arrive(ticket_ptr + block, SPLIT)
    total = tl.zeros_like(acc)
    if last:
        for s in tl.static_range(SPLIT):  # split order: the same sum whichever program came last
            total += tl.load(part_ptr + s * N * ROWS + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        reset_ticket(ticket_ptr + block)
    return total, last
