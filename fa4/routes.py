"""fa4's entries in the router (kernels.registry): its forwards for long paged chunks of the model's
paged_attention op, and the op `attention` behind `fa4.flash_attention` (dense, varlen and paged prefill).

Costs rank the implementations that support a call: the split-KV kernel (0, where it pays: short chunks, and long
ones that would leave a forward's SMs idle), the CuTe forward (1: the faster one on sm_90), the Triton forward (2),
the reference last.
"""
from typing import NamedTuple

import torch

import reference as R
from fa4 import triton_forward as TF
from fa4.cute import entry as CE
from kernels import paged_decode_attention as PD
from kernels import registry
from kernels.registry import DeviceInfo, Impl, device_info


def _triton_forward_unsupported(head_dim: int, dtype: torch.dtype, device: DeviceInfo) -> str | None:
    if head_dim not in TF.HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {TF.HEAD_DIMS}"
    if device.type != "cuda" and not device.interpret:
        return f"tensors are on {device.type}, not CUDA (and TRITON_INTERPRET=1 is not set)"
    if device.interpret and dtype == torch.bfloat16:
        return "triton 3.6's interpreter computes bf16 tl.dot wrongly; use fp16/fp32 on the CPU"
    return None


# ---- the model's paged_attention: the forwards for long chunks ---------------------------------------------

def _gated(o, gate):
    return o if gate is None else R.sigmoid_gate_mul(o, gate)


def paged_cute_forward(q, k_pages, v_pages, step, scale, gate):
    # one CTA per (query head group, 128-row tile) over the paged prefix, then the output gate
    o = CE.cute_attention(q, k_pages, v_pages, causal=True, softmax_scale=scale, max_seqlen_q=step.max_seqlen_q,
                          cu_seqlens_q=step.cu_seqlens, page_table=step.page_table, seqused_k=step.seqused_k)
    return _gated(o, gate)


def paged_triton_forward(q, k_pages, v_pages, step, scale, gate):
    o = TF.triton_forward(q, k_pages, v_pages, causal=True, scale=scale, max_seqlen_q=step.max_seqlen_q,
                          cu_seqlens_q=step.cu_seqlens, page_table=step.page_table, seqused_k=step.seqused_k)
    return _gated(o, gate)


def _paged_cute(key, tuning):
    return CE.key_unsupported(key.dtype, key.head_dim, key.page_size, key.device)


def _paged_triton(key, tuning):
    return _triton_forward_unsupported(key.head_dim, key.dtype, key.device)


# ---- fa4.flash_attention -----------------------------------------------------------------------------------

_ATTENTION_FIELDS = [("layout", str), ("causal", bool), *PD.PagedKey.__annotations__.items(), ("strided", str)]


class AttentionKey(NamedTuple("AttentionKey", _ATTENTION_FIELDS)):
    """What routes a flash_attention call: its layout ("dense", "varlen", "paged"), causal, the paged key's fields
    (kernels.paged_decode_attention.PagedKey: the batch, the longest query chunk (paged only), heads, head dim, page
    size (0 unpaged), the pages' capacity, dtype, device), and the first tensor without a unit last stride ("" when
    none)."""
    __slots__ = ()

    def paged(self) -> PD.PagedKey:
        """The model op's key of the same call: paged_attention's router decides split-KV against the forwards."""
        shape = PD.PagedKey(*self[2:-1])
        return shape if shape.q_len > PD.ALWAYS_Q_LEN else shape._replace(seqlen_k=0)


def attention_key(q, k, v, causal, cu_seqlens_q, cu_seqlens_k, page_table, seqused_k) -> AttentionKey:
    """The key of a checked flash_attention call (reads cu_seqlens_q on the host for a paged varlen call)."""
    tensors = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, page_table=page_table,
                   seqused_k=seqused_k)
    unit = next((name for name, t in tensors.items() if t is not None and t.stride(-1) != 1), "")
    heads, head_dim, kv_heads = q.shape[-2], q.shape[-1], k.shape[-2]
    if page_table is None:
        layout = "dense" if cu_seqlens_q is None else "varlen"
        batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
        return AttentionKey(layout, causal, batch, 0, heads, kv_heads, head_dim, 0, 0, q.dtype,
                            device_info(q.device), unit)
    if cu_seqlens_q is not None:
        q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    else:
        q_len = q.shape[1]
    return AttentionKey("paged", causal, page_table.shape[0], q_len, heads, kv_heads, head_dim, k.shape[1],
                        page_table.shape[1] * k.shape[1], q.dtype, device_info(q.device), unit)


def _attention_split_kv(key, tuning):
    if key.layout != "paged" or not key.causal:
        return "the split-KV kernel takes causal paged calls only"
    reason = _attention_triton(key, tuning)
    if reason is not None:
        return reason
    split = next(i for i in registry.impls("paged_attention", "triton") if i.name == "split_kv")
    reason = split.supports(key.paged(), tuning)
    if reason is not None:
        return reason
    if registry.choose("paged_attention", key.paged(), "triton", tuning) is not split:
        return f"max q_len {key.q_len} fills the GPU without KV splits (the forward is faster there)"
    return None


def _attention_cute(key, tuning):
    return CE.key_unsupported(key.dtype, key.head_dim, key.page_size if key.layout == "paged" else None, key.device)


def _attention_triton(key, tuning):
    if key.strided:
        return f"{key.strided} must be contiguous along its last dim"
    return _triton_forward_unsupported(key.head_dim, key.dtype, key.device)


def _int32(t):
    return t if t is None or t.dtype == torch.int32 else t.int()


# the attention op's implementations: (q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, page_table, seqused_k,
# rescale_threshold, poly_exp2_fraction, key), checked by fa4.interface

def run_split_kv(q, k, v, causal, scale, cu_q, cu_k, page_table, seqused_k, rescale_threshold, poly, key):
    # flash_attention checked every argument and read the metadata once: the kernel launches without checks
    return PD.launch(q, k, v, _int32(page_table).contiguous(), _int32(seqused_k).contiguous(), scale,
                     None if cu_q is None else _int32(cu_q).contiguous(), key.num_seqs, key.q_len, None, None, None,
                     None, None, None, rescale_threshold, True)


def run_cute(q, k, v, causal, scale, cu_q, cu_k, page_table, seqused_k, rescale_threshold, poly, key):
    return CE.cute_attention(q, k, v, causal=causal, softmax_scale=scale, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             page_table=page_table, seqused_k=seqused_k, rescale_threshold=rescale_threshold,
                             poly_exp2_fraction=poly)


def run_triton(q, k, v, causal, scale, cu_q, cu_k, page_table, seqused_k, rescale_threshold, poly, key):
    if cu_q is not None:
        q3, max_seqlen_q = q, int((cu_q[1:] - cu_q[:-1]).max())
    else:
        q3, max_seqlen_q = q.reshape(-1, *q.shape[2:]), q.shape[1]  # (B * S, H, D)
    k3, v3, seqlen_k = k, v, 0
    if page_table is None and cu_k is None:
        k3, v3, seqlen_k = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]), k.shape[1]  # (B * S_k, KV, D)
    o = TF.triton_forward(q3, k3, v3, causal=causal, scale=scale, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                          max_seqlen_q=max_seqlen_q, seqlen_k=seqlen_k, page_table=page_table, seqused_k=seqused_k,
                          rescale_threshold=rescale_threshold, poly_exp2_fraction=poly)
    return o.view(q.shape)


def run_reference(q, k, v, causal, scale, cu_q, cu_k, page_table, seqused_k, rescale_threshold, poly, key):
    if page_table is not None:
        return R.paged_attention(q, k, v, page_table, seqused_k, causal=causal, softmax_scale=scale, cu_seqlens_q=cu_q)
    return R.attention(q, k, v, causal=causal, softmax_scale=scale, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def attention_call_key(q, k, v, causal, scale, cu_q, cu_k, page_table, seqused_k, *flags) -> AttentionKey:
    return attention_key(q, k, v, causal, cu_q, cu_k, page_table, seqused_k)


def register_all() -> None:
    registry.register("paged_attention", Impl("cute_forward", "triton", paged_cute_forward, _paged_cute, 1.0))
    registry.register("paged_attention", Impl("triton_forward", "triton", paged_triton_forward, _paged_triton, 2.0))
    registry.define("attention", attention_call_key)
    registry.register("attention", Impl("split_kv", "triton", run_split_kv, _attention_split_kv, 0.0))
    registry.register("attention", Impl("cute", "triton", run_cute, _attention_cute, 1.0))
    registry.register("attention", Impl("triton", "triton", run_triton, _attention_triton, 2.0))
    registry.register("attention", Impl("reference", "reference", run_reference))


register_all()
