"""The input checks every kernel entry shares (reference/checks.py), at the entries a review found unguarded.

Each case once ran to a silent wrong answer, memory corruption or a crash deep inside (found in review): index
tensors read at ptr + i but given strided; outputs (and the residual a norm writes) whose elements share memory;
non-finite or non-numeric eps and scales; batches of no sequence; zero heads or page sizes; benchmark plans the
kernels cannot tile. Now each gets a ValueError that names the argument, or, for an empty batch, an empty result.
Runs on the CPU (Triton's interpreter); tiny shapes.
"""
import math

import pytest
import torch

import reference as R
from kernels import attention_prep as AP
from kernels import causal_conv1d as CC
from kernels import gdn_decode as GD
from kernels import gdn_pointwise as GP
from kernels import gdn_prefill as GPF
from kernels import linear as L
from kernels import norms as N
from kernels import paged_decode_attention as PD
from reference.checks import check_no_self_overlap, check_real
from tests.conftest import HAS_CUDA

DEV = "cuda" if HAS_CUDA else "cpu"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def strided(values, dtype=torch.int32):
    """values as a stride-2 view (every other entry of a buffer full of 99s)."""
    buf = torch.full((2 * len(values),), 99, dtype=dtype)
    buf[::2] = torch.tensor(values, dtype=dtype)
    return buf.to(DEV)[::2]


# ---- the shared helpers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, strides, overlaps", [
    ((4, 32), (32, 1), False), ((4, 32), (0, 1), True), ((4, 32), (8, 1), True), ((4, 32), (1, 4), False),
    ((3, 2), (5, 1), False), ((4, 1, 4), (8, 8, 2), False), ((2, 3), (3, 2), True), ((1, 5), (0, 1), False)])
def test_self_overlap_by_strides(shape, strides, overlaps):
    t = torch.empty(256).as_strided(shape, strides)
    if overlaps:
        with pytest.raises(ValueError, match="out is written and must not overlap itself"):
            check_no_self_overlap("out", t)
    else:
        check_no_self_overlap("out", t)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1e-6, "1e-6", None, True, torch.tensor(1e-6)])
def test_real_refuses_what_is_not_a_finite_number(value):
    with pytest.raises(ValueError, match="eps must be a finite non-negative number"):
        check_real("eps", value)


def test_real_takes_ints_and_floats():
    assert check_real("eps", 0) == 0.0 and check_real("eps", 1e-6) == 1e-6
    assert check_real("scale", 2, positive=True) == 2.0
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        check_real("scale", 0.0, positive=True)


# ---- index tensors read at ptr + i ----------------------------------------------------------------------------

def _gdn_decode_args(seed=1, hk=2, hv=4, dk=16, dv=16, bsz=2, slots=4):
    g = _gen(seed)
    c = 2 * hk * dk + hv * dv
    r = lambda *s: torch.randn(*s, generator=g).to(DEV)  # noqa: E731
    return dict(qkv=r(bsz, c), z=r(bsz, hv, dv), b=r(bsz, hv), a=r(bsz, hv), conv_w=0.5 * r(c, 4),
                A_log=torch.log(torch.rand(hv, generator=g) + 0.1).to(DEV), dt_bias=r(hv), norm_w=1 + 0.1 * r(dv),
                conv_states=r(slots, c, 3), recurrent_states=0.5 * r(slots, hv, dk, dv),
                state_slots=torch.tensor([0, 2], device=DEV), num_k_heads=hk, eps=1e-6)


def test_gdn_decode_refuses_strided_slots():
    args = _gdn_decode_args()
    with pytest.raises(ValueError, match="state_slots must be a contiguous"):
        GD.gdn_decode_step(**{**args, "state_slots": strided([0, 2], torch.int64)})


def _conv_args(seed=2, lens=(3, 5), c=8, k=4):
    g = _gen(seed)
    x = torch.randn(sum(lens), c, generator=g).to(DEV)
    w = (0.5 * torch.randn(c, k, generator=g)).to(DEV)
    pool = torch.randn(len(lens) + 3, c, k - 1, generator=g).to(DEV)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return x, w, pool, torch.tensor([4, 1], device=DEV), cu


@pytest.mark.parametrize("which", ["state_slots", "cu_seqlens"])
def test_conv1d_refuses_strided_index_tensors(which):
    x, w, pool, slots, cu = _conv_args()
    bad = dict(state_slots=strided([4, 1], torch.int64), cu_seqlens=strided([0, 3, 8]))[which]
    args = dict(state_slots=slots, cu_seqlens=cu) | {which: bad}
    with pytest.raises(ValueError, match=f"{which} must be contiguous"):
        CC.causal_conv1d_varlen(x, w, pool, args["state_slots"], args["cu_seqlens"])


@pytest.mark.parametrize("which, dtype", [("weight", torch.int32), ("conv_states", torch.int32)])
def test_conv1d_refuses_integer_weights_and_windows(which, dtype):
    x, w, pool, slots, cu = _conv_args()
    args = dict(weight=w, conv_states=pool) | {which: dict(weight=w, conv_states=pool)[which].to(dtype)}
    with pytest.raises(ValueError, match=f"{which} must have dtype"):
        CC.causal_conv1d_varlen(x, args["weight"], args["conv_states"], slots, cu)


def test_conv1d_refuses_strided_snapshot_slots():
    x, w, pool, slots, cu = _conv_args()
    with pytest.raises(ValueError, match="snapshot_slots must be a contiguous"):
        CC.causal_conv1d_varlen(x, w, pool, slots, cu, cu_seqlens_host=(0, 3, 8), snapshot_offsets=(1, 2),
                                snapshot_slots=strided([0, 2], torch.int64))


def _prefill_args(seed=3, lens=(5, 7), hk=1, hv=2, d=16):
    g = _gen(seed)
    t = sum(lens)
    r = lambda *s: torch.randn(*s, generator=g).to(DEV)  # noqa: E731
    return dict(q=r(t, hk, d), k=r(t, hk, d), v=r(t, hv, d), g=-torch.rand(t, hv, generator=g).to(DEV),
                beta=torch.rand(t, hv, generator=g).to(DEV), recurrent_states=r(4, hv, d, d),
                state_slots=torch.tensor([3, 1], device=DEV),
                cu_seqlens=torch.tensor([0, lens[0], t], dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("which", ["state_slots", "cu_seqlens"])
def test_gdn_prefill_refuses_strided_index_tensors(which):
    args = _prefill_args()
    bad = dict(state_slots=strided([3, 1], torch.int64), cu_seqlens=strided([0, 5, 12]))[which]
    q, k, v, g, beta = (args.pop(n) for n in ("q", "k", "v", "g", "beta"))
    with pytest.raises(ValueError, match=f"{which} must be contiguous"):
        GPF.chunk_gated_delta_rule(q, k, v, g, beta, **(args | {which: bad}))


@pytest.mark.parametrize("over, match", [({"scale": float("nan")}, "scale must be a finite positive"),
                                         ({"scale": 0.0}, "scale must be a finite positive"),
                                         ({"use_qk_l2norm": "no"}, "use_qk_l2norm must be a bool")])
def test_gdn_prefill_refuses_bad_scalars(over, match):
    args = _prefill_args()
    q, k, v, g, beta = (args.pop(n) for n in ("q", "k", "v", "g", "beta"))
    with pytest.raises(ValueError, match=match):
        GPF.chunk_gated_delta_rule(q, k, v, g, beta, **args, **over)


def _prep_args(seed=4, n=3, h=4, kv=2, d=32, page=8, pages=6):
    g = _gen(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(DEV)  # noqa: E731
    cos, sin = R.rope_cos_sin(torch.arange(n), d // 2, 1e4)
    return dict(q=r(n, h, d), k=r(n, kv, d), v=r(n, kv, d), q_norm_w=0.1 * r(d), k_norm_w=0.1 * r(d),
                cos=cos.to(DEV), sin=sin.to(DEV), k_pages=r(pages, page, kv, d), v_pages=r(pages, page, kv, d),
                slot_mapping=torch.tensor([3, 9, 17], device=DEV), eps=1e-6)


def test_attention_prep_refuses_strided_slot_mapping():
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        AP.attention_prep(**(_prep_args() | {"slot_mapping": strided([3, 9, 17], torch.int64)}))


# ---- outputs whose elements share memory ----------------------------------------------------------------------

def _expanded(shape):
    """An out= buffer of `shape` whose rows all alias the first."""
    return torch.empty((1, *shape[1:]), device=DEV).expand(shape)


def test_norms_refuse_self_overlapping_out_and_residual():
    g = _gen(5)
    x, w = torch.randn(4, 32, generator=g).to(DEV), (0.1 * torch.randn(32, generator=g)).to(DEV)
    with pytest.raises(ValueError, match="out is written and must not overlap itself"):
        N.rms_norm(x, w, 1e-6, out=_expanded((4, 32)))
    with pytest.raises(ValueError, match="residual is written and must not overlap itself"):
        N.add_rms_norm(x, _expanded((4, 32)), w, 1e-6)


def test_activations_and_linear_refuse_self_overlapping_out():
    from kernels import activations as A
    g = _gen(6)
    gate_up, x, w = (torch.randn(*s, generator=g).to(DEV) for s in ((4, 16), (4, 16), (8, 16)))
    for call in (lambda: A.silu_and_mul(gate_up, out=_expanded((4, 8))),
                 lambda: A.sigmoid_gate_mul(x, x, out=_expanded((4, 16))),
                 lambda: L.linear(x, w, out=_expanded((4, 8)))):
        with pytest.raises(ValueError, match="out is written and must not overlap itself"):
            call()


def test_attention_prep_refuses_self_overlapping_out():
    args = _prep_args()
    with pytest.raises(ValueError, match="out is written and must not overlap itself"):
        AP.attention_prep(**args, out=_expanded(tuple(args["q"].shape)))


# ---- eps and scales ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("eps", [float("nan"), -1.0, None, "1e-6"])
def test_every_eps_is_checked(eps):
    g = _gen(7)
    x, w = torch.randn(2, 32, generator=g).to(DEV), (0.1 * torch.randn(32, generator=g)).to(DEV)
    z = torch.randn(2, 2, 16, generator=g).to(DEV)
    weight = torch.randn(8, 32, generator=g).to(DEV)
    calls = {"rms_norm": lambda: N.rms_norm(x, w, eps),
             "gated_rms_norm": lambda: GP.gated_rms_norm(z, z, w[:16], eps),
             "add_rms_norm_linear": lambda: L.add_rms_norm_linear(x, x.clone(), w, eps, weight),
             "attention_prep": lambda: AP.attention_prep(**(_prep_args() | {"eps": eps})),
             "gdn_decode": lambda: GD.gdn_decode_step(**(_gdn_decode_args() | {"eps": eps}))}
    for name, call in calls.items():
        with pytest.raises(ValueError, match="eps must be a finite non-negative number"):
            call()
            pytest.fail(f"{name} took eps={eps!r}")


def _paged(lens=(20, 9), h=4, kv=2, d=64, page=16, seed=8):
    g = _gen(seed)
    pages = sum(-(-n // page) for n in lens) + 1
    k_pages, v_pages = (torch.randn(pages, page, kv, d, generator=g).to(DEV) for _ in range(2))
    width = max(-(-n // page) for n in lens)
    table = torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width).clamp(max=pages - 1).to(DEV)
    q = torch.randn(len(lens), 1, h, d, generator=g).to(DEV)
    return q, k_pages, v_pages, table, torch.tensor(lens, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -0.1, "0.1", torch.tensor(0.125), True])
def test_paged_decode_refuses_bad_softmax_scale(scale):
    with pytest.raises(ValueError, match="softmax_scale must be a finite positive number"):
        PD.paged_decode_attention(*_paged(), softmax_scale=scale)


def test_flash_attention_refuses_an_infinite_scale():
    from fa4 import flash_attention
    q = torch.randn(1, 8, 2, 64, generator=_gen(9)).to(DEV)
    with pytest.raises(ValueError, match="softmax_scale must be a finite positive number"):
        flash_attention(q, q, q, causal=True, softmax_scale=math.inf, backend="reference")


# ---- empty batches, zero heads and pages, argument types --------------------------------------------------------

def test_paged_decode_of_no_sequence_is_empty():
    q, k_pages, v_pages, table, lens = _paged()
    out = PD.paged_decode_attention(q[:0], k_pages, v_pages, table[:0], lens[:0])
    assert out.shape == (0, 1, 4, 64)


@pytest.mark.parametrize("backend", ["reference", "triton", "auto"])
def test_flash_attention_of_no_sequence_is_empty(backend):
    from fa4 import flash_attention
    q = torch.randn(0, 8, 2, 64, device=DEV)
    assert flash_attention(q, q, q, causal=True, backend=backend).shape == (0, 8, 2, 64)
    _, k_pages, v_pages, table, lens = _paged()
    out = flash_attention(q[:, :1], k_pages, v_pages, causal=True, page_table=table[:0], seqused_k=lens[:0],
                          backend=backend)
    assert out.shape == (0, 1, 2, 64)


def test_zero_heads_and_page_sizes_are_refused():
    from fa4 import flash_attention
    q, k_pages, v_pages, table, lens = _paged()
    with pytest.raises(ValueError, match="must be a positive multiple of kv heads"):
        PD.paged_decode_attention(q[:, :, :0], k_pages, v_pages, table, lens)
    with pytest.raises(ValueError, match="page_size 0"):
        PD.paged_decode_attention(q, k_pages[:, :0], v_pages[:, :0], table, lens)
    with pytest.raises(ValueError, match="must be a multiple of kv heads"):
        flash_attention(q[:, :, :0], q[:, :, :0], q[:, :, :0], causal=True)
    with pytest.raises(ValueError, match="page_size 0"):
        flash_attention(q, k_pages[:, :0], v_pages[:, :0], causal=True, page_table=table, seqused_k=lens)


def test_flash_attention_names_index_arguments_that_are_not_tensors():
    from fa4 import flash_attention
    q, k_pages, v_pages, table, lens = _paged()
    with pytest.raises(ValueError, match="page_table must be a torch.Tensor, got list"):
        flash_attention(q, k_pages, v_pages, causal=True, page_table=table.tolist(), seqused_k=lens)
    with pytest.raises(ValueError, match="cu_seqlens_q must be a torch.Tensor, got list"):
        flash_attention(q[0], q[0], q[0], causal=True, cu_seqlens_q=[0, 1], cu_seqlens_k=[0, 1])


@pytest.mark.parametrize("over, match", [({"num_splits": True}, "num_splits must be an int"),
                                         ({"max_seqlen_k": "x"}, "max_seqlen_k must be None or"),
                                         ({"max_seqlen_k": -1}, "max_seqlen_k must be None or")])
def test_paged_decode_names_host_ints(over, match):
    with pytest.raises(ValueError, match=match):
        PD.paged_decode_attention(*_paged(), **over)


def test_alloc_workspace_names_its_sizes():
    with pytest.raises(ValueError, match="max_splits must be a non-negative int"):
        PD.alloc_workspace(4, 2, -1, 64, DEV)
    with pytest.raises(ValueError, match="head_dim must be a non-negative int"):
        PD.alloc_workspace(4, 2, 8, 64.0, DEV)


def test_gdn_decode_refuses_empty_head_dims():
    args = _gdn_decode_args(dv=16)
    with pytest.raises(ValueError, match="head dims dk, dv >= 1"):
        GD.gdn_decode_step(**(args | {"recurrent_states": args["recurrent_states"][:, :, :0]}))


def test_rms_norm_refuses_a_scalar():
    with pytest.raises(ValueError, match="x must have at least 1 dim"):
        N.rms_norm(torch.tensor(1.0, device=DEV), torch.ones(1, device=DEV), 1e-6)


@pytest.mark.parametrize("plan", [(3, 5, 7), (0, 0, 0), (32,), "fast", (16, 32, True)])
def test_linear_names_a_plan_it_cannot_tile(plan):
    g = _gen(10)
    x, w = torch.randn(2, 64, generator=g).to(DEV), torch.randn(8, 64, generator=g).to(DEV)
    with pytest.raises(ValueError, match=r"plan must be None or \(BLOCK_N, BLOCK_K, num_warps\)"):
        L.linear(x, w, plan=plan)


def test_out_proj_mlp_names_a_list():
    w = torch.randn(8, 8, device=DEV)
    with pytest.raises(ValueError, match="o must be a torch.Tensor, got list"):
        L.out_proj_mlp([[0.0] * 8], None, w, w[0], 1e-6, torch.randn(16, 8, device=DEV), w)


# ---- paged_decode_attention's varlen metadata (host reads, check_metadata) --------------------------------------

def _varlen(lens_q=(3, 1)):
    q, k_pages, v_pages, table, lens = _paged()
    qv = torch.randn(sum(lens_q), 4, 64, generator=_gen(11)).to(DEV)
    cu = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return qv, k_pages, v_pages, table, lens, cu


@pytest.mark.parametrize("case, match", [("max_seqlen_q", "max_seqlen_q 2 is below the longest sequence's 3"),
                                         ("cu_start", "cu_seqlens_q must rise from 0 to 4"),
                                         ("cu_end", "cu_seqlens_q must rise from 0 to 4"),
                                         ("page", "page_table names pages outside the pool")])
def test_paged_decode_checks_its_metadata(case, match):
    q, k_pages, v_pages, table, lens, cu = _varlen()
    max_q = 2 if case == "max_seqlen_q" else 3
    if case == "cu_start":
        cu = torch.tensor([1, 3, 4], dtype=torch.int32, device=DEV)
    if case == "cu_end":
        cu = torch.tensor([0, 3, 3], dtype=torch.int32, device=DEV)
    if case == "page":
        table = table.clone()
        table[1, 0] = k_pages.shape[0]
    with pytest.raises(ValueError, match=match):
        PD.paged_decode_attention(q, k_pages, v_pages, table, lens, cu_seqlens_q=cu, max_seqlen_q=max_q)


def test_paged_decode_metadata_within_bounds_matches_the_reference():
    # a table wider than the sequences need, whose unread entries name no page, and seqused_k past the table's
    # capacity (clamped, as documented) pass the check and match the reference
    q, k_pages, v_pages, table, lens, cu = _varlen()
    wide = torch.cat([table, torch.full_like(table, -1)], dim=1)
    out = PD.paged_decode_attention(q, k_pages, v_pages, wide, lens, cu_seqlens_q=cu, max_seqlen_q=3)
    ref = R.paged_attention(q, k_pages, v_pages, table, lens, cu_seqlens_q=cu)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)


def test_a_host_copy_of_cu_seqlens_must_match_it_off_the_gpu():
    x, w, pool, slots, cu = _conv_args()
    if cu.is_cuda:
        pytest.skip("on the GPU the host copy is trusted (comparing would sync)")
    with pytest.raises(ValueError, match=r"cu_seqlens_host \[0, 4, 8\] is not a copy of cu_seqlens \[0, 3, 8\]"):
        CC.causal_conv1d_varlen(x, w, pool, slots, cu, cu_seqlens_host=(0, 4, 8))
