"""Batch-1 decode GEMV on Hopper in CuTe-DSL: the weight streams through a TMA ring in shared memory.

y (1, N) = x (1, K) @ weight (N, K)^T, bf16 in and out, fp32 sums. Why a second GEMV beside the Triton one
(kernels/linear.py): a decode step is ~100 GEMVs in a chain, and the Triton GEMV keeps one weight tile a program in
flight, in registers, so DRAM sees only as many bytes in flight as the resident programs hold (2B step: 97 GEMVs
take 1.24 ms for 3.76 GB, 3.0 TB/s). Here one producer warp a CTA keeps a 128 KiB ring of weight tiles in shared
memory filled with TMA (17 MB in flight over 132 SMs), and it needs nothing from the previous kernel: with
programmatic dependent launch the producer starts streaming while the previous kernel drains, and only the
consumers wait (griddepcontrol.wait) before they read x.

CTA layout: consumer_warps (8 by default) consume, the warp after them produces. The grid is min(SMs, column
blocks); CTA c takes column blocks c, c + grid, ... of block_n (16 or 8) weight rows. A ring slot holds 16 KiB:
two 16 x 256 TMA boxes along K, or four 8 x 256 ones, so a consumer pass over a slot reads as many bytes either way
(rows past N and columns past K arrive as zeros). A consumer warp owns block_n / consumer_warps rows of a tile; lane l
multiplies columns 8l..8l+7 of each box (a 16-byte shared load a row and box) by x's, which the consumers stage in
shared memory once (zero past K). Per row: 8 fp32 partial sums a lane, summed, then a butterfly over the warp; lane
0 stores the bf16 result. What is staged: x; with GATED, SwiGLU's silu(gate) * up of [gate | up] (1, 2K), rounded
to bf16, so the down projection reads [gate | up] itself; with NORM, rms_norm(x (+ residual)), each rounded to bf16
as the unfused ops round (a block reduction of the squares; CTA 0 stores the sum, the next residual).

A chain (tma_gemv_chain) runs several GEMVs in one launch, each on the previous one's output: the producer streams
every GEMV's weights in turn, and between two GEMVs the consumers sync over the grid (one CTA an SM, a counter in
global memory), so the next weights fill the rings while the last outputs land.

Compiled once per TmaGemvConfig (K and the tile are compile-time, N is a runtime value); compiling needs no GPU
(CUTE_DSL_ARCH=sm_90a). `available(x, weight)` says whether a call can run here.
"""
import dataclasses
import functools
import operator

import torch

from kernels import pdl, stamps
from kernels.cute_runtime import CompileCache, cu_stream, device_stamps, dsl_available
from kernels.host_math import cdiv

LANE_COLS = 8  # columns a lane multiplies per tile row: one 16-byte load
BLOCK_K = 32 * LANE_COLS  # a TMA box's columns (its inner extent: 512 bytes, at most 256 elements)
# a ring slot holds SLOT_ROWS x BLOCK_K weights (16 KiB): two boxes of a 16-row block, four of 8 rows (8 KiB slots
# lost at 2B and 9B: a consumer's pass over a slot, its barrier wait and release, is the cost; FINDINGS, decode step)
SLOT_ROWS = 32
RING_BYTES = 128 * 1024  # weight tiles in flight a CTA
# a chain's producer issues this many bytes of each GEMV after the first (in whole ring slots: 5 of 16 KiB), then
# waits until its CTA is past the grid sync before it: without the pause the ring is full of the next weights, in
# flight or landed, at each sync, and the sync waits on them (80 KiB ties 96, ahead of none at 2B and 0.8B; FINDINGS,
# decode step). tma_gemv_chain's boundary_bytes overrides it.
BOUNDARY_BYTES = 80 * 1024
MAX_K = 16384  # x (or [gate | up]'s product) staged in shared memory: 32 KiB at most
X_BARRIER = 1  # named barrier of the consumers after staging x
STAMP_FIELDS = len(stamps.FIELDS)
CTA_SHARED_BYTES = 227 * 1024  # the most one CTA may take on sm_90: the ring, x and the barriers


@dataclasses.dataclass(frozen=True)
class GemvInput:
    """What one GEMV of a launch multiplies: a row of width k, staged as x, silu(gate) * up of [gate | up] (gated),
    or rms_norm(x (+ residual)) (norm, add)."""
    k: int
    gated: bool = False
    norm: bool = False
    add: bool = False
    block_n: int = 16  # weight rows a column block (see block_rows)


@dataclasses.dataclass(frozen=True)
class TmaGemvConfig:
    k: int  # x's width (the product's; [gate | up] is 2k wide)
    block_n: int  # weight rows a column block: 16 or 8 (see block_rows)
    stages: int  # slots in the ring (slot_bytes each)
    gated: bool = False
    ctas_per_sm: int = 1  # the grid: this many CTAs an SM (or one a column block)
    consumer_warps: int = 4  # each owns block_n / consumer_warps rows of every tile
    norm: bool = False  # the product takes rms_norm(x) (x + residual when add), as kernels.linear's NORM input
    add: bool = False
    pdl: bool = True  # launched with programmatic dependent launch (kernels.pdl.enabled: QWEN_PDL=0 switches it off)
    chain: tuple[GemvInput, ...] = ()  # GEMVs after the first in the same launch, each on the previous one's output
    slot_rows: int = SLOT_ROWS  # a ring slot: slot_rows x BLOCK_K weights, slot_rows / block_n boxes along K
    boundary_slots: int = 0  # see BOUNDARY_BYTES (0: no pause)
    stamps: bool = False  # %globaltimer stamps into a kernels.stamps slot (profiles.step_stamps)

    @property
    def slot_bytes(self) -> int:
        return self.slot_rows * BLOCK_K * 2

    def boxes(self, g: GemvInput) -> int:
        """TMA boxes a ring slot of GEMV g: its tile is block_n x (boxes * BLOCK_K)."""
        return self.slot_rows // g.block_n

    def width(self, g: GemvInput) -> int:
        """GEMV g's staged row: K in whole tiles."""
        return cdiv(g.k, self.boxes(g) * BLOCK_K) * self.boxes(g) * BLOCK_K

    @property
    def inputs(self) -> tuple[GemvInput, ...]:
        """Every GEMV's input, in launch order."""
        return (GemvInput(self.k, self.gated, self.norm, self.add, self.block_n), *self.chain)

    def validate(self) -> "TmaGemvConfig":
        for g in self.inputs:
            if g.k <= 0 or g.k % LANE_COLS or g.k > MAX_K:
                raise ValueError(f"k must be a positive multiple of {LANE_COLS} up to {MAX_K}, got {g.k}")
            if (g.gated and g.norm) or (g.add and not g.norm):
                raise ValueError(f"the input is one of plain, gated, norm (add only with norm), got gated={g.gated} "
                                 f"norm={g.norm} add={g.add}")
            if g.block_n not in (8, 16):
                raise ValueError(f"block_n must be 8 or 16, got {g.block_n}")
            if self.consumer_warps not in (1, 2, 4, 8) or self.consumer_warps > g.block_n:
                raise ValueError(f"consumer_warps must be 1, 2, 4 or 8 and at most block_n, got {self.consumer_warps}")
        if sum(g.norm for g in self.inputs) > 1:
            raise ValueError("at most one GEMV of a chain takes a norm input (one norm weight and residual)")
        if self.slot_rows not in (16, 32):
            raise ValueError(f"slot_rows must be 16 or 32, got {self.slot_rows}")
        if self.chain and self.ctas_per_sm != 1:  # every CTA of a grid sync must be resident: one an SM
            raise ValueError(f"a chain syncs its grid: ctas_per_sm must be 1, got {self.ctas_per_sm}")
        if not 2 <= self.stages <= 32:
            raise ValueError(f"stages must be 2 to 32, got {self.stages}")
        if not 0 <= self.boundary_slots <= self.stages:
            raise ValueError(f"boundary_slots must be 0 to stages ({self.stages}), got {self.boundary_slots}")
        if self.stages * self.slot_bytes + 2 * self.x_width + 1024 > CTA_SHARED_BYTES:
            raise ValueError(f"the ring ({self.stages} x {self.slot_bytes} bytes) and x ({self.x_width} wide) take "
                             f"more than a CTA's {CTA_SHARED_BYTES} bytes of shared memory")
        return self

    @property
    def x_width(self) -> int:
        """sX's width: the widest staged row."""
        return max(self.width(g) for g in self.inputs)


def block_rows(n: int, num_sms: int = 132) -> int:
    """A GEMV's block_n: 16-row blocks unless 8-row ones finish sooner (the most rows a CTA takes: N 1024 on 132
    SMs, 16 against 8), so a 2048-wide output takes 16 (one 16-row block a CTA, or two 8-row ones)."""
    def most_rows(bn: int) -> int:
        return cdiv(cdiv(n, bn), num_sms) * bn
    return 16 if most_rows(16) <= most_rows(8) else 8


@functools.cache
def choose_config(n: int, k: int, gated: bool = False, num_sms: int = 132, *, norm: bool = False, add: bool = False,
                  pdl: bool = True, ring_bytes: int = RING_BYTES, consumer_warps: int = 8,
                  ctas_per_sm: int = 1, chain: tuple[GemvInput, ...] = (),
                  slot_rows: int = SLOT_ROWS, boundary_bytes: int = 0) -> TmaGemvConfig:
    """The first GEMV's (N n) block_n by block_rows (the chained ones carry theirs); the ring holds ring_bytes. The
    defaults (a 128 KiB ring, 8 consumer warps, one CTA an SM) were the fastest of a sweep over ring sizes, warps and
    CTAs an SM on most 2B / 9B projections (FINDINGS, decode step; `profiles.bench_decode --sweep-tma`)."""
    slot_bytes = slot_rows * BLOCK_K * 2
    stages = min(32, ring_bytes // slot_bytes)
    pause = min(stages, boundary_bytes // slot_bytes) if chain else 0
    return TmaGemvConfig(k, block_rows(n, num_sms), stages, gated, ctas_per_sm, consumer_warps, norm, add, pdl, chain,
                         slot_rows, pause).validate()


def available(x: torch.Tensor, weight: torch.Tensor, gated: bool = False, *,
              norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> bool:
    """Whether tma_gemv takes this call: one bf16 row on an sm_90+ GPU, a contiguous weight, K within MAX_K,
    16-byte aligned rows (and norm weight and residual), and nvidia-cutlass-dsl installed."""
    return chain_available(x, [weight], [GemvInput(weight.shape[1], gated, norm_weight is not None,
                                                   residual is not None)], norm_weight=norm_weight, residual=residual)


def chain_available(x: torch.Tensor, weights, inputs, *, norm_weight: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None) -> bool:
    """Whether tma_gemv_chain takes this call: as `available` for every GEMV (on sm_90), each input as wide as the
    previous output (twice the K of a gated one), one input for each weight, and a norm weight (and residual) where
    an input is a norm (with add), as wide as it."""
    widths = [x.shape[-1], *(w.shape[0] for w in weights[:-1])]
    norm_k = [g.k for g in inputs if g.norm]
    extras = [t for t in (norm_weight, residual) if t is not None]
    if (len(weights) != len(inputs) or not weights or (norm_weight is not None) != bool(norm_k)
            or (residual is not None) != any(g.add for g in inputs)):
        return False
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1
            and all(w.dtype == torch.bfloat16 and w.is_contiguous() and w.dim() == 2 and w.shape[0] > 0
                    and w.shape[1] == g.k and 0 < g.k <= MAX_K and g.k % LANE_COLS == 0
                    and width == g.k * (2 if g.gated else 1) for w, g, width in zip(weights, inputs, widths))
            and (not extras or len(norm_k) == 1)
            and all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.numel() == norm_k[0] for t in extras)
            and all(t.data_ptr() % 16 == 0 for t in (x, *weights, *extras))
            and _is_sm90(x.device.index if x.device.index is not None else torch.cuda.current_device())
            and dsl_available())


@functools.cache
def _is_sm90(index: int) -> bool:
    # the ring and CTA_SHARED_BYTES are sized for sm_90's 227 KiB a CTA (sm_120 has about 99 KiB)
    return pdl.capable(index) and torch.cuda.get_device_capability(index)[0] == 9


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
    stamp, stamp_end = device_stamps()

    class TmaGemvSm90:
        def __init__(self, cfg: TmaGemvConfig):
            self.cfg = cfg

        @cute.jit
        def __call__(self, x_ptr: cute.Pointer, w_ptrs: tuple, y_ptrs: tuple, res_ptr: cute.Pointer | None,
                     norm_w_ptr: cute.Pointer | None, s_ptr: cute.Pointer | None, sync_ptr: cute.Pointer | None,
                     stamps_ptr: cute.Pointer | None, ns: tuple, num_ctas: Int32, eps: Float32,
                     stream: cuda.CUstream):
            """x (1, K) or [gate | up] (1, 2K); GEMV g: weight w_ptrs[g] (ns[g], K_g) into y_ptrs[g] (1, ns[g]), on
            y_ptrs[g - 1] after the first; contiguous bf16; num_ctas: the SMs. The norm input: norm_w (K,); with
            add, residual (1, K) and s (1, K), where CTA 0 stores x + residual. sync: a chain's grid barrier, one
            int64 that only grows, a multiple of num_ctas between launches (every chain launches num_ctas CTAs).
            stamps (cfg.stamps): a kernels.stamps slot of int64."""
            cfg = self.cfg
            stages = cfg.stages
            tmas, mWs, mYs, blocks = [], [], [], []
            for g, spec in enumerate(cfg.inputs):
                mW = cute.make_tensor(w_ptrs[g], cute.make_layout((ns[g], spec.k), stride=(spec.k, 1)))
                box = cute.make_layout((spec.block_n, BLOCK_K), stride=(BLOCK_K, 1))
                tma, mW_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mW, box,
                                                          (spec.block_n, BLOCK_K))
                tmas.append(tma)
                mWs.append(mW_tma)
                mYs.append(cute.make_tensor(y_ptrs[g], cute.make_layout(ns[g])))
                blocks.append((ns[g] + spec.block_n - 1) // spec.block_n)
            k0 = cfg.k
            mX = cute.make_tensor(x_ptr, cute.make_layout(2 * k0 if cfg.gated else k0))
            norm_k = max([g.k for g in cfg.inputs if g.norm], default=0)
            mRes = mNormW = mS = mSync = None
            if cutlass.const_expr(norm_k > 0):
                mNormW = cute.make_tensor(norm_w_ptr, cute.make_layout(norm_k))
            if cutlass.const_expr(any(g.add for g in cfg.inputs)):
                mRes = cute.make_tensor(res_ptr, cute.make_layout(norm_k))
                mS = cute.make_tensor(s_ptr, cute.make_layout(norm_k))
            if cutlass.const_expr(len(cfg.chain) > 0):
                mSync = cute.make_tensor(sync_ptr, cute.make_layout(1))
            mStamps = None
            if cutlass.const_expr(cfg.stamps):
                mStamps = cute.make_tensor(stamps_ptr, cute.make_layout(STAMP_FIELDS))
            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
                synced: cute.struct.MemRange[cutlass.Int64, 1]
                sum_sq: cute.struct.MemRange[Float32, cfg.consumer_warps]
                sX: cute.struct.Align[cute.struct.MemRange[BFloat16, cfg.x_width], 128]
                sW: cute.struct.Align[cute.struct.MemRange[BFloat16, cfg.slot_rows * BLOCK_K * stages], 128]

            self.shared_storage = SharedStorage
            grid = num_ctas  # a chain: every SM's CTA takes part in each grid sync
            if cutlass.const_expr(len(cfg.chain) == 0):
                grid = cutlass.max(cutlass.min(num_ctas, blocks[0]), 1)
            self.kernel(tuple(tmas), tuple(mWs), mX, tuple(mYs), mRes, mNormW, mS, mSync, mStamps, eps,
                        tuple(blocks), grid).launch(grid=[grid, 1, 1], block=[32 * (cfg.consumer_warps + 1), 1, 1],
                                                    stream=stream, use_pdl=cfg.pdl)

        @cute.kernel
        def kernel(self, tmas: tuple, mWs: tuple, mX: cute.Tensor, mYs: tuple, mRes: cute.Tensor | None,
                   mNormW: cute.Tensor | None, mS: cute.Tensor | None, mSync: cute.Tensor | None,
                   mStamps: cute.Tensor | None, eps: Float32, blocks: tuple, grid: Int32):
            cfg = self.cfg
            stages, consumers = cfg.stages, cfg.consumer_warps
            tidx, _, _ = cute.arch.thread_idx()
            if cutlass.const_expr(cfg.stamps):
                if tidx == 0:
                    stamp(mStamps, 0, 1)  # arrival
            bidx, _, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = cute.arch.lane_idx()

            storage = SmemAllocator().allocate(self.shared_storage)
            ring = self.make_ring(storage)
            sX = storage.sX.get_tensor(cute.make_layout(cfg.x_width))
            # GEMV g's view of the ring: (block_n, BLOCK_K, boxes, stages), each box a dense block_n x BLOCK_K
            sWs = [storage.sW.get_tensor(cute.make_layout((g.block_n, BLOCK_K, cfg.boxes(g), stages),
                                                          stride=(BLOCK_K, 1, g.block_n * BLOCK_K,
                                                                  cfg.slot_rows * BLOCK_K)))
                   for g in cfg.inputs]
            synced = storage.synced.data_ptr()
            if warp == consumers:
                for g in cutlass.range_constexpr(len(tmas)):
                    cpasync.prefetch_descriptor(tmas[g])
                if lane == 0:
                    cute.arch.mbarrier_init(synced, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

            if warp == consumers:
                # producer: weights only, so no wait for the previous kernel (the ring fills during its tail), and
                # in a chain no wait for the previous GEMV (the next weights stream in while the grid syncs)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
                for g in cutlass.range_constexpr(len(tmas)):
                    spec = cfg.inputs[g]
                    gW = cute.local_tile(mWs[g], (spec.block_n, BLOCK_K), (None, None))  # (bn, BLOCK_K, blocks, K/BK)
                    tWsW, tWgW = cpasync.tma_partition(tmas[g], 0, cute.make_layout(1),
                                                       cute.group_modes(sWs[g], 0, 2), cute.group_modes(gW, 0, 2))
                    block = bidx
                    issued = Int32(0)
                    while block < blocks[g]:
                        boxes = cfg.boxes(spec)
                        for kt in cutlass.range(cfg.width(spec) // (boxes * BLOCK_K), unroll=1):
                            if cutlass.const_expr(g > 0 and cfg.boundary_slots > 0):
                                if issued == cfg.boundary_slots:
                                    cute.arch.mbarrier_wait(synced, (g - 1) % 2)
                            issued += 1
                            self.issue_slot(spec, tmas[g], tWgW, tWsW, ring, state, block, kt)
                            state.advance()
                        block += grid
                    if cutlass.const_expr(0 < g < len(cfg.chain) and cfg.boundary_slots > 0):
                        if issued <= cfg.boundary_slots:  # too few slots to reach the wait: wait here, so that the
                            cute.arch.mbarrier_wait(synced, (g - 1) % 2)  # next GEMV's wait has its phase in step
            else:
                if cutlass.const_expr(cfg.pdl):
                    cute.arch.griddepcontrol_wait()  # x comes from the previous kernel
                    cute.arch.griddepcontrol_launch_dependents()
                t_go = Int64(0)
                if cutlass.const_expr(cfg.stamps):
                    if tidx == 0:
                        t_go = stamp(mStamps, 2, 3)  # go
                sSumSq = storage.sum_sq.get_tensor(cute.make_layout(consumers))
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
                for g in cutlass.range_constexpr(len(tmas)):
                    if cutlass.const_expr(g > 0):  # every CTA's part of the previous output is stored
                        self.grid_sync(mSync, grid, tidx)
                        if cutlass.const_expr(cfg.boundary_slots > 0):
                            if tidx == 0:
                                cute.arch.mbarrier_arrive(synced)
                    self.stage_x(cfg.inputs[g], mX if g == 0 else mYs[g - 1], mRes, mNormW, mS, eps, sX, sSumSq,
                                 tidx, warp, lane, bidx)
                    cute.arch.barrier(barrier_id=X_BARRIER, number_of_threads=32 * consumers)
                    spec, mY = cfg.inputs[g], mYs[g]
                    acc = cute.make_rmem_tensor((spec.block_n // consumers, LANE_COLS), Float32)
                    block = bidx
                    while block < blocks[g]:
                        state = self.block_product(spec, sX, sWs[g], ring, state, acc, warp, lane)
                        for i in cutlass.range_constexpr(spec.block_n // consumers):
                            total = self.row_total(acc, i)
                            row = block * spec.block_n + warp + consumers * i
                            if lane == 0 and row < cute.size(mY):
                                mY[row] = total.to(BFloat16)
                        block += grid
                if cutlass.const_expr(cfg.stamps):  # the CTA's last stores issued: its end
                    cute.arch.barrier(barrier_id=X_BARRIER, number_of_threads=32 * consumers)
                    if tidx == 0:
                        stamp_end(mStamps, t_go)

        def make_ring(self, storage):
            """The weight ring's TMA pipeline on storage.mbar: one producer thread fills a slot, each consumer warp
            releases it."""
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(), num_stages=self.cfg.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cfg.consumer_warps),
                tx_count=self.cfg.slot_bytes, defer_sync=True)

        @cute.jit
        def issue_slot(self, spec: cutlass.Constexpr, tma, tWgW: cute.Tensor, tWsW: cute.Tensor, ring, state,
                       block: Int32, kt: Int32):
            """The producer fills the ring's next slot with K tile kt of column block `block` (a box past K
            arrives as zeros); the caller advances state."""
            boxes = self.cfg.boxes(spec)
            ring.producer_acquire(state)
            for b in cutlass.range_constexpr(boxes):
                cute.copy(tma, tWgW[None, block, kt * boxes + b], tWsW[None, b, state.index],
                          tma_bar_ptr=ring.producer_get_barrier(state))

        @cute.jit
        def block_product(self, spec: cutlass.Constexpr, sX: cute.Tensor, sW: cute.Tensor, ring, state,
                          acc: cute.Tensor, warp: Int32, lane: Int32):
            """A consumer warp's rows of one column block times the staged x, over the block's K tiles as they
            arrive in the ring: acc (rows_per_warp, LANE_COLS) gets each row's per-lane partial sums (row_total
            finishes them). Returns state advanced past the block: a caller in a dynamic loop must assign it, as
            the DSL carries through a loop only what the loop body assigns or calls a method of (passed along, the
            state restarted at slot 0 with every block, and the kernel hung)."""
            consumers, boxes = self.cfg.consumer_warps, self.cfg.boxes(spec)
            acc.fill(0.0)
            for kt in cutlass.range(self.cfg.width(spec) // (boxes * BLOCK_K), unroll=1):
                xs = [cute.local_tile(sX, (LANE_COLS,), ((kt * boxes + b) * 32 + lane,)).load().to(Float32)
                      for b in range(boxes)]
                ring.consumer_wait(state)
                for i in cutlass.range_constexpr(spec.block_n // consumers):
                    row = warp + consumers * i
                    for b in cutlass.range_constexpr(boxes):
                        ws = cute.local_tile(sW[row, None, b, state.index], (LANE_COLS,), (lane,)).load()
                        acc[i, None].store(acc[i, None].load() + ws.to(Float32) * xs[b])
                ring.consumer_release(state)
                state.advance()
            return state

        @cute.jit
        def row_total(self, acc: cute.Tensor, i: cutlass.Constexpr) -> Float32:
            """Row i of a warp's block_product: its lanes' partial sums added (every lane gets the total)."""
            total = acc[i, None].load().reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            return cute.arch.warp_reduction(total, operator.add)

        @cute.jit
        def grid_sync(self, mSync: cute.Tensor, grid: Int32, tidx: Int32):
            """Wait until every CTA's consumers have stored their part of the previous GEMV's output: after a
            consumer barrier (its stores done, sX free) each CTA adds one to the counter, and waits for the next
            multiple of grid above what it found (the counter never resets: each sync adds grid). Thread 0's release
            add (after the barrier that orders the CTA's stores before it) publishes them and its acquire poll sees
            every CTA's; no explicit fence besides (each one a MEMBAR.ALL.GPU sequence in sm_90a SASS, waiting on the
            weight stream in flight: removing the two a sync had shortened the decode step; FINDINGS, decode step)."""
            threads = 32 * self.cfg.consumer_warps
            cute.arch.barrier(barrier_id=X_BARRIER, number_of_threads=threads)
            if tidx == 0:
                counter = mSync.iterator
                found = cute.arch.atomic_add(counter, Int64(1), sem="release", scope="gpu")
                target = (found // grid + 1) * grid
                while cute.arch.load(counter, Int64, sem="acquire", scope="gpu") < target:
                    pass
            cute.arch.barrier(barrier_id=X_BARRIER, number_of_threads=threads)

        @cute.jit
        def stage_x(self, spec: cutlass.Constexpr, mX: cute.Tensor, mRes: cute.Tensor | None,
                    mNormW: cute.Tensor | None, mS: cute.Tensor | None, eps: Float32, sX: cute.Tensor,
                    sSumSq: cute.Tensor, tidx: Int32, warp: Int32, lane: Int32, bidx: Int32):
            """What the product takes into sX, 8 columns a thread a step, zeros past K: x; silu(gate) * up; or
            rms_norm(s) with s = x (+ residual), each rounded to bf16 as the unfused ops round (CTA 0 stores s).
            Every step's loads are issued before the first store (one L2 round trip, not one a step)."""
            width, threads = self.cfg.width(spec), 32 * self.cfg.consumer_warps
            steps = cdiv(width, threads * LANE_COLS)
            values, norm_ws = [], []
            sum_sq = Float32(0.0)
            for i in cutlass.range_constexpr(steps):
                c = (i * threads + tidx) * LANE_COLS
                src = cutlass.min(c, spec.k - LANE_COLS) // LANE_COLS  # past K: any in-bounds chunk (zeros below)
                v = cute.local_tile(mX, (LANE_COLS,), (src,)).load()
                if cutlass.const_expr(spec.gated):
                    gate = v.to(Float32)
                    up = cute.local_tile(mX, (LANE_COLS,), (src + spec.k // LANE_COLS,)).load().to(Float32)
                    v = (gate / (1.0 + cute.math.exp(-gate)) * up).to(BFloat16)
                if cutlass.const_expr(spec.add):
                    res = cute.local_tile(mRes, (LANE_COLS,), (src,)).load()
                    v = (v.to(Float32) + res.to(Float32)).to(BFloat16)
                if cutlass.const_expr(spec.norm):
                    norm_ws.append(cute.local_tile(mNormW, (LANE_COLS,), (src,)).load())
                    part = (v.to(Float32) * v.to(Float32)).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    if c < spec.k:
                        sum_sq = sum_sq + part
                values.append(v)
            rstd = Float32(1.0)
            if cutlass.const_expr(spec.norm):  # the CTA's sum of squares: over each warp, then over the warps
                sum_sq = cute.arch.warp_reduction(sum_sq, operator.add)
                if lane == 0:
                    sSumSq[warp] = sum_sq
                cute.arch.barrier(barrier_id=X_BARRIER, number_of_threads=threads)
                total = Float32(0.0)
                for w in cutlass.range_constexpr(self.cfg.consumer_warps):
                    total = total + sSumSq[w]
                rstd = cute.math.rsqrt(total / spec.k + eps)
            for i in cutlass.range_constexpr(steps):
                c = (i * threads + tidx) * LANE_COLS
                if c < width:
                    dst = cute.local_tile(sX, (LANE_COLS,), (c // LANE_COLS,))
                    if c < spec.k:
                        v = values[i]
                        if cutlass.const_expr(spec.add):
                            if bidx == 0:
                                cute.local_tile(mS, (LANE_COLS,), (c // LANE_COLS,)).store(v)
                        if cutlass.const_expr(spec.norm):
                            v = (v.to(Float32) * rstd * (1.0 + norm_ws[i].to(Float32))).to(BFloat16)
                        dst.store(v)
                    else:
                        dst.fill(0.0)

    return TmaGemvSm90


_SMS: dict = {}


def compile_config(cfg: TmaGemvConfig, keep_ptx: bool = False):
    """The compiled kernel of cfg (placeholder pointers and stream: no GPU needed)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    def ptr(dtype=cutlass.BFloat16):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    cfg.validate()
    gemvs = len(cfg.inputs)
    norm, add = any(g.norm for g in cfg.inputs), any(g.add for g in cfg.inputs)
    return cute.compile(_kernel_class()(cfg), ptr(), tuple(ptr() for _ in range(gemvs)),
                        tuple(ptr() for _ in range(gemvs)), ptr() if add else None, ptr() if norm else None,
                        ptr() if add else None, ptr(cutlass.Int64) if cfg.chain else None,
                        ptr(cutlass.Int64) if cfg.stamps else None, tuple(cutlass.Int32(1) for _ in range(gemvs)),
                        cutlass.Int32(1), cutlass.Float32(1e-6), make_fake_stream(),
                        options="--keep-ptx" if keep_ptx else None)


_CACHE = CompileCache(compile_config)
_SYNC: dict = {}  # device index -> a chain's grid-sync counter (one int64, never reset)


def _sync_counter(device: torch.device, index: int) -> torch.Tensor:
    """The device's grid-sync counter, made on first use, which must not be inside a CUDA graph capture (the
    serving engine warms each graph up eagerly first). Chains on one device share it, and a grid sync assumes that
    the chain's CTAs hold every SM in time: launch chains on one stream, with no other process on the GPU (MPS)."""
    if index not in _SYNC:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the first chained TMA GEMV on a device must run outside a CUDA graph capture")
        _SYNC[index] = torch.zeros(1, dtype=torch.int64, device=device)
    return _SYNC[index]


def tma_gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *, gated: bool = False,
             norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
             s_out: torch.Tensor | None = None, config: TmaGemvConfig | None = None) -> torch.Tensor:
    """x: (1, K) bf16 ((1, 2K) = [gate | up] when gated); weight: (N, K) bf16 contiguous -> (1, N) bf16, into out
    when given ((1, N), contiguous). norm_weight (K,): the product takes rms_norm(s, norm_weight, eps) with s = x,
    or x + residual (1, K) when given, which is then stored into s_out (1, K). The caller checks `available` first
    (kernels.linear does)."""
    spec = GemvInput(weight.shape[1], gated, norm_weight is not None, residual is not None)
    return tma_gemv_chain(x, [weight], [spec], out, norm_weight=norm_weight, eps=eps, residual=residual,
                          s_out=s_out, config=config)


def tma_gemv_chain(x: torch.Tensor, weights, inputs, out: torch.Tensor | None = None, *,
                   norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
                   s_out: torch.Tensor | None = None, config: TmaGemvConfig | None = None,
                   boundary_bytes: int = BOUNDARY_BYTES) -> torch.Tensor:
    """GEMVs in one launch, each on the previous one's output: y_0 = in_0(x) @ weights[0]^T, y_g = in_g(y_{g-1}) @
    weights[g]^T, where inputs[g] (GemvInput) says how row g is staged (gated: y_{g-1} is [gate | up]). Between two
    GEMVs the CTAs sync over the grid while the next weights already stream into their rings. Returns the last
    GEMV's (1, N) bf16, into out when given. The norm input (at most one) takes norm_weight, and residual and s_out
    as tma_gemv does. boundary_bytes: the producer's pause before each grid sync (0: none; benchmarks). The caller
    checks `available` first."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    for g, (weight, spec) in enumerate(zip(weights, inputs)):
        width = spec.k * (2 if spec.gated else 1)
        if weight.shape[1] != spec.k or (g > 0 and weights[g - 1].shape[0] != width):
            raise ValueError(f"weights[{g}] {tuple(weight.shape)} does not chain: K {spec.k}, the input {width} wide")
    n = weights[-1].shape[0]
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    elif out.shape != (1, n) or not out.is_contiguous() or out.dtype != x.dtype:
        raise ValueError(f"out must be a contiguous (1, {n}) {x.dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    if residual is not None and (s_out is None or s_out.shape != residual.shape or not s_out.is_contiguous()):
        raise ValueError(f"s_out must be a contiguous tensor of residual's shape {tuple(residual.shape)}")
    if residual is not None and norm_weight is None:
        raise ValueError("residual is only added before a norm: give norm_weight")
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    first, *chain = inputs
    sms = _SMS[index]
    chain = tuple(dataclasses.replace(g, block_n=block_rows(w.shape[0], sms)) for g, w in zip(chain, weights[1:]))
    cfg = config or choose_config(weights[0].shape[0], first.k, first.gated, _SMS[index], norm=first.norm,
                                  add=first.add, pdl=pdl.enabled(x.device), chain=chain,
                                  boundary_bytes=boundary_bytes)
    stamp, stamping = stamps.slot("tma_gemv_chain" if chain else "tma_gemv", x.device,
                                  bytes=sum(w.numel() * w.element_size() for w in weights))
    if stamping:  # a stamped compile of the same config (only inside stamps.record: off the hot path)
        cfg = dataclasses.replace(cfg, stamps=True)
    outs = [torch.empty((1, w.shape[0]), dtype=x.dtype, device=x.device) for w in weights[:-1]] + [out]
    stream = cu_stream(torch.cuda.current_stream(x.device).cuda_stream)

    def ptr(t, dtype=cutlass.BFloat16):
        return None if t is None else make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)

    sync = _sync_counter(x.device, index) if chain else None
    args = (ptr(x), tuple(ptr(w) for w in weights), tuple(ptr(o) for o in outs), ptr(residual), ptr(norm_weight),
            ptr(s_out), ptr(sync, cutlass.Int64), ptr(stamp, cutlass.Int64) if stamping else None,
            tuple(w.shape[0] for w in weights),
            _SMS[index] * cfg.ctas_per_sm, cutlass.Float32(eps), stream)
    if index == torch.cuda.current_device():
        _CACHE.get(cfg)(*args)
    else:  # the launch goes to the current device's context
        with torch.cuda.device(index):
            _CACHE.get(cfg)(*args)
    return out
