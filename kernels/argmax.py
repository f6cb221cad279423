"""Greedy tokens: the argmax of each row of logits in Triton, one launch split over the vocabulary.

out[b] = the index of the first maximum of logits[b] (a NaN counts as larger than everything: the first NaN wins),
as torch.argmax returns. Why a kernel: at batch 1 torch's argmax of a 248320-wide row runs after the decode graph in
about 9 us, one block reducing the row. Here a grid (B, P) of programs each reduces CHUNK logits to
(value, first index), parks the pair and takes the row's ticket (kernels.split_k); the last of the row's P programs
reduces the P pairs in chunk order and writes the token. It runs inside the decode step's CUDA graph right after
lm_head, launched with programmatic dependent launch, so the sampler of a greedy step reads tokens instead of
launching a reduction after the graph.

Bound: the logits, 0.5 MB a row at batch 1 in bf16 (0.1 us at 4.2 TB/s): the cost is the launch, one load round
trip and the ticket's. In the graph it saves most of the ~9 us a greedy decode token that torch.argmax after the
graph cost (FINDINGS, decode step).

CUDA-graph capturable: one workspace a device (parked pairs and tickets, tickets back at zero after every launch),
grown outside a capture when a call needs more (the engine's eager warm-up of each decode batch size), never freed
while the process runs, since a captured graph keeps the pointers it was captured with; `out=` is reusable.
"""
import torch
import triton
import triton.language as tl

from kernels import pdl, registry, split_k, stamps
from kernels.host_math import cdiv
from kernels.norms import triton_runs_on
from kernels.registry import Impl
from reference.checks import check_tensor
from reference.sampling import DecodeAdvance

CHUNK = 2048  # logits a program reduces: 122 programs a row at Qwen3.5's vocabulary
NUM_WARPS = 4
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _first_max(values, index, mask, past):
    """(value, index) of the first maximum of values where mask holds (index: their indices, all below past), a
    NaN counting as the largest."""
    is_nan = (values != values) & mask
    first_nan = tl.min(tl.where(is_nan, index, past), axis=0)
    clean = tl.where(mask & ~is_nan, values, float("-inf"))
    best = tl.max(clean, axis=0)
    first_best = tl.min(tl.where(mask & (clean == best), index, past), axis=0)
    has_nan = first_nan < past
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, first_best)


@triton.jit
def _advance_row(inputs_ptr, stride, table_ptr, table_stride, width, page_size, dummy_slot, row, token,
                 ring_ptr, ring_stride, ring_rows, RING: tl.constexpr):
    """reference.advance_decode_inputs for one row: inputs (5, B) int32 rows `stride` apart; RING: the token also
    at ring[position % ring_rows, row], rows `ring_stride` apart (pinned host memory: a store over the bus)."""
    slot = tl.load(inputs_ptr + 2 * stride + row)
    if slot != dummy_slot:
        position = tl.load(inputs_ptr + stride + row)
        if RING:
            tl.store(ring_ptr + (position % ring_rows).to(tl.int64) * ring_stride + row, token.to(tl.int64))
        nxt = position + 1
        column = tl.minimum(nxt // page_size, width - 1)
        page = tl.load(table_ptr + slot.to(tl.int64) * table_stride + column)
        tl.store(inputs_ptr + row, token.to(tl.int32))
        tl.store(inputs_ptr + stride + row, nxt)
        tl.store(inputs_ptr + 3 * stride + row, page * page_size + nxt % page_size)
        tl.store(inputs_ptr + 4 * stride + row, nxt + 1)


@triton.jit
def _argmax_kernel(logits_ptr, stride, part_val_ptr, part_idx_ptr, tickets_ptr, out_ptr, stamps_ptr, V,
                   inputs_ptr, inputs_stride, table_ptr, table_stride, width, page_size, dummy_slot,
                   ring_ptr, ring_stride, ring_rows,
                   CHUNK: tl.constexpr, P: tl.constexpr, PB: tl.constexpr, ADVANCE: tl.constexpr,
                   RING: tl.constexpr, STAMPS: tl.constexpr, PDL: tl.constexpr):
    # grid (B, P): chunk `part` of row `row`; parked pairs at part_*[row * P + part]. ADVANCE: the row's last
    # program also writes the next decode step's inputs (reference.DecodeAdvance), and with RING its token ring
    row, part = tl.program_id(0), tl.program_id(1)
    offs = part * CHUNK + tl.arange(0, CHUNK)
    t_go = stamps.wait(stamps_ptr, STAMPS, PDL)
    pdl.release_dependents(PDL)
    mask = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + offs, mask=mask, other=float("-inf")).to(tl.float32)
    value, index = _first_max(x, offs, mask, V)
    tl.store(part_val_ptr + row * P + part, value)
    tl.store(part_idx_ptr + row * P + part, index)
    if split_k.last_to_arrive(tickets_ptr + row, P):
        parts = tl.arange(0, PB)
        in_row = parts < P
        values = tl.load(part_val_ptr + row * P + parts, mask=in_row, other=float("-inf"), cache_modifier=".cg")
        indices = tl.load(part_idx_ptr + row * P + parts, mask=in_row, other=V, cache_modifier=".cg")
        _, token = _first_max(values, indices, in_row, V)  # chunks in order: the first index wins ties
        tl.store(out_ptr + row, token.to(tl.int64))
        if ADVANCE:
            _advance_row(inputs_ptr, inputs_stride, table_ptr, table_stride, width, page_size, dummy_slot, row, token,
                         ring_ptr, ring_stride, ring_rows, RING)
        split_k.reset_ticket(tickets_ptr + row)
        stamps.end(stamps_ptr, t_go, STAMPS)  # the step's last kernel: its end closes the stamped step


_workspaces: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}


def _workspace(device: torch.device, rows: int, parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parked values fp32, parked indices int32, tickets int32 at zero) for `rows` rows of `parts` chunks: the
    device's newest workspace, or a bigger one (the older ones stay allocated for the graphs captured with them)."""
    held = _workspaces.setdefault(device, [])
    if held and held[-1][2].numel() >= rows and held[-1][0].numel() >= rows * parts:
        return held[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ValueError(f"argmax of {rows} rows x {parts} chunks during a CUDA-graph capture: call it once outside "
                         "the capture first (its workspace is allocated there)")
    pairs = max(rows * parts, held[-1][0].numel() if held else 0)
    rows = max(rows, held[-1][2].numel() if held else 0)
    held.append((torch.empty(pairs, device=device, dtype=torch.float32),
                 torch.empty(pairs, device=device, dtype=torch.int32),
                 torch.zeros(rows, device=device, dtype=torch.int32)))
    return held[-1]


def _check_advance(advance: DecodeAdvance, rows: int, device: torch.device) -> None:
    check_tensor("advance.inputs", advance.inputs, ndim=2, dtype=torch.int32, device=device)
    check_tensor("advance.table", advance.table, ndim=2, dtype=torch.int32, device=device)
    if advance.inputs.shape != (5, rows) or advance.inputs.stride(1) != 1:
        raise ValueError(f"advance.inputs must be (5, {rows}) int32 rows contiguous along B, got "
                         f"{tuple(advance.inputs.shape)} with strides {advance.inputs.stride()}")
    if advance.table.stride(1) != 1 or advance.table.shape[1] < 1:
        raise ValueError(f"advance.table must be contiguous along its pages, got strides {advance.table.stride()}")
    if not isinstance(advance.page_size, int) or advance.page_size < 1:
        raise ValueError(f"advance.page_size must be a positive int, got {advance.page_size!r}")
    ring = advance.token_ring
    if ring is None:
        return
    check_tensor("advance.token_ring", ring, ndim=2, dtype=torch.int64)
    if ring.shape[0] < 2 or ring.shape[1] != rows or ring.stride(1) != 1:
        raise ValueError(f"advance.token_ring must be (R >= 2, {rows}) int64 contiguous along B, got "
                         f"{tuple(ring.shape)} with strides {ring.stride()}")
    if ring.device != device and not (device.type == "cuda" and ring.device.type == "cpu" and ring.is_pinned()):
        raise ValueError(f"advance.token_ring must be on {device} or, for a CUDA step, in pinned host memory; got "
                         f"{'unpinned ' if ring.device.type == 'cpu' else ''}memory on {ring.device}")


def argmax(logits: torch.Tensor, advance: DecodeAdvance | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits: (B, V) -> (B,) int64, the index of each row's first maximum (the first NaN where a row has one).
    advance: also write the tokens and the next decode step's positions, KV slots and cached tokens into
    advance.inputs (reference.advance_decode_inputs), from each row's last program, and the tokens into
    advance.token_ring where it has one."""
    check_tensor("logits", logits, ndim=2, dtype=DTYPES)
    if logits.stride(1) != 1:
        raise ValueError(f"logits must be contiguous within a row, got strides {logits.stride()}")
    rows, v = logits.shape
    if v < 1 or v >= 2**31 - 1:
        raise ValueError(f"logits need 1 <= V < 2^31 - 1 columns, got {v}")
    if not triton_runs_on(logits.device):
        raise ValueError(f"logits must be on a CUDA device (or run with TRITON_INTERPRET=1), got {logits.device}")
    if out is None:
        out = torch.empty(rows, device=logits.device, dtype=torch.int64)
    elif out.shape != (rows,) or out.dtype != torch.int64 or out.device != logits.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({rows},) int64 tensor on {logits.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if advance is not None:
        _check_advance(advance, rows, logits.device)
    if rows == 0:
        return out
    parts = cdiv(v, CHUNK)
    values, indices, tickets = _workspace(logits.device, rows, parts)
    stamp, stamping = stamps.slot("argmax", logits.device)
    inputs, table = (advance.inputs, advance.table) if advance is not None else (out, out)  # out: unused stand-ins
    ring = advance.token_ring if advance is not None and advance.token_ring is not None else None
    _argmax_kernel[(rows, parts)](logits, logits.stride(0), values, indices, tickets, out, stamp, v,
                                  inputs, inputs.stride(0), table, table.stride(0), table.shape[-1],
                                  advance.page_size if advance else 1, advance.dummy_slot if advance else 0,
                                  out if ring is None else ring, 0 if ring is None else ring.stride(0),
                                  1 if ring is None else ring.shape[0],
                                  CHUNK=CHUNK, P=parts, PB=triton.next_power_of_2(parts), ADVANCE=advance is not None,
                                  RING=ring is not None, STAMPS=stamping, num_warps=NUM_WARPS,
                                  **pdl.launch_options(logits.device))
    return out



registry.define("argmax")
registry.register("argmax", Impl("argmax", "triton", argmax))
