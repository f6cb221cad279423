"""A GDN layer's first stretch at batch-1 decode in one CuTe-DSL launch: the in-projection of the normed hidden row
and the gated delta step, with a thread-block cluster a key head exchanging through distributed shared memory.

Unfused, the stretch is two kernels (kernels/tma_gemv.py's normed GEMV, then kernels/gdn_decode.py): the GDN kernel
waits for the whole projection to land in global memory, reads it back, and its dv slices meet again over a
global-memory ticket for the gated norm. Each of those is a dependent L2 round trip behind a full ring of weights.
Here the projection rows a key head needs are computed by the CTAs that then use them:

  grid: num_k_heads clusters of `cluster` (8, or 4) CTAs; CTA `rank` of cluster `head` owns rows rank * slice ..
  + slice (slice = 128 / cluster: 16, or 32) of the head's q and k (its dk slice) and of each of its G = Hv / Hk
  value heads' v and z (its dv slice), (2 + 2G) * slice / 16 blocks of 16 in-projection rows. Ranks 0 .. G - 1 also
  take the heads' b rows, G .. 2G - 1 their a rows (one dot each, summed in the GEMV's order).

  1. The producer warp streams the CTA's row blocks through the TMA ring (tma_gemv's); the consumers stage
     rms_norm(x + residual) (tma_gemv's stage_x) and reduce each row as the plain GEMV does, rounded to bf16.
  2. Each CTA convolves its own channels (the conv is per channel) and pushes its q and k slices (and its b or a)
     into every CTA of the cluster; one cluster barrier (release / acquire) later, every CTA holds the head's whole q
     and k, so each computes their L2 norms itself.
  3. Thread layout of the delta step: the CTA's G * slice state columns, 256 / (G * slice) threads a column, each
     holding 128 / (256 / (G * slice)) rows of the column in registers (loaded before the PDL wait: no kernel of
     the step writes the states). S^T k and S^T q reduce over the column's threads with shuffles.
  4. The gated RMSNorm needs each value head's sum of o^2 over all dv: one more push of G partial sums and a
     second cluster barrier; then each CTA writes its slice of the output row.

Everything else matches kernels/gdn_decode.py's math and roundings (see there). Constraints: bf16 throughout (fp32
states), dk = dv = slice * cluster = 128, G in (1, 2, 4) with 2G <= cluster, batch 1. Compiled once per
InProjGdnConfig; compiling needs no GPU (CUTE_DSL_ARCH=sm_90a).
"""
import dataclasses
import functools

import torch

from kernels import gdn_pointwise, pdl, tma_gemv
from kernels.cute_runtime import CompileCache, cu_stream, ptx_statement
from model import ops

BLOCK_ROWS = 16  # in-projection rows of one TMA box and one consumer pass (tma_gemv's block_n)
CLUSTER_SIZES = (8, 4)  # CTAs a key head that the kernel is built for
# The cluster sizes `available` tries, in order: the first whose clusters (one a key head) the GPU holds at once.
# Clusters of 4 take half the SMs (2B: 64), each CTA streaming twice the rows; session 22's and 23's H200 held only
# 15 clusters of 8 against 2B's 16 key heads, and 33 of 4 (assumed from the GPC layout: not yet asked). Untimed, so
# only 8 until `python -m profiles.bench_decode --sweep-in-proj-gdn qwen3.5-2b` ('fused_c4') says 4 pays.
CLUSTERS = (8,)
# The weight ring of a CTA, by cluster size: clusters of 4 stream the in-projection from half the SMs, so each may
# need more bytes in flight to keep DRAM busy (Little's law: 64 SMs x 128 KiB over a ~2 us loaded round trip is
# ~4 TB/s, the edge). `--sweep-in-proj-gdn` times 4 with 192 KiB too ('fused_c4_ring192k'); untimed, both 128 KiB.
RING_BYTES = {8: tma_gemv.RING_BYTES, 4: tma_gemv.RING_BYTES}
GROUPS = (1, 2, 4)  # value heads a key head


@dataclasses.dataclass(frozen=True)
class InProjGdnConfig:
    hidden: int  # the in-projection's K
    num_k_heads: int
    num_v_heads: int
    head_dim: int = 128  # dk = dv
    conv_taps: int = 4
    add: bool = True  # a residual is added before the norm (every layer but the first)
    pdl: bool = True
    ring_bytes: int = tma_gemv.RING_BYTES
    cluster: int = 8  # CTAs a key head (CLUSTER_SIZES)

    @property
    def group(self) -> int:
        return self.num_v_heads // self.num_k_heads

    @property
    def gemv(self) -> tma_gemv.TmaGemvConfig:
        """The ring and the staged row: tma_gemv's config of one normed GEMV in 16-row blocks."""
        slot_bytes = tma_gemv.SLOT_ROWS * tma_gemv.BLOCK_K * 2
        return tma_gemv.TmaGemvConfig(self.hidden, BLOCK_ROWS, min(32, self.ring_bytes // slot_bytes), consumer_warps=8,
                                      norm=True, add=self.add, pdl=self.pdl)

    @property
    def conv_channels(self) -> int:
        return (2 * self.num_k_heads + self.num_v_heads) * self.head_dim

    @property
    def slice(self) -> int:
        """Rows of q, of k and of each value head's v and z that a CTA owns."""
        return self.head_dim // self.cluster

    @property
    def sub_blocks(self) -> int:
        """BLOCK_ROWS-row blocks in a slice."""
        return self.slice // BLOCK_ROWS

    @property
    def blocks(self) -> int:
        """BLOCK_ROWS-row blocks a CTA projects: its slices of q, k, then G of v, then G of z."""
        return (2 + 2 * self.group) * self.sub_blocks

    @property
    def own_channels(self) -> int:
        """Conv channels a CTA convolves: its q, k and v slices."""
        return (2 + self.group) * self.slice

    def validate(self) -> "InProjGdnConfig":
        if self.cluster not in CLUSTER_SIZES:
            raise ValueError(f"cluster must be one of {CLUSTER_SIZES}, got {self.cluster}")
        if self.head_dim != 128:
            raise ValueError(f"head_dim must be 128 (a slice of {BLOCK_ROWS} rows or more a CTA), got "
                             f"{self.head_dim}")
        if (self.num_k_heads < 1 or self.num_v_heads % self.num_k_heads or self.group not in GROUPS
                or 2 * self.group > self.cluster):
            raise ValueError(f"num_v_heads / num_k_heads must be one of {GROUPS} and at most cluster / 2 (a rank "
                             f"takes each b and a row), got {self.num_v_heads} / {self.num_k_heads} with cluster "
                             f"{self.cluster}")
        if self.conv_taps < 2:
            raise ValueError(f"conv_taps must be at least 2, got {self.conv_taps}")
        gemv = self.gemv.validate()
        if gemv.consumer_warps * 32 < self.own_channels:
            raise ValueError(f"a consumer thread a conv channel: {self.own_channels} channels, "
                             f"{gemv.consumer_warps} warps")
        return self


def available(x: torch.Tensor, weight: torch.Tensor, tensors: dict, num_k_heads: int) -> bool:
    """Whether in_proj_gdn takes this call: one bf16 row, the in-projection (and norm weight, residual) as
    tma_gemv.available takes them, dk = dv = 128, a supported group, and bf16 parameters, states and conv window
    of the shapes the layer has (`tensors`: in_proj_gdn's keyword tensors by name)."""
    states, conv = tensors["recurrent_states"], tensors["conv_states"]
    if (states.dim() != 4 or conv.dim() != 3 or num_k_heads < 1
            or not tma_gemv.available(x, weight, norm_weight=tensors["input_norm_w"], residual=tensors["residual"])):
        return False
    hv, dk, dv = states.shape[1:]
    cfg = InProjGdnConfig(x.shape[-1], num_k_heads, hv, dk, tensors["conv_w"].shape[-1])
    try:
        cfg.validate()
    except ValueError:
        return False
    c = cfg.conv_channels
    bf16 = ("conv_w", "A_log", "dt_bias", "norm_w", "conv_states")
    return (dk == dv and weight.shape[0] == c + hv * dv + 2 * hv and tensors["conv_w"].shape == (c, cfg.conv_taps)
            and conv.shape[1:] == (c, cfg.conv_taps - 1) and states.dtype == torch.float32
            and all(tensors[n].dtype == torch.bfloat16 and tensors[n].is_contiguous() for n in bf16)
            and tensors["A_log"].shape == (hv,) and tensors["dt_bias"].shape == (hv,)
            and tensors["norm_w"].shape == (dv,) and states.is_contiguous()
            and tensors["state_slots"].shape == (1,) and tensors["state_slots"].dtype == torch.int64
            and all(t.device == x.device and t.data_ptr() % 16 == 0 for t in tensors.values() if t is not None)
            and fitting_cluster(num_k_heads, cfg.group, x.device.index or 0) > 0)


def fitting_cluster(num_k_heads: int, group: int, device_index: int) -> int:
    """The first cluster size of CLUSTERS that the group allows (2G <= cluster) and whose num_k_heads clusters the
    device holds at once, else 0."""
    for cluster in CLUSTERS:
        if 2 * group <= cluster and resident_clusters(device_index, cluster) >= num_k_heads:
            return cluster
    return 0


@functools.cache
def resident_clusters(device_index: int, cluster: int = 8) -> int:
    """How many clusters of `cluster` CTAs the device holds at once, one CTA an SM (each holds a 128 KiB ring), as
    the driver's occupancy calculator counts them (cuOccupancyMaxActiveClusters, through the DSL's HardwareInfo, which
    asks it for a kernel of that shape). `available` wants one for every key head: a cluster that does not fit waits
    for a whole earlier one to finish, which would double the kernel's time in the step."""
    from cutlass.utils import HardwareInfo
    with torch.cuda.device(device_index):  # its probe kernel loads into the current context
        return HardwareInfo(device_index).get_max_active_clusters(cluster)


# Who computes what: plain arithmetic (min, no branches), so that the kernel traces it on device integers and the
# tests check on host ints that the CTAs of every cluster cover the in-projection exactly once.

def row_block(cfg: InProjGdnConfig, b: int, head, rank):
    """The in-projection's BLOCK_ROWS-row block index of block b (static) of CTA `rank` of cluster `head`: its
    slices of q, k (key head `head`), then of v_0 .. v_{G-1}, then of z_0 .. z_{G-1} (its value heads), each slice
    sub_blocks blocks."""
    piece, sub = divmod(b, cfg.sub_blocks)
    per_head = cfg.head_dim // BLOCK_ROWS
    within = rank * cfg.sub_blocks + sub
    if piece < 2:
        return (piece * cfg.num_k_heads + head) * per_head + within
    first = 2 * cfg.num_k_heads if piece < 2 + cfg.group else cfg.conv_channels // cfg.head_dim
    return (first + head * cfg.group + (piece - 2) % cfg.group) * per_head + within


def own_channel(cfg: InProjGdnConfig, tidx, head, rank):
    """The conv channel of consumer thread tidx < own_channels of CTA `rank` of cluster `head`: its q slice, its k
    slice, then its slice of each value head's v."""
    piece = tidx // cfg.slice
    is_v = cutlass_min(piece // 2, 1)
    key_piece = piece * cfg.num_k_heads + head  # q (piece 0) or k (piece 1) of key head `head`, in head_dims
    v_piece = 2 * cfg.num_k_heads + head * cfg.group + piece - 2
    return ((1 - is_v) * key_piece + is_v * v_piece) * cfg.head_dim + rank * cfg.slice + tidx % cfg.slice


def ab_weight_row(cfg: InProjGdnConfig, rank, head):
    """The in-projection row whose dot rank takes: b of value head head * G + rank (ranks < G), a of head * G + rank
    - G (G .. 2G - 1); ranks past 2G read the last row and their dot is not used."""
    first = cfg.conv_channels + cfg.num_v_heads * cfg.head_dim  # b's rows, then a's
    row = first + (rank // cfg.group) * cfg.num_v_heads + head * cfg.group + rank % cfg.group
    return cutlass_min(row, first + 2 * cfg.num_v_heads - 1)


def cutlass_min(a, b):
    """min of host ints, or of device integers inside a kernel trace (cutlass.min takes both)."""
    import cutlass
    return cutlass.min(a, b)


@functools.cache
def _kernel_class():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    from cutlass import BFloat16, Float32, Int32, Int64
    from cutlass.cute.nvgpu import cpasync
    try:
        from cutlass.memory import SmemAllocator
    except ImportError:  # pragma: no cover
        from cutlass.utils import SmemAllocator

    from cutlass.cutlass_dsl import dsl_user_op

    BLOCK_K, LANE_COLS, X_BARRIER = tma_gemv.BLOCK_K, tma_gemv.LANE_COLS, tma_gemv.X_BARRIER

    @dsl_user_op
    def _store_remote_f32(smem_ptr: cute.Pointer, value: Float32, peer: Int32, *, loc=None, ip=None):
        """st.shared::cluster of value at smem_ptr's offset in CTA `peer`'s shared memory (mapa)."""
        ptx_statement("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, $0, $1;\n"
                      "st.shared::cluster.f32 [remote], $2;\n}", "r,r,f", [smem_ptr, Int32(peer), Float32(value)],
                      loc=loc, ip=ip)

    class InProjGdnSm90(tma_gemv._kernel_class()):
        def __init__(self, gdn: InProjGdnConfig):
            super().__init__(gdn.gemv)
            self.gdn = gdn

        @cute.jit
        def __call__(self, x_ptr: cute.Pointer, w_ptr: cute.Pointer, res_ptr: cute.Pointer | None,
                     norm_w_ptr: cute.Pointer, s_ptr: cute.Pointer | None, conv_w_ptr: cute.Pointer,
                     a_log_ptr: cute.Pointer, dt_bias_ptr: cute.Pointer, gnorm_w_ptr: cute.Pointer,
                     conv_ptr: cute.Pointer, state_ptr: cute.Pointer, slot_ptr: cute.Pointer, out_ptr: cute.Pointer,
                     eps: Float32, gdn_eps: Float32, stream: cuda.CUstream):
            """x (1, K), residual and s (1, K) when add, norm_w (K,), the in-projection w (C + Hv dv + 2 Hv, K);
            conv_w (C, taps), A_log, dt_bias (Hv,), gnorm_w (dv,), conv (slots, C, taps - 1) bf16, state (slots, Hv,
            dk, dv) fp32, slot (1,) int64, out (1, Hv dv) bf16; all contiguous."""
            gdn, cfg = self.gdn, self.cfg
            rows = gdn.conv_channels + gdn.num_v_heads * gdn.head_dim + 2 * gdn.num_v_heads
            mW = cute.make_tensor(w_ptr, cute.make_layout((rows, gdn.hidden), stride=(gdn.hidden, 1)))
            box = cute.make_layout((BLOCK_ROWS, BLOCK_K), stride=(BLOCK_K, 1))
            tma, mW_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mW, box, (BLOCK_ROWS, BLOCK_K))
            mX = cute.make_tensor(x_ptr, cute.make_layout(gdn.hidden))
            mNormW = cute.make_tensor(norm_w_ptr, cute.make_layout(gdn.hidden))
            mRes = mS = None
            if cutlass.const_expr(gdn.add):
                mRes = cute.make_tensor(res_ptr, cute.make_layout(gdn.hidden))
                mS = cute.make_tensor(s_ptr, cute.make_layout(gdn.hidden))
            mConvW = cute.make_tensor(conv_w_ptr, cute.make_layout((gdn.conv_channels, gdn.conv_taps),
                                                                   stride=(gdn.conv_taps, 1)))
            mALog = cute.make_tensor(a_log_ptr, cute.make_layout(gdn.num_v_heads))
            mDtBias = cute.make_tensor(dt_bias_ptr, cute.make_layout(gdn.num_v_heads))
            mGNormW = cute.make_tensor(gnorm_w_ptr, cute.make_layout(gdn.head_dim))
            mSlot = cute.make_tensor(slot_ptr, cute.make_layout(1))
            mOut = cute.make_tensor(out_ptr, cute.make_layout(gdn.num_v_heads * gdn.head_dim))
            consumers, stages, group, cluster = cfg.consumer_warps, cfg.stages, gdn.group, gdn.cluster

            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
                sum_sq: cute.struct.MemRange[Float32, consumers]
                proj: cute.struct.MemRange[Float32, gdn.blocks * BLOCK_ROWS]  # the CTA's rows, bf16-rounded
                conv: cute.struct.MemRange[Float32, gdn.own_channels]  # silu(conv) of its channels
                qk: cute.struct.MemRange[Float32, 2 * gdn.head_dim]  # the head's q | k, from every CTA
                ab: cute.struct.MemRange[Float32, 2 * group]  # the heads' b | a, from ranks 0 .. 2G - 1
                o: cute.struct.MemRange[Float32, group * gdn.slice]  # o of the CTA's columns, bf16-rounded
                o_sq: cute.struct.MemRange[Float32, cluster * group]  # each CTA's sums of o^2, a value head
                sX: cute.struct.Align[cute.struct.MemRange[BFloat16, cfg.x_width], 128]
                sW: cute.struct.Align[cute.struct.MemRange[BFloat16, cfg.slot_rows * BLOCK_K * stages], 128]

            self.shared_storage = SharedStorage
            grid = gdn.num_k_heads * cluster
            self.fused_kernel(tma, mW_tma, mW, mX, mRes, mNormW, mS, mConvW, mALog, mDtBias, mGNormW, conv_ptr,
                              state_ptr, mSlot, mOut, eps, gdn_eps).launch(
                grid=[grid, 1, 1], block=[32 * (consumers + 1), 1, 1], cluster=[cluster, 1, 1], stream=stream,
                use_pdl=cfg.pdl)

        @cute.kernel
        def fused_kernel(self, tma, mW_tma: cute.Tensor, mW: cute.Tensor, mX: cute.Tensor, mRes: cute.Tensor | None,
                         mNormW: cute.Tensor, mS: cute.Tensor | None, mConvW: cute.Tensor, mALog: cute.Tensor,
                         mDtBias: cute.Tensor, mGNormW: cute.Tensor, conv_ptr: cute.Pointer,
                         state_ptr: cute.Pointer, mSlot: cute.Tensor, mOut: cute.Tensor, eps: Float32,
                         gdn_eps: Float32):
            gdn, cfg = self.gdn, self.cfg
            spec = cfg.inputs[0]
            stages, consumers = cfg.stages, cfg.consumer_warps
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = cute.arch.lane_idx()
            rank = cute.arch.block_idx_in_cluster()
            head = bidx // gdn.cluster

            storage = SmemAllocator().allocate(self.shared_storage)
            ring = self.make_ring(storage)
            sX = storage.sX.get_tensor(cute.make_layout(cfg.x_width))
            sW = storage.sW.get_tensor(cute.make_layout((BLOCK_ROWS, BLOCK_K, cfg.boxes(spec), stages),
                                                        stride=(BLOCK_K, 1, BLOCK_ROWS * BLOCK_K,
                                                                cfg.slot_rows * BLOCK_K)))
            if warp == consumers:
                cpasync.prefetch_descriptor(tma)
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            cute.arch.cluster_arrive_relaxed()  # every CTA of the cluster has started before any DSMEM store

            if warp == consumers:  # producer: the CTA's row blocks, weights only (no wait for the previous kernel)
                gW = cute.local_tile(mW_tma, (BLOCK_ROWS, BLOCK_K), (None, None))  # (16, BLOCK_K, blocks, K tiles)
                tWsW, tWgW = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2),
                                                   cute.group_modes(gW, 0, 2))
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
                for b in cutlass.range_constexpr(gdn.blocks):
                    block = row_block(gdn, b, head, rank)
                    for kt in cutlass.range(cfg.width(spec) // (cfg.boxes(spec) * BLOCK_K), unroll=1):
                        self.issue_slot(spec, tma, tWgW, tWsW, ring, state, block, kt)
                        state.advance()
                # the start's phase waited before the warp exits, as every thread of the cluster does (an exited
                # thread no longer counts, but CUTLASS never relies on that; review, session 22)
                cute.arch.cluster_wait()
            else:
                self.consume(spec, ring, storage, sX, sW, mW, mX, mRes, mNormW, mS, mConvW, mALog, mDtBias, mGNormW,
                             conv_ptr, state_ptr, mSlot, mOut, eps, gdn_eps, tidx, warp, lane, bidx, rank, head)

        @cute.jit
        def consume(self, spec: cutlass.Constexpr, ring, storage, sX: cute.Tensor, sW: cute.Tensor,
                    mW: cute.Tensor, mX: cute.Tensor, mRes: cute.Tensor | None, mNormW: cute.Tensor,
                    mS: cute.Tensor | None, mConvW: cute.Tensor, mALog: cute.Tensor, mDtBias: cute.Tensor,
                    mGNormW: cute.Tensor, conv_ptr: cute.Pointer, state_ptr: cute.Pointer, mSlot: cute.Tensor,
                    mOut: cute.Tensor, eps: Float32, gdn_eps: Float32, tidx: Int32, warp: Int32, lane: Int32,
                    bidx: Int32, rank: Int32, head: Int32):
            gdn, cfg = self.gdn, self.cfg
            consumers, group, taps = cfg.consumer_warps, gdn.group, gdn.conv_taps
            cluster, slice_ = gdn.cluster, gdn.slice
            threads = 32 * consumers
            sProj = storage.proj.get_tensor(cute.make_layout(gdn.blocks * BLOCK_ROWS))
            sConv = storage.conv.get_tensor(cute.make_layout(gdn.own_channels))
            sQK = storage.qk.get_tensor(cute.make_layout(2 * gdn.head_dim))
            sAB = storage.ab.get_tensor(cute.make_layout(2 * group))
            sO = storage.o.get_tensor(cute.make_layout(group * slice_))
            sOSq = storage.o_sq.get_tensor(cute.make_layout(cluster * group))
            sSumSq = storage.sum_sq.get_tensor(cute.make_layout(consumers))

            # before the PDL wait, what no kernel of the step writes: the slot, the states, the conv windows and
            # weights, the parameters and the b / a weight row
            slot = Int64(mSlot[0])
            cols = group * slice_  # the CTA's state columns
            per_col = threads // cols  # threads a column
            col_rows = gdn.head_dim // per_col  # rows a thread holds
            col = tidx // per_col
            part = tidx % per_col
            j = col // slice_  # value head in the group
            vhead = head * group + j
            dv = gdn.head_dim
            state_base = state_ptr + ((slot * gdn.num_v_heads + vhead) * gdn.head_dim + part * col_rows) * dv
            mState = cute.make_tensor(state_base + (rank * slice_ + col % slice_),
                                      cute.make_layout(col_rows, stride=dv))
            s = cute.make_rmem_tensor(cute.make_layout(col_rows), Float32)
            for i in cutlass.range_constexpr(col_rows):
                s[i] = mState[i]
            channel = own_channel(gdn, tidx, head, rank)
            mConv = cute.make_tensor(conv_ptr + (slot * gdn.conv_channels + channel) * (taps - 1),
                                     cute.make_layout(taps - 1))
            window = cute.make_rmem_tensor(cute.make_layout(taps - 1), Float32)
            conv_w = cute.make_rmem_tensor(cute.make_layout(taps), Float32)
            if tidx < gdn.own_channels:
                for t in cutlass.range_constexpr(taps - 1):
                    window[t] = mConv[t].to(Float32)
                for t in cutlass.range_constexpr(taps):
                    conv_w[t] = mConvW[channel, t].to(Float32)
            a_log = mALog[vhead].to(Float32)
            dt_bias = mDtBias[vhead].to(Float32)
            gnorm_w = mGNormW[rank * slice_ + col % slice_]
            # the b / a row, as block_product's lanes cut a row: lane l takes columns 8l .. 8l + 7 of each BLOCK_K
            ab_row = ab_weight_row(gdn, rank, head)
            ab_chunks = cfg.width(spec) // BLOCK_K
            ab_w = [cute.local_tile(mW[ab_row, None], (LANE_COLS,),
                                    (cutlass.min(c * 32 + lane, gdn.hidden // LANE_COLS - 1),)).load()
                    for c in range(ab_chunks)]

            if cutlass.const_expr(cfg.pdl):
                cute.arch.griddepcontrol_wait()  # x and the residual come from the previous kernel
                cute.arch.griddepcontrol_launch_dependents()
            self.stage_x(spec, mX, mRes, mNormW, mS, eps, sX, sSumSq, tidx, warp, lane, bidx)
            cute.arch.barrier(barrier_id=X_BARRIER, number_of_threads=threads)

            # the b / a dot (used by ranks 0 .. 2G - 1), summed in the plain GEMV's order: the same bf16 as its row
            acc = cute.make_rmem_tensor((BLOCK_ROWS // consumers, LANE_COLS), Float32)
            acc.fill(0.0)
            for c in cutlass.range_constexpr(ab_chunks):
                if c * BLOCK_K + lane * LANE_COLS < gdn.hidden:
                    xs = cute.local_tile(sX, (LANE_COLS,), (c * 32 + lane,)).load().to(Float32)
                    acc[0, None].store(acc[0, None].load() + ab_w[c].to(Float32) * xs)
            ab = self.row_total(acc, 0).to(BFloat16).to(Float32)

            # the ring's row blocks, each row rounded to bf16 as the plain GEMV stores it
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
            for b in cutlass.range_constexpr(gdn.blocks):
                state = self.block_product(spec, sX, sW, ring, state, acc, warp, lane)
                for i in cutlass.range_constexpr(BLOCK_ROWS // consumers):
                    total = self.row_total(acc, i)
                    if lane == 0:
                        sProj[b * BLOCK_ROWS + warp + consumers * i] = total.to(BFloat16).to(Float32)
            cute.arch.barrier(barrier_id=X_BARRIER, number_of_threads=threads)

            # the CTA's channels: conv, silu, bf16; the window shifts in place
            if tidx < gdn.own_channels:
                x_new = sProj[tidx]
                y = conv_w[taps - 1] * x_new
                for t in cutlass.range_constexpr(taps - 1):
                    y = y + conv_w[t] * window[t]
                y = y / (Float32(1.0) + cute.math.exp(-y))
                sConv[tidx] = y.to(BFloat16).to(Float32)
                for t in cutlass.range_constexpr(taps - 2):
                    mConv[t] = window[t + 1].to(BFloat16)
                mConv[taps - 2] = x_new.to(BFloat16)
            cute.arch.barrier(barrier_id=X_BARRIER, number_of_threads=threads)

            # push q, k slices and b / a into every CTA of the cluster
            cute.arch.cluster_wait()
            if tidx < 2 * slice_:
                dst = (tidx // slice_) * gdn.head_dim + rank * slice_ + tidx % slice_
                for peer in cutlass.range_constexpr(cluster):
                    self.push(sQK.iterator + dst, sConv[tidx], peer)
            if tidx == 0 and rank < 2 * group:
                for peer in cutlass.range_constexpr(cluster):
                    self.push(sAB.iterator + rank, ab, peer)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

            # the delta step on the thread's rows of its column
            q = cute.make_rmem_tensor(cute.make_layout(col_rows), Float32)
            k = cute.make_rmem_tensor(cute.make_layout(col_rows), Float32)
            q_sq = Float32(0.0)
            k_sq = Float32(0.0)
            for i in cutlass.range_constexpr(col_rows):
                q[i] = sQK[part * col_rows + i]
                k[i] = sQK[gdn.head_dim + part * col_rows + i]
                q_sq = q_sq + q[i] * q[i]
                k_sq = k_sq + k[i] * k[i]
            q_sq = self.column_sum(q_sq, per_col)
            k_sq = self.column_sum(k_sq, per_col)
            q_scale = cute.math.rsqrt(q_sq + Float32(gdn_pointwise.L2NORM_EPS.value)) * Float32(gdn.head_dim ** -0.5)
            k_scale = cute.math.rsqrt(k_sq + Float32(gdn_pointwise.L2NORM_EPS.value))
            x = sAB[group + j] + dt_bias
            softplus = x
            if x <= Float32(gdn_pointwise.SOFTPLUS_THRESHOLD.value):
                softplus = cute.math.log(Float32(1.0) + cute.math.exp(x))
            decay = cute.math.exp(-cute.math.exp(a_log) * softplus)
            beta = Float32(1.0) / (Float32(1.0) + cute.math.exp(-sAB[j]))
            kv = Float32(0.0)
            for i in cutlass.range_constexpr(col_rows):
                k[i] = k[i] * k_scale
                s[i] = s[i] * decay
                kv = kv + s[i] * k[i]
            kv = self.column_sum(kv, per_col)
            u = beta * (sConv[(2 + j) * slice_ + col % slice_] - kv)
            o = Float32(0.0)
            for i in cutlass.range_constexpr(col_rows):
                s[i] = s[i] + k[i] * u
                o = o + s[i] * (q[i] * q_scale)
                mState[i] = s[i]
            o = self.column_sum(o, per_col).to(BFloat16).to(Float32)
            if part == 0:
                sO[col] = o
            cute.arch.barrier(barrier_id=X_BARRIER, number_of_threads=threads)

            # the gated norm: each value head's sum of o^2 over its dv, from every CTA
            if tidx < group:
                o_sq = Float32(0.0)
                for c in cutlass.range_constexpr(slice_):
                    o_sq = o_sq + sO[tidx * slice_ + c] * sO[tidx * slice_ + c]
                for peer in cutlass.range_constexpr(cluster):
                    self.push(sOSq.iterator + rank * group + tidx, o_sq, peer)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            if part == 0:
                total = Float32(0.0)
                for r in cutlass.range_constexpr(cluster):
                    total = total + sOSq[r * group + j]
                y = (o * cute.math.rsqrt(total / dv + gdn_eps)).to(BFloat16)
                wy = (gnorm_w.to(Float32) * y.to(Float32)).to(BFloat16).to(Float32)
                z = sProj[(2 + group + j) * slice_ + col % slice_]
                mOut[vhead * dv + rank * slice_ + col % slice_] = (wy * (z / (Float32(1.0) + cute.math.exp(-z)))
                                                                   ).to(BFloat16)

        @cute.jit
        def column_sum(self, value: Float32, per_col: cutlass.Constexpr) -> Float32:
            """The sum over the per_col adjacent lanes that share a column (every one gets it)."""
            for step in cutlass.range_constexpr(per_col.bit_length() - 1):
                value = value + cute.arch.shuffle_sync_bfly(value, offset=per_col >> (step + 1))
            return value

        def push(self, ptr: cute.Pointer, value: Float32, peer: int):
            """value into the same shared-memory word of CTA `peer` of the cluster (seen after a cluster barrier)."""
            _store_remote_f32(ptr, value, Int32(peer))

    return InProjGdnSm90


def compile_config(cfg: InProjGdnConfig, keep_ptx: bool = False):
    """The compiled kernel of cfg (placeholder pointers and stream: no GPU needed)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    def ptr(dtype=cutlass.BFloat16):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    cfg.validate()
    return cute.compile(_kernel_class()(cfg), ptr(), ptr(), ptr() if cfg.add else None, ptr(),
                        ptr() if cfg.add else None, ptr(), ptr(), ptr(), ptr(), ptr(), ptr(cutlass.Float32),
                        ptr(cutlass.Int64), ptr(), cutlass.Float32(1e-6), cutlass.Float32(1e-6),
                        make_fake_stream(),
                        options="--keep-ptx" if keep_ptx else None)


_CACHE = CompileCache(compile_config)


def in_proj_gdn(x, residual, input_norm_w, eps, weight, conv_w, A_log, dt_bias, norm_w, conv_states,
                recurrent_states, state_slots, num_k_heads, gdn_eps):
    """One decode token of a GDN layer's first stretch: s = x + residual (x when residual is None); proj =
    rms_norm(s, input_norm_w, eps) @ weight^T split into qkv | z | b | a; returns (gated_deltanet's output (1,
    Hv * dv) bf16, s), the conv window and recurrent state of slot state_slots[0] updated in place. The caller
    checks `available` first."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    hv, dk = recurrent_states.shape[1:3]
    cluster = fitting_cluster(num_k_heads, hv // num_k_heads, x.device.index or 0)
    cfg = InProjGdnConfig(x.shape[-1], num_k_heads, hv, dk, conv_w.shape[-1], residual is not None,
                          pdl.enabled(x.device), ring_bytes=RING_BYTES.get(cluster, tma_gemv.RING_BYTES),
                          cluster=cluster)
    out = torch.empty((1, hv * dk), dtype=x.dtype, device=x.device)
    s = x if residual is None else torch.empty_like(x)

    def ptr(t, dtype=cutlass.BFloat16):
        return None if t is None else make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)

    stream = cu_stream(torch.cuda.current_stream(x.device).cuda_stream)
    args = (ptr(x), ptr(weight), ptr(residual), ptr(input_norm_w), ptr(None if residual is None else s), ptr(conv_w),
            ptr(A_log), ptr(dt_bias), ptr(norm_w), ptr(conv_states), ptr(recurrent_states, cutlass.Float32),
            ptr(state_slots, cutlass.Int64), ptr(out), cutlass.Float32(eps), cutlass.Float32(gdn_eps),
            stream)
    with torch.cuda.device(x.device):
        _CACHE.get(cfg)(*args)
    return out, s


# Whether in_proj_gated_deltanet takes the one-launch kernel at batch-1 decode (else the normed GEMV, then the GDN
# decode kernel). Off: it is GPU-tested in clusters of 8 (session 23: `pytest -m gpu tests/test_in_proj_gdn.py`,
# in two waves) but not faster yet. Predicted: a GDN layer's mixer costs ~10 us between the two projections' weight
# streams (2B step 1.275 ms against ~1.01 of their bytes at 4.4 TB/s, the attention layers' share taken out); the
# fused kernel keeps one boundary and two DSMEM exchanges of it, ~4-6 us a layer, 0.07-0.11 ms a step. Measured
# (H200, session 23, `python -m profiles.host_time --model M --decode 1 --ab in_proj_gdn`): that H200 held only 15
# clusters of 8 at once against 2B's and 0.8B's 16 key heads, so `available` refused it ('on' = 'off', 1.27 ms);
# in two waves ('waves') it tied the two ops (1.27-1.28 ms at 2B, 0.775-0.778 at 0.8B). Next: `python -m
# profiles.bench_decode --sweep-in-proj-gdn qwen3.5-2b` times one wave (8 and 15 key heads) against two (16), and
# clusters of 4 (CLUSTERS), which fit in one wave
FUSED = False


def in_proj_gated_deltanet(x, residual, norm_w, eps, in_w, parts, conv_w, A_log, dt_bias, gdn_norm_w, conv_states,
                           recurrent_states, step, num_k_heads):
    """model.ops.in_proj_gated_deltanet: the one-launch kernel for one token of one sequence (FUSED, on an sm_90
    GPU, shapes it takes), else model.ops.in_proj_gated_deltanet_by_ops."""
    if FUSED and step.max_seqlen_q == 1 and x.dim() == 2 and x.shape[0] == 1:
        tensors = dict(residual=residual, input_norm_w=norm_w, conv_w=conv_w, A_log=A_log, dt_bias=dt_bias,
                       norm_w=gdn_norm_w, conv_states=conv_states, recurrent_states=recurrent_states,
                       state_slots=step.state_slots)
        if available(x, in_w, tensors, num_k_heads):
            return in_proj_gdn(x, residual, norm_w, eps, in_w, conv_w, A_log, dt_bias, gdn_norm_w, conv_states,
                               recurrent_states, step.state_slots, num_k_heads, eps)
    return ops.in_proj_gated_deltanet_by_ops(x, residual, norm_w, eps, in_w, parts, conv_w, A_log, dt_bias,
                                             gdn_norm_w, conv_states, recurrent_states, step, num_k_heads)


OPS = {"in_proj_gated_deltanet": in_proj_gated_deltanet}
