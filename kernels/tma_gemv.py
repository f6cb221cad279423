"""Batch-1 decode GEMV on Hopper in CuTe-DSL: the weight streams through a TMA ring in shared memory.

y (1, N) = x (1, K) @ weight (N, K)^T, bf16 in and out, fp32 sums. Why a second GEMV beside the Triton one
(kernels/linear.py): a decode step is ~100 GEMVs in a chain, and the Triton GEMV keeps one weight tile a program in
flight, in registers, so DRAM sees only as many bytes in flight as the resident programs hold (2B step: 97 GEMVs
take 1.24 ms for 3.76 GB, 3.0 TB/s). Here one producer warp a CTA keeps a 128 KiB ring of weight tiles in shared
memory filled with TMA (17 MB in flight over 132 SMs), and it needs nothing from the previous kernel: with
programmatic dependent launch the producer starts streaming while the previous kernel drains, and only the
consumers wait (griddepcontrol.wait) before they read x.

CTA layout: consumer_warps (8 by default) consume, the warp after them produces. The grid is min(SMs, column
blocks); CTA c takes column blocks c, c + grid, ... of BLOCK_N weight rows, each as K / BLOCK_K tiles of BLOCK_N x
BLOCK_K (one TMA box; rows past N and columns past K arrive as zeros). A consumer warp owns BLOCK_N / consumer_warps
rows of a tile; lane l multiplies columns 8l..8l+7 (a 16-byte shared load a row) by x's, which the consumers stage
in shared memory once (zero past K). Per row: 8 fp32 partial sums a lane, summed, then a butterfly over the warp;
lane 0 stores the bf16 result. What is staged: x; with GATED, SwiGLU's silu(gate) * up of [gate | up] (1, 2K),
rounded to bf16, so the down projection reads [gate | up] itself; with NORM, rms_norm(x (+ residual)), each rounded
to bf16 as the unfused ops round (a block reduction of the squares; CTA 0 stores the sum, the next residual).

Compiled once per TmaGemvConfig (K and the tile are compile-time, N is a runtime value); compiling needs no GPU
(CUTE_DSL_ARCH=sm_90a). `available(x, weight)` says whether a call can run here.
"""
import functools
import operator
from dataclasses import dataclass

import torch

from kernels import pdl
from kernels.cute_runtime import CompileCache, cu_stream, dsl_available
from kernels.host_math import cdiv

LANE_COLS = 8  # columns a lane multiplies per tile row: one 16-byte load
BLOCK_K = 32 * LANE_COLS  # a tile's columns (also the TMA box's inner extent: 512 bytes, at most 256 elements)
RING_BYTES = 128 * 1024  # weight tiles in flight a CTA
MAX_K = 16384  # x (or [gate | up]'s product) staged in shared memory: 32 KiB at most
X_BARRIER = 1  # named barrier of the consumers after staging x


@dataclass(frozen=True)
class TmaGemvConfig:
    k: int  # x's width (the product's; [gate | up] is 2k wide)
    block_n: int  # weight rows a column block
    stages: int  # tiles in the ring
    gated: bool = False
    ctas_per_sm: int = 1  # the grid: this many CTAs an SM (or one a column block)
    consumer_warps: int = 4  # each owns block_n / consumer_warps rows of every tile
    norm: bool = False  # the product takes rms_norm(x) (x + residual when add), as kernels.linear's NORM input
    add: bool = False
    pdl: bool = True  # launched with programmatic dependent launch (kernels.pdl.enabled: QWEN_PDL=0 switches it off)

    def validate(self) -> "TmaGemvConfig":
        if self.k <= 0 or self.k % LANE_COLS or self.k > MAX_K:
            raise ValueError(f"k must be a positive multiple of {LANE_COLS} up to {MAX_K}, got {self.k}")
        if self.block_n not in (4, 8, 16, 32):
            raise ValueError(f"block_n must be 4, 8, 16 or 32, got {self.block_n}")
        if self.consumer_warps not in (1, 2, 4, 8) or self.consumer_warps > self.block_n:
            raise ValueError(f"consumer_warps must be 1, 2, 4 or 8 and at most block_n, got {self.consumer_warps}")
        if not 2 <= self.stages <= 32:
            raise ValueError(f"stages must be 2 to 32, got {self.stages}")
        if (self.gated and self.norm) or (self.add and not self.norm):
            raise ValueError(f"the input is one of plain, gated, norm (add only with norm), got gated={self.gated} "
                             f"norm={self.norm} add={self.add}")
        return self

    @property
    def k_tiles(self) -> int:
        return cdiv(self.k, BLOCK_K)


@functools.cache
def choose_config(n: int, k: int, gated: bool = False, num_sms: int = 132, *, norm: bool = False, add: bool = False,
                  pdl: bool = True, ring_bytes: int = RING_BYTES, consumer_warps: int = 8,
                  ctas_per_sm: int = 1) -> TmaGemvConfig:
    """16-row column blocks, or 8 where 16 would leave SMs without a block (at least one row a consumer warp); the
    ring holds ring_bytes. The defaults: H200, session 16, `python -m profiles.bench_decode --sweep-tma`, where a
    128 KiB ring and 8 consumer warps were the fastest of 32-128 KiB x 4-8 warps x 1-2 CTAs an SM on 10 of the 12
    2B / 9B projections."""
    block_n = max(16 if cdiv(n, 16) >= num_sms else 8, consumer_warps)
    return TmaGemvConfig(k, block_n, min(32, ring_bytes // (block_n * BLOCK_K * 2)), gated, ctas_per_sm,
                         consumer_warps, norm, add, pdl).validate()


def available(x: torch.Tensor, weight: torch.Tensor, gated: bool = False, *,
              norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> bool:
    """Whether tma_gemv takes this call: one bf16 row on an sm_90+ GPU, a contiguous weight, K within MAX_K,
    16-byte aligned rows (and norm weight and residual), and nvidia-cutlass-dsl installed."""
    k = weight.shape[1]
    extras = [t for t in (norm_weight, residual) if t is not None]
    return (x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.dim() == 2
            and x.shape[0] == 1 and x.stride(-1) == 1 and x.shape[1] == k * (2 if gated else 1)
            and weight.is_contiguous() and 0 < k <= MAX_K and k % LANE_COLS == 0 and weight.shape[0] > 0
            and all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.numel() == k for t in extras)
            and all(t.data_ptr() % 16 == 0 for t in (x, weight, *extras))
            and pdl.capable(x.device.index if x.device.index is not None else torch.cuda.current_device())
            and dsl_available())


@functools.cache
def _kernel_class():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.nvgpu import cpasync
    try:
        from cutlass.memory import SmemAllocator
    except ImportError:  # pragma: no cover
        from cutlass.utils import SmemAllocator

    class TmaGemvSm90:
        def __init__(self, cfg: TmaGemvConfig):
            self.cfg = cfg

        @cute.jit
        def __call__(self, x_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer,
                     res_ptr: cute.Pointer | None, norm_w_ptr: cute.Pointer | None, s_ptr: cute.Pointer | None,
                     n: Int32, num_ctas: Int32, eps: Float32, stream: cuda.CUstream):
            """x (1, K) or [gate | up] (1, 2K), weight (n, K), y (1, n): contiguous bf16; num_ctas: the SMs.
            norm: norm_w (K,); add: residual (1, K) and s (1, K), where CTA 0 stores x + residual."""
            cfg = self.cfg
            k, bn, stages = cfg.k, cfg.block_n, cfg.stages
            mW = cute.make_tensor(w_ptr, cute.make_layout((n, k), stride=(k, 1)))
            mX = cute.make_tensor(x_ptr, cute.make_layout(2 * k if cfg.gated else k))
            mY = cute.make_tensor(y_ptr, cute.make_layout(n))
            mRes = mNormW = mS = None
            if cutlass.const_expr(cfg.norm):
                mNormW = cute.make_tensor(norm_w_ptr, cute.make_layout(k))
            if cutlass.const_expr(cfg.add):
                mRes = cute.make_tensor(res_ptr, cute.make_layout(k))
                mS = cute.make_tensor(s_ptr, cute.make_layout(k))
            sW_layout = cute.make_layout((bn, BLOCK_K, stages), stride=(BLOCK_K, 1, bn * BLOCK_K))
            tma, mW_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mW,
                                                      cute.slice_(sW_layout, (None, None, 0)), (bn, BLOCK_K))
            self.tile_bytes = bn * BLOCK_K * 2

            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
                sum_sq: cute.struct.MemRange[Float32, cfg.consumer_warps]
                sX: cute.struct.Align[cute.struct.MemRange[BFloat16, cfg.k_tiles * BLOCK_K], 128]
                sW: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sW_layout)], 128]

            self.shared_storage = SharedStorage
            blocks = (n + bn - 1) // bn
            grid = cutlass.max(cutlass.min(num_ctas, blocks), 1)
            self.kernel(tma, mW_tma, mX, mY, mRes, mNormW, mS, eps, sW_layout, blocks, grid).launch(
                grid=[grid, 1, 1], block=[32 * (cfg.consumer_warps + 1), 1, 1], stream=stream, use_pdl=cfg.pdl)

        @cute.kernel
        def kernel(self, tma: cute.CopyAtom, mW: cute.Tensor, mX: cute.Tensor, mY: cute.Tensor,
                   mRes: cute.Tensor | None, mNormW: cute.Tensor | None, mS: cute.Tensor | None, eps: Float32,
                   sW_layout: cute.Layout, blocks: Int32, grid: Int32):
            cfg = self.cfg
            bn, stages, k_tiles = cfg.block_n, cfg.stages, cfg.k_tiles
            consumers = cfg.consumer_warps
            rows_per_warp = bn // consumers
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = cute.arch.lane_idx()

            storage = SmemAllocator().allocate(self.shared_storage)
            ring = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(), num_stages=stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers),
                tx_count=self.tile_bytes, defer_sync=True)
            sX = storage.sX.get_tensor(cute.make_layout(k_tiles * BLOCK_K))
            sW = storage.sW.get_tensor(sW_layout)  # (BLOCK_N, BLOCK_K, stages)
            if warp == consumers:
                cpasync.prefetch_descriptor(tma)
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

            if warp == consumers:
                # producer: weights only, so no wait for the previous kernel (the ring fills during its tail)
                gW = cute.local_tile(mW, (bn, BLOCK_K), (None, None))  # (BLOCK_N, BLOCK_K, blocks, k_tiles)
                tWsW, tWgW = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2),
                                                   cute.group_modes(gW, 0, 2))
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
                block = bidx
                while block < blocks:
                    for kt in cutlass.range(k_tiles, unroll=1):
                        ring.producer_acquire(state)
                        cute.copy(tma, tWgW[None, block, kt], tWsW[None, state.index],
                                  tma_bar_ptr=ring.producer_get_barrier(state))
                        state.advance()
                    block += grid
            else:
                if cutlass.const_expr(cfg.pdl):
                    cute.arch.griddepcontrol_wait()  # x comes from the previous kernel
                    cute.arch.griddepcontrol_launch_dependents()
                self.stage_x(mX, mRes, mNormW, mS, eps, sX, storage.sum_sq.get_tensor(cute.make_layout(consumers)),
                             tidx, warp, lane, bidx)
                cute.arch.barrier(barrier_id=X_BARRIER, number_of_threads=32 * consumers)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
                acc = cute.make_rmem_tensor((rows_per_warp, LANE_COLS), Float32)
                block = bidx
                while block < blocks:
                    acc.fill(0.0)
                    for kt in cutlass.range(k_tiles, unroll=1):
                        xs = cute.local_tile(sX, (LANE_COLS,), (kt * 32 + lane,)).load().to(Float32)
                        ring.consumer_wait(state)
                        for i in cutlass.range_constexpr(rows_per_warp):
                            row = warp + consumers * i
                            ws = cute.local_tile(sW[row, None, state.index], (LANE_COLS,), (lane,)).load()
                            acc[i, None].store(acc[i, None].load() + ws.to(Float32) * xs)
                        ring.consumer_release(state)
                        state.advance()
                    for i in cutlass.range_constexpr(rows_per_warp):
                        total = acc[i, None].load().reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                        total = cute.arch.warp_reduction(total, operator.add)
                        row = block * bn + warp + consumers * i
                        if lane == 0 and row < cute.size(mY):
                            mY[row] = total.to(BFloat16)
                    block += grid

        @cute.jit
        def stage_x(self, mX: cute.Tensor, mRes: cute.Tensor | None, mNormW: cute.Tensor | None,
                    mS: cute.Tensor | None, eps: Float32, sX: cute.Tensor, sSumSq: cute.Tensor, tidx: Int32,
                    warp: Int32, lane: Int32, bidx: Int32):
            """What the product takes into sX, 8 columns a thread a step, zeros past K: x; silu(gate) * up; or
            rms_norm(s) with s = x (+ residual), each rounded to bf16 as the unfused ops round (CTA 0 stores s).
            Every step's loads are issued before the first store (one L2 round trip, not one a step)."""
            cfg = self.cfg
            width, threads = cfg.k_tiles * BLOCK_K, 32 * cfg.consumer_warps
            steps = cdiv(width, threads * LANE_COLS)
            values, norm_ws = [], []
            sum_sq = Float32(0.0)
            for i in cutlass.range_constexpr(steps):
                c = (i * threads + tidx) * LANE_COLS
                src = cutlass.min(c, cfg.k - LANE_COLS) // LANE_COLS  # past K: any in-bounds chunk (zeros below)
                v = cute.local_tile(mX, (LANE_COLS,), (src,)).load()
                if cutlass.const_expr(cfg.gated):
                    gate = v.to(Float32)
                    up = cute.local_tile(mX, (LANE_COLS,), (src + cfg.k // LANE_COLS,)).load().to(Float32)
                    v = (gate / (1.0 + cute.math.exp(-gate)) * up).to(BFloat16)
                if cutlass.const_expr(cfg.add):
                    res = cute.local_tile(mRes, (LANE_COLS,), (src,)).load()
                    v = (v.to(Float32) + res.to(Float32)).to(BFloat16)
                if cutlass.const_expr(cfg.norm):
                    norm_ws.append(cute.local_tile(mNormW, (LANE_COLS,), (src,)).load())
                    part = (v.to(Float32) * v.to(Float32)).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    if c < cfg.k:
                        sum_sq = sum_sq + part
                values.append(v)
            rstd = Float32(1.0)
            if cutlass.const_expr(cfg.norm):  # the CTA's sum of squares: over each warp, then over the warps
                sum_sq = cute.arch.warp_reduction(sum_sq, operator.add)
                if lane == 0:
                    sSumSq[warp] = sum_sq
                cute.arch.barrier(barrier_id=X_BARRIER, number_of_threads=threads)
                total = Float32(0.0)
                for w in cutlass.range_constexpr(cfg.consumer_warps):
                    total = total + sSumSq[w]
                rstd = cute.math.rsqrt(total / cfg.k + eps)
            for i in cutlass.range_constexpr(steps):
                c = (i * threads + tidx) * LANE_COLS
                if c < width:
                    dst = cute.local_tile(sX, (LANE_COLS,), (c // LANE_COLS,))
                    if c < cfg.k:
                        v = values[i]
                        if cutlass.const_expr(cfg.add):
                            if bidx == 0:
                                cute.local_tile(mS, (LANE_COLS,), (c // LANE_COLS,)).store(v)
                        if cutlass.const_expr(cfg.norm):
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

    def ptr():
        return make_ptr(cutlass.BFloat16, 0, cute.AddressSpace.gmem, assumed_align=16)

    cfg.validate()
    return cute.compile(_kernel_class()(cfg), ptr(), ptr(), ptr(), ptr() if cfg.add else None,
                        ptr() if cfg.norm else None, ptr() if cfg.add else None, cutlass.Int32(1), cutlass.Int32(1),
                        cutlass.Float32(1e-6), make_fake_stream(), options="--keep-ptx" if keep_ptx else None)


_CACHE = CompileCache(compile_config)


def tma_gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *, gated: bool = False,
             norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
             s_out: torch.Tensor | None = None, config: TmaGemvConfig | None = None) -> torch.Tensor:
    """x: (1, K) bf16 ((1, 2K) = [gate | up] when gated); weight: (N, K) bf16 contiguous -> (1, N) bf16, into out
    when given ((1, N), contiguous). norm_weight (K,): the product takes rms_norm(s, norm_weight, eps) with s = x,
    or x + residual (1, K) when given, which is then stored into s_out (1, K). The caller checks `available` first
    (kernels.linear does)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    n, k = weight.shape
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    elif out.shape != (1, n) or not out.is_contiguous() or out.dtype != x.dtype:
        raise ValueError(f"out must be a contiguous (1, {n}) {x.dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    if residual is not None and (s_out is None or s_out.shape != x.shape or not s_out.is_contiguous()):
        raise ValueError(f"s_out must be a contiguous tensor of x's shape {tuple(x.shape)} when residual is given")
    if residual is not None and norm_weight is None:
        raise ValueError("residual is only added before a norm: give norm_weight")
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    cfg = config or choose_config(n, k, gated, _SMS[index], norm=norm_weight is not None, add=residual is not None,
                                  pdl=pdl.enabled(x.device), ring_bytes=RING_BYTES)
    stream = cu_stream(torch.cuda.current_stream(x.device).cuda_stream)

    def ptr(t):
        return None if t is None else make_ptr(cutlass.BFloat16, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)

    args = (ptr(x), ptr(weight), ptr(out), ptr(residual), ptr(norm_weight), ptr(s_out), n,
            _SMS[index] * cfg.ctas_per_sm, cutlass.Float32(eps), stream)
    if index == torch.cuda.current_device():
        _CACHE.get(cfg)(*args)
    else:  # the launch goes to the current device's context
        with torch.cuda.device(index):
            _CACHE.get(cfg)(*args)
    return out
