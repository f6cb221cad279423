"""Paged attention of short query chunks over long cached prefixes: split-KV, GQA-packed, in Triton.

Each sequence b brings q_len_b new query tokens, 1 <= q_len_b <= 2048 (1 for decode, 2..8 for speculative
verification, tens to hundreds for an agent turn: a tool result appended to a long cached conversation; longer
chunks only where a forward with one program per M-block would leave SMs idle: `split_kv_pays`), and
attends over its seqused_k[b] cached tokens (the new ones included, already written), read through its page
table, causal aligned at the end: query i sees keys j <= seqused_k[b] - q_len_b + i. One varlen batch may mix
decode rows with chunks.

Algorithm (two kernels):
1. A split kernel, grid (B * m_blocks, KV, S). GQA packing: the tile's M dimension holds packed rows, row r
   being query token r // group and query head kv * group + r % group, so every K/V tile is read once for all
   the heads sharing it. One program owns one M-block of BLOCK_M packed rows of one sequence, one KV head and
   one of S contiguous slices of the keys that M-block needs; programs whose M-block lies past their
   sequence's q_len * group rows exit at once (m_blocks comes from the host bound max_seqlen_q). The slices
   are computed on the device: chunk = ceil(ceil(hi / S) / BLOCK_N) * BLOCK_N, hi being the M-block's last
   visible key + 1, so slices are whole tiles and short sequences leave their last splits empty (they write
   lse = -inf and no O). The loop is an online softmax in the log2 domain (log2(e) folded into the scale),
   fp32 statistics and accumulator. It writes the split's normalised O (fp32) and LSE into a workspace
   (N, H, S, D) / (N, H, S); with S == 1 it normalises, applies the gate and writes the output directly.
   Two variants, chosen on the host from max_seqlen_q and the group (`plan`):
   - decode (`_split_kernel`; max_seqlen_q <= 8 and at most 128 packed rows): one M-block of
     next_pow2(rows) >= 16 rows, one masked loop (see the decode bound below).
   - chunk (`_chunk_kernel`; everything else): M-blocks of 128 rows (16..64 when fewer rows), two loops per
     split: tiles below the M-block's first row's causal limit run unmasked, only the diagonal tiles (at
     most ceil(BLOCK_M / group / BLOCK_N) + 1 of them) apply the mask, and fully masked tiles are never
     visited. The O rescale is conditional (FA4: the running max is only replaced when it grows by more than
     RESCALE_THRESHOLD in log2 units; P <= 2^threshold; exact, since O is divided by the true row sum).
     Programs of one (KV head, split) that differ only in their M-block are adjacent in launch order, so they
     read the same K/V tiles at about the same time and the second read hits L2. A mixed varlen step (decode
     rows beside chunks; the host only knows max_seqlen_q) launches it twice with the same splits: first the
     sequences of <= SHORT_ROWS // group tokens in SHORT_ROWS-row tiles, then the others in 128-row tiles, each
     launch skipping the other's sequences, so decode rows are not computed in 128-row tiles.
2. `_combine_kernel`, grid (N, H, D / BLOCK_D) (the chunk variant's `_combine_rows_kernel` takes several
   (token, head) rows per program): out = sum_s 2^(lse_s - m) O_s / sum_s 2^(lse_s - m),
   times sigmoid(gate) when a gate is given, stored in q's dtype; rows that see no key give 0. Each
   program reads all splits of a BLOCK_D slice in one load. On sm_90 it is launched with
   programmatic dependent launch, so its launch overlaps the split kernel (it waits in griddepcontrol), and it
   lets the next kernel (the layer's out-proj chain) launch from its start, before its wait, so that the chain's
   weights stream while the split runs.

K/V are gathered through the page table per token (page = table[b, n // page_size]); when a page
holds a whole number of tiles, one page index per tile is loaded instead. Page sizes need not be
powers of two. head_dim is the contiguous inner axis, so each key's row is read with 16-byte vectors.

CUDA graphs: S (`num_splits`) and the variant/M-blocks are host choices fixed per captured shape (see
`choose_num_splits`: B, M-blocks, KV heads, the SM count and a host-known bound `max_seqlen_k`, by default
the page table's capacity); everything length-dependent is computed on the device, and with `out=` and
`workspace=` given nothing is allocated. Values (seqused_k within the page table's capacity,
cu_seqlens_q consistent with max_seqlen_q, page ids within the pool) are the caller's contract:
checking them would need a host sync; lengths are clamped to [0, capacity]. A graph that serves steps of other
sizes takes its split count on the device (`kv_splits`, at most the grid's S) and, for several sequences, a work
list (`work_programs`: a fixed number of programs that take the step's real (sequence, M-block, split) triples, sized
by `captured_work_grid`), so that its grid is not every sequence padded to the longest.

Decode bound (H200): the KV bytes over the ~4.4 TB/s read ceiling:
  B1  32k, H16/KV4, d256: 32768 * 4 * 256 * 2 B * 2 (K, V) = 134 MB -> 30.5 us;
  B1 128k, H8/KV2,  d256: 268 MB -> 61 us;   B8 32k: 1.07 GB -> 244 us;   B64 8k: 2.15 GB -> 488 us.
Config: BLOCK_N = 64 keys per iteration (a 32 KB K tile and a 32 KB V tile at d256 bf16), 4 warps (8 once the
packed M x D accumulator exceeds 8 K fp32). Pipeline depth: one stage (plain loads, no cp.async prologue; 43 KB of
shared memory and ~224 registers a thread at d256) where a split holds at most SHORT_SPLIT_TILES tiles,
LONG_SPLIT_STAGES for longer splits. Two programs an SM: one alone reads well below the ceiling, two reach it.
Hence the split heuristic: enough splits that B * KV * S programs fill 2 per SM in whole waves (the fewest within
5% of the best wave efficiency, counting only splits that tile rounding leaves non-empty; <= MAX_SPLITS; one tile
per split is allowed). The combine (one load per program) adds ~2 us at B1 32k, which PDL hides in part.

Chunk bound (H200, bf16; FLOPs = 4 * visible (query, key) pairs * H * D at ~700 TFLOP/s, the best measured
attention rate, against the K/V bytes 2 * ctx * KV * D * 2 B at ~4.4 TB/s). FLOPs per K/V byte are
q_len * group, so with the H200's 700 / 4.4 = 160 FLOP/B a chunk is compute-bound once q_len * group > ~160
(q_len > 40 at GQA 4); only decode and very short chunks are bandwidth-bound. H16/KV4 d256, one sequence:
  64 new over a 50k prefix:  52.5 GFLOP -> 75 us;  KV 205 MB -> 47 us.   256 new: 210 GFLOP -> 300 us.
  512 new over 50k: 421 GFLOP -> 602 us.   500 new over 8k: 67.6 GFLOP -> 97 us;  KV 35 MB -> 8 us.
  batch 8, 64 new over 32k: 275 GFLOP -> 393 us (278 us even at the 989 TFLOP/s dense peak); KV 1.08 GB -> 245 us.
So the chunk kernel is a compute kernel: wgmma-sized tiles (128 packed rows x 64 keys, 8 warps = two
warpgroups of 64 rows), 1 program per SM, and splits only to fill the SMs. Budget at d256 bf16 (sm_90a
compile on a CPU, `tests/test_agent_turn_attention.py`): the Q tile 128 x 256 (64 KB) plus two buffers each of
the 64 x 256 K and V tiles (4 x 32 KB) = 192 KB of the 227 KB per CTA; the fp32 accumulator 128 x 256 over
256 threads is 128 registers, the S/P tile 32 more: 255 registers per thread (ptxas spills ~44 bytes, all
outside the key loops), so 8 warps x 255 registers fill the 64 K register file: one program per SM. A
256-row M-block would need a 256 KB accumulator (the whole register file), hence two M-blocks for 64 tokens
x GQA 4 and L2 for the second K/V read. The split count aims at one program per SM in whole waves
(`choose_num_splits` with programs_per_sm=1): 64/50k -> S = 16 (128 programs of ~49 tiles), 500/8k -> S = 2
(16 M-blocks x 4 heads x 2), B8 64/32k -> S = 2. The workspace (N * H * S * D fp32, 16.8 MB at 64/50k and
500/8k) is written once and read once by the combine: ~8 us of traffic if it does not stay in the 50 MB L2.
"""
import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import pdl, registry, stamps
from kernels.host_math import cdiv, next_power_of_2
from kernels.norms import triton_runs_on
from kernels.registry import DeviceInfo, Impl, device_info, triton_unsupported
from kernels.varlen import sequence_span
from reference.checks import check_cu_seqlens, check_page_table, check_real, check_same_device, check_tensor, is_int

MAX_Q_LEN = 2048  # query tokens per sequence the kernel takes (a whole prefill chunk of the engine's default budget)
ALWAYS_Q_LEN = 512  # chunks up to this always run here; longer ones only where the split pays (`split_kv_pays`)
DECODE_MAX_Q_LEN = 8  # the decode variant's limits: q_len and packed rows (q_len * group)
DECODE_MAX_ROWS = 128
CHUNK_BLOCK_M = 128  # packed rows per M-block of the chunk variant (16-bit dtypes)
SHORT_ROWS = 32  # a mixed step's decode rows: sequences of <= SHORT_ROWS // group tokens get tiles this small
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_N = 64  # keys a tile, both variants (the decode split's 32-key tiles lost: FINDINGS, decode step)
MAX_SPLITS = 128  # choose_num_splits' cap; a caller may ask for up to 256
PROGRAMS_PER_SM = 2  # resident split programs per SM that choose_num_splits aims for (decode)
RESCALE_THRESHOLD = 8.0  # chunk variant: log2 growth of the running max that forces an O rescale (0: always)
COMBINE_TILE = 4096  # splits x head dims one combine program reduces
COMBINE_ROWS_TILE = 8192  # rows x splits x head dims one program of the chunk variant's combine reduces
# Pipeline depth (Triton num_stages) of the decode split kernel's key loop: one stage (plain loads, no cp.async
# prologue; 43 KB of shared memory at d256 instead of 76) for splits of up to SHORT_SPLIT_TILES tiles, where deeper
# pipelines lost at batch 1; LONG_SPLIT_STAGES for longer splits (64k, batch 16), where one stage lost (FINDINGS,
# decode step).
DECODE_STAGES = 1
SHORT_SPLIT_TILES = 2
LONG_SPLIT_STAGES = 2
LOG2E = 1.4426950408889634
H200_SMS = 132


class DecodeWorkspace(NamedTuple):
    """Flat fp32 scratch for the splits: o holds N*H*S*D partial outputs, lse N*H*S log-sum-exps."""
    o: torch.Tensor
    lse: torch.Tensor


class Plan(NamedTuple):
    """Host-side launch shape of one call: the variant, its tile and how many programs fit per SM."""
    chunk: bool  # the chunk variant (M-blocks, two loops) rather than the decode one
    block_m: int  # packed (query token, head) rows per M-block
    m_blocks: int  # M-blocks per (sequence, KV head), from the host bound max_seqlen_q
    block_n: int  # keys a tile
    num_warps: int
    num_stages: int
    programs_per_sm: int  # what choose_num_splits aims to keep resident


def alloc_workspace(max_tokens: int, num_heads: int, max_splits: int, head_dim: int, device) -> DecodeWorkspace:
    """Scratch for any call with N <= max_tokens query tokens and num_splits <= max_splits."""
    for name, value in (("max_tokens", max_tokens), ("num_heads", num_heads), ("max_splits", max_splits),
                        ("head_dim", head_dim)):
        if not is_int(value) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    rows = max_tokens * num_heads * max_splits
    return DecodeWorkspace(torch.empty(rows * head_dim, device=device, dtype=torch.float32),
                           torch.empty(rows, device=device, dtype=torch.float32))


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return H200_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=1024)
def choose_num_splits(batch: int, kv_heads: int, max_seqlen_k: int, num_sms: int = H200_SMS, *, m_blocks: int = 1,
                      programs_per_sm: int = PROGRAMS_PER_SM, block_n: int = BLOCK_N) -> int:
    """Splits per (sequence, M-block, KV head): the fewest whose programs fill programs_per_sm per SM in waves
    within 5% of the best wave efficiency, counting only the splits that tile rounding leaves non-empty.
    block_n: the plan's keys a tile (both variants' BLOCK_N)."""
    n_blocks = max(1, cdiv(max_seqlen_k, block_n))
    max_splits = min(MAX_SPLITS, n_blocks)
    effs = []
    for s in range(1, max_splits + 1):
        used = cdiv(n_blocks, cdiv(n_blocks, s))  # splits left non-empty by tile rounding
        waves = batch * m_blocks * kv_heads * used / (num_sms * programs_per_sm)
        effs.append(waves / math.ceil(waves))
    return next(s for s, eff in enumerate(effs, 1) if eff >= 0.95 * max(effs))


def tile_splits(tile: Plan, batch: int, kv_heads: int, max_seqlen_k: int, num_sms: int) -> int:
    """choose_num_splits for a call launched with this plan's tile."""
    return choose_num_splits(batch, kv_heads, max_seqlen_k, num_sms, m_blocks=tile.m_blocks,
                             programs_per_sm=tile.programs_per_sm, block_n=tile.block_n)


def _config(block_m: int, head_dim: int, elt_size: int) -> tuple[int, int]:
    """(num_warps, num_stages) of a split program for an M x D query tile and elt_size-byte K/V (the decode plan
    takes its warps and DECODE_STAGES; small chunk tiles take both)."""
    num_warps = 4 if block_m * head_dim <= 8192 else 8
    row_bytes = head_dim * elt_size
    return num_warps, (4 if row_bytes <= 256 else 3 if row_bytes <= 512 else 2)


@functools.lru_cache(maxsize=1024)
def plan(max_q_len: int, group: int, head_dim: int, elt_size: int, block_m: int | None = None) -> Plan:
    """The variant and tile for a call whose sequences have at most max_q_len query tokens.
    block_m (a power of two in 16..128) forces the chunk variant with that M-block (tests, tuning).

    Chunk tiles (sm_90a compiles on a CPU, Triton 3.6, bf16, page 64; see tests/test_agent_turn_attention.py):
    M-block 128 with 8 warps and 3 stages (4 at d64) uses wgmma with two buffers each of K and V:
    d256 192 KB of shared memory, 255 registers (~44 bytes spilled, outside the key loops); d128 96 KB,
    220 registers; d64 48 KB, 142 registers. Eight warps at 255 registers take the whole register file, so
    one program per SM; four-warp tiles (M-block <= 32, or 64 at d <= 128) leave room for two."""
    rows = max_q_len * group
    if block_m is None and max_q_len <= DECODE_MAX_Q_LEN and rows <= DECODE_MAX_ROWS:
        bm = max(16, next_power_of_2(rows))
        return Plan(False, bm, 1, BLOCK_N, _config(bm, head_dim, elt_size)[0], DECODE_STAGES, PROGRAMS_PER_SM)
    if block_m is None:
        big = CHUNK_BLOCK_M if elt_size <= 2 else CHUNK_BLOCK_M // 2  # fp32: a 128 x 256 Q tile alone is 128 KB
        block_m = max(16, next_power_of_2(rows)) if rows <= 64 else big
    if block_m <= 32:
        num_warps, num_stages = _config(block_m, head_dim, elt_size)
    else:
        num_warps = 4 if block_m * head_dim * elt_size <= 16384 else 8
        num_stages = 4 if head_dim * elt_size <= 128 else 3 if head_dim * elt_size <= 512 else 2
    return Plan(True, block_m, cdiv(rows, block_m), BLOCK_N, num_warps, num_stages, 2 if num_warps == 4 else 1)


def _short_rows_plan(tile: Plan, group: int, head_dim: int, elt_size: int) -> tuple[int, Plan] | None:
    """(q_max, plan) of a mixed step's decode-row launch: sequences of <= q_max tokens in SHORT_ROWS-row tiles;
    None when the big tile is no larger."""
    q_max = SHORT_ROWS // group
    if q_max < 1 or tile.block_m <= SHORT_ROWS:
        return None
    return q_max, plan(q_max, group, head_dim, elt_size, block_m=max(16, next_power_of_2(q_max * group)))


@triton.jit
def _pages_of(pt_row, start, end, n, n_ok, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page (int64; one scalar when the tile lies in one page, else (N,)) and in-page slot (N,) of the tile's keys
    n = start + arange(N), those < end valid (n_ok); an empty tile (start >= end) reads no page."""
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(pt_row + start // PAGE_SIZE, mask=start < end, other=0).to(tl.int64)
    else:
        page = tl.load(pt_row + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    return page, n % PAGE_SIZE


@triton.jit
def _prefetch_tile(k_base, v_base, pt_row, start, end, stride_kp, stride_kt, stride_vp, stride_vt,
                   PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ROW_BYTES: tl.constexpr):
    """Ask L2 for the K and V rows of the key tile [start, start + BLOCK_N) below end (none when start >= end)."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < end
    page, slot = _pages_of(pt_row, start, end, n, n_ok, PAGE_SIZE, BLOCK_N)
    pdl.prefetch_l2(k_base + page * stride_kp + slot * stride_kt, n_ok, ROW_BYTES)
    pdl.prefetch_l2(v_base + page * stride_vp + slot * stride_vt, n_ok, ROW_BYTES)


@triton.jit
def _kv_rows(page, slot, stride_p, stride_t, d):
    """(N, D) offsets of the K or V rows at page, slot (N,) (a page-major pool's strides), columns d."""
    return (page * stride_p + slot * stride_t)[:, None] + d[None, :]


@triton.jit
def _finish(acc, l_i, m_i, token, head, row_ok, d, split, num_splits, num_heads, gate_ptr, out_ptr, ws_o_ptr,
            ws_lse_ptr, stride_gn, stride_gh, stride_on, stride_oh,
            HEAD_DIM: tl.constexpr, DIRECT: tl.constexpr, HAS_GATE: tl.constexpr):
    """A split's epilogue for rows (token, head) (M,): O / l, gated, into out (DIRECT: the only split), or
    O / l and the LSE into the workspace row (token, head, split); rows that saw no key store lse = -inf."""
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]  # (M, D)
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
def _split_tile(acc, l_i, m_i, q, k, v, n, n_ok, last_key, qk_scale, DOT_PRECISION: tl.constexpr):
    """One key tile of the split kernel's online softmax: k, v (N, D) of keys n (N,), valid where n_ok."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (M, N), log2 units
    s = tl.where(n_ok[None, :] & (n[None, :] <= last_key[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["num_splits", "capacity"])
def _split_kernel(
    q_ptr, k_ptr, v_ptr, pt_ptr, seqused_ptr, cu_q_ptr, gate_ptr, out_ptr, ws_o_ptr, ws_lse_ptr,
    stride_qn, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_ptb,
    stride_gn, stride_gh, stride_on, stride_oh,
    qk_scale, num_splits, capacity, stamps_ptr,
    Q_LEN: tl.constexpr, VARLEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    HAS_GATE: tl.constexpr, DOT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr, STAMPS: tl.constexpr,
    PDL: tl.constexpr,
):
    # seqused_k and cu_seqlens_q (the host's) load before the PDL wait; q and the step's own keys come from
    # attention_prep, so every key tile loads after it (loading the first tile's cached keys before the wait lost:
    # FINDINGS, decode step); PREFETCH (under PDL) only asks L2 for them
    stamps.arrive(stamps_ptr, STAMPS)
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
    d = tl.arange(0, HEAD_DIM)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    pt_row = pt_ptr + b * stride_ptb
    row_bytes: tl.constexpr = HEAD_DIM * k_ptr.dtype.element_ty.primitive_bitwidth // 8
    if PREFETCH:  # the first tile's cached K and V rows into L2 while attention_prep runs (DRAM idles then)
        _prefetch_tile(k_base, v_base, pt_row, kv_start, kv_end, stride_kp, stride_kt, stride_vp, stride_vt,
                       PAGE_SIZE, BLOCK_N, row_bytes)
    pdl.wait_for_producer(PDL)  # q and the new token's K/V come from attention_prep
    t_go = stamps.go(stamps_ptr, STAMPS)
    pdl.release_dependents(PDL)  # let the combine kernel launch now; it waits for this grid to finish

    rows = tl.arange(0, BLOCK_M)  # row r: query token r // GROUP, head kvh * GROUP + r % GROUP
    qi = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = qi < q_len
    last_key = seqlen - q_len + qi  # (M,) causal limit, aligned at the end
    q_rows = (q_start + qi) * stride_qn + head * stride_qh  # (M,)
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)  # (M, D)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(kv_start, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # (N,) key positions
        n_ok = n < kv_end
        page, slot = _pages_of(pt_row, start, kv_end, n, n_ok, PAGE_SIZE, BLOCK_N)
        k = tl.load(k_base + _kv_rows(page, slot, stride_kp, stride_kt, d), mask=n_ok[:, None], other=0.0)  # (N, D)
        v = tl.load(v_base + _kv_rows(page, slot, stride_vp, stride_vt, d), mask=n_ok[:, None], other=0.0)
        acc, l_i, m_i = _split_tile(acc, l_i, m_i, q, k, v, n, n_ok, last_key, qk_scale, DOT_PRECISION)

    _finish(acc, l_i, m_i, q_start + qi, head, row_ok, d, split, num_splits, num_heads, gate_ptr, out_ptr, ws_o_ptr,
            ws_lse_ptr, stride_gn, stride_gh, stride_on, stride_oh, HEAD_DIM, DIRECT, HAS_GATE)
    stamps.end(stamps_ptr, t_go, STAMPS)


@triton.jit
def _chunk_tiles(acc, l_i, m_i, q, k_base, v_base, pt_row, lo, hi, last_key, d, qk_scale,
                 stride_kp, stride_kt, stride_vp, stride_vt,
                 MASK: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 RESCALE_THRESHOLD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax over the key tiles [lo, hi). MASK: keys >= hi and the causal limit last_key (M,) are
    masked (the diagonal tiles); otherwise every key of every tile is visible to every row (no masks)."""
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # (N,) key positions
        n_ok = n < hi
        if PAGE_SIZE % BLOCK_N == 0:
            page = tl.load(pt_row + start // PAGE_SIZE).to(tl.int64)
        elif MASK:
            page = tl.load(pt_row + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        else:
            page = tl.load(pt_row + n // PAGE_SIZE).to(tl.int64)
        slot = n % PAGE_SIZE
        k_ptrs = k_base + (page * stride_kp + slot * stride_kt)[:, None] + d[None, :]  # (N, D)
        v_ptrs = v_base + (page * stride_vp + slot * stride_vt)[:, None] + d[None, :]
        if MASK:
            k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (M, N), log2 units
        if MASK:
            s = tl.where(n_ok[None, :] & (n[None, :] <= last_key[:, None]), s, float("-inf"))
        m_cand = tl.maximum(m_i, tl.max(s, 1))  # (M,)
        if RESCALE_THRESHOLD > 0:
            # FA4's conditional rescale: keep the old max (P <= 2^threshold) unless a row grows it by more
            if tl.max(m_cand - m_i, 0) > RESCALE_THRESHOLD:
                alpha = tl.exp2(m_i - m_cand)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_cand
        else:
            alpha = tl.exp2(m_i - m_cand)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_cand
        p = tl.exp2(s - m_i[:, None])  # (M, N); 0 where masked
        l_i += tl.sum(p, 1)
        if MASK:
            v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _work_item(cu_q_ptr, p, num_seqs, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, Q_MIN: tl.constexpr,
               Q_MAX: tl.constexpr, SEQS: tl.constexpr):
    """A work-list program's (sequence, first packed row, split, whether it has work): program p does item
    p % items and split p // items, the items being the launch's real (sequence, M-block) pairs in order (the
    M-blocks of its sequences of Q_MIN..Q_MAX tokens, counted from cu_seqlens_q over SEQS >= num_seqs lanes)."""
    seq = tl.arange(0, SEQS)
    lens = tl.load(cu_q_ptr + seq + 1, mask=seq < num_seqs, other=0) - tl.load(cu_q_ptr + seq, mask=seq < num_seqs,
                                                                             other=0)
    mine = lens >= tl.maximum(Q_MIN, 1)
    if Q_MAX > 0:
        mine = mine & (lens <= Q_MAX)
    blocks = tl.where(mine, tl.cdiv(lens * GROUP, BLOCK_M), 0)  # (SEQS,) M-blocks of each sequence here
    ends = tl.cumsum(blocks, 0)
    total = tl.sum(blocks, 0)
    items = tl.maximum(total, 1)
    item = p % items
    b = tl.minimum(tl.sum((ends <= item).to(tl.int32), 0), num_seqs - 1)
    m0 = (item - tl.sum(tl.where(seq < b, blocks, 0), 0)) * BLOCK_M
    return b, m0, p // items, total > 0


@triton.jit(do_not_specialize=["num_splits", "capacity", "seqlen_q", "m_blocks", "num_seqs"])
def _chunk_kernel(
    q_ptr, k_ptr, v_ptr, pt_ptr, seqused_ptr, cu_q_ptr, gate_ptr, out_ptr, ws_o_ptr, ws_lse_ptr,
    stride_qn, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_ptb,
    stride_gn, stride_gh, stride_on, stride_oh,
    qk_scale, num_splits, capacity, seqlen_q, m_blocks, splits_ptr, num_seqs,
    VARLEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, HAS_GATE: tl.constexpr,
    RESCALE_THRESHOLD: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    Q_MIN: tl.constexpr, Q_MAX: tl.constexpr, SPLITS_ON_DEVICE: tl.constexpr, WORK_SEQS: tl.constexpr,
):
    # grid (B * m_blocks, KV, S); seqlen_q: every sequence's q_len when not VARLEN; only sequences with
    # Q_MIN <= q_len <= Q_MAX (0: no bound) are done here (a mixed step runs its decode rows in small tiles).
    # SPLITS_ON_DEVICE: the keys go to the first splits_ptr[0] of the S splits (a captured grid of S splits whose
    # step asks for fewer); the others see no key and store lse = -inf for the combine.
    # WORK_SEQS > 0 (a work list, with SPLITS_ON_DEVICE): grid (programs, KV, 1), each program one (sequence,
    # M-block, split) of the real ones (`_work_item`); splits past splits_ptr[0] are not run (the combine skips them)
    pdl.wait_for_producer(PDL)  # q and the new token's K/V come from attention_prep
    pdl.release_dependents(PDL)  # let the combine kernel launch now; it waits for this grid to finish
    used_splits = tl.load(splits_ptr) if SPLITS_ON_DEVICE else num_splits
    if WORK_SEQS > 0:
        b, m0, split, active = _work_item(cu_q_ptr, tl.program_id(0), num_seqs, GROUP, BLOCK_M, Q_MIN, Q_MAX,
                                          WORK_SEQS)
        active = active & (split < used_splits)
    else:
        b = tl.program_id(0) // m_blocks
        m0 = (tl.program_id(0) % m_blocks) * BLOCK_M  # first packed row of this M-block
        split = tl.program_id(2)
    kvh = tl.program_id(1)
    num_heads = tl.num_programs(1) * GROUP
    q_start, q_len = sequence_span(cu_q_ptr, b, seqlen_q, VARLEN)
    if WORK_SEQS == 0:
        active = m0 < q_len * GROUP  # M-blocks past this sequence's rows have nothing to do
        if Q_MIN > 0:
            active = active & (q_len >= Q_MIN)
        if Q_MAX > 0:
            active = active & (q_len <= Q_MAX)
    if active:
        seqlen = tl.minimum(tl.maximum(tl.load(seqused_ptr + b), 0), capacity)
        rows = m0 + tl.arange(0, BLOCK_M)  # row r: query token r // GROUP, head kvh * GROUP + r % GROUP
        qi = rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_ok = qi < q_len
        last_key = seqlen - q_len + qi  # (M,) causal limit, aligned at the end
        # keys [0, full) are visible to every row of the M-block, [0, hi) to some row
        hi = tl.minimum(tl.maximum(seqlen - q_len + tl.minimum((m0 + BLOCK_M - 1) // GROUP, q_len - 1) + 1, 0),
                        seqlen)
        full = tl.minimum(tl.maximum(seqlen - q_len + m0 // GROUP + 1, 0), hi)
        chunk = tl.cdiv(tl.cdiv(hi, used_splits), BLOCK_N) * BLOCK_N
        kv_start = split * chunk
        kv_end = tl.minimum(kv_start + chunk, hi)
        kv_mid = tl.minimum(tl.maximum(full // BLOCK_N * BLOCK_N, kv_start), kv_end)  # unmasked [start, mid)

        d = tl.arange(0, HEAD_DIM)
        token = q_start + qi
        q = tl.load(q_ptr + (token * stride_qn + head * stride_qh)[:, None] + d[None, :],
                    mask=row_ok[:, None] & (kv_start < kv_end), other=0.0)  # (M, D); none for an empty split
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        pt_row = pt_ptr + b.to(tl.int64) * stride_ptb
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        acc, l_i, m_i = _chunk_tiles(acc, l_i, m_i, q, k_base, v_base, pt_row, kv_start, kv_mid, last_key, d,
                                     qk_scale, stride_kp, stride_kt, stride_vp, stride_vt, False, PAGE_SIZE,
                                     BLOCK_N, RESCALE_THRESHOLD, DOT_PRECISION)
        acc, l_i, m_i = _chunk_tiles(acc, l_i, m_i, q, k_base, v_base, pt_row, kv_mid, kv_end, last_key, d,
                                     qk_scale, stride_kp, stride_kt, stride_vp, stride_vt, True, PAGE_SIZE,
                                     BLOCK_N, RESCALE_THRESHOLD, DOT_PRECISION)
        _finish(acc, l_i, m_i, token, head, row_ok, d, split, num_splits, num_heads, gate_ptr, out_ptr, ws_o_ptr,
                ws_lse_ptr, stride_gn, stride_gh, stride_on, stride_oh, HEAD_DIM, DIRECT, HAS_GATE)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    ws_o_ptr, ws_lse_ptr, gate_ptr, out_ptr, stride_gn, stride_gh, stride_on, stride_oh, num_splits, stamps_ptr,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr,
    STAMPS: tl.constexpr, PDL: tl.constexpr,
):
    # release before the wait: the next kernel (the layer's out-proj chain, whose producer streams weights before its
    # own wait) launches while the split runs, on SMs with room for its CTA beside the split's programs, and fills
    # its rings during the split instead of after it (faster than a release after the wait: FINDINGS, decode step)
    pdl.release_dependents(PDL)
    t_go = stamps.wait(stamps_ptr, STAMPS, PDL)  # launched early: wait for the split kernel's writes
    token = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    ws_row = (token * tl.num_programs(1) + head) * num_splits + tl.arange(0, BLOCK_S)  # (S,) this row's splits
    s_ok = tl.arange(0, BLOCK_S) < num_splits
    o_ptrs = ws_o_ptr + ws_row[:, None] * HEAD_DIM + d[None, :]
    # O loads beside the LSEs (one L2 round trip after the wait, not two); empty splits' stale rows are zeroed below
    o = tl.load(o_ptrs, mask=s_ok[:, None], other=0.0)  # (S, BD)
    lse = tl.load(ws_lse_ptr + ws_row, mask=s_ok, other=float("-inf"))  # (S,)
    live = lse > float("-inf")
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # (S,), 0 for empty splits
    o = tl.where(live[:, None], o, 0.0)
    denom = tl.sum(w, 0)
    o = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0.0, denom, 1.0)  # (BD,)
    if HAS_GATE:
        o = o * tl.sigmoid(tl.load(gate_ptr + token * stride_gn + head * stride_gh + d).to(tl.float32))
    tl.store(out_ptr + token * stride_on + head * stride_oh + d, o.to(out_ptr.dtype.element_ty))
    stamps.end(stamps_ptr, t_go, STAMPS)


@triton.jit(do_not_specialize=["num_rows", "num_heads", "num_splits"])
def _combine_rows_kernel(
    ws_o_ptr, ws_lse_ptr, gate_ptr, out_ptr, stride_gn, stride_gh, stride_on, stride_oh, num_rows, num_heads,
    num_splits, splits_ptr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr, SPLITS_ON_DEVICE: tl.constexpr, PDL: tl.constexpr,
):
    """The chunk variant's combine: grid (cdiv(N * H, ROWS), D / BLOCK_D), ROWS (token, head) rows a program,
    the same sum as `_combine_kernel` (chunks have many rows and few splits, so rows are batched).
    SPLITS_ON_DEVICE: only the first splits_ptr[0] splits were run (a work list writes no others)."""
    pdl.release_dependents(PDL)  # as `_combine_kernel`: the next kernel launches while the split runs
    pdl.wait_for_producer(PDL)  # launched early: wait for the split kernel's writes
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (R,) rows token * H + head
    r_ok = r < num_rows
    sp = tl.arange(0, BLOCK_S)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ws_row = r.to(tl.int64)[:, None] * num_splits + sp[None, :]  # (R, S)
    run = tl.minimum(tl.load(splits_ptr), num_splits) if SPLITS_ON_DEVICE else num_splits
    lse = tl.load(ws_lse_ptr + ws_row, mask=r_ok[:, None] & (sp < run)[None, :], other=float("-inf"))
    live = lse > float("-inf")
    m = tl.max(lse, 1)  # (R,)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)[:, None])  # (R, S), 0 for empty splits
    o = tl.load(ws_o_ptr + ws_row[:, :, None] * HEAD_DIM + d[None, None, :], mask=live[:, :, None], other=0.0)
    denom = tl.sum(w, 1)  # (R,)
    o = tl.sum(w[:, :, None] * o, 1) / tl.where(denom > 0.0, denom, 1.0)[:, None]  # (R, BD)
    token = r // num_heads
    head = r % num_heads
    if HAS_GATE:
        g = tl.load(gate_ptr + (token * stride_gn + head * stride_gh)[:, None] + d[None, :], mask=r_ok[:, None],
                    other=0.0)
        o = o * tl.sigmoid(g.to(tl.float32))
    tl.store(out_ptr + (token * stride_on + head * stride_oh)[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None])


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
    if not triton_runs_on(q.device):
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
    if kv_heads == 0 or q.shape[-2] == 0 or q.shape[-2] % kv_heads != 0:
        raise ValueError(f"q heads ({q.shape[-2]}) must be a positive multiple of kv heads ({kv_heads})")
    if k_pages.shape[1] == 0:
        raise ValueError(f"k_pages' pages must hold at least one token, got page_size 0 ({tuple(k_pages.shape)})")
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
        if not is_int(max_seqlen_q) or max_seqlen_q < 1:
            raise ValueError(f"max_seqlen_q must be a positive host int with cu_seqlens_q, got {max_seqlen_q!r}")
        q_len = max_seqlen_q
    if not 1 <= q_len <= MAX_Q_LEN:
        raise ValueError(f"q_len (max_seqlen_q) must be in 1..{MAX_Q_LEN}, got {q_len}")
    for name, t in (("gate", gate), ("out", out)):
        if t is not None and t.shape != q.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must have q's shape {tuple(q.shape)}")
    return batch, q_len


def _check_metadata(q, k_pages, page_table, seqused_k, cu_seqlens_q, q_len: int) -> None:
    """paged_decode_attention's check_metadata (host reads)."""
    if cu_seqlens_q is not None:
        c = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
        longest = max(b - a for a, b in zip(c, c[1:]))
        if longest > q_len:
            raise ValueError(f"max_seqlen_q {q_len} is below the longest sequence's {longest} tokens (cu_seqlens_q)")
    page_size = k_pages.shape[1]
    lens = seqused_k.clamp(0, page_table.shape[1] * page_size)  # the kernels clamp seqused_k so
    check_page_table(page_table, lens, page_size, k_pages.shape[0])


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
                           workspace=None, block_m=None, rescale_threshold=RESCALE_THRESHOLD, split_decode_rows=True,
                           check_metadata=True, kv_splits=None, work_programs=None):
    """Causal attention of 1..512 new queries per sequence over its paged KV cache (decode steps, speculative
    verification, agent-turn chunks; mixed in one varlen batch).

    q: (B, q_len, H, D), or (N, H, D) with cu_seqlens_q (B+1,) int32 and host int max_seqlen_q;
    k_pages, v_pages: (num_pages, page_size, KV, D); page_table: (B, max_pages) int32;
    seqused_k: (B,) int32 cached tokens per sequence including the new ones; gate: q's shape or None
    (the output is multiplied by sigmoid(gate)). num_splits: KV splits (None: choose_num_splits from
    max_seqlen_k, by default the page table's capacity). out: q's shape and dtype; workspace: from
    alloc_workspace. Tuning knobs of the chunk variant: block_m (power of two in 16..128; forces the chunk
    variant) and rescale_threshold (0: rescale O whenever the max grows; both exact). split_decode_rows: in a
    varlen batch of 2+ sequences on the chunk variant, first run the sequences of at most SHORT_ROWS // group
    tokens (decode rows) in SHORT_ROWS-row tiles, then the rest in the big tiles (one more launch; the same
    splits and combine). check_metadata: read cu_seqlens_q, seqused_k and the page table on the host (one sync) to
    refuse a cu_seqlens_q that does not rise from 0 to q's tokens, a max_seqlen_q below its longest sequence, and
    pages outside the pool; skipped inside a CUDA graph capture. Callers that build these themselves (the model's
    op, fa4.flash_attention, which checks them first) pass False. kv_splits: a (1,) int32 tensor on q's device, or
    None: the keys go to its first kv_splits[0] of num_splits splits (1 <= kv_splits[0] <= num_splits, which an int
    num_splits must give; the chunk variant only), so that a CUDA graph captured at num_splits serves steps that
    ask for fewer. work_programs: (big, short) ints, or None: with kv_splits and cu_seqlens_q, launch a work list
    instead of the (B * M-blocks, KV, S) grid: (big, KV) and (short, KV) programs, program p doing the (sequence,
    M-block) item p % items of its launch and split p // items, so that a CUDA graph of several sequences holds the
    step's real items x splits (`work_items`, at most the programs: checked with check_metadata), not every
    sequence padded to the longest. Returns out.
    """
    _check_tensors(q, k_pages, v_pages, page_table, seqused_k, cu_seqlens_q, gate, out)
    batch, q_len = _check_shapes(q, k_pages, v_pages, page_table, seqused_k, cu_seqlens_q, max_seqlen_q, gate, out)
    if block_m is not None and block_m not in (16, 32, 64, 128):
        raise ValueError(f"block_m must be None or one of 16, 32, 64, 128, got {block_m!r}")
    if not isinstance(rescale_threshold, (int, float)) or not 0 <= rescale_threshold <= 15:
        raise ValueError(f"rescale_threshold must be in [0, 15] (P <= 2^threshold), got {rescale_threshold!r}")
    if max_seqlen_k is not None and (not is_int(max_seqlen_k) or max_seqlen_k < 0):
        raise ValueError(f"max_seqlen_k must be None or a non-negative host int, got {max_seqlen_k!r}")
    scale = check_real("softmax_scale", softmax_scale, positive=True) if softmax_scale is not None else \
        1.0 / math.sqrt(q.shape[-1])
    if batch == 0:  # no sequences
        return torch.empty(q.shape, device=q.device, dtype=q.dtype) if out is None else out
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if kv_splits is not None:
        tile = plan(q_len, q.shape[-2] // k_pages.shape[2], k_pages.shape[3], q.element_size(), block_m)
        _check_kv_splits(kv_splits, num_splits, tile, q.device, check_metadata and not capturing)
    if check_metadata and not capturing:
        _check_metadata(q, k_pages, page_table, seqused_k, cu_seqlens_q, q_len)
    if work_programs is not None:
        _check_work_programs(work_programs, kv_splits, cu_seqlens_q, block_m, split_decode_rows)
        if check_metadata and not capturing:
            lens = cu_seqlens_q.diff().tolist()
            items = work_items(lens, q.shape[-2] // k_pages.shape[2], k_pages.shape[3], q.element_size(), q_len)
            used = int(kv_splits[0])
            if any(i * used > p for i, p in zip(items, work_programs)):
                raise ValueError(f"work_programs {work_programs} cannot hold this step's (big, short) items {items} "
                                 f"x {used} splits (kv_splits)")
    return launch(q, k_pages, v_pages, page_table, seqused_k, scale, cu_seqlens_q, batch, q_len, gate, num_splits,
                   max_seqlen_k, out, workspace, block_m, rescale_threshold, split_decode_rows, kv_splits,
                   work_programs)


def _check_work_programs(work_programs, kv_splits, cu_seqlens_q, block_m, split_decode_rows) -> None:
    if not (isinstance(work_programs, tuple) and len(work_programs) == 2
            and all(is_int(p) and p >= 1 for p in work_programs)):
        raise ValueError(f"work_programs must be None or two positive ints (big, short), got {work_programs!r}")
    if kv_splits is None or cu_seqlens_q is None:
        raise ValueError("work_programs needs kv_splits and cu_seqlens_q (a captured varlen step)")
    if block_m is not None or not split_decode_rows:
        raise ValueError("work_programs takes the default plan (block_m None, split_decode_rows True)")


def _check_kv_splits(kv_splits, num_splits, tile: Plan, device, read: bool) -> None:
    # read: the value too (a host sync)
    check_tensor("kv_splits", kv_splits, ndim=1, dtype=torch.int32, device=device)
    if kv_splits.shape[0] != 1:
        raise ValueError(f"kv_splits must hold one value, got shape {tuple(kv_splits.shape)}")
    if not is_int(num_splits):
        raise ValueError(f"kv_splits needs an int num_splits (the captured split count), got {num_splits!r}")
    if not tile.chunk:
        raise ValueError("kv_splits is for the chunk variant (q_len * group above the decode variant's rows)")
    if read and not 1 <= int(kv_splits[0]) <= num_splits:
        raise ValueError(f"kv_splits[0] must be in 1..num_splits ({num_splits}), got {int(kv_splits[0])}")


def launch(q, k_pages, v_pages, page_table, seqused_k, scale, cu_seqlens_q, batch, q_len, gate, num_splits,
            max_seqlen_k, out, workspace, block_m, rescale_threshold, split_decode_rows, kv_splits=None,
            work_programs=None):
    """paged_decode_attention on checked arguments (the engine's own, or fa4.flash_attention's after its checks):
    the plan and the launches, nothing checked again."""
    _, page_size, kv_heads, head_dim = k_pages.shape
    num_heads = q.shape[-2]
    group = num_heads // kv_heads
    capacity = page_table.shape[1] * page_size
    tile = plan(q_len, group, head_dim, q.element_size(), block_m)
    if num_splits is None:
        num_splits = tile_splits(tile, batch, kv_heads, max_seqlen_k or capacity, _num_sms(q.device))
    elif not is_int(num_splits) or not 1 <= num_splits <= 256:
        raise ValueError(f"num_splits must be an int in 1..256, got {num_splits!r}")
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype) if out is None else out
    q3, out3 = q.flatten(0, -3), out.view(-1, num_heads, head_dim)  # (N, H, D)
    g3 = gate.flatten(0, -3) if gate is not None else out3  # (N, H, D); out3 stands in when there is no gate
    n_tokens = q3.shape[0]
    if max(q3.numel(), n_tokens * num_heads * num_splits * head_dim) >= 2**31:
        raise ValueError(f"q ({n_tokens} tokens x {num_heads} heads) with num_splits {num_splits} is too large for the "
                         f"kernels' int32 offsets (N * H * S * D must be < 2^31)")
    if num_splits > 1:
        if workspace is None:
            workspace = alloc_workspace(n_tokens, num_heads, num_splits, head_dim, q.device)
        _check_workspace(workspace, n_tokens * num_heads * num_splits, head_dim, q.device)
    ws_o, ws_lse = (workspace.o, workspace.lse) if num_splits > 1 else (out3, out3)  # unused when S == 1
    launch = pdl.launch_options(q.device)
    args = (q3, k_pages, v_pages, page_table, seqused_k, cu_seqlens_q if cu_seqlens_q is not None else seqused_k,
            g3, out3, ws_o, ws_lse,
            q3.stride(0), q3.stride(1), *k_pages.stride()[:3], *v_pages.stride()[:3], page_table.stride(0),
            g3.stride(0), g3.stride(1), out3.stride(0), out3.stride(1),
            scale * LOG2E, num_splits, capacity)
    on_device = dict(SPLITS_ON_DEVICE=kv_splits is not None)
    common = dict(VARLEN=cu_seqlens_q is not None, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
                  BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, DIRECT=num_splits == 1, HAS_GATE=gate is not None,
                  DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=tile.num_warps,
                  num_stages=tile.num_stages if tile.chunk else decode_stages(max_seqlen_k or capacity, num_splits,
                                                                              tile.block_n),
                  **launch)
    if tile.chunk:
        # seqlen_q: the fixed q_len without cu_seqlens_q (unused with it)
        q_min = 0
        short = _short_rows_plan(tile, group, head_dim, q.element_size()) if (
            split_decode_rows and cu_seqlens_q is not None and batch > 1 and block_m is None) else None
        work = dict(WORK_SEQS=next_power_of_2(batch) if work_programs else 0)
        grids = [(programs, kv_heads, 1) for programs in work_programs] if work_programs else \
            [(batch * tile.m_blocks, kv_heads, num_splits), (batch, kv_heads, num_splits)]
        if short is not None:  # a mixed step: its decode rows (q_len <= short q_max) in small tiles first
            _chunk_kernel[grids[1]](
                *args, q_len, 1, kv_splits, batch, RESCALE_THRESHOLD=float(rescale_threshold), Q_MIN=0,
                Q_MAX=short[0], **{**common, **on_device, **work, "BLOCK_M": short[1].block_m,
                                   "num_warps": short[1].num_warps, "num_stages": short[1].num_stages})
            q_min = short[0] + 1
        _chunk_kernel[grids[0]](
            *args, q_len, tile.m_blocks, kv_splits, batch, RESCALE_THRESHOLD=float(rescale_threshold), Q_MIN=q_min,
            Q_MAX=0, **common, **on_device, **work)
    else:
        stamp, stamping = stamps.slot("attention_split", q.device)
        _split_kernel[(batch, kv_heads, num_splits)](*args, stamp, Q_LEN=q_len, STAMPS=stamping,
                                                     PREFETCH=launch["PDL"], **common)
    if num_splits > 1 and tile.chunk:
        _combine_rows(workspace, g3 if gate is not None else None, out3, num_splits, kv_splits, launch)
    elif num_splits > 1:
        _combine(workspace, g3 if gate is not None else None, out3, num_splits, launch)
    return out


def decode_stages(max_seqlen_k: int, num_splits: int, block_n: int) -> int:
    """The decode split kernel's pipeline depth: DECODE_STAGES for splits of up to SHORT_SPLIT_TILES tiles of
    block_n keys (of max_seqlen_k / num_splits keys), else LONG_SPLIT_STAGES."""
    tiles = cdiv(cdiv(max_seqlen_k, num_splits), block_n)
    return DECODE_STAGES if tiles <= SHORT_SPLIT_TILES else LONG_SPLIT_STAGES


def _combine(workspace: DecodeWorkspace, gate, out, num_splits: int, launch: dict) -> None:
    # workspace: (N, H, S, D) / (N, H, S) flat; gate (or None), out: (N, H, D)
    n_tokens, num_heads, head_dim = out.shape
    block_s = next_power_of_2(num_splits)
    block_d = min(head_dim, max(16, COMBINE_TILE // block_s))
    g = gate if gate is not None else out
    stamp, stamping = stamps.slot("attention_combine", out.device)
    _combine_kernel[(n_tokens, num_heads, head_dim // block_d)](
        workspace.o, workspace.lse, g, out, g.stride(0), g.stride(1), out.stride(0), out.stride(1), num_splits, stamp,
        HEAD_DIM=head_dim, BLOCK_S=block_s, BLOCK_D=block_d, HAS_GATE=gate is not None, STAMPS=stamping,
        num_warps=4, **launch,
    )


def _combine_rows(workspace: DecodeWorkspace, gate, out, num_splits: int, kv_splits, launch: dict) -> None:
    # the chunk variant's combine; workspace: (N, H, S, D) / (N, H, S) flat; gate (or None), out: (N, H, D);
    # kv_splits: (1,) int32, the splits that ran, or None: all num_splits
    n_tokens, num_heads, head_dim = out.shape
    block_s = next_power_of_2(num_splits)
    block_d = min(head_dim, max(16, COMBINE_ROWS_TILE // block_s))
    rows = max(1, COMBINE_ROWS_TILE // (block_s * block_d))
    g = gate if gate is not None else out
    _combine_rows_kernel[(cdiv(n_tokens * num_heads, rows), head_dim // block_d)](
        workspace.o, workspace.lse, g, out, g.stride(0), g.stride(1), out.stride(0), out.stride(1),
        n_tokens * num_heads, num_heads, num_splits, kv_splits, HEAD_DIM=head_dim, ROWS=rows, BLOCK_S=block_s,
        BLOCK_D=block_d, HAS_GATE=gate is not None, SPLITS_ON_DEVICE=kv_splits is not None, num_warps=4, **launch,
    )


def compile_variants(num_heads: int, k_pages: torch.Tensor, v_pages: torch.Tensor, width: int,
                     gated: bool = True) -> int:
    """Compile every launch variant a server meets, before requests pay for it (seconds each): the decode variant
    (q_len 1..8 is a constant of it) and the chunk variant's M-blocks, each with one split (DIRECT) and several,
    a mixed step's two launches, and both combines at every power-of-two split tile (BLOCK_S 2..MAX_SPLITS).
    Runs on a pool's first page with no keys (k_pages, v_pages: a real layer's pools, so strides and alignment
    match; width: the page tables' width). Returns the number of calls made."""
    dev, dtype, head_dim, kv_heads = k_pages.device, k_pages.dtype, k_pages.shape[3], k_pages.shape[2]
    group = num_heads // kv_heads
    calls = 0

    def run(q_lens, splits):
        nonlocal calls
        n = sum(q_lens)
        q = torch.zeros(n, num_heads, head_dim, dtype=dtype, device=dev)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        table = torch.zeros(len(q_lens), width, dtype=torch.int32, device=dev)
        seqused = torch.zeros(len(q_lens), dtype=torch.int32, device=dev)
        paged_decode_attention(q, k_pages, v_pages, table, seqused, cu_seqlens_q=cu, max_seqlen_q=max(q_lens),
                               check_metadata=False,
                               gate=q if gated else None, num_splits=splits)
        calls += 1

    firsts = {}  # one q_len per compiled variant: the decode variant's q_len, the chunk variant's M-block
    for q_len in range(1, MAX_Q_LEN + 1):
        tile = plan(q_len, group, head_dim, k_pages.element_size())
        firsts.setdefault((tile.chunk, tile.block_m, None if tile.chunk else q_len), q_len)
        if tile.chunk and tile.block_m == plan(MAX_Q_LEN, group, head_dim, k_pages.element_size()).block_m:
            break
    for splits in (1, 2):
        for q_len in firsts.values():
            run([q_len], splits)
        run([1, max(firsts.values())], splits)  # a mixed step: decode rows in small tiles, then the chunk
    for block_s in range(1, int(math.log2(MAX_SPLITS)) + 1):
        run([1], 2 ** block_s)
        run([max(firsts.values())], 2 ** block_s)
    return calls


# The share of the SMs a long chunk's forward must fill to beat this kernel when the forward is the CuTe one (fa4/cute):
# 800 new over 50k at d256 goes to CuTe at H16/KV4 (100 CTAs on 132 SMs) and stays here at H8/KV2 (50 CTAs).
CUTE_FORWARD_FILL = 0.5


class PagedKey(NamedTuple):
    """What routes paged attention (kernels.registry; entries here and in fa4.routes): the batch, its longest query
    chunk, the heads, the pages, the key bound (only where the choice reads it: chunks over ALWAYS_Q_LEN), dtype and
    device."""
    num_seqs: int
    q_len: int
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    seqlen_k: int
    dtype: torch.dtype
    device: DeviceInfo


def paged_key(q, k_pages, v_pages, step, scale, gate) -> PagedKey:
    # q: (N, H, D); k_pages: (pages, page_size, KV, D); step: model.step.StepInput
    q_len = step.max_seqlen_q
    seqlen_k = (step.max_seqlen_k or step.page_table.shape[1] * k_pages.shape[1]) if q_len > ALWAYS_Q_LEN else 0
    return PagedKey(step.num_seqs, q_len, q.shape[-2], k_pages.shape[2], k_pages.shape[3], k_pages.shape[1], seqlen_k,
                    q.dtype, device_info(q.device))


def split_kv_pays(batch: int, max_q_len: int, group: int, kv_heads: int, head_dim: int, elt_size: int,
                  max_seqlen_k: int, num_sms: int = H200_SMS, forward_fill: float = 1.0) -> bool:
    """Whether a causal paged call goes to this kernel rather than a prefill forward: always for chunks of up to
    ALWAYS_Q_LEN tokens; for longer ones (up to MAX_Q_LEN) when the forward's one program per (sequence, 128-row
    M-block, KV head) would fill less than forward_fill of the SMs (1: the Triton forward; CUTE_FORWARD_FILL: the
    faster CuTe one) and choose_num_splits asks for more than one split. Example: 800 new
    tokens over 50k on Qwen3.5-2B (H8/KV2, group 4) gives the forward 25 x 2 = 50 programs on 132 SMs."""
    if max_q_len <= ALWAYS_Q_LEN:
        return True
    if max_q_len > MAX_Q_LEN:
        return False
    tile = plan(max_q_len, group, head_dim, elt_size)
    if batch * tile.m_blocks * kv_heads >= forward_fill * num_sms:  # the forward fills the SMs enough
        return False
    return tile_splits(tile, batch, kv_heads, max_seqlen_k, num_sms) > 1


def paged_attention_op(q, k_pages, v_pages, step, scale, gate):
    """model.ops' paged_attention on this kernel (the router sends it decode steps, mixed steps and agent turns):
    the step's host bound max_seqlen_k; the engine built the step, so nothing is checked again."""
    grid_splits, used_splits, programs = step.kv_splits or (None, None, None)  # a captured step's (CapturedGrid)
    return launch(q, k_pages, v_pages, step.page_table, step.seqused_k, scale, step.cu_seqlens, step.num_seqs,
                   step.max_seqlen_q, gate, grid_splits, step.max_seqlen_k, None, None, None, RESCALE_THRESHOLD, True,
                   used_splits, programs)


def step_splits(num_seqs: int, q_len: int, heads: int, k_pages, seqlen_k: int, device) -> int:
    """The KV splits launch() chooses for a chunk-variant call (num_seqs sequences of up to q_len tokens over up
    to seqlen_k keys, k_pages: (pages, page_size, KV, D))."""
    kv_heads, head_dim = k_pages.shape[2], k_pages.shape[3]
    tile = plan(q_len, heads // kv_heads, head_dim, k_pages.element_size())
    return tile_splits(tile, num_seqs, kv_heads, seqlen_k, _num_sms(device))


def _key_bounds(capacity: int) -> list[int]:
    """The key bounds a captured grid is sized at: the powers of two below the page tables' capacity, and it."""
    return [1 << i for i in range(capacity.bit_length()) if 1 << i < capacity] + [capacity]


def work_items(q_lens, group: int, head_dim: int, elt_size: int, max_seqlen_q: int) -> tuple[int, int]:
    """(big, short) work items of a chunk-variant call of several sequences of q_lens tokens (host ints) planned at
    max_seqlen_q: the big tile's M-blocks of the sequences its launch takes, and the short launch's sequences (one
    M-block each; 0 without that launch). A work-list grid needs items x splits programs for each."""
    tile = plan(max_seqlen_q, group, head_dim, elt_size)
    short = _short_rows_plan(tile, group, head_dim, elt_size) if len(q_lens) > 1 else None
    q_max = short[0] if short else 0
    return (sum(cdiv(q * group, tile.block_m) for q in q_lens if q > q_max),
            sum(1 for q in q_lens if 1 <= q <= q_max))


def captured_work_grid(max_seqs: int, q_lens: range, heads: int, k_pages, max_pages: int,
                       device) -> tuple[int, int, int]:
    """(splits, big programs, short programs) of a work-list grid (`work_programs`) planned at q_lens' top that
    serves the steps of 2..max_seqs sequences and n tokens for n in q_lens, over page tables of max_pages pages:
    the most splits launch() chooses for any of them (its longest sequence's plan, at a power-of-two key bound or
    the capacity), and the most items x splits, the big items bounded by the step's M-blocks (at most
    n * group / block_m + sequences) and the short ones by its sequences."""
    kv_heads, head_dim, elt = k_pages.shape[2], k_pages.shape[3], k_pages.element_size()
    group, sms, top = heads // kv_heads, _num_sms(device), q_lens[-1]
    block_m = plan(top, group, head_dim, elt).block_m
    bounds = _key_bounds(max_pages * k_pages.shape[1])
    longest = {}  # each chunk plan of a step's longest sequence: its longest q_len (steps of the decode plan's
    for q in range(1, top + 1):  # sizes run another kernel eagerly, so they do not size the grid)
        tile = plan(q, group, head_dim, elt)
        if tile.chunk:
            longest[tile] = q
    splits = big = short = 1
    for seqs in range(2, max_seqs + 1):
        for tile, q in longest.items():
            if q * seqs < q_lens[0]:  # no step of the bucket has so short a longest sequence
                continue
            s = max(tile_splits(tile, seqs, kv_heads, b, sms) for b in bounds)
            items = min(seqs * cdiv(q * group, block_m), top * group // block_m + seqs)
            splits, big, short = max(splits, s), max(big, items * s), max(short, seqs * s)
    # every step fits one split (the sizing skips steps whose longest sequence takes the decode plan)
    return splits, max(big, top * group // block_m + max_seqs), max(short, max_seqs)


def captured_splits(num_seqs: int, q_lens: range, heads: int, k_pages, max_pages: int, device) -> int:
    """The splits of a captured grid (its step's count on the device, kv_splits) that serves steps of num_seqs
    sequences of up to q_len tokens for every q_len in q_lens, over page tables of max_pages pages: the most that
    launch() chooses for any of them at a power-of-two key bound (or the capacity). choose_num_splits is not
    monotone in the bound: between them it can ask for more (a step then uses the grid's; the same sums in other
    splits), and the grid of its largest ask would be mostly empty programs. Steps of the decode variant's sizes
    (its own kernel eagerly) do not size the grid."""
    kv_heads, head_dim = k_pages.shape[2], k_pages.shape[3]
    bounds = _key_bounds(max_pages * k_pages.shape[1])
    tiles = {plan(q, heads // kv_heads, head_dim, k_pages.element_size()) for q in q_lens}
    tiles = {t for t in tiles if t.chunk} or tiles
    return max(tile_splits(t, num_seqs, kv_heads, b, _num_sms(device)) for t in tiles for b in bounds)


# ---- the router's entry (kernels.registry): this kernel for decode, mixed steps and agent turns -----------------

def _split_kv(key, tuning):
    if key.head_dim not in HEAD_DIMS:
        return f"head_dim {key.head_dim} is not one of {HEAD_DIMS}"
    if not 1 <= key.q_len <= MAX_Q_LEN:
        return f"max q_len {key.q_len} is not in 1..{MAX_Q_LEN}"
    return triton_unsupported(key)


def _split_kv_cost(key, tuning) -> float:
    # below the forwards (1-2) where the split pays: short chunks always, long ones where a forward leaves SMs idle
    forward = registry.choose("paged_attention", key._replace(q_len=MAX_Q_LEN + 1),
                              "triton", tuning)
    fill = CUTE_FORWARD_FILL if forward.name == "cute_forward" else 1.0
    pays = split_kv_pays(
        key.num_seqs, key.q_len, key.heads // key.kv_heads, key.kv_heads, key.head_dim, key.dtype.itemsize,
        key.seqlen_k, key.device.num_sms or H200_SMS, fill)
    return 0.0 if pays else 3.0


registry.define("paged_attention", paged_key)
def _checked_op(q, k_pages, v_pages, step, scale, gate):
    # the op through the public checks, the step's metadata read on the host
    grid_splits, used_splits, programs = step.kv_splits or (None, None, None)
    return paged_decode_attention(q, k_pages, v_pages, step.page_table, step.seqused_k, softmax_scale=scale,
                                  cu_seqlens_q=step.cu_seqlens, max_seqlen_q=step.max_seqlen_q, gate=gate,
                                  max_seqlen_k=step.max_seqlen_k, num_splits=grid_splits, kv_splits=used_splits,
                                  work_programs=programs)


registry.register("paged_attention", Impl("split_kv", "triton", paged_attention_op, _split_kv, _split_kv_cost,
                                          _checked_op, captures=True))
