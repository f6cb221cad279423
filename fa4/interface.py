"""`flash_attention`: one entry point for prefill attention, dense, varlen or over a paged KV prefix.

It checks its arguments once, then runs the implementation the router (kernels.registry, op "attention",
registered in fa4.routes) chooses for the call's key, or the one asked for by name.
"""
import math

import torch

from fa4 import routes
from fa4 import triton_forward as TF
from kernels import registry
from reference.checks import check_cu_seqlens, check_page_table, check_real, check_same_device, check_tensor

BACKENDS = ("auto", "split_kv", "cute", "triton", "reference")
INDEX_DTYPES = (torch.int32, torch.int64)


def _check_kv(q, k, v):
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    if k.shape[-2] == 0 or q.shape[-2] == 0 or q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(f"q heads ({q.shape[-2]}) must be a multiple of kv heads ({k.shape[-2]})")


def _check_paged(q, k, page_table, seqused_k, cu_seqlens_q, cu_seqlens_k) -> None:
    if seqused_k is None:
        raise ValueError("page_table needs seqused_k (the cached tokens of each sequence)")
    if cu_seqlens_k is not None:
        raise ValueError("cu_seqlens_k cannot be given with page_table: keys come from seqused_k")
    check_tensor("k", k, ndim=4)
    check_tensor("page_table", page_table, ndim=2, dtype=INDEX_DTYPES)
    check_tensor("seqused_k", seqused_k, ndim=1, dtype=INDEX_DTYPES)
    if k.shape[1] == 0:
        raise ValueError(f"k's pages must hold at least one token, got page_size 0 (k {tuple(k.shape)})")
    batch = page_table.shape[0]
    if seqused_k.shape[0] != batch:
        raise ValueError(f"seqused_k has {seqused_k.shape[0]} entries for a page_table of batch {batch}")
    if cu_seqlens_q is None and q.shape[0] != batch:
        raise ValueError(f"q has batch {q.shape[0]} for a page_table of batch {batch}")
    if cu_seqlens_q is not None and cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries for a page_table of batch {batch}")
    check_page_table(page_table, seqused_k, k.shape[1], k.shape[0])


def _check_inputs(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, page_table, seqused_k, backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if softmax_scale is not None:
        check_real("softmax_scale", softmax_scale, positive=True)
    check_tensor("q", q, ndim=3 if cu_seqlens_q is not None else 4, dtype=TF.DTYPES)
    check_tensor("k", k)
    check_tensor("v", v)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("page_table", page_table),
                    ("seqused_k", seqused_k)):
        if t is not None:
            check_tensor(name, t)
    _check_kv(q, k, v)
    check_same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, page_table=page_table,
                      seqused_k=seqused_k)
    if cu_seqlens_q is not None:
        check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    if page_table is not None:
        _check_paged(q, k, page_table, seqused_k, cu_seqlens_q, cu_seqlens_k)
        return
    if seqused_k is not None:
        raise ValueError("seqused_k is only read with page_table")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    check_tensor("k", k, ndim=3 if cu_seqlens_k is not None else 4)
    if cu_seqlens_k is not None:
        check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
        if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
            raise ValueError("cu_seqlens_q and cu_seqlens_k must describe the same number of sequences")
    elif q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must share batch, got {q.shape[0]} and {k.shape[0]}")


def flash_attention(q, k, v, *, causal: bool, softmax_scale=None, cu_seqlens_q=None, cu_seqlens_k=None,
                    page_table=None, seqused_k=None, backend: str = "auto", rescale_threshold: float = 8.0,
                    poly_exp2_fraction: float = 0.0):
    """Softmax attention with GQA (query head h reads KV head h // (H / KV)); returns q's shape and dtype.

    q, k, v: (B, S, H, D) / (B, S_k, KV, D), or (total, H, D) / (total_k, KV, D) with cu_seqlens_q/_k (B+1,).
    With page_table (B, max_pages) and seqused_k (B,): k, v are paged pools (num_pages, page_size, KV, D) and
    sequence b reads its first seqused_k[b] keys; q is (B, S, H, D) or (total, H, D) with cu_seqlens_q.
    Causal masks align at the end (a chunk attends to its cached prefix and itself); rows with no key give 0.
    backend: "auto" (the router's choice, kernels.registry op "attention": the split-KV paged kernel for causal
    paged chunks where it pays, else the CuTe forward (bf16 d128/d256 on sm_90a), else the Triton forward, else
    the reference), or one of "split_kv", "cute", "triton", "reference" by name, which never falls back: a call it
    cannot run is a ValueError saying why.
    FA4 flags (both exact; the split-KV kernel takes rescale_threshold and uses the hardware exp2 only):
    rescale_threshold, the log2 growth of the running max that forces an O rescale (0: always);
    poly_exp2_fraction, the share of each tile's columns whose exp2 runs as an FMA polynomial (0: none).
    Inputs are checked on the host (cu_seqlens, seqused_k and the page table are read once), so this entry point is
    not meant for CUDA-graph capture.
    """
    _check_inputs(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, page_table, seqused_k, backend)
    TF.check_flags(rescale_threshold, poly_exp2_fraction)
    if q.numel() == 0:  # no query rows (no sequences, or none with a query): nothing to launch
        return torch.zeros_like(q)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    args = (q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, page_table, seqused_k, rescale_threshold,
            poly_exp2_fraction)
    key = routes.attention_call_key(*args)
    impl = registry.choose("attention", key, "triton") if backend == "auto" else registry.named("attention",
                                                                                             backend, key)
    return impl.run(*args, key)
