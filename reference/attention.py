"""Reference attention: dense, varlen (cu_seqlens) and over a paged KV cache.

Shapes: q (batch, seqlen_q, heads, dim) or (total_q, heads, dim) with cu_seqlens_q;
k, v (batch, seqlen_k, kv_heads, dim) or (total_k, kv_heads, dim) with cu_seqlens_k.
GQA: query head h reads KV head h // (heads // kv_heads).
Causal masks are aligned at the end: with q_len new queries over k_len keys, query i sees keys
j <= i + k_len - q_len (so a chunk appended to a cached prefix sees the prefix and itself).
Rows that see no key return zeros. Everything is computed in fp32 and returned in q's dtype.
"""
import math

import torch

from reference.checks import check_cu_seqlens, check_page_table, check_same_device, check_tensor


def _attend_one(q, k, v, causal: bool, scale: float):
    # q: (Sq, H, D), k/v: (Sk, KV, D) -> o: (Sq, H, D) fp32, lse: (Sq, H) fp32
    sq, h, _ = q.shape
    sk, kvh, _ = k.shape
    group = h // kvh
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # (H, Sq, Sk)
    if causal:
        visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)  # (Sq, Sk)
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (H, Sq)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # rows with no key give 0
    o = torch.einsum("hqk,khd->qhd", probs, v)
    return o, lse.transpose(0, 1)


def _check_heads(q, k, v):
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    if q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(f"q heads ({q.shape[-2]}) must be a multiple of kv heads ({k.shape[-2]})")


def attention(q, k, v, *, causal: bool, softmax_scale=None, cu_seqlens_q=None, cu_seqlens_k=None,
              return_lse: bool = False):
    """Softmax attention with GQA; varlen when cu_seqlens_q/cu_seqlens_k are given (then q, k, v are 3-D)."""
    check_tensor("q", q, ndim=3 if cu_seqlens_q is not None else 4)
    check_tensor("k", k, ndim=3 if cu_seqlens_k is not None else 4)
    check_tensor("v", v, ndim=k.ndim)
    check_same_device(q=q, k=k, v=v)
    _check_heads(q, k, v)
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if cu_seqlens_q is None:
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"q and k must share batch, got {q.shape[0]} and {k.shape[0]}")
        if q.shape[0] == 0:  # no sequences
            return _empty(q, return_lse)
        parts = [_attend_one(q[b], k[b], v[b], causal, scale) for b in range(q.shape[0])]
        o = torch.stack([p[0] for p in parts])
        lse = torch.stack([p[1] for p in parts])
    else:
        check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
        check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError("cu_seqlens_q and cu_seqlens_k must describe the same number of sequences")
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        parts = [_attend_one(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], causal, scale)
                 for i in range(len(cq) - 1)]
        o = torch.cat([p[0] for p in parts])
        lse = torch.cat([p[1] for p in parts])
    o = o.to(q.dtype)
    return (o, lse) if return_lse else o


def _empty(q, return_lse: bool):
    # a batch of no sequences: q's (0, ...) shape, and lse (0, Sq, H)
    o = q.new_zeros(q.shape)
    return (o, q.new_zeros(q.shape[:-1], dtype=torch.float32)) if return_lse else o


def gather_pages(pages, page_table_row, length: int):
    """pages: (num_pages, page_size, kv_heads, dim); page_table_row: (max_pages,) -> (length, kv_heads, dim)."""
    page_size = pages.shape[1]
    n = (length + page_size - 1) // page_size
    return pages[page_table_row[:n].long()].flatten(0, 1)[:length]


def paged_attention(q, k_pages, v_pages, page_table, seqused_k, *, causal: bool = True, softmax_scale=None,
                    cu_seqlens_q=None, return_lse: bool = False):
    """Attention of q over each sequence's first seqused_k[b] cached tokens, read through its page table.

    q: (batch, seqlen_q, heads, dim) or (total_q, heads, dim) with cu_seqlens_q;
    k_pages, v_pages: (num_pages, page_size, kv_heads, dim); page_table: (batch, max_pages) int32;
    seqused_k: (batch,) int32, the cached tokens of each sequence, including the new ones.
    """
    check_tensor("k_pages", k_pages, ndim=4)
    check_tensor("v_pages", v_pages, ndim=4)
    check_tensor("page_table", page_table, ndim=2, dtype=(torch.int32, torch.int64))
    check_tensor("seqused_k", seqused_k, ndim=1, dtype=(torch.int32, torch.int64))
    check_same_device(q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table, seqused_k=seqused_k)
    batch = page_table.shape[0]
    if seqused_k.shape[0] != batch:
        raise ValueError(f"seqused_k has {seqused_k.shape[0]} entries for a page_table of batch {batch}")
    if cu_seqlens_q is None and batch == 0:
        check_tensor("q", q, ndim=4)
        if q.shape[0] != 0:
            raise ValueError(f"q has batch {q.shape[0]} for a page_table of batch 0")
        return _empty(q, return_lse)
    lens = check_page_table(page_table, seqused_k, k_pages.shape[1], k_pages.shape[0])
    ks = [gather_pages(k_pages, page_table[b], lens[b]) for b in range(batch)]
    vs = [gather_pages(v_pages, page_table[b], lens[b]) for b in range(batch)]
    cu_k = torch.tensor([0] + lens, device=q.device).cumsum(0).to(torch.int32)
    if cu_seqlens_q is None:
        check_tensor("q", q, ndim=4)
        if q.shape[0] != batch:
            raise ValueError(f"q has batch {q.shape[0]} for a page_table of batch {batch}")
        sq = q.shape[1]
        cu_q = torch.arange(0, (batch + 1) * sq, sq, device=q.device, dtype=torch.int32)
        out = attention(q.flatten(0, 1), torch.cat(ks), torch.cat(vs), causal=causal, softmax_scale=softmax_scale,
                        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=return_lse)
        if return_lse:
            return out[0].unflatten(0, (batch, sq)), out[1].unflatten(0, (batch, sq))
        return out.unflatten(0, (batch, sq))
    if cu_seqlens_q.numel() != batch + 1:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel()} entries for a page_table of batch {batch}")
    return attention(q, torch.cat(ks), torch.cat(vs), causal=causal, softmax_scale=softmax_scale,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_k, return_lse=return_lse)


def write_kv_pages(k, v, k_pages, v_pages, slot_mapping):
    """Write new tokens into the paged cache in place. k, v: (tokens, kv_heads, dim);
    slot_mapping: (tokens,) int, the flat slot page * page_size + offset of each token (negative: skip)."""
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtype=(torch.int32, torch.int64))
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens")
    if k.shape != v.shape or k.shape[1:] != k_pages.shape[2:]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not fit pages {tuple(k_pages.shape)}")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() and int(slots.max()) >= k_pages.shape[0] * k_pages.shape[1]:
        raise ValueError(f"slot_mapping reaches slot {int(slots.max())} of a pool of "
                         f"{k_pages.shape[0] * k_pages.shape[1]} slots")
    k_pages.view(-1, *k_pages.shape[2:])[slots] = k[keep].to(k_pages.dtype)
    v_pages.view(-1, *v_pages.shape[2:])[slots] = v[keep].to(v_pages.dtype)
