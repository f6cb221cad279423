"""The small reference ops (reference/norms.py, rope.py, conv.py, moe.py) against transformers' Qwen3.5 code and
against direct formulas, with their argument checks."""
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_rel, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import (
    add_rms_norm,
    apply_rope,
    causal_conv1d,
    causal_conv1d_update,
    gated_rms_norm,
    l2norm,
    moe,
    rms_norm,
    rope_cos_sin,
    sigmoid_gate_mul,
    silu_and_mul,
    swiglu,
    topk_route,
)

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
hf_moe = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig  # noqa: E402

TOL = {torch.float32: 2e-6, torch.float64: 2e-6, torch.bfloat16: 8e-3}  # the references compute in fp32


def rand(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


SHAPES = [(1, 1), (3, 65), (2, 3, 256), (5, 128)]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


# --- norms -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_rms_norm_matches_transformers(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    x = rand(gen, *shape, dtype=dtype)
    norm = hf.Qwen3_5RMSNorm(shape[-1]).to(dtype)
    norm.weight.copy_(rand(gen, shape[-1], scale=0.3))
    assert_rel(rms_norm(x, norm.weight), norm(x), TOL[dtype], f"rms_norm {shape} {dtype}")
    # the zero-centred weight: (1 + w), and eps inside the root, checked on a tiny input where eps dominates
    small = x * 1e-4
    norm5 = hf.Qwen3_5RMSNorm(shape[-1], eps=1e-5).to(dtype)
    norm5.weight.copy_(norm.weight)
    assert_rel(rms_norm(small, norm.weight, eps=1e-5), norm5(small), TOL[dtype], "eps=1e-5 on tiny input")
    if shape[-1] > 1:
        assert rel_err(rms_norm(small, norm.weight, eps=1e-5), rms_norm(small, norm.weight)) > 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_add_rms_norm(dtype):
    gen = torch.Generator().manual_seed(1)
    x, r = rand(gen, 4, 65, dtype=dtype), rand(gen, 4, 65, dtype=dtype)
    norm = hf.Qwen3_5RMSNorm(65).to(dtype)
    norm.weight.copy_(rand(gen, 65, scale=0.3))
    y, summed = add_rms_norm(x, r, norm.weight)
    assert torch.equal(summed, x + r) and summed.dtype == dtype
    assert_rel(y, norm(x + r), TOL[dtype], "add_rms_norm")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_gated_rms_norm_matches_transformers(shape, dtype):
    gen = torch.Generator().manual_seed(2 + sum(shape))
    x, z = rand(gen, *shape, dtype=dtype), rand(gen, *shape, dtype=dtype)
    norm = hf.Qwen3_5RMSNormGated(shape[-1]).to(dtype)
    norm.weight.copy_(1.0 + rand(gen, shape[-1], scale=0.3))  # a plain weight, around 1
    assert_rel(gated_rms_norm(x, z, norm.weight), norm(x, z), TOL[dtype], f"gated_rms_norm {shape} {dtype}")


def test_gated_rms_norm_direct_formula():
    """weight * x / sqrt(mean(x^2) + eps) * silu(z), in fp64 by hand."""
    gen = torch.Generator().manual_seed(3)
    x, z, w = rand(gen, 7, 33), rand(gen, 7, 33), rand(gen, 33)
    xd = x.double()
    ref = w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * F.silu(z.double())
    assert_rel(gated_rms_norm(x, z, w).double(), ref, 2e-6, "gated_rms_norm vs fp64 formula")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_l2norm(dtype):
    gen = torch.Generator().manual_seed(4)
    x = rand(gen, 3, 5, 128, dtype=dtype)
    assert_rel(l2norm(x), hf.l2norm(x), 1e-12, "l2norm vs transformers")
    assert_rel(l2norm(x), F.normalize(x, dim=-1), 1e-7, "l2norm vs F.normalize")
    tiny = torch.full((1, 4), 1e-5, dtype=dtype)  # eps under the root: sqrt(4e-10 + 1e-6), not 2e-5
    torch.testing.assert_close(l2norm(tiny), tiny / math.sqrt(4e-10 + 1e-6))


def test_norm_bad_input_raises():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight has 7 entries for x of width 8"):
        rms_norm(x, torch.randn(7))
    with pytest.raises(ValueError, match="x .* and residual .* must match"):
        add_rms_norm(x, torch.randn(3, 7), torch.randn(8))
    with pytest.raises(ValueError, match="x .* and z .* must match"):
        gated_rms_norm(x, torch.randn(2, 8), torch.randn(8))


# --- rope --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("theta", [1e4, 1e7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_rope_matches_transformers(head_dim, theta, dtype):
    cfg = Qwen3_5TextConfig(head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": theta,
                                                                "partial_rotary_factor": 0.25})
    rotary = hf.Qwen3_5TextRotaryEmbedding(cfg)
    rot_dim = head_dim // 4
    gen = torch.Generator().manual_seed(5)
    pos = torch.cat([torch.arange(3), torch.randint(0, 300_000, (62,), generator=gen)])  # 65 positions
    q, k = rand(gen, 65, 4, head_dim, dtype=dtype), rand(gen, 65, 2, head_dim, dtype=dtype)
    cos_hf, sin_hf = rotary(q.float()[None], pos[None, None].expand(3, 1, -1))  # text: three equal M-RoPE rows
    q_hf, k_hf = hf.apply_rotary_pos_emb(q.float()[None], k.float()[None], cos_hf, sin_hf, unsqueeze_dim=2)
    cos, sin = rope_cos_sin(pos, rot_dim, theta)
    assert cos.shape == (65, rot_dim // 2) and cos.dtype == torch.float32
    assert_rel(cos, cos_hf[0, :, :rot_dim // 2], 1e-6, "cos")
    assert_rel(sin, sin_hf[0, :, :rot_dim // 2], 1e-6, "sin")
    assert torch.equal(cos_hf[0, :, :rot_dim // 2], cos_hf[0, :, rot_dim // 2:])  # NeoX halves
    qo, ko = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert qo.dtype == dtype
    assert_rel(qo, q_hf[0].to(dtype), TOL[dtype], f"q rope {head_dim} {theta:g} {dtype}")
    assert_rel(ko, k_hf[0].to(dtype), TOL[dtype], f"k rope {head_dim} {theta:g} {dtype}")
    assert torch.equal(qo[..., rot_dim:], q[..., rot_dim:]), "dims past rotary_dim must pass through"


def test_rope_direct_formula():
    """inv_freq_i = theta^(-2i/rd); pairs (i, i + rd/2) rotate by pos * inv_freq_i, in fp64 by hand."""
    gen = torch.Generator().manual_seed(6)
    rd, theta, dim = 16, 1e6, 40
    pos = torch.randint(0, 2048, (9,), generator=gen)
    x = rand(gen, 9, 3, dim)
    cos, sin = rope_cos_sin(pos, rd, theta)
    ang = pos.double()[:, None] * theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    assert (cos.double() - ang.cos()).abs().max() < 1e-3 and (sin.double() - ang.sin()).abs().max() < 1e-3
    y = apply_rope(x, cos, sin).double()
    xd, c, s = x.double(), cos.double()[:, None], sin.double()[:, None]
    half = rd // 2
    ref = torch.cat([xd[..., :half] * c - xd[..., half:rd] * s, xd[..., half:rd] * c + xd[..., :half] * s,
                     xd[..., rd:]], dim=-1)
    assert_rel(y, ref, 1e-6, "rope vs fp64 formula")
    # rd = 2: one pair rotating by pos radians
    c1, s1 = rope_cos_sin(pos, 2, theta)
    y1 = apply_rope(x, c1, s1)
    p = pos.double()[:, None]
    torch.testing.assert_close(y1[..., 0].double(), xd[..., 0] * p.cos() - xd[..., 1] * p.sin(), atol=1e-4, rtol=0)
    torch.testing.assert_close(y1[..., 1].double(), xd[..., 1] * p.cos() + xd[..., 0] * p.sin(), atol=1e-4, rtol=0)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(0, 1000), n=st.integers(0, 1000), shift=st.integers(0, 1000),
       rd=st.sampled_from([2, 8, 64]))
def test_rope_is_relative_and_norm_preserving(seed, m, n, shift, rd):
    gen = torch.Generator().manual_seed(seed)
    q, k = rand(gen, 1, 1, 64), rand(gen, 1, 1, 64)

    def rot(x, p):
        return apply_rope(x, *rope_cos_sin(torch.tensor([p]), rd, 1e4))

    a = (rot(q, m) * rot(k, n)).sum()
    b = (rot(q, m + shift) * rot(k, n + shift)).sum()
    scale = (q.norm() * k.norm()).item()
    assert abs(a - b).item() <= 1e-4 * scale, f"<R(m)q, R(n)k> depends on m+shift: {a.item()} vs {b.item()}"
    torch.testing.assert_close(rot(q, m).norm(), q.norm(), rtol=1e-5, atol=0)


def test_rope_bad_input_raises():
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        rope_cos_sin(torch.arange(4), 7, 1e4)
    cos, sin = rope_cos_sin(torch.arange(4), 8, 1e4)
    with pytest.raises(ValueError, match="do not fit x"):
        apply_rope(torch.randn(5, 2, 16), cos, sin)  # 5 tokens, 4 positions
    with pytest.raises(ValueError, match="do not fit x"):
        apply_rope(torch.randn(4, 2, 6), cos, sin)  # rotary_dim 8 > head_dim 6


# --- causal conv1d -----------------------------------------------------------------------------------------------

def conv_by_hand(x, weight, state, activation):
    """fp64 loop: y[t, c] = sum_j w[c, j] * full[t + j, c] with full = [state (K-1 oldest first); x]."""
    k = weight.shape[1]
    full = torch.cat([state.double().T, x.double()])  # (K-1+T, C)
    y = torch.stack([(full[t:t + k].T * weight.double()).sum(-1) for t in range(x.shape[0])])
    return F.silu(y) if activation == "silu" else y, full[full.shape[0] - (k - 1):].T


@pytest.mark.parametrize("t", [1, 2, 3, 65])
@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv1d_matches_transformers(t, activation):
    gen = torch.Generator().manual_seed(t)
    c, k, batch = 24, 4, 2
    x, w = rand(gen, batch, t, c), rand(gen, c, k, scale=0.5)
    y, state = causal_conv1d(x, w, activation=activation)
    ref = hf.causal_conv1d_fn(x.transpose(1, 2), w, None, activation=activation).transpose(1, 2)
    assert_rel(y, ref, 1e-6, f"no initial state, T={t}")
    # from an initial state: transformers' update keeps K columns; the oldest one must not matter
    s0 = rand(gen, batch, c, k - 1)
    y, state = causal_conv1d(x, w, initial_state=s0, activation=activation)
    hf_state = torch.cat([rand(gen, batch, c, 1, scale=100.0), s0], dim=-1)
    ref = hf.causal_conv1d_update(x.transpose(1, 2), hf_state, w, None, activation=activation).transpose(1, 2)
    assert_rel(y, ref, 1e-6, f"with initial state, T={t}")
    torch.testing.assert_close(state, hf_state[..., 1:], rtol=0, atol=0)
    for b in range(batch):
        y_hand, s_hand = conv_by_hand(x[b], w, s0[b], activation)
        assert_rel(y[b].double(), y_hand, 1e-6, "vs fp64 loop")
        assert torch.equal(state[b].double(), s_hand)


def test_conv_state_is_last_inputs_oldest_first():
    """T < K-1: the state keeps part of the old state, shifted; with no initial state, zeros before the start."""
    gen = torch.Generator().manual_seed(7)
    c, k = 5, 5
    x, w, s0 = rand(gen, 1, 2, c), rand(gen, c, k), rand(gen, 1, c, k - 1)
    _, s = causal_conv1d(x, w, initial_state=s0)
    assert torch.equal(s[0], torch.cat([s0[0, :, 2:], x[0].T], dim=1))
    y, s = causal_conv1d(x, w)
    assert torch.equal(s[0], torch.cat([torch.zeros(c, 2), x[0].T], dim=1))
    torch.testing.assert_close(y[0, 0], F.silu(w[:, -1] * x[0, 0]))  # the newest input meets the last tap
    torch.testing.assert_close(y[0, 1], F.silu(w[:, -1] * x[0, 1] + w[:, -2] * x[0, 0]))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), data=st.data(), t=st.integers(2, 40), k=st.sampled_from([1, 2, 3, 4, 5]),
       c=st.sampled_from([1, 3, 16]), activation=st.sampled_from(["silu", None]), with_state=st.booleans())
def test_conv_split_equals_one_call(seed, data, t, k, c, activation, with_state):
    split = data.draw(st.integers(1, t - 1), label="split")
    gen = torch.Generator().manual_seed(seed)
    x, w = rand(gen, 2, t, c), rand(gen, c, k)
    s0 = rand(gen, 2, c, k - 1) if with_state else None
    y, s = causal_conv1d(x, w, initial_state=s0, activation=activation)
    y1, s1 = causal_conv1d(x[:, :split], w, initial_state=s0, activation=activation)
    y2, s2 = causal_conv1d(x[:, split:], w, initial_state=s1, activation=activation)
    assert_rel(torch.cat([y1, y2], dim=1), y, 1e-6, f"split at {split} of {t}, K={k}")
    assert torch.equal(s2, s), f"state after the split differs (K={k})"
    for b in range(2):
        y_hand, s_hand = conv_by_hand(x[b], w, s0[b] if with_state else torch.zeros(c, k - 1), activation)
        assert_rel(y[b].double(), y_hand, 1e-6, f"vs fp64 loop K={k}")
        assert torch.equal(s[b].double(), s_hand)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lens=st.lists(st.integers(1, 20), min_size=1, max_size=4),
       k=st.sampled_from([2, 4]), with_state=st.booleans())
def test_conv_varlen_equals_each_sequence(seed, lens, k, with_state):
    gen = torch.Generator().manual_seed(seed)
    c = 6
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    x, w = rand(gen, int(cu[-1]), c), rand(gen, c, k)
    s0 = rand(gen, len(lens), c, k - 1) if with_state else None
    y, s = causal_conv1d(x, w, initial_state=s0, cu_seqlens=cu)
    assert y.shape == x.shape and s.shape == (len(lens), c, k - 1)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y1, s1 = causal_conv1d(x[None, a:b], w, initial_state=None if s0 is None else s0[i:i + 1])
        assert_rel(y[a:b], y1[0], 1e-7, f"sequence {i} of {lens}")
        assert torch.equal(s[i], s1[0])


def test_conv_varlen_zero_length_sequence():
    """check_cu_seqlens accepts an empty sequence (attention and the gated delta rule handle it); the conv should
    give no output for it and keep its state."""
    gen = torch.Generator().manual_seed(8)
    x, w, s0 = rand(gen, 5, 6), rand(gen, 6, 4), rand(gen, 2, 6, 3)
    y, s = causal_conv1d(x, w, initial_state=s0, cu_seqlens=torch.tensor([0, 0, 5]))
    assert y.shape == x.shape and torch.equal(s[0], s0[0])


@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_decode_updates_equal_full_conv(activation):
    gen = torch.Generator().manual_seed(9)
    batch, t, c, k = 3, 17, 10, 4
    x, w, s0 = rand(gen, batch, t, c), rand(gen, c, k), rand(gen, batch, c, k - 1)
    y_full, s_full = causal_conv1d(x, w, initial_state=s0, activation=activation)
    state = s0.clone()
    hf_state = torch.cat([rand(gen, batch, c, 1), s0], dim=-1)
    for i in range(t):
        y = causal_conv1d_update(x[:, i], state, w, activation=activation)  # updates state in place
        assert y.shape == (batch, c)
        assert_rel(y, y_full[:, i], 1e-6, f"decode step {i}")
        y_hf = hf.causal_conv1d_update(x[:, i, :, None], hf_state, w, None, activation=activation)[..., 0]
        assert_rel(y, y_hf, 1e-6, f"decode step {i} vs transformers")
    assert torch.equal(state, s_full)
    torch.testing.assert_close(state, hf_state[..., 1:], rtol=0, atol=0)


def test_conv_bad_input_raises():
    x, w, s0 = torch.randn(2, 5, 6), torch.randn(6, 4), torch.randn(2, 6, 3)
    causal_conv1d(x, w, initial_state=s0)
    cases = [
        ((x[0], w), {}, "x must have 3 dims"),
        ((x, w), dict(cu_seqlens=torch.tensor([0, 5])), "x must have 2 dims"),
        ((x, w[None]), {}, "weight must have 2 dims"),
        ((x, w[:5]), {}, "x has 6 channels for a weight of 5"),
        ((x, w), dict(activation="gelu"), "activation must be None or 'silu'"),
        ((x, w), dict(initial_state=s0[:1]), "initial_state must have shape"),
        ((x, w), dict(initial_state=s0[..., :2]), "initial_state must have shape"),
        ((x[0], w), dict(cu_seqlens=torch.tensor([0, 2, 4])), "cu_seqlens must rise from 0 to 5"),
        ((x[0], w), dict(cu_seqlens=torch.tensor([0, 3, 2, 5])), "cu_seqlens must rise"),
        ((x[0], w), dict(cu_seqlens=torch.tensor([0.0, 5.0])), "cu_seqlens must have dtype"),
        ((x[0], w), dict(cu_seqlens=torch.tensor([0, 2, 5]), initial_state=s0[:1]), "initial_state must have shape"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            causal_conv1d(*args, **kw)
    state = s0.clone()
    with pytest.raises(ValueError, match="x must have 2 dims"):
        causal_conv1d_update(x, state, w)
    with pytest.raises(ValueError, match="conv_state must have 3 dims"):
        causal_conv1d_update(x[:, 0], state[0], w)
    with pytest.raises(ValueError, match="initial_state must have shape"):
        causal_conv1d_update(x[:, 0], state[:, :, :2], w)
    with pytest.raises(ValueError, match="initial_state must have shape"):
        causal_conv1d_update(x[:1, 0], state, w)
    assert torch.equal(state, s0), "a rejected update must not touch the state"


# --- SwiGLU, gates, routing and the MoE block --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_and_sigmoid_gate_mul(dtype):
    gen = torch.Generator().manual_seed(10)
    gu = rand(gen, 3, 5, 2 * 33, dtype=dtype)
    out = silu_and_mul(gu)
    ref = (F.silu(gu[..., :33].double()) * gu[..., 33:].double()).to(dtype)
    assert_rel(out, ref, TOL[dtype], "silu_and_mul")
    x, g = rand(gen, 4, 65, dtype=dtype), rand(gen, 4, 65, dtype=dtype)
    assert_rel(sigmoid_gate_mul(x, g), (x.double() * g.double().sigmoid()).to(dtype), TOL[dtype], "sigmoid_gate_mul")
    with pytest.raises(ValueError, match="must match"):
        sigmoid_gate_mul(x, g[:, :64])


def randomize(module, gen, scale=0.2):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


@torch.no_grad()
def test_swiglu_matches_transformers_mlp():
    gen = torch.Generator().manual_seed(11)
    mlp = hf.Qwen3_5MLP(Qwen3_5TextConfig(hidden_size=48), intermediate_size=80)
    randomize(mlp, gen)
    x = rand(gen, 65, 48)
    out = swiglu(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    assert_rel(out, mlp(x), 1e-6, "swiglu")


def moe_block(n_exp, top_k, hidden=32, inter=16, shared=24, seed=0):
    cfg = Qwen3_5MoeTextConfig(hidden_size=hidden, num_experts=n_exp, num_experts_per_tok=top_k,
                               moe_intermediate_size=inter, shared_expert_intermediate_size=shared)
    block = hf_moe.Qwen3_5MoeSparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(seed)
    randomize(block, gen)
    with torch.no_grad():
        block.gate.weight.mul_(5.0)  # spread the router so the top-k is well defined
    w = (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj)
    se = block.shared_expert
    return block, w, (se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight, block.shared_expert_gate.weight)


@pytest.mark.parametrize("n", [1, 2, 65])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@torch.no_grad()
def test_moe_matches_transformers(n, top_k):
    block, (router, gate_up, down), shared = moe_block(8, top_k, seed=n + top_k)
    x = rand(torch.Generator().manual_seed(n), n, 32)
    out = moe(x, router, gate_up, down, top_k, shared=shared)
    assert_rel(out, block(x[None])[0], 1e-5, f"moe n={n} top_k={top_k}")
    # without the shared expert: transformers' routed experts alone
    _, weights, ids = block.gate(x)
    assert_rel(moe(x, router, gate_up, down, top_k), block.experts(x, ids, weights), 1e-5, "routed experts only")


@torch.no_grad()
def test_topk_route_matches_transformers():
    block, (router, _, _), _ = moe_block(16, 4, seed=3)
    x = rand(torch.Generator().manual_seed(12), 65, 32)
    weights, ids = topk_route(x, router, 4)
    _, hf_weights, hf_ids = block.gate(x)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, hf_ids)
    assert_rel(weights, hf_weights, 1e-6, "router weights")
    torch.testing.assert_close(weights.sum(-1), torch.ones(65))
    assert (weights[:, :-1] >= weights[:, 1:]).all()


@torch.no_grad()
def test_moe_with_all_experts_is_the_dense_mixture():
    """top_k = E: sum_e softmax(router(x))_e * expert_e(x) + sigmoid(shared_gate(x)) * shared(x), in fp64 by hand."""
    _, (router, gate_up, down), shared = moe_block(6, 6, seed=4)
    x = rand(torch.Generator().manual_seed(13), 9, 32)
    out = moe(x, router, gate_up, down, 6, shared=shared)
    xd = x.double()
    p = torch.softmax(xd @ router.double().T, -1)
    ref = sum(p[:, e:e + 1] * swiglu(xd, *gate_up[e].double().chunk(2, 0), down[e].double()) for e in range(6))
    g, u, d, sg = (t.double() for t in shared)
    ref = ref + torch.sigmoid(xd @ sg.T) * swiglu(xd, g, u, d)
    assert_rel(out.double(), ref, 1e-5, "moe vs dense mixture")


def test_moe_bad_input_raises():
    _, (router, gate_up, down), _ = moe_block(6, 2, seed=5)
    x = torch.randn(4, 32)
    for k in (0, 7):
        with pytest.raises(ValueError, match=r"top_k must be in \[1, 6\]"):
            moe(x, router, gate_up, down, k)
        with pytest.raises(ValueError, match=r"top_k must be in \[1, 6\]"):
            topk_route(x, router, k)
    with pytest.raises(ValueError, match="disagree on the number of experts"):
        moe(x, router, gate_up[:5], down, 2)
    with pytest.raises(ValueError, match="disagree on the number of experts"):
        moe(x, router[:5], gate_up, down, 2)
