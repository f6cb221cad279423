"""Kernel tuning as data: the choices the router and the launch plans read, in one frozen dataclass.

The defaults are the measured winners on the H200 and the H100 (profiles/FINDINGS.md gives each field's
evidence). An A/B builds two KernelTunings and runs each under `kernels.registry.use(tuning=...)` in one process.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class MoeTiles:
    """A launch plan of kernels.moe's grouped GEMMs: pairs a block (block_m, also the routing's alignment), output
    columns a program (block_n, at most the width's power of two), the K step, warps and software-pipeline stages.
    down: the down kernel's own plan (its K is the expert's intermediate size, short where gate_up's is the hidden
    size), with the same block_m; None: this one."""
    block_m: int
    block_n: int
    block_k: int = 64
    warps: int = 4
    stages: int = 3
    down: "MoeTiles | None" = None

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's least), got {value!r}")
        if self.warps not in (1, 2, 4, 8, 16) or not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"warps must be a power of two up to 16 and stages >= 1, got {self.warps}, {self.stages}")
        if self.down is not None and (not isinstance(self.down, MoeTiles) or self.down.down is not None
                                      or self.down.block_m != self.block_m):
            raise ValueError(f"down must be MoeTiles of the same block_m ({self.block_m}: the pairs' blocks are "
                             f"shared) and no down of its own, got {self.down!r}")

    @property
    def down_tiles(self) -> "MoeTiles":
        """The down kernel's plan."""
        return self.down or self


@dataclass(frozen=True)
class MoeGemvPlan:
    """A launch plan of kernels.moe_gemv (one token's experts as GEMVs): output columns a program and the K step of
    the gate_up and down kernels, and warps."""
    gate_up_n: int = 8
    gate_up_k: int = 256
    down_n: int = 4
    down_k: int = 512
    warps: int = 4

    def __post_init__(self):
        for name in ("gate_up_n", "gate_up_k", "down_n", "down_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value!r}")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"warps must be a power of two up to 16, got {self.warps!r}")


@dataclass(frozen=True)
class KernelTuning:
    # One bf16 row of a weight of at least tma_min_bytes runs the TMA-ring GEMV (kernels.tma_gemv): smaller ones
    # stream faster on the Triton GEMV; 8 MiB takes 0.8B's 10-13 MB in-projections, which 16 MiB left out (0.8B's
    # step faster, 2B and 9B equal). SwiGLU's down projection only from K tma_gated_min_k: staging [gate | up]
    # costs more than the ring gains below it (2B's K 6144 lost, 9B's 12288 won).
    tma_min_bytes: int = 8 * 2**20
    tma_gated_min_k: int = 8192
    # The pre-norm projection of up to 4 rows computes its norm inside the GEMV up to this K: every program
    # recomputes the rows' norm, which pays at 0.8B (K 1024) and costs at 2B and 9B (K 2048, 4096).
    fused_norm_max_k: int = 1024
    # The chained TMA GEMV's producer pauses before each grid sync once it has this many bytes in flight past it
    # (kernels.tma_gemv.BOUNDARY_BYTES): faster at 2B and 0.8B on both cards; 9B's chain alone preferred none.
    chain_pause_bytes: int = 80 * 2**10
    # programmatic dependent launch on sm_90 (kernels.pdl); off only for the no-PDL rows of a benchmark
    pdl: bool = True
    # projections of up to gemv_max_rows rows (at most kernels.row_buckets.GEMV_MAX_ROWS) run the Triton GEMV, more
    # rows the skinny GEMM. 2B's verify step in its graph on the H100 (profiles.bench_spec), GEMV against skinny GEMM:
    # 2 rows 2363 / 2012 us, 3 rows 3239 / 2114, 4 rows 3351 / 2221 (a decode step: 1514); the GEMV's per-row
    # accumulators cost it more than its weight read at several rows (FINDINGS, MTP speculative decoding)
    gemv_max_rows: int = 1
    # kernels.moe's grouped GEMMs where experts average at most moe_decode.block_m pairs (decode and verify steps),
    # and above it (prefill). Measured on the H200 (one 35B-A3B layer, profiles.bench_moe --tiles; FINDINGS, MoE):
    # decode's 32 columns and K steps of 128 take 1 row from 87.5 to 62 us (more programs stream the few experts);
    # prefill's 64 x 128 tiles at 4 stages take 1024 rows from 1560 to 953 us and 8192 from 2840 to 2444.
    moe_decode: MoeTiles = MoeTiles(16, 32, 128, 4, 4)
    moe_prefill: MoeTiles = MoeTiles(64, 128, 64, 4, 4)
    # one token's MoE (a batch-1 decode step) as GEMVs over its chosen experts (kernels.moe_gemv) on this plan; None:
    # the grouped GEMMs, whose 16-row blocks hold one real row there. One 35B-A3B layer on the H100: 38.1 us against
    # 62.9 (profiles.bench_moe --row-gemv; other plans within 2 us; FINDINGS, MoE)
    moe_row_gemv: MoeGemvPlan | None = MoeGemvPlan()

    def __post_init__(self):
        for name in ("tma_min_bytes", "tma_gated_min_k", "fused_norm_max_k", "chain_pause_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if isinstance(self.gemv_max_rows, bool) or self.gemv_max_rows not in (1, 2, 3, 4):
            raise ValueError(f"gemv_max_rows must be 1..4 (the GEMV's rows), got {self.gemv_max_rows!r}")
