"""Where a sequence's rows live, for the CuTe-DSL attention forward (compile-time layout, runtime lengths).

Queries: dense, sequence b is rows b * Sq .. (b + 1) * Sq of the (B * Sq, H, D) tensor; varlen (cu_seqlens_q),
rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1]. Keys: dense, rows b * Sk ..; varlen (cu_seqlens_k) likewise;
paged, the first seqused_k[b] keys of the pages page_table[b, :] of a (num_pages * page_size, KV, D) pool
(k_start 0: the producer finds each tile's page, tile_scheduler.py / kernel.py).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def sequence_bounds(batch: Int32, seqlen_q: Int32, seqlen_k: Int32, cu_seqlens_q, cu_seqlens_k, seqused_k,
                    varlen_q: cutlass.Constexpr, kv_mode: cutlass.Constexpr):
    """-> (q_start, seqlen_q, k_start, seqlen_k) of sequence `batch`; seqlen_q/_k are the dense lengths."""
    q_start = batch * seqlen_q
    len_q = seqlen_q
    if cutlass.const_expr(varlen_q):
        q_start = cu_seqlens_q[batch]
        len_q = cu_seqlens_q[batch + 1] - q_start
    k_start = batch * seqlen_k
    len_k = seqlen_k
    if cutlass.const_expr(kv_mode == "varlen"):
        k_start = cu_seqlens_k[batch]
        len_k = cu_seqlens_k[batch + 1] - k_start
    if cutlass.const_expr(kv_mode == "paged"):
        k_start = Int32(0)
        len_k = seqused_k[batch]
    return q_start, len_q, k_start, len_k
