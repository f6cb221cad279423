"""The reference gated delta rule (reference/gated_delta.py): chunked == recurrent, varlen == per sequence,
state carry, closed forms, transformers' torch implementations, a verify step's per-token states (and conv windows), and
argument checks."""
import math

import pytest
import torch
from conftest import assert_rel, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import (
    causal_conv1d,
    causal_conv1d_windows,
    chunk_gated_delta_rule,
    gdn_gates,
    l2norm,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_states,
)

F64_TOL = 1e-10  # chunked vs recurrent, both in fp64
F32_TOL = 1e-4  # the same in fp32
LENGTHS = [1, 2, 3, 15, 16, 17, 63, 64, 65, 130]


def make_inputs(seed, lead, hk, hv, dk, dv, dtype=torch.float64, n_states=None):
    """Random q, k, v, realistic log-decays g (<= 0, through gdn_gates) and beta in (0, 1); lead is (B, T) or
    (total,). Returns the five tensors and a random initial state for n_states sequences (None: no state)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, hk, dk, generator=gen, dtype=dtype)
    k = torch.randn(*lead, hk, dk, generator=gen, dtype=dtype)
    v = torch.randn(*lead, hv, dv, generator=gen, dtype=dtype)
    a = torch.randn(*lead, hv, generator=gen)
    b = torch.randn(*lead, hv, generator=gen)
    a_log = torch.log(torch.rand(hv, generator=gen) * 2.0 + 0.01)
    dt_bias = torch.randn(hv, generator=gen)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    state = None if n_states is None else torch.randn(n_states, hv, dk, dv, generator=gen, dtype=dtype)
    return q, k, v, g.to(dtype), beta.to(dtype), state


heads = st.sampled_from([(1, 1), (2, 2), (1, 2), (2, 4), (1, 4), (3, 6)])  # (Hk, Hv): ratios 1, 2, 4
dims = st.sampled_from([1, 2, 8, 16])
chunks = st.sampled_from([1, 4, 16, 64])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 2), t=st.sampled_from(LENGTHS), chunk=chunks,
       hkv=heads, dk=dims, dv=dims, with_state=st.booleans(), fp64=st.booleans())
def test_chunked_equals_recurrent_batched(seed, batch, t, chunk, hkv, dk, dv, with_state, fp64):
    dtype, tol = (torch.float64, F64_TOL) if fp64 else (torch.float32, F32_TOL)
    q, k, v, g, beta, s0 = make_inputs(seed, (batch, t), *hkv, dk, dv, dtype, batch if with_state else None)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    assert o.dtype == v.dtype and o.shape == v.shape
    assert s.shape == (batch, hkv[1], dk, dv) and s.dtype == dtype
    assert_rel(o, o_ref, tol, f"output T={t} chunk={chunk} {dtype}")
    assert_rel(s, s_ref, tol, f"final state T={t} chunk={chunk} {dtype}")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lens=st.lists(st.integers(0, 70), min_size=1, max_size=4),
       chunk=chunks, hkv=heads, dk=dims, dv=dims, with_state=st.booleans())
def test_varlen_equals_each_sequence_alone(seed, lens, chunk, hkv, dk, dv, with_state):
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    q, k, v, g, beta, s0 = make_inputs(seed, (int(cu[-1]),), *hkv, dk, dv, torch.float64,
                                       len(lens) if with_state else None)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu, chunk_size=chunk)
    assert o_r.shape == v.shape and s_r.shape == (len(lens), hkv[1], dk, dv)
    assert_rel(o_c, o_r, F64_TOL, f"varlen chunked vs varlen recurrent, lens={lens}")
    assert_rel(s_c, s_r, F64_TOL, f"varlen chunked state vs recurrent state, lens={lens}")
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = [x[a:b][None] for x in (q, k, v, g, beta)]
        o1, s1 = recurrent_gated_delta_rule(*one, initial_state=None if s0 is None else s0[i:i + 1])
        if b > a:
            assert_rel(o_c[a:b], o1[0], F64_TOL, f"sequence {i} of lens={lens}")
        assert_rel(s_c[i], s1[0], F64_TOL, f"state of sequence {i} of lens={lens}")
        if b == a:  # an empty sequence leaves its state as it was
            want = torch.zeros_like(s1[0]) if s0 is None else s0[i]
            assert torch.equal(s_c[i], want) and torch.equal(s_r[i], want)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(2, 100), data=st.data(), chunk=chunks, hkv=heads)
def test_state_carry_split_equals_one_call(seed, t, data, chunk, hkv):
    """Running [0, s) then [s, T) from the returned state equals running [0, T) in one call."""
    split = data.draw(st.integers(1, t - 1), label="split")
    q, k, v, g, beta, s0 = make_inputs(seed, (1, t), *hkv, 8, 4, torch.float64, 1)
    o_full, s_full = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    first = [x[:, :split] for x in (q, k, v, g, beta)]
    second = [x[:, split:] for x in (q, k, v, g, beta)]
    o1, s1 = chunk_gated_delta_rule(*first, initial_state=s0, chunk_size=chunk)
    o2, s2 = recurrent_gated_delta_rule(*second, initial_state=s1)
    assert_rel(torch.cat([o1, o2], dim=1), o_full, F64_TOL, f"split at {split} of {t}")
    assert_rel(s2, s_full, F64_TOL, f"final state, split at {split} of {t}")


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lens=st.lists(st.integers(0, 150), min_size=1, max_size=3),
       chunk=st.sampled_from([4, 16, 64]), segments=st.integers(1, 5), hkv=heads, dk=dims, dv=dims,
       with_state=st.booleans())
def test_segments_stitched_by_their_transitions_equal_the_recurrence(seed, lens, chunk, segments, hkv, dk, dv,
                                                                     with_state):
    """Context parallelism's oracle: sequences cut into segments of a multiple of the chunk (a last segment shorter,
    segments longer than a sequence), each run from zero and stitched by its transition matrix, equal the recurrence,
    over varlen batches with start states."""
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    q, k, v, g, beta, s0 = make_inputs(seed, (int(cu[-1]),), *hkv, dk, dv, torch.float64,
                                       len(lens) if with_state else None)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu, chunk_size=chunk,
                                  segment_size=segments * chunk)
    assert_rel(o, o_r, F64_TOL, f"segmented output, lens={lens}, segments of {segments * chunk}")
    assert_rel(s, s_r, F64_TOL, f"segmented final state, lens={lens}, segments of {segments * chunk}")


@pytest.mark.parametrize("segment_size", [0, 32, 96])
def test_segment_size_must_be_a_multiple_of_the_chunk(segment_size):
    q, k, v, g, beta, _ = make_inputs(0, (1, 8), 1, 1, 4, 4)
    with pytest.raises(ValueError, match="segment_size"):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, segment_size=segment_size)


def test_single_token_closed_form():
    """From state S0, one token gives S = a S0 + k (beta (v - a S0^T k))^T and o = S^T q / sqrt(dk) with unit q, k."""
    dk, dv, h = 5, 3, 2
    q, k, v, g, beta, s0 = make_inputs(7, (1, 1), h, h, dk, dv, torch.float64, 1)
    qn, kn = (x / x.norm(dim=-1, keepdim=True) for x in (q[0, 0], k[0, 0]))  # (H, dk)
    for state in (None, s0):
        S0 = torch.zeros(h, dk, dv, dtype=torch.float64) if state is None else state[0]
        a = torch.exp(g[0, 0])  # (H,)
        pred = torch.stack([a[i] * S0[i].T @ kn[i] for i in range(h)])  # (H, dv)
        S = torch.stack([a[i] * S0[i] + torch.outer(kn[i], beta[0, 0, i] * (v[0, 0, i] - pred[i])) for i in range(h)])
        o = torch.stack([S[i].T @ qn[i] for i in range(h)]) / math.sqrt(dk)
        for fn in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
            out, st_ = fn(q, k, v, g, beta, initial_state=state)
            # l2norm adds eps=1e-6 under the square root, hence the looser tolerance
            assert_rel(out[0, 0], o, 1e-6, f"{fn.__name__} output")
            assert_rel(st_[0], S, 1e-6, f"{fn.__name__} state")


def test_scale_and_no_l2norm():
    """Without the l2norm, q * c with scale s equals q with scale s * c; the default scale is dk ** -0.5."""
    q, k, v, g, beta, s0 = make_inputs(3, (2, 33), 2, 4, 8, 8, torch.float64, 2)
    k = l2norm(k)  # keep the delta rule stable without the in-kernel norm
    for fn in (recurrent_gated_delta_rule, lambda *a, **kw: chunk_gated_delta_rule(*a, chunk_size=16, **kw)):
        base, _ = fn(q, k, v, g, beta, initial_state=s0, scale=0.3, use_qk_l2norm=False)
        scaled, _ = fn(q * 2.5, k, v, g, beta, initial_state=s0, scale=0.12, use_qk_l2norm=False)
        assert_rel(scaled, base, 1e-12, "q * 2.5 with scale 0.12 vs q with scale 0.3")
        default, _ = fn(q, k, v, g, beta, initial_state=s0)
        explicit, _ = fn(q, k, v, g, beta, initial_state=s0, scale=8 ** -0.5)
        assert torch.equal(default, explicit)
        other, _ = fn(q, k, v, g, beta, initial_state=s0, scale=0.5)
        assert rel_err(other, default) > 1e-2, "scale has no effect"


def test_gqa_value_head_reads_key_head_j_div_group():
    """Value head j must use key head j // (Hv / Hk): same as repeating the key heads by hand."""
    q, k, v, g, beta, s0 = make_inputs(11, (1, 20), 2, 6, 4, 4, torch.float64, 1)
    ref, ref_s = recurrent_gated_delta_rule(q.repeat_interleave(3, 2), k.repeat_interleave(3, 2), v, g, beta,
                                            initial_state=s0)
    for fn in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        o, s = fn(q, k, v, g, beta, initial_state=s0)
        assert_rel(o, ref, 1e-14, f"{fn.__name__} GQA")
        assert_rel(s, ref_s, 1e-14, f"{fn.__name__} GQA state")
    wrong, _ = recurrent_gated_delta_rule(q.repeat(1, 1, 3, 1), k.repeat(1, 1, 3, 1), v, g, beta, initial_state=s0)
    assert rel_err(wrong, ref) > 1e-2, "the test cannot tell the head mappings apart"


def test_output_dtypes():
    """Outputs come back in v's dtype, the state in fp32 (fp64 for fp64 inputs)."""
    q, k, v, g, beta, _ = make_inputs(5, (1, 9), 1, 2, 8, 8, torch.float32)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta)
    o, s = chunk_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, chunk_size=4)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_rel(o, o_ref, 2e-2, "bf16 inputs vs fp32")


# --- transformers' torch implementations (the model's own oracle) -----------------------------------------------

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


@pytest.mark.parametrize("t", [1, 2, 65])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_transformers(t, with_state):
    hk, hv, dk, dv, batch = 2, 4, 16, 8, 2
    q, k, v, g, beta, s0 = make_inputs(100 + t, (batch, t), hk, hv, dk, dv, torch.float32,
                                       batch if with_state else None)
    rep = hv // hk
    args = (q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g, beta)
    hf_o, hf_s = hf.torch_recurrent_gated_delta_rule(*args, initial_state=s0, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    hfc_o, hfc_s = hf.torch_chunk_gated_delta_rule(*args, initial_state=s0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    assert_rel(hfc_o, hf_o, 1e-4, "transformers chunked vs transformers recurrent (sanity)")
    for chunk in (None, 1, 16, 64):
        if chunk is None:
            o, s = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
        else:
            o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
        assert_rel(o, hf_o, 1e-5, f"output vs transformers recurrent, chunk={chunk}")
        assert_rel(s, hf_s, 1e-5, f"state vs transformers recurrent, chunk={chunk}")
        assert_rel(o, hfc_o, 1e-4, f"output vs transformers chunked, chunk={chunk}")


def test_gdn_gates_match_transformers_formula():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 7, 5, generator=gen), torch.randn(3, 7, 5, generator=gen)
    a_log, dt_bias = torch.randn(5, generator=gen), torch.randn(5, generator=gen)
    g, beta = gdn_gates(a.bfloat16(), b.bfloat16(), a_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32
    ref_g = -a_log.float().exp() * torch.nn.functional.softplus(a.bfloat16().float() + dt_bias)
    torch.testing.assert_close(g, ref_g, rtol=1e-6, atol=0)
    torch.testing.assert_close(beta, b.bfloat16().float().sigmoid(), rtol=1e-6, atol=0)
    assert (g < 0).all() and ((beta > 0) & (beta < 1)).all()


# --- bad input -------------------------------------------------------------------------------------------------

def _ok(total=10):
    q, k, v, g, beta, s0 = make_inputs(0, (total,), 2, 4, 8, 6, torch.float32, 2)
    return dict(q=q, k=k, v=v, g=g, beta=beta), s0, torch.tensor([0, 4, total], dtype=torch.int32)


@pytest.mark.parametrize("fn", [recurrent_gated_delta_rule, chunk_gated_delta_rule])
def test_bad_input_raises(fn):
    x, s0, cu = _ok()
    fn(**x, initial_state=s0, cu_seqlens=cu)  # the baseline is accepted
    cases = [
        (dict(x), dict(), "q must have 4 dims"),  # varlen shapes without cu_seqlens
        ({**x, "q": x["q"][None]}, dict(cu_seqlens=cu), "q must have 3 dims"),
        ({**x, "g": x["g"][..., None]}, dict(cu_seqlens=cu), "g must have 2 dims"),
        ({**x, "beta": x["beta"][:, 0]}, dict(cu_seqlens=cu), "beta must have 2 dims"),
        ({**x, "k": x["k"][..., :4]}, dict(cu_seqlens=cu), "q and k must have one shape"),
        ({**x, "g": x["g"][:, :3]}, dict(cu_seqlens=cu), "do not match"),
        ({**x, "v": x["v"][:9]}, dict(cu_seqlens=cu), "do not match"),
        ({**x, "v": x["v"][:, :3], "g": x["g"][:, :3], "beta": x["beta"][:, :3]}, dict(cu_seqlens=cu),
         "multiple of key heads"),
        (x, dict(cu_seqlens=torch.tensor([1, 4, 10])), "cu_seqlens must rise from 0"),
        (x, dict(cu_seqlens=torch.tensor([0, 4, 9])), "cu_seqlens must rise from 0"),
        (x, dict(cu_seqlens=torch.tensor([0, 6, 4, 10])), "cu_seqlens must rise from 0"),
        (x, dict(cu_seqlens=torch.tensor([0.0, 10.0])), "cu_seqlens must have dtype"),
        (x, dict(cu_seqlens=torch.tensor([[0, 10]])), "cu_seqlens must have 1 dims"),
        (x, dict(cu_seqlens=torch.tensor([0])), "at least 2 entries"),
        (x, dict(cu_seqlens=cu, initial_state=s0[:1]), "initial_state must have shape"),
        (x, dict(cu_seqlens=cu, initial_state=s0.transpose(2, 3)), "initial_state must have shape"),
        (x, dict(cu_seqlens=cu, initial_state=s0[0]), "initial_state must have 4 dims"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            fn(**args, **kw)
    batched = {n: t[None] for n, t in x.items()}
    with pytest.raises(ValueError, match="initial_state must have shape"):
        fn(**batched, initial_state=s0)  # batch 1 needs 1 state, not 2


def test_bad_chunk_size():
    x, _, cu = _ok()
    for c in (0, -4):
        with pytest.raises(ValueError, match="chunk_size must be positive"):
            chunk_gated_delta_rule(**x, cu_seqlens=cu, chunk_size=c)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 3), t=st.integers(1, 5), hkv=heads, dk=dims, dv=dims)
def test_verify_states_are_the_prefixes_final_states(seed, batch, t, hkv, dk, dv):
    # a verify step of t tokens (speculative decoding) rolls back to the state after its L-th token: that state is
    # the final state of the rule over the first L tokens, and so is the conv window
    hk, hv = hkv
    q, k, v, g, beta, s0 = make_inputs(seed, (batch, t), hk, hv, dk, dv, n_states=batch)
    o, states = recurrent_gated_delta_rule_states(q, k, v, g, beta, initial_state=s0)
    assert states.shape == (batch, t, hv, dk, dv)
    full_o, _ = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    assert_rel(o, full_o, F64_TOL, "outputs")
    for n in range(1, t + 1):
        _, final = recurrent_gated_delta_rule(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], initial_state=s0)
        assert_rel(states[:, n - 1], final, F64_TOL, f"state after token {n}")
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(batch, t, 5, generator=gen), torch.randn(5, 4, generator=gen)
    window0 = torch.randn(batch, 5, 3, generator=gen)
    y, windows = causal_conv1d_windows(x, w, initial_state=window0)
    assert torch.equal(y, causal_conv1d(x, w, initial_state=window0)[0]) and windows.shape == (batch, t, 5, 3)
    for n in range(1, t + 1):
        assert torch.equal(windows[:, n - 1], causal_conv1d(x[:, :n], w, initial_state=window0)[1]), n
