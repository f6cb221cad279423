"""FA4-style attention forward in Triton: dense, varlen (cu_seqlens) and over a paged KV prefix.

Grid (KV, M tiles, B). One program owns BLOCK_M packed query rows of one KV head of one sequence and streams
that sequence's keys in BLOCK_N tiles: S = Q K^T (fp32 accumulation, log2(e) folded into the scale), online
softmax with FA4's conditional rescaling (fa4/softmax.py), P = 2^(S - m) partly by a software exp2 on the FMA
units, O += P V in fp32, and O / l at the end with the true row sum, so both FA4 flags leave results exact.

GQA packing: the G = H / KV query heads of a KV head share each K/V tile. Packed row r is query position r // G
of query head kvh G + r % G, so a tile holds BLOCK_M / G positions of all G heads (contiguous in q's
(tokens, H, D) layout) and each K/V tile is loaded once for the group.

Causal masks are aligned at the end (query i of q_len sees keys j <= i + k_len - q_len). A tile's loop
stops at its last position's limit, so fully masked tiles are never visited; the keys below its first position's
limit run unmasked, and only the diagonal (and the k_len tail) tiles apply the mask. M tiles are visited
longest first. Rows that see no key keep l = 0 and write 0 (the running max starts at -1e30, not -inf,
so no inf - inf arises).

KV sources: contiguous k, v (tokens, KV, D) with per-sequence offsets (dense or cu_seqlens_k), or paged pools
(num_pages, PAGE_SIZE, KV, D) read through page_table[b] up to seqused_k[b]: the key at position n lives in
page page_table[b, n // PAGE_SIZE], slot n % PAGE_SIZE (one page id per tile when a page holds whole tiles).

Bound (H200, bf16, causal): 4 * B * H * S^2 * D / 2 FLOP over ~990 TFLOP/s dense bf16 wgmma; the exp2 work
(S^2 / 2 per head over 16 ex2/clk/SM) is what the poly split offloads. Autotuned on (head dim, causal, paged,
dtypes, the two FA4 flags) over the head dim's `CONFIGS`; the interpreter uses one config. Compiled ahead of time
for sm_90a on a CPU (bf16, every config x causal x paged x poly level 0/2/4, with 16-divisible pointers and strides):
all compile with cp.async pipelining and wgmma; shared memory 41-213 KB; ptxas reports no spills except
d256 128x64 (4 bytes). Dropped from the list: d256 64x64 with 4 warps (100-byte spill) and d256 BLOCK_N 32
(ptxas C7515: wgmma serialised).
"""

import torch
import triton
import triton.language as tl

from fa4.softmax import exp2_mixed, needs_rescale, poly_level
from kernels.environment import INTERPRET
from kernels.host_math import cdiv
from kernels.varlen import sequence_span

HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634


def _configs():
    """(head_dim, config) pairs: BLOCK_M x BLOCK_N tiles, warps and stages that fit sm_90's 228 KB smem.
    The interpreter gets one config for every head dim (the autotuner then runs without benchmarking)."""
    if INTERPRET:
        return [(None, triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1))]
    table = {
        64: [(128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 4)],
        128: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
        256: [(128, 64, 8, 2), (64, 64, 8, 2)],
    }
    return [(d, triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s))
            for d, rows in table.items() for bm, bn, w, s in rows]


CONFIGS = _configs()


def _prune(configs, named_args, **kwargs):
    # keep the configs listed for this call's head dim
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    return [c for d, c in CONFIGS if d in (None, head_dim)]


@triton.jit
def _kv_tile_offsets(pt_row, start, n, n_ok, stride_t, stride_p, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """(N,) element offsets of keys n (positions within the sequence) from the sequence's KV base."""
    if PAGED:
        if PAGE_SIZE % BLOCK_N == 0:
            page = tl.load(pt_row + start // PAGE_SIZE).to(tl.int64)
        else:
            page = tl.load(pt_row + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        off = page * stride_p + (n % PAGE_SIZE) * stride_t
    else:
        off = n.to(tl.int64) * stride_t
    return off


@triton.jit
def _rescale(acc, l_i, m_i, m_new):
    """The running output and row sums moved from max m_i to m_new (M,)."""
    alpha = tl.exp2(m_i - m_new)  # (M,)
    return acc * alpha[:, None], l_i * alpha, m_new


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, k_base, v_base, pt_row, lo, hi, k_len, last_key, d, qk_scale,
                  stride_kt, stride_kp, stride_vt, stride_vp,
                  MASK: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, RESCALE_THRESHOLD: tl.constexpr, POLY_LEVEL: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Online softmax over key tiles [lo, hi); MASK applies the causal limit last_key (M,) and k_len."""
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # (N,) key positions
        n_ok = n < k_len
        k_off = _kv_tile_offsets(pt_row, start, n, n_ok, stride_kt, stride_kp, PAGED, PAGE_SIZE, BLOCK_N)
        v_off = _kv_tile_offsets(pt_row, start, n, n_ok, stride_vt, stride_vp, PAGED, PAGE_SIZE, BLOCK_N)
        if MASK:
            k = tl.load(k_base + k_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)  # (N, D)
        else:
            k = tl.load(k_base + k_off[:, None] + d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (M, N), log2 units
        if MASK:
            s = tl.where(n_ok[None, :] & (n[None, :] <= last_key[:, None]), s, float("-inf"))
        m_cand = tl.maximum(m_i, tl.max(s, 1))  # (M,)
        if RESCALE_THRESHOLD == 0:  # the classic online softmax: each row follows its max, no tile-wide decision
            acc, l_i, m_i = _rescale(acc, l_i, m_i, m_cand)
        elif needs_rescale(m_i, m_cand, RESCALE_THRESHOLD):
            acc, l_i, m_i = _rescale(acc, l_i, m_i, m_cand)
        p = exp2_mixed(s - m_i[:, None], BLOCK_M, BLOCK_N, POLY_LEVEL)  # (M, N), each <= 2^threshold
        l_i += tl.sum(p, 1)
        if MASK:
            v = tl.load(v_base + v_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)  # (N, D)
        else:
            v = tl.load(v_base + v_off[:, None] + d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i


AUTOTUNE_KEY = ["HEAD_DIM", "CAUSAL", "PAGED", "RESCALE_THRESHOLD", "POLY_LEVEL"]


@triton.autotune(configs=[c for _, c in CONFIGS], key=AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _prune})
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, pt_ptr, seqused_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_kp, stride_vt, stride_vh, stride_vp,
    stride_ot, stride_oh, stride_ptb,
    qk_scale, seqlen_q, seqlen_k,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, VARLEN_Q: tl.constexpr,
    VARLEN_K: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, RESCALE_THRESHOLD: tl.constexpr,
    POLY_LEVEL: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # q, o: (total_q, H, D); k, v: (total_k, KV, D) or pools (num_pages, PAGE_SIZE, KV, D). GQA packing: a program
    # owns one KV head and BLOCK_M packed rows, row r = (query position r // GROUP, query head kvh GROUP + r % GROUP),
    # so the GROUP query heads of the KV head share every K/V tile (and their rows are contiguous in q).
    kvh = tl.program_id(0)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)  # longest (causal) tiles first
    b = tl.program_id(2)
    q_start, q_len = sequence_span(cu_q_ptr, b, seqlen_q, VARLEN_Q)
    m0 = m_block * BLOCK_M
    if m0 < q_len * GROUP:
        if PAGED:
            k_start = b * 0  # positions index pages through the page table
            k_len = tl.load(seqused_ptr + b)
        else:
            k_start, k_len = sequence_span(cu_k_ptr, b, seqlen_k, VARLEN_K)
        rows = m0 + tl.arange(0, BLOCK_M)  # (M,) packed rows
        pos = rows // GROUP  # (M,) query positions in the sequence
        head = kvh * GROUP + rows % GROUP  # (M,) query heads
        row_ok = pos < q_len
        d = tl.arange(0, HEAD_DIM)
        q_off = (q_start + pos).to(tl.int64) * stride_qt + head * stride_qh  # (M,)
        q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)  # (M, D)
        k_base = k_ptr + k_start.to(tl.int64) * stride_kt + kvh * stride_kh
        v_base = v_ptr + k_start.to(tl.int64) * stride_vt + kvh * stride_vh
        pt_row = pt_ptr + b.to(tl.int64) * stride_ptb

        if CAUSAL:
            last_key = pos + (k_len - q_len)  # (M,) each row's last visible key
            # past the tile's last position: never visited; below its first: seen by every row
            hi = tl.minimum(k_len, (m0 + BLOCK_M - 1) // GROUP + 1 + k_len - q_len)
            full = tl.maximum(tl.minimum(m0 // GROUP + k_len - q_len + 1, hi), 0)
        else:
            last_key = pos + k_len
            hi = k_len
            full = k_len
        hi = tl.maximum(hi, 0)
        full = full // BLOCK_N * BLOCK_N  # whole unmasked tiles

        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_base, v_base, pt_row, 0, full, k_len, last_key, d, qk_scale,
            stride_kt, stride_kp, stride_vt, stride_vp, False, PAGED, PAGE_SIZE, BLOCK_M, BLOCK_N,
            RESCALE_THRESHOLD, POLY_LEVEL, DOT_PRECISION)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_base, v_base, pt_row, full, hi, k_len, last_key, d, qk_scale,
            stride_kt, stride_kp, stride_vt, stride_vp, True, PAGED, PAGE_SIZE, BLOCK_M, BLOCK_N,
            RESCALE_THRESHOLD, POLY_LEVEL, DOT_PRECISION)

        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # (M, D); rows that see no key stay 0
        o_off = (q_start + pos).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(o_ptr + o_off[:, None] + d[None, :], o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def check_flags(rescale_threshold: float, poly_exp2_fraction: float) -> int:
    """Validate the FA4 flags; returns exp2_mixed's POLY_LEVEL."""
    if not isinstance(rescale_threshold, (int, float)) or not 0 <= rescale_threshold <= 15:
        raise ValueError(f"rescale_threshold must be in [0, 15] (P <= 2^threshold must fit fp16's 65504), "
                         f"got {rescale_threshold!r}")
    return poly_level(poly_exp2_fraction)


def triton_forward(q, k, v, *, causal: bool, scale: float, cu_seqlens_q=None, cu_seqlens_k=None,
                   max_seqlen_q: int, seqlen_k: int = 0, page_table=None, seqused_k=None,
                   rescale_threshold: float = 8.0, poly_exp2_fraction: float = 0.0):
    """Launch on checked inputs (fa4/interface.py validates). q: (total_q, H, D) -> o of q's shape and dtype.

    k, v: (total_k, KV, D), or (num_pages, page_size, KV, D) with page_table (B, max_pages) int32 and
    seqused_k (B,) int32. Dense inputs come flattened with max_seqlen_q = seqlen_q (and seqlen_k) per sequence.
    rescale_threshold: log2 growth of the running max that forces a rescale (0: always).
    poly_exp2_fraction: share of each tile's columns whose exp2 is the FMA polynomial (see POLY_FRACTIONS).
    """
    level = check_flags(rescale_threshold, poly_exp2_fraction)
    num_heads, head_dim = q.shape[1], q.shape[2]
    paged = page_table is not None
    kv_heads = k.shape[-2]
    batch = (page_table.shape[0] if paged else
             cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else q.shape[0] // max(max_seqlen_q, 1))
    o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if q.shape[0] == 0 or batch == 0:
        return o
    dummy = seqused_k if paged else (cu_seqlens_q if cu_seqlens_q is not None else q)
    stride_kp, stride_vp = (k.stride(0), v.stride(0)) if paged else (0, 0)
    stride_kt, stride_vt = (k.stride(1), v.stride(1)) if paged else (k.stride(0), v.stride(0))
    grid = lambda meta: (kv_heads, cdiv(max_seqlen_q * (num_heads // kv_heads), meta["BLOCK_M"]), batch)
    _fwd_kernel[grid](
        q, k, v, o,
        cu_seqlens_q if cu_seqlens_q is not None else dummy, cu_seqlens_k if cu_seqlens_k is not None else dummy,
        page_table if paged else dummy, seqused_k if paged else dummy,
        q.stride(0), q.stride(1), stride_kt, k.stride(-2), stride_kp, stride_vt, v.stride(-2), stride_vp,
        o.stride(0), o.stride(1), page_table.stride(0) if paged else 0,
        scale * LOG2E, max_seqlen_q, seqlen_k,
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, CAUSAL=bool(causal), VARLEN_Q=cu_seqlens_q is not None,
        VARLEN_K=cu_seqlens_k is not None, PAGED=paged, PAGE_SIZE=k.shape[1] if paged else 1,
        RESCALE_THRESHOLD=float(rescale_threshold), POLY_LEVEL=level,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return o
