"""Compile cache of the CuTe-DSL attention forward: one compiled kernel per AttentionConfig.

Shapes are runtime values of the compiled kernel: batch, lengths and head counts are Int32 arguments and the
tensors' row strides are dynamic, so every call with an equal config reuses one compile. Tensors are passed
as DLPack views with a dynamic layout (`as_cute`); the compile sees the same kind of view (of a tiny CPU tensor,
so compiling needs no GPU: set CUTE_DSL_ARCH=sm_90a) and a placeholder stream.
"""
import threading

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import from_dlpack, make_fake_stream

from fa4.cute.config import AttentionConfig
from fa4.cute.kernel import FlashAttentionForwardSm90

_CACHE: dict = {}
_LOCK = threading.Lock()
TORCH_DTYPES = {"bfloat16": torch.bfloat16}


def as_cute(t: torch.Tensor):
    """A (rows, heads, head_dim) torch tensor, contiguous in its last dim, as a CuTe tensor with dynamic
    shape and row/head strides (16-byte aligned base)."""
    return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=2)


def as_cute_index(t: torch.Tensor | None):
    """An int32 index tensor (cu_seqlens, seqused_k: (n,); page_table: (B, pages), rows contiguous) as a CuTe
    tensor with dynamic shape and strides; None stays None (the kernel is compiled without it)."""
    if t is None:
        return None
    return from_dlpack(t, assumed_align=4).mark_layout_dynamic(leading_dim=t.dim() - 1)


def _example_args(config: AttentionConfig):
    """Placeholders of the kernel's arguments (shapes and strides are dynamic; only the None-ness of the index
    tensors and the dtypes matter)."""
    dtype = TORCH_DTYPES[config.dtype]
    q = torch.empty(2, 2, config.head_dim, dtype=dtype)
    kv = torch.empty(2, 1, config.head_dim, dtype=dtype)
    index = torch.zeros(3, dtype=torch.int32)
    cu_q = index if config.varlen_q else None
    cu_k = index if config.kv_mode == "varlen" else None
    seqused = index if config.kv_mode == "paged" else None
    table = torch.zeros(2, 2, dtype=torch.int32) if config.kv_mode == "paged" else None
    return (as_cute(q), as_cute(kv), as_cute(kv), as_cute(q), as_cute_index(cu_q), as_cute_index(cu_k),
            as_cute_index(seqused), as_cute_index(table), cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1),
            cutlass.Float32(1.0), cutlass.Int32(1), make_fake_stream())


def compile_config(config: AttentionConfig, keep_ptx: bool = False):
    """Compiles (without caching) the kernel of `config`; returns the compiled callable (with keep_ptx, its
    `__ptx__` holds the PTX, and a copy lands in $CUTE_DSL_DUMP_DIR or the working directory)."""
    options = "--keep-ptx" if keep_ptx else None
    return cute.compile(FlashAttentionForwardSm90(config), *_example_args(config), options=options)


def get_kernel(config: AttentionConfig):
    """The compiled kernel of `config`, compiled on first use."""
    kernel = _CACHE.get(config)
    if kernel is None:
        with _LOCK:
            kernel = _CACHE.get(config)
            if kernel is None:
                kernel = _CACHE[config] = compile_config(config.validate())
    return kernel


def cache_size() -> int:
    return len(_CACHE)
