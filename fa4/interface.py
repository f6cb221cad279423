"""`flash_attention`: one entry point for prefill attention, dense, varlen or over a paged KV prefix.

Backends: "triton" (fa4/triton_forward.py), "reference" (reference.attention / reference.paged_attention),
"cute" (fa4/cute: the CuTe-DSL kernel for sm_90a; bf16, d128/d256, dense, varlen or paged with page sizes whose
gcd with the K tile is a multiple of 16; anything else is a ValueError) and
"auto". "auto" sends causal chunks of at most 512 tokens per sequence
over a paged prefix (decode steps, agent turns) to the split-KV kernel of kernels/paged_decode_attention.py
(see `split_kv_unsupported`), takes cute wherever it runs the call (`fa4.cute.entry.cute_unsupported`: the
faster forward on the H200), then triton wherever it supports the call (see `triton_unsupported`), and the
reference otherwise. A backend asked for by name never falls back: an
unsupported call raises ValueError saying why. Inputs are checked on the host (cu_seqlens, seqused_k and the
page table are read once), so this entry point is not meant for CUDA-graph capture.
"""
import math

import torch

import reference as R
from fa4 import triton_forward as TF
from fa4.cute import entry as CE
from kernels import paged_decode_attention as PD
from reference._checks import check_cu_seqlens, check_page_table, check_real, check_same_device, check_tensor

BACKENDS = ("auto", "triton", "reference", "cute")
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


def triton_unsupported(q, k, v, **index_tensors) -> str | None:
    """Why the triton backend cannot run this (checked) call, or None when it can.
    index_tensors: cu_seqlens_q/_k, page_table, seqused_k (None when absent)."""
    if q.shape[-1] not in TF.HEAD_DIMS:
        return f"head_dim {q.shape[-1]} is not one of {TF.HEAD_DIMS}"
    if q.device.type != "cuda" and not TF.INTERPRET:
        return f"tensors are on {q.device}, not CUDA (and TRITON_INTERPRET=1 is not set)"
    if TF.INTERPRET and q.dtype == torch.bfloat16:
        return "triton 3.6's interpreter computes bf16 tl.dot wrongly; use fp16/fp32 on the CPU"
    for name, t in (("q", q), ("k", k), ("v", v), *index_tensors.items()):
        if t is not None and t.stride(-1) != 1:
            return f"{name} must be contiguous along its last dim, got strides {t.stride()}"
    return None


def _int32(t):
    return t if t is None or t.dtype == torch.int32 else t.int()


def _max_seqlen_q(q, cu_seqlens_q) -> int:
    if cu_seqlens_q is not None:
        return int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    return q.shape[1]


def split_kv_unsupported(q, k, causal, max_seqlen_q, page_table, triton_reason) -> str | None:
    """Why auto does not send this (checked) call to the split-KV paged kernel, or None when it does."""
    if page_table is None:
        return "no page_table"
    if not causal:
        return "not causal"
    if q.shape[-1] not in PD.HEAD_DIMS:
        return f"head_dim {q.shape[-1]} is not one of {PD.HEAD_DIMS}"
    if not 1 <= max_seqlen_q <= PD.MAX_Q_LEN:
        return f"max q_len {max_seqlen_q} is not in 1..{PD.MAX_Q_LEN}"
    kv_heads, page_size = k.shape[2], k.shape[1]
    if not PD.split_kv_pays(page_table.shape[0], max_seqlen_q, q.shape[-2] // kv_heads, kv_heads, q.shape[-1],
                            q.element_size(), page_table.shape[1] * page_size, PD._num_sms(q.device),
                            PD.forward_fill(q, k, page_table, max_seqlen_q)):
        return f"max q_len {max_seqlen_q} fills the GPU without KV splits (the forward is faster there)"
    return triton_reason  # device, the interpreter's bf16 and strides: the same limits as the triton forward


def flash_attention(q, k, v, *, causal: bool, softmax_scale=None, cu_seqlens_q=None, cu_seqlens_k=None,
                    page_table=None, seqused_k=None, backend: str = "auto", rescale_threshold: float = 8.0,
                    poly_exp2_fraction: float = 0.0):
    """Softmax attention with GQA (query head h reads KV head h // (H / KV)); returns q's shape and dtype.

    q, k, v: (B, S, H, D) / (B, S_k, KV, D), or (total, H, D) / (total_k, KV, D) with cu_seqlens_q/_k (B+1,).
    With page_table (B, max_pages) and seqused_k (B,): k, v are paged pools (num_pages, page_size, KV, D) and
    sequence b reads its first seqused_k[b] keys; q is (B, S, H, D) or (total, H, D) with cu_seqlens_q.
    Causal masks align at the end (a chunk attends to its cached prefix and itself); rows with no key give 0.
    backend: "triton", "reference", "auto" (the split-KV paged kernel when `split_kv_unsupported` is None, else
    cute when `fa4.cute.entry.cute_unsupported` is None, else triton when `triton_unsupported` is None, else
    reference) or "cute" (bf16 d128/d256 on sm_90a: 0.91-0.98x flash-attn-4 on the H200 against triton's
    0.62-0.75x, so auto takes it wherever it runs).
    FA4 flags (both exact; the split-KV kernel takes rescale_threshold and uses the hardware exp2 only):
    rescale_threshold, the log2 growth of the running max that forces an O rescale (0: always);
    poly_exp2_fraction, the share of each tile's columns whose exp2 runs as an FMA polynomial (0: none).
    """
    _check_inputs(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, page_table, seqused_k, backend)
    TF.check_flags(rescale_threshold, poly_exp2_fraction)
    if q.numel() == 0:  # no query rows (no sequences, or none with a query): nothing to launch
        return torch.zeros_like(q)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    reason = triton_unsupported(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, page_table=page_table,
                                seqused_k=seqused_k)
    if backend == "auto" and page_table is not None:
        max_seqlen_q = _max_seqlen_q(q, cu_seqlens_q)
        if split_kv_unsupported(q, k, causal, max_seqlen_q, page_table, reason) is None:
            return PD.paged_decode_attention(q, k, v, _int32(page_table), _int32(seqused_k), softmax_scale=scale,
                                             cu_seqlens_q=_int32(cu_seqlens_q),
                                             max_seqlen_q=max_seqlen_q if cu_seqlens_q is not None else None,
                                             rescale_threshold=rescale_threshold, check_metadata=False)
    if backend in ("auto", "cute"):  # fa4/cute: bf16, d128/d256, sm_90a; asked for by name, it never falls back
        why = CE.cute_unsupported(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                  page_table=page_table, seqused_k=seqused_k)
        if why is None:
            return CE.cute_attention(q, k, v, causal=causal, softmax_scale=scale, cu_seqlens_q=cu_seqlens_q,
                                     cu_seqlens_k=cu_seqlens_k, page_table=page_table, seqused_k=seqused_k,
                                     rescale_threshold=rescale_threshold, poly_exp2_fraction=poly_exp2_fraction)
        if backend == "cute":
            raise ValueError(f"backend 'cute' cannot run this call: {why}")
    if backend == "auto":
        backend = "reference" if reason else "triton"
    if backend == "reference":
        if page_table is not None:
            return R.paged_attention(q, k, v, page_table, seqused_k, causal=causal, softmax_scale=scale,
                                     cu_seqlens_q=cu_seqlens_q)
        return R.attention(q, k, v, causal=causal, softmax_scale=scale, cu_seqlens_q=cu_seqlens_q,
                           cu_seqlens_k=cu_seqlens_k)
    if reason is not None:
        raise ValueError(f"backend 'triton' cannot run this call: {reason}")
    if cu_seqlens_q is not None:
        q3, max_seqlen_q = q, int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    else:
        q3, max_seqlen_q = q.reshape(-1, *q.shape[2:]), q.shape[1]  # (B * S, H, D)
    k3, v3, seqlen_k = k, v, 0
    if page_table is None and cu_seqlens_k is None:
        k3, v3, seqlen_k = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]), k.shape[1]  # (B * S_k, KV, D)
    o = TF.triton_forward(q3, k3, v3, causal=causal, scale=scale, cu_seqlens_q=cu_seqlens_q,
                          cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, seqlen_k=seqlen_k,
                          page_table=page_table, seqused_k=seqused_k, rescale_threshold=rescale_threshold,
                          poly_exp2_fraction=poly_exp2_fraction)
    return o.view(q.shape)
