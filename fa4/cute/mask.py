"""Masking for the CuTe-DSL attention forward: which K/V tiles a Q tile visits, and which scores to drop.

Causal masks align at the end, as in reference/attention.py: query position s (of seqlen_q) sees keys
j <= s + seqlen_k - seqlen_q. With GQA packing, packed row m is query position m // pack.

For the Q tile m_block (rows [m_block * tile_m, (m_block + 1) * tile_m) of the packed M = pack * seqlen_q):
- `n_block_max`: one past the last K/V tile any row sees (tiles beyond are never loaded: fully masked tiles
  are skipped);
- `n_block_nomask`: tiles below it are visible to every row of the tile and to
  the end of the keys, so they need no mask. The mainloop runs from n_block_max - 1 down, masking only the
  first `n_block_max - n_block_nomask` iterations (the diagonal tiles and the ragged last key tile).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa4.cute.softmax import acc_mn_view


@cute.jit
def n_block_max(m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr,
                pack: cutlass.Constexpr, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr) -> Int32:
    keys = seqlen_k
    if cutlass.const_expr(causal):
        s_last = cutlass.min(((m_block + 1) * tile_m - 1) // pack, seqlen_q - 1)
        keys = cutlass.max(cutlass.min(seqlen_k, s_last + seqlen_k - seqlen_q + 1), 0)
    return (keys + (tile_n - 1)) // tile_n


@cute.jit
def n_block_nomask(m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr,
                   pack: cutlass.Constexpr, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr) -> Int32:
    full = seqlen_k // tile_n  # tiles inside the keys
    if cutlass.const_expr(causal):
        s_first = (m_block * tile_m) // pack
        seen = s_first + seqlen_k - seqlen_q + 1  # keys seen by the tile's first row
        seen = cutlass.max(seen, 0)
        full = cutlass.min(full, seen // tile_n)
    return full


@cute.jit
def apply_mask(acc_s: cute.Tensor, coords: cute.Tensor, row_base: Int32, n_block: Int32, seqlen_q: Int32,
               seqlen_k: Int32, causal: cutlass.Constexpr, pack: cutlass.Constexpr, tile_n: cutlass.Constexpr):
    """Sets to -inf the scores of acc_s (a 64 x tile_n accumulator) whose key is past seqlen_k or, if causal,
    past the row's diagonal. coords: the same partition of an identity tensor (local (row, col) of each value);
    row_base: the packed row of local row 0; n_block: the K/V tile."""
    s_mn = acc_mn_view(acc_s)
    c_mn = acc_mn_view(coords)
    col_base = n_block * tile_n
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        limit = seqlen_k
        if cutlass.const_expr(causal):
            s = (row_base + c_mn[r, 0][0]) // pack
            limit = cutlass.min(limit, s + seqlen_k - seqlen_q + 1)
        limit = limit - col_base
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            if c_mn[r, c][1] >= limit:
                s_mn[r, c] = -Float32.inf


@cute.jit
def zero_key_rows(sV: cute.Tensor, valid: Int32, tid: Int32, tile_n: cutlass.Constexpr, head_dim: cutlass.Constexpr):
    """Zeroes the rows `valid..tile_n` (keys past the sequence) of one V tile in shared memory, sV (D, N).

    Masking sets their scores to -inf, so P is 0 there, but the PV wgmma still multiplies those P by V, and
    0 x NaN (a neighbour's or an unused page slot's NaN/Inf) is NaN. A consumer warpgroup calls this on its
    sequence's last, ragged tile only, after the V tile has landed and before its PV: thread tid writes columns
    tid, tid + 128... of each row, then a proxy fence and the warpgroup's barrier make the zeros visible to
    wgmma. Both consumer warpgroups zero the same rows (the same value), so neither waits for the other."""
    for n in cutlass.range(valid, tile_n, unroll=1):
        for c in cutlass.range_constexpr(head_dim // 128):
            sV[c * 128 + tid, n] = sV.element_type(0.0)
