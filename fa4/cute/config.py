"""Host-side configuration of the CuTe-DSL attention forward: one frozen dataclass per compiled kernel.

Pure Python (no DSL import), so `fa4.interface` can ask what the cute backend supports without
nvidia-cutlass-dsl installed. A config is the key of the compile cache (fa4/cute/compile_cache.py): two calls
with equal configs share one compiled kernel; shapes (batch, lengths, heads) are runtime values.

The CTA: one producer warpgroup (its first warp issues every TMA load) and `num_consumer_wg` consumer
warpgroups, each owning `tile_m / num_consumer_wg` = 64 rows of the Q tile (one wgmma M). GQA packing:
`pack_gqa` query heads that share a KV head are folded into the M dimension (row m of the tile is query
position m // pack_gqa of head m % pack_gqa of the group), so one K/V tile feeds them all.

Shared memory: Q (tile_m x d) + kv_stages x (K and V tiles, tile_n x d each), bf16.
  d128: tile_n 128, 2 stages: 32 + 2 x 64 KiB = 160 KiB.   d256: tile_n 64, 2 stages: 64 + 2 x 64 = 192 KiB.

Sequences (compile-time layout, runtime lengths): `varlen_q` reads query rows through cu_seqlens_q; `kv_mode`
"dense" (b * S_k), "varlen" (cu_seqlens_k) or "paged" (a pool of pages of `page_size` keys, page_table and
seqused_k). Every K/V TMA box lies inside one page: pages that are a multiple of the tile hold whole tiles; pages
that divide the tile (8, 16, 32, 64 keys: whole 8-row swizzle atoms) fill a tile with one box per page
(`kv_box_rows`); other pages shrink tile_n to gcd(tile_n, page_size) when that is a multiple of 16 (48 -> 16),
and are refused otherwise (24, 40).
`persistent`: grid = number of SMs, each CTA loops over tiles in a static strided order (tile_scheduler.py).
"""
import math
from dataclasses import dataclass

HEAD_DIMS = (128, 256)
DTYPES = ("bfloat16",)
KV_MODES = ("dense", "varlen", "paged")
PAGE_ROWS = 8  # a page smaller than the K/V tile is one TMA box: whole 8-row swizzle atoms
POLY_FRACTIONS = (0.0, 0.125, 0.25, 0.5, 1.0)  # same set as the triton backend (fa4/softmax.py)
MAX_RESCALE_THRESHOLD = 15.0  # P = 2^(s - m) <= 2^threshold must stay far from bf16/fp32 overflow
SMEM_LIMIT = 227 * 1024  # sm_90 opt-in dynamic shared memory per CTA
BUFFER_ALIGN = 1024  # alignment of each smem buffer (fa4/cute/kernel.py's SharedStorage)
WGMMA_M = 64


@dataclass(frozen=True)
class AttentionConfig:
    head_dim: int
    causal: bool
    pack_gqa: int = 1  # query heads of one KV group folded into M (divides 64)
    dtype: str = "bfloat16"
    tile_m: int = 128  # query rows (packed) per CTA
    tile_n: int = 128  # keys per K/V tile
    kv_stages: int = 2  # depth of the K and of the V smem rings
    num_consumer_wg: int = 2
    # consumer warpgroups take turns issuing QK^T: one softmaxes while the other multiplies (choose_config: all but
    # dense d128, default_pingpong)
    pingpong: bool = True
    # issue QK^T of tile i with PV of tile i-1, so softmax i overlaps that PV: on by default (H200, bf16, against the
    # plain loop: +7% at d128, +15% at d256; profiles/results/prefill.json 'cute')
    intra_wg_overlap: bool = True
    producer_regs: int = 24  # setmaxnreg of the producer warpgroup
    consumer_regs: int = 240  # setmaxnreg of each consumer warpgroup
    rescale_threshold: float = 8.0  # FA4 conditional rescale, log2 units (0: rescale whenever the max grows)
    poly_exp2_fraction: float = 0.0  # share of each row's exp2 done by the FMA polynomial
    varlen_q: bool = False  # query rows of sequence b: cu_seqlens_q[b] .. cu_seqlens_q[b + 1]
    kv_mode: str = "dense"  # "dense", "varlen" (cu_seqlens_k) or "paged" (page_table + seqused_k)
    page_size: int = 0  # keys per page (kv_mode "paged" only)
    # grid = SMs, tiles claimed in a static strided order, longest first if causal (choose_config: dense d128
    # non-causal, default_persistent)
    persistent: bool = False
    # QK^T issued with our own wgmma descriptors (fa4/cute/wgmma_desc.py): Q's built once before the tile loop, K's
    # as a hoisted base plus the ring stage, where cute.gemm rebuilds both from the smem base at every issue
    hoisted_qk_desc: bool = False

    @property
    def rows_per_wg(self) -> int:
        return self.tile_m // self.num_consumer_wg

    @property
    def kv_box_rows(self) -> int:
        """Rows of one K/V TMA box: a page when pages are smaller than the tile, else the tile."""
        if self.kv_mode == "paged" and self.page_size < self.tile_n:
            return self.page_size
        return self.tile_n

    @property
    def num_threads(self) -> int:
        return 128 * (1 + self.num_consumer_wg)

    def smem_bytes(self) -> int:
        """The kernel's SharedStorage: the mbarriers, then Q and the K and V rings, each buffer aligned to
        BUFFER_ALIGN (128-byte swizzle atoms), plus one BUFFER_ALIGN of slack for the base's alignment."""
        elt = 2
        barriers = 8 * (2 + 4 * self.kv_stages)  # Q (2) and the K and V rings' full and empty barriers
        q = self.tile_m * self.head_dim * elt
        ring = self.kv_stages * self.tile_n * self.head_dim * elt  # K, and again V
        return BUFFER_ALIGN + sum(-(-size // BUFFER_ALIGN) * BUFFER_ALIGN for size in (barriers, q, ring, ring))

    def validate(self) -> "AttentionConfig":
        """Raises ValueError naming what is unsupported; returns self."""
        if self.dtype not in DTYPES:
            raise ValueError(f"cute backend: dtype {self.dtype} is not supported (only {DTYPES})")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"cute backend: head_dim {self.head_dim} is not one of {HEAD_DIMS}")
        if self.rows_per_wg != WGMMA_M:
            raise ValueError(f"tile_m / num_consumer_wg must be {WGMMA_M}, got {self.rows_per_wg}")
        if self.pack_gqa < 1 or WGMMA_M % self.pack_gqa:
            raise ValueError(f"pack_gqa must divide {WGMMA_M}, got {self.pack_gqa}")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 16 in [16, 256], got {self.tile_n}")
        if self.kv_stages < 1:
            raise ValueError(f"kv_stages must be >= 1, got {self.kv_stages}")
        if self.poly_exp2_fraction not in POLY_FRACTIONS:
            raise ValueError(f"poly_exp2_fraction must be one of {POLY_FRACTIONS}, got {self.poly_exp2_fraction!r}")
        if not 0.0 <= self.rescale_threshold <= MAX_RESCALE_THRESHOLD:
            raise ValueError(f"rescale_threshold must be in [0, {MAX_RESCALE_THRESHOLD}], got {self.rescale_threshold}")
        if self.producer_regs * 128 + self.consumer_regs * 128 * self.num_consumer_wg > 65536:
            raise ValueError("setmaxnreg budget exceeds the 64K registers of an SM")
        if self.kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {KV_MODES}, got {self.kv_mode!r}")
        if self.kv_mode == "paged":
            if self.page_size < 1 or (self.page_size % self.tile_n and (self.tile_n % self.page_size
                                                                         or self.page_size % PAGE_ROWS)):
                raise ValueError(f"page_size {self.page_size} neither is a multiple of the K/V tile ({self.tile_n} "
                                 f"keys) nor divides it in multiples of {PAGE_ROWS} rows: a TMA box must lie inside "
                                 "one page")
        elif self.page_size:
            raise ValueError("page_size is only read with kv_mode 'paged'")
        if self.smem_bytes() > SMEM_LIMIT:
            raise ValueError(f"config needs {self.smem_bytes()} bytes of shared memory (> {SMEM_LIMIT})")
        return self


def pack_factor(group: int) -> int:
    """The largest power of two that divides the GQA group and WGMMA_M: those heads share one M tile."""
    return math.gcd(group, WGMMA_M)


def default_tile_n(head_dim: int) -> int:
    return 128 if head_dim <= 128 else 64


def default_pingpong(head_dim: int, dense: bool) -> bool:
    """Ping-pong of the consumer warpgroups, except for dense (not varlen, not paged) d128, where it lost to
    flash-attn-4 by more than without it; varlen and paged d128 keep it until their GPU tests run without it
    (FINDINGS, CuTe forward: ping-pong)."""
    return head_dim > 128 or not dense


def paged_tile_n(head_dim: int, page_size: int) -> int:
    """The K/V tile for a page size. The default tile when the page is a multiple of it, or divides it in multiples
    of 8 rows (a tile is then one TMA box per page); else the largest divisor of the page that divides the default
    tile. Raises ValueError when that is not a multiple of 16 (a wgmma K step)."""
    default = default_tile_n(head_dim)
    if page_size > 0 and (page_size % default == 0 or (default % page_size == 0 and page_size % PAGE_ROWS == 0)):
        return default
    tile_n = math.gcd(default, page_size) if page_size > 0 else 0
    if tile_n < 16 or tile_n % 16:
        raise ValueError(f"page_size {page_size} is not supported: a K/V TMA box must lie inside one page, as a "
                         f"multiple of {PAGE_ROWS} rows dividing the {default}-key tile, or a tile of a multiple of 16 "
                         f"keys dividing the page (gcd({default}, {page_size}) = {tile_n})")
    return tile_n


def default_hoisted_qk_desc(head_dim: int, causal: bool, dense: bool) -> bool:
    """Our own QK^T descriptors (AttentionConfig.hoisted_qk_desc) where they were timed faster: dense d128 causal;
    d128 non-causal and d256 causal lose (FINDINGS, CuTe forward: hoisted descriptors)."""
    return head_dim == 128 and causal and dense


def default_persistent(head_dim: int, causal: bool, dense: bool) -> bool:
    """The persistent scheduler (AttentionConfig.persistent) where it was timed faster: dense d128 non-causal;
    causal d128 and d256 lose to a CTA a tile (FINDINGS, CuTe forward: persistent scheduler)."""
    return head_dim == 128 and not causal and dense


def choose_config(head_dim: int, causal: bool, num_heads: int, num_kv_heads: int, *, rescale_threshold: float = 8.0,
                  poly_exp2_fraction: float = 0.0, varlen_q: bool = False, kv_mode: str = "dense", page_size: int = 0,
                  **overrides) -> AttentionConfig:
    """The config for a call; `overrides` replace any field (tile sizes, stages, pingpong...)."""
    tile_n = paged_tile_n(head_dim, page_size) if kv_mode == "paged" else default_tile_n(head_dim)
    dense = kv_mode == "dense" and not varlen_q  # the shape the schedule defaults were timed on
    fields = dict(head_dim=head_dim, causal=causal, pack_gqa=pack_factor(num_heads // num_kv_heads),
                  tile_n=tile_n, pingpong=default_pingpong(head_dim, dense),
                  rescale_threshold=float(rescale_threshold),
                  poly_exp2_fraction=float(poly_exp2_fraction), varlen_q=varlen_q, kv_mode=kv_mode,
                  page_size=page_size if kv_mode == "paged" else 0,
                  hoisted_qk_desc=default_hoisted_qk_desc(head_dim, causal, dense),
                  persistent=default_persistent(head_dim, causal, dense))
    fields.update(overrides)
    return AttentionConfig(**fields).validate()


def representative_configs() -> list[AttentionConfig]:
    """The CPU compile-test set: each head dim, causal and not, with and without GQA packing, FA4 flags and
    the intra-warpgroup overlap on (the default) and off; varlen, paged (pages of 64 and 16 keys), the
    persistent scheduler (dense d128 non-causal's default) and a CTA a tile there, the wider K/V tiles (d128 176
    keys, d256 80: 11 and 5 wgmma K steps of PV), and rescale_threshold 0 (no vote, no branch) with the overlap on
    and off."""
    return [
        choose_config(128, False, 8, 8),
        choose_config(128, True, 8, 2, poly_exp2_fraction=0.25),
        choose_config(256, False, 16, 4),
        choose_config(256, True, 16, 2, poly_exp2_fraction=0.125),
        choose_config(256, True, 16, 4, intra_wg_overlap=False),
        choose_config(128, True, 8, 4, varlen_q=True, kv_mode="varlen"),
        choose_config(256, True, 16, 4, varlen_q=True, kv_mode="paged", page_size=64),
        choose_config(128, False, 8, 1, kv_mode="paged", page_size=16, persistent=True),
        choose_config(256, True, 16, 2, varlen_q=True, kv_mode="varlen", intra_wg_overlap=True, persistent=True),
        choose_config(128, False, 8, 8, tile_n=176),
        choose_config(128, True, 8, 8, rescale_threshold=0.0),
        choose_config(128, False, 8, 8, rescale_threshold=0.0, intra_wg_overlap=False, persistent=False),
        choose_config(256, True, 16, 4, tile_n=80),
    ]
