"""The reference attention (reference/attention.py): dense vs torch's SDPA, varlen == per sequence,
paged == dense for any page size and page order, write_kv_pages, fully masked rows, and argument checks."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_rel
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right

from reference import attention, paged_attention, write_kv_pages

TOL = 2e-5  # the reference computes in fp32; the oracle in fp64


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=dtype)


def lower_right_mask(sq, sk):
    """torch's own bottom-right causal mask (sq, sk), True = visible."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns that sq > sk gives rows with no key
        return causal_lower_right(sq, sk)._materialize()


def sdpa_oracle(q, k, v, causal, scale):
    """fp64 torch SDPA on (B, S, H, D) inputs, GQA by repeating KV heads; rows with no key give 0.
    Returns o (B, Sq, H, D) and lse (B, Sq, H)."""
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))  # (B, H, S, D)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    sq, sk = q.shape[2], k.shape[2]
    if not causal:
        mask = torch.ones(sq, sk, dtype=torch.bool)
        o = F.scaled_dot_product_attention(q, k, v, scale=scale)
    elif sq == sk:
        mask = torch.ones(sq, sk, dtype=torch.bool).tril()
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        mask = lower_right_mask(sq, sk)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    o = o.nan_to_num(0.0).masked_fill(~mask.any(-1)[:, None], 0.0)
    lse = torch.logsumexp((q @ k.transpose(-1, -2) * scale).masked_fill(~mask, -math.inf), dim=-1)
    return o.transpose(1, 2), lse.transpose(1, 2)


def check_lse(lse, ref, what):
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: lse finiteness differs"
    assert (lse[~finite] == -math.inf).all(), f"{what}: rows with no key must have lse -inf"
    if finite.any():
        err = (lse[finite].double() - ref[finite]).abs().max().item()
        assert err <= 1e-4, f"{what}: lse max abs error {err:.3e}"


seq = st.sampled_from([1, 2, 3, 16, 17, 64, 65])
gqa = st.sampled_from([1, 2, 4, 8])
head_dims = st.sampled_from([1, 16, 64, 128, 256])


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 2), sq=seq, sk=seq, kvh=st.integers(1, 2), ratio=gqa,
       d=head_dims, causal=st.booleans(), scale=st.sampled_from([None, 0.05, 1.0]), fp64=st.booleans())
def test_dense_matches_sdpa(seed, batch, sq, sk, kvh, ratio, d, causal, scale, fp64):
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if fp64 else torch.float32
    q, k, v = rand(gen, batch, sq, kvh * ratio, d, dtype=dtype), rand(gen, batch, sk, kvh, d, dtype=dtype), \
        rand(gen, batch, sk, kvh, d, dtype=dtype)
    o, lse = attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    ref, ref_lse = sdpa_oracle(q, k, v, causal, scale if scale is not None else d ** -0.5)
    assert o.dtype == dtype and lse.shape == (batch, sq, kvh * ratio)
    what = f"sq={sq} sk={sk} H={kvh * ratio}/{kvh} d={d} causal={causal}"
    if ref.count_nonzero() > 0:
        assert_rel(o, ref, TOL, what)
    masked_rows = ~torch.isfinite(ref_lse)
    assert (o[masked_rows] == 0).all(), f"{what}: rows with no key must be zero"
    check_lse(lse, ref_lse, what)


def test_bottom_right_alignment_by_hand():
    """With scale 0 each query averages the values it sees: with 2 queries over 4 keys, query 0 sees keys 0..2
    and query 1 keys 0..3. With 5 queries over 3 keys, queries 0, 1 see nothing (zeros), query i >= 2 sees 0..i-2."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = rand(gen, 1, 2, 2, 8), rand(gen, 1, 4, 1, 8), rand(gen, 1, 4, 1, 8)
    o = attention(q, k, v, causal=True, softmax_scale=0.0)
    torch.testing.assert_close(o[0, 0], v[0, :3, 0].mean(0).expand(2, 8))
    torch.testing.assert_close(o[0, 1], v[0, :4, 0].mean(0).expand(2, 8))
    q5 = rand(gen, 1, 5, 2, 8)
    o, lse = attention(q5, k[:, :3], v[:, :3], causal=True, softmax_scale=0.0, return_lse=True)
    assert not o.isnan().any() and not lse.isnan().any()
    assert (o[0, :2] == 0).all() and (lse[0, :2] == -math.inf).all()
    for i in range(2, 5):
        torch.testing.assert_close(o[0, i], v[0, :i - 1, 0].mean(0).expand(2, 8))
        torch.testing.assert_close(lse[0, i], torch.full((2,), math.log(i - 1)))
    # not causal: every query averages every key
    o = attention(q5, k, v, causal=False, softmax_scale=0.0)
    torch.testing.assert_close(o[0], v[0, :, 0].mean(0).expand(5, 2, 8))


def test_fully_masked_rows_are_zero_not_nan():
    gen = torch.Generator().manual_seed(1)
    q, k, v = rand(gen, 2, 7, 4, 16), rand(gen, 2, 3, 2, 16), rand(gen, 2, 3, 2, 16)
    o, lse = attention(q, k, v, causal=True, return_lse=True)
    assert torch.isfinite(o).all()
    assert (o[:, :4] == 0).all() and (lse[:, :4] == -math.inf).all()
    assert (o[:, 4:].abs().sum(-1) > 0).all() and torch.isfinite(lse[:, 4:]).all()
    # no keys at all, causal or not
    for causal in (True, False):
        o = attention(q, k[:, :0], v[:, :0], causal=causal)
        assert o.shape == q.shape and (o == 0).all()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1),
       lens=st.lists(st.tuples(st.sampled_from([0, 1, 2, 5, 17, 65]), st.sampled_from([0, 1, 2, 5, 17, 65])),
                     min_size=1, max_size=4),
       kvh=st.integers(1, 2), ratio=gqa, d=st.sampled_from([8, 64]), causal=st.booleans())
def test_varlen_equals_per_sequence(seed, lens, kvh, ratio, d, causal):
    gen = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + [a for a, _ in lens]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [b for _, b in lens]).cumsum(0)  # int64 is accepted too
    q = rand(gen, int(cu_q[-1]), kvh * ratio, d)
    k, v = rand(gen, int(cu_k[-1]), kvh, d), rand(gen, int(cu_k[-1]), kvh, d)
    o, lse = attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    assert o.shape == q.shape and lse.shape == q.shape[:2]
    for i, ((a, b), (c, e)) in enumerate(zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()),
                                             zip(cu_k[:-1].tolist(), cu_k[1:].tolist()))):
        ref, ref_lse = attention(q[None, a:b], k[None, c:e], v[None, c:e], causal=causal, return_lse=True)
        oracle, oracle_lse = sdpa_oracle(q[None, a:b], k[None, c:e], v[None, c:e], causal, d ** -0.5)
        what = f"sequence {i} of lens={lens} causal={causal}"
        torch.testing.assert_close(o[a:b], ref[0], rtol=1e-6, atol=1e-6, msg=what)
        torch.testing.assert_close(lse[a:b], ref_lse[0], rtol=1e-6, atol=1e-6, msg=what)
        if oracle.count_nonzero() > 0:
            assert_rel(o[a:b], oracle[0], TOL, what)
        check_lse(lse[a:b], oracle_lse[0], what)


# --- paged KV cache ----------------------------------------------------------------------------------------------

def build_pool(gen, ctx_lens, page_size, kvh, d, extra_pages, extra_cols):
    """A pool of pages full of NaN, each sequence given a random set of pages in random order, and a page table
    whose unused entries point at random (garbage) pages. Returns k_pages, v_pages, page_table, slots (per
    sequence: the flat slot of each of its tokens)."""
    need = [-(-n // page_size) for n in ctx_lens]
    num_pages = sum(need) + extra_pages
    perm = torch.randperm(num_pages, generator=gen)
    max_pages = max(need) + extra_cols
    table = torch.randint(0, num_pages, (len(ctx_lens), max(max_pages, 1)), generator=gen, dtype=torch.int32)
    start, slots = 0, []
    for b, n in enumerate(need):
        table[b, :n] = perm[start:start + n].to(torch.int32)
        start += n
        pos = torch.arange(ctx_lens[b])
        slots.append(table[b, pos // page_size].long() * page_size + pos % page_size)
    k_pages = torch.full((num_pages, page_size, kvh, d), math.nan)
    return k_pages, k_pages.clone(), table, slots


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), data=st.data(), batch=st.integers(1, 3), page_size=st.integers(1, 64),
       kvh=st.integers(1, 2), ratio=gqa, d=st.sampled_from([1, 16, 64, 128, 256]), varlen=st.booleans(),
       causal=st.booleans(), extra_pages=st.integers(0, 5), extra_cols=st.integers(0, 2))
def test_paged_equals_dense(seed, data, batch, page_size, kvh, ratio, d, varlen, causal, extra_pages, extra_cols):
    gen = torch.Generator().manual_seed(seed)
    ctx = data.draw(st.lists(st.integers(1, 150), min_size=batch, max_size=batch), label="context lengths")
    if varlen:
        qlens = [data.draw(st.integers(1, n), label="q_len") for n in ctx]
    else:
        qlens = [data.draw(st.integers(1, min(ctx)), label="q_len")] * batch
    k_pages, v_pages, table, slots = build_pool(gen, ctx, page_size, kvh, d, extra_pages, extra_cols)
    ks = [rand(gen, n, kvh, d) for n in ctx]
    vs = [rand(gen, n, kvh, d) for n in ctx]
    for b in range(batch):
        k_pages.view(-1, kvh, d)[slots[b]] = ks[b]
        v_pages.view(-1, kvh, d)[slots[b]] = vs[b]
    qs = [rand(gen, n, kvh * ratio, d) for n in qlens]
    seqused = torch.tensor(ctx, dtype=torch.int32)
    if varlen:
        cu_q = torch.tensor([0, *qlens]).cumsum(0).to(torch.int32)
        o, lse = paged_attention(torch.cat(qs), k_pages, v_pages, table, seqused, causal=causal, cu_seqlens_q=cu_q,
                                 return_lse=True)
        outs = [o[a:b] for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist())]
        lses = [lse[a:b] for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist())]
    else:
        o, lse = paged_attention(torch.stack(qs), k_pages, v_pages, table, seqused, causal=causal, return_lse=True)
        assert o.shape == (batch, qlens[0], kvh * ratio, d) and lse.shape == (batch, qlens[0], kvh * ratio)
        outs, lses = list(o), list(lse)
    for b in range(batch):
        ref, ref_lse = attention(qs[b][None], ks[b][None], vs[b][None], causal=causal, return_lse=True)
        what = f"seq {b}: ctx={ctx[b]} q_len={qlens[b]} page_size={page_size} causal={causal}"
        assert_rel(outs[b], ref[0], 1e-6, what)
        torch.testing.assert_close(lses[b], ref_lse[0], rtol=1e-6, atol=1e-6, msg=what)
    # and against torch's SDPA, for the first sequence
    oracle, _ = sdpa_oracle(qs[0][None], ks[0][None], vs[0][None], causal, d ** -0.5)
    assert_rel(outs[0], oracle[0], TOL, "paged vs SDPA")


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), data=st.data(), batch=st.integers(1, 3), page_size=st.integers(1, 64),
       kvh=st.integers(1, 2), ratio=gqa, d=st.sampled_from([8, 64]), slot_dtype=st.sampled_from([torch.int32,
                                                                                                  torch.int64]))
def test_write_kv_pages_then_paged_equals_dense(seed, data, batch, page_size, kvh, ratio, d, slot_dtype):
    """Write a cached prefix of each sequence, then a chunk of new tokens for all sequences in one flat call with
    padding tokens (slot -1) between them; paged attention of the chunk then equals dense attention."""
    gen = torch.Generator().manual_seed(seed)
    ctx = data.draw(st.lists(st.integers(1, 130), min_size=batch, max_size=batch), label="context lengths")
    new = [data.draw(st.integers(1, n), label="new tokens") for n in ctx]
    k_pages, v_pages, table, slots = build_pool(gen, ctx, page_size, kvh, d, 3, 1)
    ks = [rand(gen, n, kvh, d) for n in ctx]
    vs = [rand(gen, n, kvh, d) for n in ctx]
    for b in range(batch):  # the prefix, one sequence at a time
        p = ctx[b] - new[b]
        write_kv_pages(ks[b][:p], vs[b][:p], k_pages, v_pages, slots[b][:p].to(slot_dtype))
    flat_k, flat_v, flat_slots = [], [], []
    for b in range(batch):  # the chunk: one call, each sequence followed by a padding token
        p = ctx[b] - new[b]
        flat_k += [ks[b][p:], torch.full((1, kvh, d), 1e4)]
        flat_v += [vs[b][p:], torch.full((1, kvh, d), -1e4)]
        flat_slots += [slots[b][p:], torch.tensor([-1])]
    write_kv_pages(torch.cat(flat_k), torch.cat(flat_v), k_pages, v_pages, torch.cat(flat_slots).to(slot_dtype))
    # the pool holds exactly the written tokens, where the page table says
    written = ~k_pages.isnan().all(-1).all(-1)
    assert written.sum().item() == sum(ctx), "write_kv_pages wrote the wrong number of slots"
    for b in range(batch):
        pos = torch.arange(ctx[b])
        pages, offs = table[b, pos // page_size].long(), pos % page_size
        assert torch.equal(k_pages[pages, offs], ks[b]) and torch.equal(v_pages[pages, offs], vs[b])
    qs = [rand(gen, n, kvh * ratio, d) for n in new]
    cu_q = torch.tensor([0, *new]).cumsum(0).to(torch.int32)
    o = paged_attention(torch.cat(qs), k_pages, v_pages, table, torch.tensor(ctx, dtype=torch.int32),
                        cu_seqlens_q=cu_q)
    for b, (a, e) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist())):
        ref = attention(qs[b][None], ks[b][None], vs[b][None], causal=True)
        assert_rel(o[a:e], ref[0], 1e-6, f"seq {b}: ctx={ctx[b]} new={new[b]} page_size={page_size}")


def test_write_kv_pages_casts_to_the_pool_dtype():
    gen = torch.Generator().manual_seed(2)
    k, v = rand(gen, 5, 2, 8), rand(gen, 5, 2, 8)
    k_pages = torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16)
    v_pages = torch.zeros_like(k_pages)
    slots = torch.tensor([11, 0, -1, 5, 6])
    write_kv_pages(k, v, k_pages, v_pages, slots)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_pages[s // 4, s % 4], k[i].bfloat16()) and torch.equal(v_pages[s // 4, s % 4],
                                                                                         v[i].bfloat16())
    assert (k_pages != 0).any(-1).any(-1).sum() == 4


def test_paged_empty_context_gives_zeros():
    gen = torch.Generator().manual_seed(3)
    k_pages, v_pages = rand(gen, 4, 8, 1, 16), rand(gen, 4, 8, 1, 16)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    q = rand(gen, 2, 3, 2, 16)
    o, lse = paged_attention(q, k_pages, v_pages, table, torch.tensor([0, 5], dtype=torch.int32), return_lse=True)
    assert (o[0] == 0).all() and (lse[0] == -math.inf).all() and torch.isfinite(o).all()
    ref = attention(q[1:], k_pages[1, :5][None], v_pages[1, :5][None], causal=True)
    assert_rel(o[1:], ref, 1e-6, "second sequence")


# --- bad input -------------------------------------------------------------------------------------------------

def test_attention_bad_input_raises():
    gen = torch.Generator().manual_seed(4)
    q, k, v = rand(gen, 2, 5, 4, 16), rand(gen, 2, 7, 2, 16), rand(gen, 2, 7, 2, 16)
    attention(q, k, v, causal=True)
    cu_q, cu_k = torch.tensor([0, 4, 10]), torch.tensor([0, 7, 14])
    qf, kf, vf = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    attention(qf, kf, vf, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    cases = [
        ((q[0], k, v), {}, "q must have 4 dims"),
        ((q, k[0], v[0]), {}, "k must have 4 dims"),
        ((q, k, v[0]), {}, "v must have 4 dims"),
        ((q, k, v[:, :6]), {}, "k and v must have one shape"),
        ((q, k[..., :8], v[..., :8]), {}, "share head_dim"),
        ((q[:, :, :3], k, v), {}, "multiple of kv heads"),
        ((q[:1], k, v), {}, "share batch"),
        ((q, kf, vf), dict(cu_seqlens_k=cu_k), "must be given together"),
        ((qf, kf, vf), dict(cu_seqlens_q=cu_q), "k must have 4 dims"),
        ((qf, kf, vf), dict(cu_seqlens_q=cu_q, cu_seqlens_k=torch.tensor([0, 14])), "same number of sequences"),
        ((qf, kf, vf), dict(cu_seqlens_q=torch.tensor([0, 4, 9]), cu_seqlens_k=cu_k), "cu_seqlens_q must rise"),
        ((qf, kf, vf), dict(cu_seqlens_q=cu_q, cu_seqlens_k=torch.tensor([1, 7, 14])), "cu_seqlens_k must rise"),
        ((qf, kf, vf), dict(cu_seqlens_q=torch.tensor([0, 6, 4, 10]), cu_seqlens_k=torch.tensor([0, 1, 2, 14])),
         "cu_seqlens_q must rise"),
        ((qf, kf, vf), dict(cu_seqlens_q=cu_q.float(), cu_seqlens_k=cu_k), "cu_seqlens_q must have dtype"),
        ((qf, kf, vf), dict(cu_seqlens_q=cu_q[None], cu_seqlens_k=cu_k), "cu_seqlens_q must have 1 dims"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            attention(*args, causal=True, **kw)
    with pytest.raises(ValueError, match="q must be a torch.Tensor"):
        attention(q.numpy(), k, v, causal=True)


def test_paged_attention_bad_input_raises():
    gen = torch.Generator().manual_seed(5)
    k_pages, v_pages = rand(gen, 6, 4, 2, 16), rand(gen, 6, 4, 2, 16)
    table = torch.tensor([[0, 3, 5], [1, 2, 4]], dtype=torch.int32)
    used = torch.tensor([12, 5], dtype=torch.int32)  # capacity is 3 pages * 4 = 12 tokens
    q = rand(gen, 2, 3, 4, 16)
    paged_attention(q, k_pages, v_pages, table, used)
    cu_q = torch.tensor([0, 2, 6], dtype=torch.int32)
    paged_attention(q.flatten(0, 1), k_pages, v_pages, table, used, cu_seqlens_q=cu_q)
    cases = [
        ((q, k_pages, v_pages, table, torch.tensor([13, 5], dtype=torch.int32)), {}, "exceeds the page_table"),
        ((q, k_pages, v_pages, table, torch.tensor([3, -1], dtype=torch.int32)), {}, "exceeds the page_table"),
        ((q, k_pages, v_pages, table, used[:1]), {}, "seqused_k has 1 entries"),
        ((q, k_pages, v_pages, table, used.float()), {}, "seqused_k must have dtype"),
        ((q, k_pages, v_pages, table[0], used), {}, "page_table must have 2 dims"),
        ((q, k_pages, v_pages, table.float(), used), {}, "page_table must have dtype"),
        ((q, k_pages[0], v_pages, table, used), {}, "k_pages must have 4 dims"),
        ((q, k_pages, v_pages[0], table, used), {}, "v_pages must have 4 dims"),
        ((q[:1], k_pages, v_pages, table, used), {}, "q has batch 1"),
        ((q.flatten(0, 1), k_pages, v_pages, table, used), {}, "q must have 4 dims"),
        ((q.flatten(0, 1), k_pages, v_pages, table, used), dict(cu_seqlens_q=cu_q[:2]), "cu_seqlens_q has 2 entries"),
        ((q, k_pages, v_pages, table, used), dict(cu_seqlens_q=cu_q), "q must have 3 dims"),
        ((q[..., :8], k_pages, v_pages, table, used), {}, "share head_dim"),
        ((q.flatten(0, 1), k_pages, v_pages, table, used), dict(cu_seqlens_q=torch.tensor([0, 2, 5])),
         "cu_seqlens_q must rise"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            paged_attention(*args, **kw)


def test_write_kv_pages_bad_input_raises():
    gen = torch.Generator().manual_seed(6)
    k, v = rand(gen, 5, 2, 8), rand(gen, 5, 2, 8)
    k_pages, v_pages = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping has 4 entries for 5 tokens"):
        write_kv_pages(k, v, k_pages, v_pages, torch.arange(4))
    with pytest.raises(ValueError, match="slot_mapping must have 1 dims"):
        write_kv_pages(k, v, k_pages, v_pages, torch.arange(5)[None])
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        write_kv_pages(k, v, k_pages, v_pages, torch.arange(5).float())
    assert (k_pages == 0).all(), "a rejected write must not touch the pool"
