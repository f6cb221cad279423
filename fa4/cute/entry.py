"""The cute backend's entry for `fa4.flash_attention`: what it supports, and the call.

Importing this module needs no nvidia-cutlass-dsl (the kernel modules are imported on the first call), so
`fa4.interface` can always ask `cute_unsupported` why a call cannot run here.
"""
import importlib.util
import math

import torch

from fa4.cute.config import DTYPES, HEAD_DIMS, choose_config

TORCH_DTYPES = {getattr(torch, name): name for name in DTYPES}


def dsl_available() -> bool:
    """Whether nvidia-cutlass-dsl is installed (without importing it: its import fixes CUTE_DSL_ARCH)."""
    return importlib.util.find_spec("cutlass") is not None


def cute_unsupported(q, k, v, **index_tensors) -> str | None:
    """Why the cute backend cannot run this (checked) call, or None when it can.
    index_tensors: cu_seqlens_q/_k, page_table, seqused_k (None when absent)."""
    if q.dtype not in TORCH_DTYPES:
        return f"dtype {q.dtype} is not supported (only {DTYPES}); use backend 'triton'"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head_dim {q.shape[-1]} is not one of {HEAD_DIMS}; use backend 'triton'"
    given = [name for name, t in index_tensors.items() if t is not None]
    if given:
        return f"varlen and paged KV ({', '.join(given)}) are not written yet in the cute backend"
    if not dsl_available():
        return "nvidia-cutlass-dsl is not installed"
    if q.device.type != "cuda":
        return f"tensors are on {q.device}, not CUDA"
    major, minor = torch.cuda.get_device_capability(q.device)
    if (major, minor) != (9, 0):
        return f"the cute kernel is written for sm_90a, not sm_{major}{minor}"
    return None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(B, S, heads, D) -> (B * S, heads, D), contiguous and 16-byte aligned (TMA needs both)."""
    t = t.reshape(-1, *t.shape[2:])
    if not t.is_contiguous() or t.data_ptr() % 16:
        t = t.contiguous()
    return t


def cute_attention(q, k, v, *, causal: bool, softmax_scale: float, rescale_threshold: float = 8.0,
                   poly_exp2_fraction: float = 0.0, **config_overrides):
    """Dense attention, q (B, Sq, H, D) and k, v (B, Sk, KV, D), bf16 on an sm_90 GPU; returns q's shape.
    Call `cute_unsupported` first. config_overrides: fields of AttentionConfig (tile_n, kv_stages, ...)."""
    import cutlass

    from fa4.cute.compile_cache import as_cute, get_kernel

    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv = k.shape[1], k.shape[2]
    config = choose_config(head_dim, causal, num_heads, num_kv, rescale_threshold=rescale_threshold,
                           poly_exp2_fraction=poly_exp2_fraction, **config_overrides)
    kernel = get_kernel(config)
    q3, k3, v3 = _rows(q), _rows(k), _rows(v)
    o = torch.empty_like(q3)
    if o.numel() == 0:
        return o.view(q.shape)
    if seqlen_k == 0:  # no keys: every row gives 0 (and a TMA descriptor cannot have an empty extent)
        return o.zero_().view(q.shape)
    from cuda.bindings import driver

    stream = driver.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    kernel(as_cute(q3), as_cute(k3), as_cute(v3), as_cute(o), cutlass.Int32(batch), cutlass.Int32(seqlen_q),
           cutlass.Int32(seqlen_k), cutlass.Float32(softmax_scale * math.log2(math.e)), stream)
    return o.view(q.shape)
