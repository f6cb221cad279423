"""Paged decode attention: split-KV, GQA-packed, in Triton.

Each sequence b brings q_len_b <= 8 new query tokens (1 for decode, 2..8 for speculative
verification) and attends over its seqused_k[b] cached tokens (the new ones included, already
written), read through its page table, causal aligned at the end: query i sees keys
j <= seqused_k[b] - q_len_b + i.

Algorithm (two kernels):
1. `_split_kernel`, grid (B, KV, S). One program owns one KV head of one sequence and one of S
   contiguous slices of its keys. GQA packing: its tile has M = q_len * group rows, row r being
   query token r // group and query head kv * group + r % group (padded to a power of two >= 16 for
   tl.dot), so every K/V tile is read from HBM once for all the heads sharing it. The slice is
   computed on the device from seqused_k: chunk = ceil(ceil(len / S) / BLOCK_N) * BLOCK_N, so
   slices are whole tiles and a short sequence simply leaves its last splits empty (they write
   lse = -inf and no O). The loop is a plain online softmax in the log2 domain (log2(e) folded into
   the scale, exp2), fp32 statistics and accumulator. It writes the split's normalised O (fp32) and
   LSE into a workspace (N, H, S, D) / (N, H, S). With S == 1 it normalises, applies the gate and
   writes the output directly, and the second kernel is skipped.
2. `_combine_kernel`, grid (N, H, D / BLOCK_D): out = sum_s 2^(lse_s - m) O_s / sum_s 2^(lse_s - m),
   times sigmoid(gate) when a gate is given, stored in q's dtype; rows that see no key give 0. Each
   program reads all splits of a BLOCK_D slice in one load. On sm_90 it is launched with
   programmatic dependent launch, so its launch overlaps the split kernel (it waits in griddepcontrol).

K/V are gathered through the page table per token (page = table[b, n // page_size]); when a page
holds a whole number of tiles, one page index per tile is loaded instead. Page sizes need not be
powers of two. head_dim is the contiguous inner axis, so each key's row is read with 16-byte vectors.

CUDA graphs: S (`num_splits`) is a host choice fixed per captured shape (see `choose_num_splits`:
B, KV heads, the SM count and a host-known bound `max_seqlen_k`, by default the page table's
capacity); everything length-dependent is computed on the device, and with `out=` and
`workspace=` given nothing is allocated. Values (seqused_k within the page table's capacity,
cu_seqlens_q consistent with max_seqlen_q, page ids within the pool) are the caller's contract:
checking them would need a host sync; lengths are clamped to [0, capacity].

Performance (H200). The bound is the KV bytes over the ~4.4 TB/s read ceiling:
  B1  32k, H16/KV4, d256: 32768 * 4 * 256 * 2 B * 2 (K, V) = 134 MB -> 30.5 us;
  B1 128k, H8/KV2,  d256: 268 MB -> 61 us;   B8 32k: 1.07 GB -> 244 us;   B64 8k: 2.15 GB -> 488 us.
Config: BLOCK_N = 64 keys per iteration (a 32 KB K tile and a 32 KB V tile at d256 bf16), 4 warps
(8 once the packed M x D accumulator exceeds 8 K fp32), cp.async pipelining with 3 stages at
d256 (4 at d <= 128 in 16-bit; fewer for fp32): ~75 KB of shared memory and ~165 registers per
thread at d256, so two programs fit per SM. Measured (CUDA graph, one sweep on the H200): BLOCK_N
32 was 30% slower, 128 no better at d256 (worse with many splits), more stages or 8 warps gave
nothing, and one program per SM reached only 2.4-2.9 TB/s while two reached 4.3-4.5. Hence the
split heuristic: enough splits that B * KV * S programs fill 2 per SM in whole waves (the fewest
within 5% of the best wave efficiency, counting only splits that tile rounding leaves non-empty;
<= 128; one tile per split is allowed: B1 4k ran in 9.2 us with 64 splits, 12.7 us with 16).
Measured with it, before the combine used PDL: B1 32k 3.35 TB/s (S = 64), B1 128k 3.91 (S = 128),
B8 32k 4.42 (S = 8), B64 8k 4.51 (S = 1), against a torch.sum read ceiling of 4.27 in the same run.
At B1 32k the split kernel alone runs at 3.54 TB/s; the combine (one load per program) adds ~2 us,
which PDL is meant to hide in part.
"""
import functools
import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels.varlen import sequence_span
from reference._checks import check_same_device, check_tensor

MAX_Q_LEN = 8
MAX_ROWS = 128  # q_len * group rows of one tile
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_N = 64
MAX_SPLITS = 128  # choose_num_splits' cap; a caller may ask for up to 256
PROGRAMS_PER_SM = 2  # resident split programs per SM that choose_num_splits aims for
COMBINE_TILE = 4096  # splits x head dims one combine program reduces
LOG2E = 1.4426950408889634
H200_SMS = 132
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


class DecodeWorkspace(NamedTuple):
    """Flat fp32 scratch for the splits: o holds N*H*S*D partial outputs, lse N*H*S log-sum-exps."""
    o: torch.Tensor
    lse: torch.Tensor


def alloc_workspace(max_tokens: int, num_heads: int, max_splits: int, head_dim: int, device) -> DecodeWorkspace:
    """Scratch for any call with N <= max_tokens query tokens and num_splits <= max_splits."""
    rows = max_tokens * num_heads * max_splits
    return DecodeWorkspace(torch.empty(rows * head_dim, device=device, dtype=torch.float32),
                           torch.empty(rows, device=device, dtype=torch.float32))


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return H200_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache
def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (sm_90+): the combine kernel launches while the split kernel runs."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def choose_num_splits(batch: int, kv_heads: int, max_seqlen_k: int, num_sms: int = H200_SMS) -> int:
    """Splits per (sequence, KV head): the fewest whose programs fill PROGRAMS_PER_SM per SM in waves within
    5% of the best wave efficiency, counting only the splits that tile rounding leaves non-empty."""
    n_blocks = max(1, triton.cdiv(max_seqlen_k, BLOCK_N))
    max_splits = min(MAX_SPLITS, n_blocks)
    effs = []
    for s in range(1, max_splits + 1):
        used = triton.cdiv(n_blocks, triton.cdiv(n_blocks, s))  # splits left non-empty by tile rounding
        waves = batch * kv_heads * used / (num_sms * PROGRAMS_PER_SM)
        effs.append(waves / math.ceil(waves))
    return next(s for s, eff in enumerate(effs, 1) if eff >= 0.95 * max(effs))


def _config(block_m: int, head_dim: int, elt_size: int) -> tuple[int, int]:
    """(num_warps, num_stages) of the split kernel for an M x D query tile and elt_size-byte K/V."""
    num_warps = 4 if block_m * head_dim <= 8192 else 8
    row_bytes = head_dim * elt_size
    return num_warps, (4 if row_bytes <= 256 else 3 if row_bytes <= 512 else 2)


@triton.jit
def _pages_of(pt_row, start, n, n_ok, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page (int64; one scalar when the tile lies in one page, else (N,)) and in-page slot (N,) of keys n."""
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(pt_row + start // PAGE_SIZE).to(tl.int64)
    else:
        page = tl.load(pt_row + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    return page, n % PAGE_SIZE


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, pt_ptr, seqused_ptr, cu_q_ptr, gate_ptr, out_ptr, ws_o_ptr, ws_lse_ptr,
    stride_qn, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_ptb,
    stride_gn, stride_gh, stride_on, stride_oh,
    qk_scale, num_splits, capacity,
    Q_LEN: tl.constexpr, VARLEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    HAS_GATE: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()  # let the combine kernel launch now; it waits for this grid to finish
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    # the sequence's query tokens [q_start, q_start + q_len) and its keys [0, seqlen)
    q_start, q_len = sequence_span(cu_q_ptr, b, Q_LEN, VARLEN)
    seqlen = tl.minimum(tl.maximum(tl.load(seqused_ptr + b), 0), capacity)
    chunk = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    kv_start = split * chunk
    kv_end = tl.minimum(kv_start + chunk, seqlen)

    rows = tl.arange(0, BLOCK_M)  # row r: query token r // GROUP, head kvh * GROUP + r % GROUP
    qi = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = qi < q_len
    last_key = seqlen - q_len + qi  # (M,) causal limit, aligned at the end
    d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + qi) * stride_qn + head * stride_qh  # (M,)
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)  # (M, D)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    pt_row = pt_ptr + b * stride_ptb
    for start in range(kv_start, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # (N,) key positions
        n_ok = n < kv_end
        page, slot = _pages_of(pt_row, start, n, n_ok, PAGE_SIZE, BLOCK_N)
        k = tl.load(k_ptr + kvh * stride_kh + (page * stride_kp + slot * stride_kt)[:, None] + d[None, :],
                    mask=n_ok[:, None], other=0.0)  # (N, D)
        v = tl.load(v_ptr + kvh * stride_vh + (page * stride_vp + slot * stride_vt)[:, None] + d[None, :],
                    mask=n_ok[:, None], other=0.0)  # (N, D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (M, N), log2 units
        s = tl.where(n_ok[None, :] & (n[None, :] <= last_key[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]  # (M, D)
    token = q_start + qi
    if DIRECT:
        if HAS_GATE:
            g = tl.load(gate_ptr + (token * stride_gn + head * stride_gh)[:, None] + d[None, :],
                        mask=row_ok[:, None], other=0.0).to(tl.float32)
            o = o * tl.sigmoid(g)
        out_rows = token * stride_on + head * stride_oh
        tl.store(out_ptr + out_rows[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        ws_row = (token * num_heads + head) * num_splits + split  # (M,) row of the (N, H, S) workspace
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(ws_lse_ptr + ws_row, lse, mask=row_ok)
        tl.store(ws_o_ptr + ws_row[:, None] * HEAD_DIM + d[None, :], o, mask=(row_ok & seen)[:, None])


@triton.jit
def _combine_kernel(
    ws_o_ptr, ws_lse_ptr, gate_ptr, out_ptr, stride_gn, stride_gh, stride_on, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # launched early (programmatic dependent launch): wait for the split kernel's writes
    token = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    ws_row = (token * tl.num_programs(1) + head) * num_splits + tl.arange(0, BLOCK_S)  # (S,) this row's splits
    lse = tl.load(ws_lse_ptr + ws_row, mask=tl.arange(0, BLOCK_S) < num_splits, other=float("-inf"))  # (S,)
    live = lse > float("-inf")
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # (S,), 0 for empty splits
    o = tl.load(ws_o_ptr + ws_row[:, None] * HEAD_DIM + d[None, :], mask=live[:, None], other=0.0)  # (S, BD)
    denom = tl.sum(w, 0)
    o = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0.0, denom, 1.0)  # (BD,)
    if HAS_GATE:
        o = o * tl.sigmoid(tl.load(gate_ptr + token * stride_gn + head * stride_gh + d).to(tl.float32))
    tl.store(out_ptr + token * stride_on + head * stride_oh + d, o.to(out_ptr.dtype.element_ty))


def _check_tensors(q, k_pages, v_pages, page_table, seqused_k, cu_seqlens_q, gate, out):
    """Types, ranks, dtypes, one device, and a contiguous last dim wherever the kernels assume it."""
    check_tensor("q", q, ndim=3 if cu_seqlens_q is not None else 4, dtype=DTYPES)
    check_tensor("k_pages", k_pages, ndim=4, dtype=q.dtype)
    check_tensor("v_pages", v_pages, dtype=q.dtype)
    check_tensor("page_table", page_table, ndim=2, dtype=torch.int32)
    check_tensor("seqused_k", seqused_k, ndim=1, dtype=torch.int32)
    if cu_seqlens_q is not None:
        check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtype=torch.int32)
    if gate is not None:
        check_tensor("gate", gate, dtype=DTYPES)
    if out is not None:
        check_tensor("out", out, dtype=q.dtype)
    check_same_device(q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table, seqused_k=seqused_k,
                      cu_seqlens_q=cu_seqlens_q, gate=gate, out=out)
    if q.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"q must be on a CUDA device (or run under TRITON_INTERPRET=1), got {q.device}")
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages), ("page_table", page_table),
                    ("seqused_k", seqused_k), ("cu_seqlens_q", cu_seqlens_q), ("gate", gate)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dim, got strides {t.stride()}")
    if out is not None and not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()}")


def _check_shapes(q, k_pages, v_pages, page_table, seqused_k, cu_seqlens_q, max_seqlen_q, gate, out):
    """Shapes that must agree; returns (batch, q_len bound)."""
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages {tuple(v_pages.shape)} must match k_pages {tuple(k_pages.shape)}")
    head_dim, kv_heads = k_pages.shape[3], k_pages.shape[2]
    if head_dim not in HEAD_DIMS or q.shape[-1] != head_dim:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS} and shared by q {tuple(q.shape)} "
                         f"and k_pages {tuple(k_pages.shape)}")
    if q.shape[-2] % kv_heads != 0:
        raise ValueError(f"q heads ({q.shape[-2]}) must be a multiple of kv heads ({kv_heads})")
    batch = page_table.shape[0]
    if seqused_k.shape[0] != batch:
        raise ValueError(f"seqused_k has {seqused_k.shape[0]} entries for a page_table of batch {batch}")
    if cu_seqlens_q is None:
        if q.shape[0] != batch:
            raise ValueError(f"q has batch {q.shape[0]} for a page_table of batch {batch}")
        q_len = q.shape[1]
    else:
        if cu_seqlens_q.shape[0] != batch + 1:
            raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries for a page_table of batch {batch}")
        if not isinstance(max_seqlen_q, int) or max_seqlen_q < 1:
            raise ValueError(f"max_seqlen_q must be a positive host int with cu_seqlens_q, got {max_seqlen_q!r}")
        q_len = max_seqlen_q
    if not 1 <= q_len <= MAX_Q_LEN:
        raise ValueError(f"q_len (max_seqlen_q) must be in 1..{MAX_Q_LEN}, got {q_len}")
    if q_len * (q.shape[-2] // kv_heads) > MAX_ROWS:
        raise ValueError(f"q_len * heads per kv head must be <= {MAX_ROWS}, got {q_len} * {q.shape[-2] // kv_heads}")
    for name, t in (("gate", gate), ("out", out)):
        if t is not None and t.shape != q.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must have q's shape {tuple(q.shape)}")
    return batch, q_len


def _check_workspace(workspace, rows: int, head_dim: int, device):
    # rows = N * H * S
    if not isinstance(workspace, DecodeWorkspace):
        raise ValueError(f"workspace must be a DecodeWorkspace (see alloc_workspace), got {type(workspace).__name__}")
    check_tensor("workspace.o", workspace.o, ndim=1, dtype=torch.float32, device=device)
    check_tensor("workspace.lse", workspace.lse, ndim=1, dtype=torch.float32, device=device)
    if workspace.o.numel() < rows * head_dim or workspace.lse.numel() < rows:
        raise ValueError(f"workspace too small: needs {rows * head_dim} o and {rows} lse entries, "
                         f"has {workspace.o.numel()} and {workspace.lse.numel()}")


def paged_decode_attention(q, k_pages, v_pages, page_table, seqused_k, *, softmax_scale=None, cu_seqlens_q=None,
                           max_seqlen_q=None, gate=None, num_splits=None, max_seqlen_k=None, out=None,
                           workspace=None):
    """Causal attention of up to 8 new queries per sequence over its paged KV cache.

    q: (B, q_len, H, D), or (N, H, D) with cu_seqlens_q (B+1,) int32 and host int max_seqlen_q;
    k_pages, v_pages: (num_pages, page_size, KV, D); page_table: (B, max_pages) int32;
    seqused_k: (B,) int32 cached tokens per sequence including the new ones; gate: q's shape or None
    (the output is multiplied by sigmoid(gate)). num_splits: KV splits (None: choose_num_splits from
    max_seqlen_k, by default the page table's capacity). out: q's shape and dtype; workspace: from
    alloc_workspace. Returns out.
    """
    _check_tensors(q, k_pages, v_pages, page_table, seqused_k, cu_seqlens_q, gate, out)
    batch, q_len = _check_shapes(q, k_pages, v_pages, page_table, seqused_k, cu_seqlens_q, max_seqlen_q, gate, out)
    _, page_size, kv_heads, head_dim = k_pages.shape
    num_heads = q.shape[-2]
    capacity = page_table.shape[1] * page_size
    if num_splits is None:
        num_splits = choose_num_splits(batch, kv_heads, max_seqlen_k or capacity, _num_sms(q.device))
    if not isinstance(num_splits, int) or not 1 <= num_splits <= 256:
        raise ValueError(f"num_splits must be an int in 1..256, got {num_splits!r}")
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype) if out is None else out
    q3, out3 = q.flatten(0, -3), out.view(-1, num_heads, head_dim)  # (N, H, D)
    g3 = gate.flatten(0, -3) if gate is not None else out3  # (N, H, D); out3 stands in when there is no gate
    n_tokens = q3.shape[0]
    if num_splits > 1:
        if workspace is None:
            workspace = alloc_workspace(n_tokens, num_heads, num_splits, head_dim, q.device)
        _check_workspace(workspace, n_tokens * num_heads * num_splits, head_dim, q.device)
    ws_o, ws_lse = (workspace.o, workspace.lse) if num_splits > 1 else (out3, out3)  # unused when S == 1
    group = num_heads // kv_heads
    block_m = max(16, triton.next_power_of_2(q_len * group))
    num_warps, num_stages = _config(block_m, head_dim, q.element_size())
    pdl = _has_pdl(q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    _split_kernel[(batch, kv_heads, num_splits)](
        q3, k_pages, v_pages, page_table, seqused_k, cu_seqlens_q if cu_seqlens_q is not None else seqused_k,
        g3, out3, ws_o, ws_lse,
        q3.stride(0), q3.stride(1), *k_pages.stride()[:3], *v_pages.stride()[:3], page_table.stride(0),
        g3.stride(0), g3.stride(1), out3.stride(0), out3.stride(1),
        scale * LOG2E, num_splits, capacity,
        Q_LEN=q_len, VARLEN=cu_seqlens_q is not None, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, DIRECT=num_splits == 1, HAS_GATE=gate is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl, num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _combine(workspace, g3 if gate is not None else None, out3, num_splits, pdl)
    return out


def _combine(workspace: DecodeWorkspace, gate, out, num_splits: int, pdl: bool) -> None:
    # workspace: (N, H, S, D) / (N, H, S) flat; gate (or None), out: (N, H, D)
    n_tokens, num_heads, head_dim = out.shape
    block_s = triton.next_power_of_2(num_splits)
    block_d = min(head_dim, max(16, COMBINE_TILE // block_s))
    g = gate if gate is not None else out
    _combine_kernel[(n_tokens, num_heads, head_dim // block_d)](
        workspace.o, workspace.lse, g, out, g.stride(0), g.stride(1), out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=head_dim, BLOCK_S=block_s, BLOCK_D=block_d, HAS_GATE=gate is not None, PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )


def paged_attention_op(q, k_pages, v_pages, step, scale, gate):
    """model.ops' paged_attention: this kernel for q_len <= 8, the reference op for longer chunks."""
    if step.max_seqlen_q > MAX_Q_LEN:
        from model import ops
        return ops._BACKENDS["reference"]["paged_attention"](q, k_pages, v_pages, step, scale, gate)
    return paged_decode_attention(q, k_pages, v_pages, step.page_table, step.seqused_k, softmax_scale=scale,
                                  cu_seqlens_q=step.cu_seqlens, max_seqlen_q=step.max_seqlen_q, gate=gate)


OPS = {"paged_attention": paged_attention_op}
