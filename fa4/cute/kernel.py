"""The CuTe-DSL FlashAttention forward for Hopper (sm_90a): TMA, mbarrier rings, wgmma, warp specialisation.

Tensors (host view): q, o (total_q, H, D); k, v (total_k, KV, D) or, paged, the pools seen as
(num_pages * page_size, KV, D); contiguous, bf16. Sequence b's rows (seqlen.py): dense b * Sq / b * Sk, varlen
cu_seqlens_q/_k, paged the pages page_table[b] holding its first seqused_k[b] keys. The kernel sees:
- Q and O as ((pack, T), D, H / pack): GQA packing puts the `pack` heads that share a KV head in M (row
  m = g + pack * t), so a 64-row wgmma tile holds 64 / pack query positions of `pack` heads;
- K as (T_k, D, KV) (K-major B of QK^T) and V as (D, T_k, KV) (MN-major B of PV).
TMA descriptors cover the whole tensors; a CTA offsets their row coordinate by its sequence start
(`domain_offset`; paged: each K/V tile's TMA coordinate is its page's row in the pool, one page_table read per
tile). Rows a tile reads past its sequence belong to the next sequence, an unused page slot, or are zero-filled
past the tensor: query rows there are never stored; key rows there never reach the softmax (their scores are set
to -inf before the row max) nor O (their V rows are zeroed in shared memory before PV, mask.zero_key_rows, so a
neighbour's NaN or Inf cannot leak through 0 x NaN).

CTA (config.py): warpgroup 0 is the producer (setmaxnreg down; its warp 0 issues the TMA loads: Q once, then
K and V of each visited tile, last tile first); warpgroups 1 and 2 are consumers (setmaxnreg up), each owning
64 rows of the 128-row Q tile. Per K/V tile a consumer: S = Q K^T (wgmma, smem operands), mask (diagonal and
ragged tiles only), online softmax (softmax.py), P to bf16 in registers, O += P V (wgmma, P from registers).
Epilogue: O / rowsum to bf16, into the warpgroup's own Q smem slice, then 16-byte stores of the rows that
exist; then the consumers release Q's buffer, so a persistent CTA's producer may load its next tile's Q.
Tiles (tile_scheduler.py): one per CTA, or a persistent loop; the K/V ring states carry across tiles.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from fa4.cute import mask as M
from fa4.cute import pipeline as P
from fa4.cute import softmax as S
from fa4.cute import tile_scheduler as TS
from fa4.cute import wgmma_desc as WD
from fa4.cute.config import BUFFER_ALIGN, WGMMA_M, AttentionConfig
from fa4.cute.seqlen import sequence_bounds

WGMMA_K = 16  # k of one bf16 wgmma: QK^T's k-blocks along the head dim

try:  # 4.8 moved these; the old paths warn
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum
except ImportError:  # pragma: no cover
    LayoutEnum, SmemAllocator = utils.LayoutEnum, utils.SmemAllocator


@cute.jit
def _gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, t_a: cute.Tensor, t_b: cute.Tensor, zero_init: bool):
    """acc (+)= A B over the k-blocks of the fragments (MMA, MMA_M/N, MMA_K)."""
    for k in cutlass.range_constexpr(cute.size(t_a, mode=[2])):
        tiled_mma.set(warpgroup.Field.ACCUMULATE, not zero_init or k != 0)
        cute.gemm(tiled_mma, acc, t_a[None, None, k], t_b[None, None, k], acc)
    return tiled_mma  # set() rebinds the atom's accumulate flag: callers rebind it so loops carry it


class FlashAttentionForwardSm90:
    def __init__(self, config: AttentionConfig):
        self.cfg = config.validate()
        self.dtype = BFloat16

    # ---------------------------------------------------------------- host side (traced once per config)
    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, o_ptr: cute.Pointer,
                 cu_seqlens_q_ptr: cute.Pointer | None, cu_seqlens_k_ptr: cute.Pointer | None,
                 seqused_k_ptr: cute.Pointer | None, page_table_ptr: cute.Pointer | None, total_q: Int32,
                 total_k: Int32, num_heads: Int32, num_kv: Int32, table_width: Int32, batch: Int32, seqlen_q: Int32,
                 seqlen_k: Int32, scale_log2: Float32, num_ctas: Int32, pairs_per_section: Int32,
                 stream: cuda.CUstream):
        """Raw pointers and sizes (no per-call tensor conversion on the host): q, o (total_q, num_heads, D);
        k, v (total_k, num_kv, D), all contiguous; cu_seqlens (batch + 1,), seqused_k (batch,), page_table
        (batch, table_width) row-major, int32. seqlen_q: the (longest, with varlen) query length; seqlen_k: the
        dense key length (else unread); num_ctas: the persistent grid (number of SMs; else unread);
        pairs_per_section: the persistent order's (head group, sequence) pairs a section (tile_scheduler.py)."""
        cfg = self.cfg
        d, pack, n_tile = cfg.head_dim, cfg.pack_gqa, cfg.tile_n
        cu_seqlens_q = cu_seqlens_k = seqused_k = page_table = None
        if cutlass.const_expr(cu_seqlens_q_ptr is not None):
            cu_seqlens_q = cute.make_tensor(cu_seqlens_q_ptr, cute.make_layout(batch + 1))
        if cutlass.const_expr(cu_seqlens_k_ptr is not None):
            cu_seqlens_k = cute.make_tensor(cu_seqlens_k_ptr, cute.make_layout(batch + 1))
        if cutlass.const_expr(seqused_k_ptr is not None):
            seqused_k = cute.make_tensor(seqused_k_ptr, cute.make_layout(batch))
        if cutlass.const_expr(page_table_ptr is not None):
            page_table = cute.make_tensor(page_table_ptr, cute.make_layout((batch, table_width),
                                                                           stride=(table_width, 1)))
        # Q, O: ((pack, T), D, H / pack); K: (T_k, D, KV); V: (D, T_k, KV)
        # the row stride declared a multiple of D, so O's epilogue may store 16 bytes at a time (unknown, it falls
        # back to 2-byte stores, 64 a thread, which showed in the d128 kernel's stalls: profiles/FINDINGS.md)
        q_view = cute.make_layout(((pack, total_q), d, num_heads // pack),
                                  stride=((d, cute.assume(num_heads * d, divby=d)), 1, pack * d))
        mQ = cute.make_tensor(q_ptr, q_view)
        mO = cute.make_tensor(o_ptr, q_view)
        mK = cute.make_tensor(k_ptr, cute.make_layout((total_k, d, num_kv), stride=(num_kv * d, 1, d)))
        mV = cute.make_tensor(v_ptr, cute.make_layout((d, total_k, num_kv), stride=(1, num_kv * d, d)))

        qk_tiler = (WGMMA_M, n_tile, d)  # (M, N, K) of S = Q K^T per consumer warpgroup
        pv_tiler = (WGMMA_M, d, n_tile)  # (M, N, K) of O = P V
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (1, 1, 1), qk_tiler[:2])
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
            (1, 1, 1), pv_tiler[:2], warpgroup.OperandSource.RMEM)

        # smem: Q as num_consumer_wg stages of 64 x D (one per consumer warpgroup), K and V rings
        sQ_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, qk_tiler, self.dtype, cfg.num_consumer_wg)
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, qk_tiler, self.dtype, cfg.kv_stages)
        sV_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, pv_tiler, self.dtype, cfg.kv_stages)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(g2s, mQ, cute.slice_(sQ_layout, (None, None, 0)), (WGMMA_M, d))
        # K/V: one TMA box per page inside a tile when pages are smaller than the tile (paged), else the whole tile
        box = cfg.kv_box_rows
        sK_box = cute.slice_(sK_layout, (None, None, 0))
        sV_box = cute.slice_(sV_layout, (None, None, 0))
        if cutlass.const_expr(box != n_tile):
            sK_box = cute.composition(sK_box, (cute.make_layout(box), cute.make_layout(d)))  # rows 0..box of a tile
            sV_box = cute.composition(sV_box, (cute.make_layout(d), cute.make_layout(box)))
        tma_k, mK_tma = cpasync.make_tiled_tma_atom(g2s, mK, sK_box, (box, d))
        tma_v, mV_tma = cpasync.make_tiled_tma_atom(g2s, mV, sV_box, (d, box))
        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_layout)  # both halves, one barrier
        self.kv_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0)))

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            k_mbar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.kv_stages]
            v_mbar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.kv_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], BUFFER_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], BUFFER_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], BUFFER_ALIGN]

        self.shared_storage = SharedStorage

        num_m_blocks = (seqlen_q * pack + (cfg.tile_m - 1)) // cfg.tile_m
        grid = (num_m_blocks, num_heads // pack, batch)
        if cutlass.const_expr(cfg.persistent):
            grid = (cutlass.max(cutlass.min(num_ctas, num_m_blocks * (num_heads // pack) * batch), 1), 1, 1)
        self.kernel(tma_q, mQ_tma, tma_k, mK_tma, tma_v, mV_tma, mO, tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout,
                    sV_layout, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, batch, seqlen_q, seqlen_k,
                    num_heads // num_kv, scale_log2, num_m_blocks, num_heads // pack, pairs_per_section).launch(
            grid=grid, block=[cfg.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, mO: cute.Tensor, tiled_mma_qk: cute.TiledMma,
               tiled_mma_pv: cute.TiledMma, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, cu_seqlens_q: cute.Tensor | None,
               cu_seqlens_k: cute.Tensor | None, seqused_k: cute.Tensor | None,
               page_table: cute.Tensor | None, batch_size: Int32, max_seqlen_q: Int32, dense_seqlen_k: Int32,
               group: Int32, scale_log2: Float32, num_m_blocks: Int32, num_head_groups: Int32,
               pairs_per_section: Int32):
        cfg = self.cfg
        d, pack, n_tile = cfg.head_dim, cfg.pack_gqa, cfg.tile_n
        paged = cfg.kv_mode == "paged"
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        q_pipe = P.make_tma_pipeline(storage.q_mbar.data_ptr(), 1, self.q_bytes, cfg.num_consumer_wg)
        k_pipe = P.make_tma_pipeline(storage.k_mbar.data_ptr(), cfg.kv_stages, self.kv_bytes, cfg.num_consumer_wg)
        v_pipe = P.make_tma_pipeline(storage.v_mbar.data_ptr(), cfg.kv_stages, self.kv_bytes, cfg.num_consumer_wg)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (64, D, num_consumer_wg)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (N, D, stages)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)  # (D, N, stages)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        total_tiles = TS.num_tiles(num_m_blocks, num_head_groups, batch_size, cfg.persistent)
        box = cfg.kv_box_rows
        boxes = n_tile // box
        lane = cute.arch.lane_idx()

        if wg_idx == 0:
            # ------------------------------------------------ producer warpgroup
            cute.arch.setmaxregister_decrease(cfg.producer_regs)
            if warp_idx == 0:
                q_state = P.producer_state(1)
                k_state = P.producer_state(cfg.kv_stages)
                v_state = P.producer_state(cfg.kv_stages)
                tile = TS.first_tile(cfg.persistent)
                while tile < total_tiles:
                    m_block, head_group, batch, q_start, seqlen_q, k_start, seqlen_k = self.tile_work(
                        tile, num_m_blocks, num_head_groups, batch_size, pairs_per_section, max_seqlen_q,
                        dense_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqused_k)
                    if m_block * cfg.tile_m < seqlen_q * pack:  # else: past this sequence (varlen)
                        kv_head = (head_group * pack) // group
                        n_max = M.n_block_max(m_block, seqlen_q, seqlen_k, cfg.causal, pack, cfg.tile_m, n_tile)
                        gQ = cute.local_tile(cute.domain_offset(((0, q_start), 0), mQ[None, None, head_group]),
                                             (WGMMA_M, d), (None, 0))
                        # K (box, D, boxes) and V (D, box, boxes) of this sequence (paged: of the whole pool); the
                        # smem tiles as (box, D, boxes per tile, 1, stages) and (D, box, 1, boxes per tile, stages)
                        gK = cute.local_tile(cute.domain_offset((k_start, 0), mK[None, None, kv_head]), (box, d),
                                             (None, 0))
                        gV = cute.local_tile(cute.domain_offset((0, k_start), mV[None, None, kv_head]), (d, box),
                                             (0, None))
                        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                                           cute.group_modes(gQ, 0, 2))
                        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1),
                                                           cute.group_modes(cute.flat_divide(sK, (box, d)), 0, 2),
                                                           cute.group_modes(gK, 0, 2))
                        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, cute.make_layout(1),
                                                           cute.group_modes(cute.flat_divide(sV, (d, box)), 0, 2),
                                                           cute.group_modes(gV, 0, 2))
                        # Q is loaded even when no key is visible: the consumers' epilogue stages O in its buffer
                        q_pipe.producer_acquire(q_state)
                        for half in cutlass.range_constexpr(cfg.num_consumer_wg):
                            cute.copy(tma_q, tQgQ[None, m_block * cfg.num_consumer_wg + half], tQsQ[None, half],
                                      tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
                        q_state.advance()
                        # paged: lane j holds the page of box j of the next tile, read one tile ahead
                        pages = self.load_pages(page_table, batch, n_max - 1, seqlen_k, lane)
                        for i in cutlass.range(n_max, unroll=1):
                            n_block = n_max - 1 - i
                            pages_now = pages
                            if cutlass.const_expr(paged):
                                if n_block > 0:
                                    pages = self.load_pages(page_table, batch, n_block - 1, seqlen_k, lane)
                            k_pipe.producer_acquire(k_state)
                            for j in cutlass.range_constexpr(boxes):
                                cute.copy(tma_k, tKgK[None, self.box_index(pages_now, n_block, j)],
                                          tKsK[None, j, 0, k_state.index],
                                          tma_bar_ptr=k_pipe.producer_get_barrier(k_state))
                            k_state.advance()
                            v_pipe.producer_acquire(v_state)
                            for j in cutlass.range_constexpr(boxes):
                                cute.copy(tma_v, tVgV[None, self.box_index(pages_now, n_block, j)],
                                          tVsV[None, 0, j, v_state.index],
                                          tma_bar_ptr=v_pipe.producer_get_barrier(v_state))
                            v_state.advance()
                    tile = TS.next_tile(tile, cfg.persistent)
        else:
            # ------------------------------------------------ consumer warpgroups
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
            cwg = wg_idx - 1
            tid = tidx % 128
            thr_qk = tiled_mma_qk.get_slice(tid)
            thr_pv = tiled_mma_pv.get_slice(tid)
            sQ_wg = sQ[None, None, cwg]
            tSrQ = tiled_mma_qk.make_fragment_A(thr_qk.partition_A(sQ_wg))  # (MMA, 1, D / 16)
            tSrK = tiled_mma_qk.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, 1, D / 16, stages)
            tOrV = tiled_mma_pv.make_fragment_B(thr_pv.partition_B(sV))  # (MMA, D / n, N / 16, stages)
            q_descs = k_operand = None  # hoisted_qk_desc: Q's descriptors (one a k-block), K's (a hoisted base)
            if cutlass.const_expr(cfg.hoisted_qk_desc):
                q_descs = WD.KMajorOperand(sQ_wg, sQ_layout, self.dtype, WGMMA_K).descriptors()
                k_operand = WD.KMajorOperand(sK, sK_layout, self.dtype, WGMMA_K)
            coords = thr_qk.partition_C(cute.make_identity_tensor((WGMMA_M, n_tile)))
            pingpong = cfg.pingpong and cfg.num_consumer_wg == 2
            acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((WGMMA_M, d)))
            acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((WGMMA_M, n_tile)))
            # P in registers as the A operand of PV: the accumulator of S and the A fragment of a
            # 64 x N x 16 wgmma hold the same (row, col) per thread in the same order for 16-bit types
            tOrP = cute.make_rmem_tensor(thr_pv.partition_shape_A((WGMMA_M, n_tile)), self.dtype)
            tOrP_as_s = cute.make_tensor(tOrP.iterator, acc_s.layout)
            q_state = P.consumer_state(1)
            k_state = P.consumer_state(cfg.kv_stages)
            v_state = P.consumer_state(cfg.kv_stages)
            tile = TS.first_tile(cfg.persistent)
            while tile < total_tiles:
                m_block, head_group, batch, q_start, seqlen_q, k_start, seqlen_k = self.tile_work(
                    tile, num_m_blocks, num_head_groups, batch_size, pairs_per_section, max_seqlen_q, dense_seqlen_k,
                    cu_seqlens_q, cu_seqlens_k, seqused_k)
                if m_block * cfg.tile_m < seqlen_q * pack:  # else: past this sequence (varlen)
                    n_max = M.n_block_max(m_block, seqlen_q, seqlen_k, cfg.causal, pack, cfg.tile_m, n_tile)
                    n_nomask = M.n_block_nomask(m_block, seqlen_q, seqlen_k, cfg.causal, pack, cfg.tile_m, n_tile)
                    row_max, row_sum, row_scale = S.make_state(2)
                    row_base = m_block * cfg.tile_m + cwg * WGMMA_M
                    acc_o.fill(0.0)
                    q_pipe.consumer_wait(q_state)
                    if n_max > 0:
                        P.pingpong_start(cwg, pingpong)
                        if cutlass.const_expr(not cfg.intra_wg_overlap):
                            # per tile: S = Q K^T, wait; softmax; O += P V, wait
                            for i in cutlass.range(n_max, unroll=1):
                                n_block = n_max - 1 - i
                                k_pipe.consumer_wait(k_state)
                                P.pingpong_wait(cwg, pingpong)
                                warpgroup.fence()
                                tiled_mma_qk = self.gemm_qk(tiled_mma_qk, acc_s, tSrQ, tSrK, k_state.index, q_descs,
                                                            k_operand)
                                warpgroup.commit_group()
                                P.pingpong_pass(cwg, i == n_max - 1, pingpong)
                                warpgroup.wait_group(0)
                                k_pipe.consumer_release(k_state)
                                k_state.advance()
                                if n_block >= n_nomask:
                                    M.apply_mask(acc_s, coords, row_base, n_block, seqlen_q, seqlen_k, cfg.causal,
                                                 pack, n_tile)
                                need = S.online_softmax_update(row_max, row_sum, row_scale, acc_s, scale_log2,
                                                               cfg.rescale_threshold, cfg.poly_exp2_fraction)
                                S.store_p(acc_s, tOrP_as_s)
                                if need:
                                    S.rescale_o(acc_o, row_scale)
                                v_pipe.consumer_wait(v_state)
                                self.zero_ragged_v(sV, v_state.index, n_block, seqlen_k, tid, cwg)
                                warpgroup.fence()
                                tiled_mma_pv = _gemm(tiled_mma_pv, acc_o, tOrP, tOrV[None, None, None, v_state.index],
                                                     False)
                                warpgroup.commit_group()
                                warpgroup.wait_group(0)
                                v_pipe.consumer_release(v_state)
                                v_state.advance()
                        else:
                            # intra-warpgroup overlap (FA3): S_i = Q K_i^T and O += P_{i-1} V_{i-1} are issued
                            # together; the softmax of S_i runs while PV_{i-1} is in flight, and only the
                            # (conditional) O rescale waits for it. Turns (ping-pong): tile 0's QK^T, the n_max - 1
                            # pairs, the last PV.
                            k_pipe.consumer_wait(k_state)
                            P.pingpong_wait(cwg, pingpong)
                            warpgroup.fence()
                            tiled_mma_qk = self.gemm_qk(tiled_mma_qk, acc_s, tSrQ, tSrK, k_state.index, q_descs,
                                                        k_operand)
                            warpgroup.commit_group()
                            P.pingpong_pass(cwg, False, pingpong)
                            warpgroup.wait_group(0)
                            k_pipe.consumer_release(k_state)
                            k_state.advance()
                            if n_max - 1 >= n_nomask:
                                M.apply_mask(acc_s, coords, row_base, n_max - 1, seqlen_q, seqlen_k, cfg.causal, pack,
                                             n_tile)
                            S.online_softmax_update(row_max, row_sum, row_scale, acc_s, scale_log2,  # O is 0 yet
                                                    cfg.rescale_threshold, cfg.poly_exp2_fraction)
                            S.store_p(acc_s, tOrP_as_s)
                            # only the first tile (n_max - 1) can reach past the keys: its V is zeroed here, so
                            # the loops below hold no branch for it (their waits on this V slot pass at once)
                            v_pipe.consumer_wait(v_state)
                            self.zero_ragged_v(sV, v_state.index, n_max - 1, seqlen_k, tid, cwg)
                            # the tiles that need a mask (n_block >= n_nomask: the diagonal and the ragged last
                            # key tile) come first; the rest run a loop without the mask's branch, so the
                            # softmax is one basic block from the QK^T wait to P's conversion
                            first_nomask = cutlass.max(cutlass.min(n_max - n_nomask, n_max), 1)
                            for phase in cutlass.range_constexpr(2):
                                masked = phase == 0
                                lo, hi = (1, first_nomask) if masked else (first_nomask, n_max)
                                for i in cutlass.range(lo, hi, unroll=1):
                                    n_block = n_max - 1 - i
                                    k_pipe.consumer_wait(k_state)
                                    v_pipe.consumer_wait(v_state)
                                    P.pingpong_wait(cwg, pingpong)
                                    warpgroup.fence()
                                    tiled_mma_qk = self.gemm_qk(tiled_mma_qk, acc_s, tSrQ, tSrK, k_state.index,
                                                                q_descs, k_operand)
                                    warpgroup.commit_group()
                                    tiled_mma_pv = _gemm(tiled_mma_pv, acc_o, tOrP,
                                                         tOrV[None, None, None, v_state.index], False)
                                    warpgroup.commit_group()
                                    P.pingpong_pass(cwg, False, pingpong)
                                    warpgroup.wait_group(1)  # S_i is ready; PV_{i-1} may still run
                                    if cutlass.const_expr(masked):
                                        M.apply_mask(acc_s, coords, row_base, n_block, seqlen_q, seqlen_k, cfg.causal,
                                                     pack, n_tile)
                                    need = S.online_softmax_update(row_max, row_sum, row_scale, acc_s, scale_log2,
                                                                   cfg.rescale_threshold, cfg.poly_exp2_fraction)
                                    # K's slot released after the softmax, not at the QK^T wait: ptxas then keeps
                                    # the wait for PV_{i-1} below the first exps when the max moves by a branch
                                    # (d128 SASS: 8-9 exps before it against 2), as flash-attn-4's loop has it
                                    k_pipe.consumer_release(k_state)
                                    k_state.advance()
                                    warpgroup.wait_group(0)  # PV_{i-1} done: O and P_{i-1} are free
                                    v_pipe.consumer_release(v_state)
                                    v_state.advance()
                                    # P before the rescale: no branch between the exps and P's conversion, so the
                                    # conversions interleave with the exps' tail instead of trailing the iteration
                                    S.store_p(acc_s, tOrP_as_s)
                                    if need:
                                        S.rescale_o(acc_o, row_scale)
                            v_pipe.consumer_wait(v_state)
                            P.pingpong_wait(cwg, pingpong)
                            warpgroup.fence()
                            tiled_mma_pv = _gemm(tiled_mma_pv, acc_o, tOrP, tOrV[None, None, None, v_state.index],
                                                 False)
                            warpgroup.commit_group()
                            P.pingpong_pass(cwg, True, pingpong)
                            warpgroup.wait_group(0)
                            v_pipe.consumer_release(v_state)
                            v_state.advance()

                    S.online_softmax_finalize(row_sum, acc_o)
                    self.epilogue(acc_o, thr_pv, sQ_wg, mO, cwg, tid, m_block, head_group, q_start, seqlen_q)
                    cute.arch.fence_proxy("async.shared", space="cta")  # O's generic smem writes before Q's TMA
                    q_pipe.consumer_release(q_state)  # O's staging in Q's buffer is read: the next Q may land
                    q_state.advance()
                tile = TS.next_tile(tile, cfg.persistent)

    @cute.jit
    def gemm_qk(self, tiled_mma_qk: cute.TiledMma, acc_s: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                stage: Int32, q_descs, k_operand):
        """S = Q K^T from K's ring slot `stage`: through cute.gemm, or (hoisted_qk_desc) our wgmmas with Q's
        descriptors built before the loops and K's from its hoisted base (q_descs, k_operand: wgmma_desc.py)."""
        if cutlass.const_expr(self.cfg.hoisted_qk_desc):
            WD.wgmma_ss(acc_s, q_descs, k_operand.descriptors(stage), self.cfg.tile_n, True)
        else:
            tiled_mma_qk = _gemm(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, stage], True)
        return tiled_mma_qk

    @cute.jit
    def tile_work(self, tile: Int32, num_m_blocks: Int32, num_head_groups: Int32, batch_size: Int32,
                  pairs_per_section: Int32, max_seqlen_q: Int32, dense_seqlen_k: Int32, cu_seqlens_q, cu_seqlens_k,
                  seqused_k):
        """The work of linear tile `tile`, the same in the producer and the consumers:
        (m_block, head_group, batch, q_start, seqlen_q, k_start, seqlen_k)."""
        cfg = self.cfg
        m_block, head_group, batch = TS.tile_coords(tile, num_m_blocks, num_head_groups, batch_size,
                                                    pairs_per_section, cfg.causal, cfg.persistent)
        q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(batch, max_seqlen_q, dense_seqlen_k, cu_seqlens_q,
                                                               cu_seqlens_k, seqused_k, cfg.varlen_q, cfg.kv_mode)
        return m_block, head_group, batch, q_start, seqlen_q, k_start, seqlen_k

    @cute.jit
    def load_pages(self, page_table, batch: Int32, n_block: Int32, seqlen_k: Int32, lane: Int32) -> Int32:
        """Paged: lane j (< boxes per tile) reads the page of box j of K/V tile n_block (boxes past the keys read the
        last page: their rows are masked and zeroed). Not paged: 0."""
        page = Int32(0)
        if cutlass.const_expr(self.cfg.kv_mode == "paged"):
            cfg = self.cfg
            boxes = cfg.tile_n // cfg.kv_box_rows
            first_key = n_block * cfg.tile_n + cutlass.min(lane, boxes - 1) * cfg.kv_box_rows
            key = cutlass.max(cutlass.min(first_key, seqlen_k - 1), 0)  # in the table even without keys
            page = page_table[batch, key // cfg.page_size]
        return page

    @cute.jit
    def box_index(self, pages: Int32, n_block: Int32, j: cutlass.Constexpr) -> Int32:
        """The TMA box (of kv_box_rows rows, counted from the sequence start or, paged, the pool start) that fills
        box j of K/V tile n_block."""
        cfg = self.cfg
        index = n_block
        if cutlass.const_expr(cfg.kv_mode == "paged"):
            page = cute.arch.shuffle_sync(pages, j)
            if cutlass.const_expr(cfg.page_size >= cfg.tile_n):  # the tile inside its page
                per_page = cfg.page_size // cfg.tile_n
                index = page * per_page + n_block % per_page
            else:  # one box is one page
                index = page
        return index

    @cute.jit
    def zero_ragged_v(self, sV: cute.Tensor, stage: Int32, n_block: Int32, seqlen_k: Int32, tid: Int32, cwg: Int32):
        """If V tile n_block (in ring slot `stage`) reaches past the keys, zero those rows (mask.zero_key_rows)
        and make the zeros visible to this warpgroup's wgmma."""
        valid = seqlen_k - n_block * self.cfg.tile_n
        if valid < self.cfg.tile_n:
            M.zero_key_rows(sV[None, None, stage], valid, tid, self.cfg.tile_n, self.cfg.head_dim)
            cute.arch.fence_proxy("async.shared", space="cta")
            P.epilogue_sync(cwg)

    @cute.jit
    def epilogue(self, acc_o: cute.Tensor, thr_pv, sO: cute.Tensor, mO: cute.Tensor, cwg: Int32, tid: Int32,
                 m_block: Int32, head_group: Int32, q_start: Int32, seqlen_q: Int32):
        """O (fp32 fragment, already normalised) -> bf16 in the warpgroup's Q smem slice -> the rows that exist."""
        cfg = self.cfg
        d, pack = cfg.head_dim, cfg.pack_gqa
        r_o = cute.make_rmem_tensor_like(acc_o, self.dtype)
        r_o.store(acc_o.load().to(self.dtype))
        P.epilogue_sync(cwg)  # every warp's QK^T has read this Q slice (wgmma reads finish before wait_group)
        cute.autovec_copy(r_o, thr_pv.partition_C(sO))
        P.epilogue_sync(cwg)

        tile = m_block * cfg.num_consumer_wg + cwg  # 64-row tile of this sequence's packed rows
        gO = cute.local_tile(cute.domain_offset(((0, q_start), 0), mO[None, None, head_group]),
                             (WGMMA_M, d), (tile, 0))
        cO = cute.local_tile(cute.make_identity_tensor((pack * seqlen_q, d)), (WGMMA_M, d), (tile, 0))
        vec = 128 // self.dtype.width  # 8 bf16 = 16 bytes per store
        threads_per_row = d // vec
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        tiled_copy = cute.make_tiled_copy_tv(
            atom, cute.make_layout((128 // threads_per_row, threads_per_row), stride=(threads_per_row, 1)),
            cute.make_layout((1, vec)))
        thr_copy = tiled_copy.get_slice(tid)
        tOsO = thr_copy.partition_S(sO)
        tOgO = thr_copy.partition_D(gO)
        tOcO = thr_copy.partition_D(cO)
        rows = pack * seqlen_q
        for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
            if tOcO[0, m, 0][0] < rows:
                cute.copy(atom, tOsO[None, m, None], tOgO[None, m, None])
