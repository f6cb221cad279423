"""Compile cache of the CuTe-DSL attention forward: one compiled kernel per AttentionConfig.

Shapes are runtime values of the compiled kernel: batch, lengths and head counts are Int32 arguments, so every
call with an equal config reuses one compile. Tensors are passed as raw global pointers (`gmem_ptr`, a few
microseconds each, against ~30 us for a DLPack view) plus their sizes; the kernel builds its layouts (contiguous
rows) and TMA descriptors itself. The compile sees placeholder pointers and a placeholder stream, so compiling
needs no GPU (set CUTE_DSL_ARCH=sm_90a).
"""
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_stream, make_ptr

from fa4.cute.config import AttentionConfig
from fa4.cute.kernel import FlashAttentionForwardSm90
from kernels.cute_runtime import CompileCache


def gmem_ptr(t: torch.Tensor | None, dtype=cutlass.BFloat16, align: int = 16):
    """A global-memory pointer to t's data (None stays None: the kernel is compiled without that tensor)."""
    if t is None:
        return None
    return make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def _example_args(config: AttentionConfig):
    """Placeholders of the kernel's arguments: sizes are runtime values, so only the None-ness of the index
    pointers, the dtypes and the alignments matter."""
    def ptr(dtype, align):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)

    bf16, idx = ptr(cutlass.BFloat16, 16), ptr(cutlass.Int32, 4)
    cu_q = idx if config.varlen_q else None
    cu_k = idx if config.kv_mode == "varlen" else None
    seqused = table = idx if config.kv_mode == "paged" else None
    sizes = [cutlass.Int32(1)] * 8  # total_q, total_k, num_heads, num_kv, table_width, batch, seqlen_q, seqlen_k
    return (bf16, bf16, bf16, bf16, cu_q, cu_k, seqused, table, *sizes, cutlass.Float32(1.0), cutlass.Int32(1),
            cutlass.Int32(1), make_fake_stream())


def compile_config(config: AttentionConfig, keep_ptx: bool = False):
    """Compiles (without caching) the kernel of `config`; returns the compiled callable (with keep_ptx, its
    `__ptx__` holds the PTX, and a copy lands in $CUTE_DSL_DUMP_DIR or the working directory)."""
    options = "--keep-ptx" if keep_ptx else None
    return cute.compile(FlashAttentionForwardSm90(config), *_example_args(config), options=options)


_CACHE = CompileCache(lambda config: compile_config(config.validate()))


def get_kernel(config: AttentionConfig):
    """The compiled kernel of `config`, compiled on first use."""
    return _CACHE.get(config)


def cache_size() -> int:
    return len(_CACHE)
