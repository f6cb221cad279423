"""CuTe-DSL FlashAttention forward for Hopper (sm_90a), reached through `fa4.flash_attention(backend="cute")`.

One concept per file: config.py (host-side AttentionConfig, the compile-cache key; no DSL import), entry.py
(what the backend supports, and the call; no DSL import until called), compile_cache.py (one compiled kernel
per config), kernel.py (TMA + wgmma + warp-specialised CTA), softmax.py (online softmax, FA4 conditional
rescale and polynomial exp2), mask.py (visited tiles, causal/ragged masking, zeroing keys past a sequence),
seqlen.py (where a sequence's rows live: dense, varlen, paged), pipeline.py (mbarrier rings, ping-pong and
epilogue named barriers), tile_scheduler.py (tile order: one CTA per tile, or persistent longest first),
wgmma_desc.py (wgmma smem descriptors built once, and QK^T issued with them: AttentionConfig.hoisted_qk_desc).
Compiling needs nvidia-cutlass-dsl (CUTE_DSL_ARCH=sm_90a without a GPU); running needs an sm_90 GPU.
"""
