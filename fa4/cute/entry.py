"""The cute backend's entry for `fa4.flash_attention`: what it supports, and the call.

Importing this module needs no nvidia-cutlass-dsl (the kernel modules are imported on the first call), so the
router can always ask `key_unsupported` why a call cannot run here.
"""
import math

import torch

from fa4.cute.config import DTYPES, HEAD_DIMS, choose_config, paged_tile_n
from kernels.cute_runtime import dsl_available

TORCH_DTYPES = {getattr(torch, name): name for name in DTYPES}


def key_unsupported(dtype: torch.dtype, head_dim: int, page_size: int | None, device) -> str | None:
    """Why the CuTe forward cannot run a call of this dtype, head dim, page size (None: not paged) and device (a
    kernels.registry.DeviceInfo), or None when it can."""
    if dtype not in TORCH_DTYPES:
        return f"dtype {dtype} is not supported (only {DTYPES}); use backend 'triton'"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {HEAD_DIMS}; use backend 'triton'"
    if page_size is not None:
        try:
            paged_tile_n(head_dim, page_size)
        except ValueError as err:
            return f"{err}; use backend 'triton'"
    if not dsl_available():
        return "nvidia-cutlass-dsl is not installed"
    if device.type != "cuda":
        return f"tensors are on {device.type}, not CUDA"
    if not device.sm90:
        return f"the cute kernel is written for sm_90a, not sm_{device.capability[0]}{device.capability[1]}"
    return None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(B, S, heads, D) -> (B * S, heads, D), contiguous and 16-byte aligned (TMA needs both); 3-dim tensors
    (varlen rows) are only made contiguous."""
    if t.dim() == 4:
        t = t.reshape(-1, *t.shape[2:])
    if not t.is_contiguous() or t.data_ptr() % 16:
        t = t.contiguous()
    return t


def _index(t):
    return None if t is None else t.to(torch.int32).contiguous()


_NUM_SMS: dict = {}


def num_sms(device) -> int:
    index = torch.device(device).index
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[index]


def cute_attention(q, k, v, *, causal: bool, softmax_scale: float, cu_seqlens_q=None, cu_seqlens_k=None,
                   page_table=None, seqused_k=None, max_seqlen_q: int | None = None, rescale_threshold: float = 8.0,
                   poly_exp2_fraction: float = 0.0, **config_overrides):
    """Attention on an sm_90 GPU, bf16; returns q's shape. The router asks `key_unsupported` first (the inputs are
    those `fa4.flash_attention` checked).
    q: (B, Sq, H, D), or (total_q, H, D) with cu_seqlens_q (B + 1,). k, v: (B, Sk, KV, D); (total_k, KV, D) with
    cu_seqlens_k; or pools (num_pages, page_size, KV, D) with page_table (B, max_pages) and seqused_k (B,).
    max_seqlen_q: the longest query sequence (read from cu_seqlens_q on the host when not given: a sync).
    config_overrides: fields of AttentionConfig (tile_n, kv_stages, persistent, ...)."""
    import cutlass

    from fa4.cute.compile_cache import get_kernel, gmem_ptr
    from kernels.cute_runtime import cu_stream

    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv = k.shape[-2]
    varlen_q = cu_seqlens_q is not None
    kv_mode = "paged" if page_table is not None else "varlen" if cu_seqlens_k is not None else "dense"
    if varlen_q:
        batch = cu_seqlens_q.shape[0] - 1
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if batch > 0 else 0
    else:
        batch, max_seqlen_q = q.shape[0], q.shape[1]
    seqlen_k = k.shape[1] if kv_mode == "dense" else 0
    key = (head_dim, causal, num_heads, num_kv, rescale_threshold, poly_exp2_fraction, varlen_q, kv_mode,
           k.shape[1] if kv_mode == "paged" else 0, tuple(sorted(config_overrides.items())))
    kernel = _KERNELS.get(key)
    if kernel is None:  # the config is validated once per call signature
        config = choose_config(head_dim, causal, num_heads, num_kv, rescale_threshold=rescale_threshold,
                               poly_exp2_fraction=poly_exp2_fraction, varlen_q=varlen_q, kv_mode=kv_mode,
                               page_size=k.shape[1] if kv_mode == "paged" else 0, **config_overrides)
        kernel = _KERNELS[key] = get_kernel(config)
    q3, k3, v3 = _rows(q), _rows(k), _rows(v)
    o = torch.empty_like(q3)
    if o.numel() == 0 or max_seqlen_q == 0:
        return o.view(q.shape)
    if k3.shape[0] == 0 or (kv_mode == "dense" and seqlen_k == 0):
        # no keys: every row gives 0 (and a TMA descriptor cannot have an empty extent)
        return o.zero_().view(q.shape)
    cu_q, cu_k, seqused, table = (_index(t) for t in (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table))
    # a sequence's keys as the host knows them without a sync: dense or average varlen, the page table's capacity
    keys = table.shape[1] * k.shape[1] if kv_mode == "paged" else k3.shape[0] // max(batch, 1)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    kernel(gmem_ptr(q3), gmem_ptr(k3), gmem_ptr(v3), gmem_ptr(o), gmem_ptr(cu_q, cutlass.Int32, 4),
           gmem_ptr(cu_k, cutlass.Int32, 4), gmem_ptr(seqused, cutlass.Int32, 4), gmem_ptr(table, cutlass.Int32, 4),
           q3.shape[0], k3.shape[0], num_heads, num_kv, table.shape[1] if table is not None else 0, batch,
           max_seqlen_q, seqlen_k, cutlass.Float32(softmax_scale * math.log2(math.e)), num_sms(q.device),
           pairs_per_section(keys, head_dim, k3.element_size(), num_heads * batch), cu_stream(stream))
    return o.view(q.shape)


L2_SECTION_BYTES = 24 * 2**20  # about half the H200's 50 MB L2: the K/V a persistent kernel's CTAs share at once


def pairs_per_section(keys: int, head_dim: int, element_size: int, max_pairs: int) -> int:
    """(head group, sequence) pairs per section of the persistent order (fa4/cute/tile_scheduler.py): as many as
    have their K and V (keys per sequence) in L2_SECTION_BYTES, at least one and at most max_pairs."""
    return max(1, min(max_pairs, L2_SECTION_BYTES // max(1, keys * head_dim * 2 * element_size)))


_KERNELS: dict = {}  # call signature -> compiled kernel (skips building and validating the config)
