"""The chunked gated delta rule prefill (kernels/gdn_prefill.py) against the recurrent oracle
reference.recurrent_gated_delta_rule: outputs and the final states written back in place into scattered slots of a
larger pool (other slots untouched), varlen batches crossing the chunk edges; the model.ops adapter against
model.ops._ref_gated_deltanet; argument checks; bf16 at Qwen3.5-9B shapes on the GPU."""
import os
import subprocess
import sys

import pytest
import torch
from conftest import compiled_script_output, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from kernels import gdn_prefill
from kernels.gdn_prefill import chunk_gated_delta_rule, gated_deltanet_prefill_op
from kernels.varlen import CHUNK, DeviceBatch, max_pieces, token_chunks
from model.ops import _ref_gated_deltanet
from model.step import StepInput

EPS = 1e-6
CONV_K = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(gen, lens, hk, hv, dk, dv, dtype, n_slots, device=DEVICE):
    """q, k (T, Hk, dk), v (T, Hv, dv) in dtype; g, beta (T, Hv) fp32 from the model's gates; cu_seqlens;
    a random nonzero fp32 state pool (n_slots, Hv, dk, dv) and len(lens) distinct permuted slots."""
    total = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k, v = r(total, hk, dk).to(dtype), r(total, hk, dk).to(dtype), r(total, hv, dv).to(dtype)
    g, beta = R.gdn_gates(r(total, hv) * 2, r(total, hv), torch.log(torch.rand(hv, generator=gen) * 15 + 1), r(hv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pool = r(n_slots, hv, dk, dv) * 0.5
    slots = torch.randperm(n_slots, generator=gen)[:len(lens)]
    return [t.to(device) for t in (q, k, v, g, beta, cu, pool, slots)]


def assert_close(out, ref, tol, what):
    assert (out.shape, out.dtype) == (ref.shape, ref.dtype), f"{what}: {out.shape} {out.dtype} vs {ref.dtype}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def check_against_oracle(lens, hk, hv, dk, dv, dtype, tol_out, tol_state, seed=0, scale=None, use_qk_l2norm=True,
                         with_out=False, host_cu=False):
    """Run the kernel on a pool copy and the oracle on the gathered slots; compare o, the written-back states,
    and that slots outside state_slots kept their bytes. host_cu: pass cu_seqlens' host copy too."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta, cu, pool, slots = make_inputs(gen, lens, hk, hv, dk, dv, dtype, len(lens) + 3)
    if not use_qk_l2norm:  # unnormalised keys would make the recurrence blow up
        q, k = R.l2norm(q.float()).to(dtype), R.l2norm(k.float()).to(dtype)
    ref_o, ref_s = R.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool[slots], cu_seqlens=cu,
                                                scale=scale, use_qk_l2norm=use_qk_l2norm)
    states = pool.clone()
    out = torch.full_like(v, float("nan")) if with_out else None
    o = chunk_gated_delta_rule(q, k, v, g, beta, recurrent_states=states, state_slots=slots, cu_seqlens=cu,
                               cu_seqlens_host=tuple(cu.tolist()) if host_cu else None, scale=scale,
                               use_qk_l2norm=use_qk_l2norm, out=out)
    what = f"lens={lens} Hk={hk} Hv={hv} dk={dk} dv={dv} {dtype}"
    if with_out:
        assert o is out, f"{what}: out= not returned"
    assert_close(o, ref_o, tol_out, f"{what} output")
    assert_close(states[slots], ref_s, tol_state, f"{what} final states")
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    untouched[slots] = False
    assert torch.equal(states[untouched], pool[untouched]), f"{what}: a slot outside state_slots was written"


# ---- interpreter-sized (also run on the GPU) ----------------------------------------------------------------

MIXED = [1, 2, 17, 63, 64, 65, 130]  # inside, at and across the 64-token chunk edges and the solve's 16-row blocks


def test_mixed_lengths_gqa2_fp32():
    check_against_oracle(MIXED, 1, 2, 16, 16, torch.float32, 1e-5, 1e-5, with_out=True)


def test_gqa2_wider_heads_and_empty_sequence_fp32():
    # an empty sequence keeps its state; dk != dv
    check_against_oracle([130, 0, 1, 65], 2, 4, 32, 16, torch.float32, 1e-5, 1e-5, seed=1)


def test_host_copy_of_cu_seqlens():
    # the chunk table planned from the caller's host copy (no device read) gives the same result
    check_against_oracle([130, 0, 1, 65], 2, 4, 32, 16, torch.float32, 1e-5, 1e-5, seed=1, host_cu=True)


def test_fp16_io():
    # 16-bit io: the products after the WY pass take 16-bit operands (S, w, kd, v_new rounded), as fla's do
    check_against_oracle([70, 3], 1, 1, 16, 32, torch.float16, 2e-3, 2e-3, seed=2)


def test_no_l2norm_custom_scale():
    check_against_oracle([5, 80], 1, 2, 16, 16, torch.float32, 1e-5, 1e-5, seed=3, scale=0.3, use_qk_l2norm=False)


def test_correlated_keys_weak_decay_fp32():
    """The regime where T = (I + A)^-1 has large entries: keys of one direction (cosines near 0.9), beta near 1, almost
    no decay. The blocked solve (16 x 16 diagonal blocks by substitution, the rest by block products) against the
    recurrence in float64."""
    gen = torch.Generator().manual_seed(8)
    lens, hk, hv, d = [64, 130, 17], 1, 2, 32
    total = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen)
    k = r(1, hk, d) + 0.3 * r(total, hk, d)
    q, v = r(total, hk, d), r(total, hv, d)
    g = -0.01 * torch.rand(total, hv, generator=gen)
    beta = 0.9 + 0.1 * torch.rand(total, hv, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pool = r(len(lens), hv, d, d) * 0.5
    ref_o, ref_s = R.recurrent_gated_delta_rule(*(t.double() for t in (q, k, v, g, beta)), initial_state=pool.double(),
                                                cu_seqlens=cu)
    q, k, v, g, beta, cu, states = (t.to(DEVICE) for t in (q, k, v, g, beta, cu, pool))
    o = chunk_gated_delta_rule(q, k, v, g, beta, recurrent_states=states, state_slots=torch.arange(len(lens),
                               device=DEVICE), cu_seqlens=cu)
    # fp32 io: exact fp32 products on the GPU too
    assert_close(o.double().cpu(), ref_o, 1e-5, "correlated keys output")
    assert_close(states.double().cpu(), ref_s, 1e-5, "correlated keys final states")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 299)), min_size=1, max_size=8))
def test_token_chunks_cut_every_sequence(lens_and_cuts):
    """The vectorised chunk table against the plain loop: CHUNK-token spans of each sequence, in order, with their
    sequence, restarting at the sequence's cut (a snapshot point strictly inside it, when it has one), and each
    sequence's first chunk (empty sequences have none: the next one's), 16-byte aligned."""
    lens = [n for n, _ in lens_and_cuts]
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    offsets = [o if 0 < o < n else 0 for n, o in lens_and_cuts]
    cuts = tuple(cu[i] + o if o else 0 for i, o in enumerate(offsets))
    spans, first = [], []
    for i, (b, e) in enumerate(zip(cu[:-1], cu[1:])):
        first.append(len(spans))
        bounds = [b, cuts[i], e] if cuts[i] else [b, e]
        for lo, hi in zip(bounds, bounds[1:]):
            spans += [[s, min(s + CHUNK, hi), i] for s in range(lo, hi, CHUNK)]
    table, first_chunk = token_chunks(tuple(cu), "cpu", cuts if any(cuts) else None)
    assert table.dtype == first_chunk.dtype == torch.int32 and table.shape == (len(spans), 3)
    assert table.tolist() == spans and first_chunk.tolist() == first
    assert first_chunk.data_ptr() % 16 == 0  # one compiled variant of the kernels that take it, whatever the count


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 200), st.integers(0, 199)), min_size=1, max_size=5), st.integers(0, 3))
def test_device_plan_lays_out_token_chunks(lens_and_cuts, spare_seqs):
    """kernels.varlen.DeviceBatch: the piece tables built on the device equal token_chunks' (with and without the
    cuts) in their first rows, the rest empty (start == end), and each sequence's first piece; sequences past the
    batch's own hold no tokens."""
    lens = [n for n, _ in lens_and_cuts]
    cu = tuple([0, *torch.tensor(lens).cumsum(0).tolist()])
    offsets = tuple(o if 0 < o < n else 0 for n, o in lens_and_cuts)
    cuts = tuple(cu[i] + o if o else 0 for i, o in enumerate(offsets))
    max_seqs, rows = len(lens) + spare_seqs, cu[-1] + 64 * spare_seqs
    batch = DeviceBatch(max_seqs, rows, DEVICE)
    slots = torch.arange(len(lens), device=DEVICE)
    batch.fill(cu, slots, offsets, slots + len(lens))
    batch.build(rows)
    plan = batch.plan(rows)
    assert plan.chunks.shape == plan.plain_chunks.shape == (max_pieces(rows, max_seqs), 3)
    for table, host in ((plan.chunks, token_chunks(cu, "cpu", cuts if any(cuts) else None)),
                        (plan.plain_chunks, token_chunks(cu, "cpu"))):
        n = host[0].shape[0]
        assert table[:n].tolist() == host[0].tolist()
        assert (table[n:, 0] == table[n:, 1]).all()
    assert plan.first_chunk[:len(lens)].tolist() == token_chunks(cu, "cpu", cuts if any(cuts) else None)[1].tolist()
    assert plan.cu_seqlens.tolist() == [*cu, *[cu[-1]] * spare_seqs]
    assert plan.cuts_dev.tolist() == [*cuts, *[0] * spare_seqs]
    assert plan.offsets_dev.tolist() == [*offsets, *[0] * spare_seqs]
    with pytest.raises(ValueError, match="device batch holds up to"):
        batch.fill(cu + (cu[-1] + 1,) * (spare_seqs + 1), torch.arange(max_seqs + 1, device=DEVICE), None, None)


PLAN_SM90 = """
from tests.sm90_compile import ptxas_sm90a
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from kernels import varlen as V
fn = V._device_plan_kernel
const = dict(BT=V.CHUNK, BLOCK=64)
sig = {n: "constexpr" if n in const else "*i32" if n.endswith("_ptr") else "i32" for n in fn.arg_names}
k = triton.compile(ASTSource(fn, sig, const, {}), target=GPUTarget("cuda", 90, 32), options={"num_warps": 2})
print(ptxas_sm90a(k.asm["ptx"])["regs"])
"""


def test_device_plan_kernel_compiles_for_sm90():
    # the interpreter runs the plan's loops as Python: compile them for sm_90a as a graph would launch them
    assert int(compiled_script_output(PLAN_SM90)) > 0


def test_op_on_a_device_plan_equals_the_host_plan():
    """The GDN op of a step whose plan was built on the device (a captured prefill step: more sequences and rows
    than the batch, a snapshot in one sequence, stale slots from a larger batch before) gives the host plan's
    outputs, windows, states and snapshots; slots outside the step stay as they were."""
    gen = torch.Generator().manual_seed(21)
    lens, hk, hv, d = [70, 5, 130], 1, 2, 16
    n_slots, rows, max_seqs = 10, 320, 5
    args = make_layer_inputs(gen, lens, hk, hv, d, d, torch.float32, n_slots)
    slots, snaps = torch.tensor([4, 0, 7], device=DEVICE), torch.tensor([4, 9, 7], device=DEVICE)
    host_args = [t.clone() for t in args]
    host_step = prefill_step(lens, slots)
    host_step.snapshot_offsets, host_step.snapshot_slots = (0, 3, 0), snaps
    ref = gated_deltanet_prefill_op(*host_args, host_step, hk, EPS)

    batch = DeviceBatch(max_seqs, rows, DEVICE)
    batch.fill((0, 1, 2, 3, 4, 5), torch.tensor([1, 2, 3, 5, 6], device=DEVICE), None, None)  # a larger batch's
    batch.fill(host_step.cu_seqlens_host, slots, (0, 3, 0), snaps)
    batch.build(rows)
    pad = lambda t: torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])  # the graph's rows past the step
    qkv, z, b, a = (pad(t) for t in args[:4])
    zeros = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    step = StepInput(token_ids=zeros, positions=zeros, cu_seqlens=batch.cu_seqlens, max_seqlen_q=rows,
                     seqused_k=zeros[:1], page_table=zeros.view(-1, 1)[:1], slot_mapping=zeros,
                     state_slots=batch.state_slots, snapshot_slots=batch.snapshot_slots)
    gdn_prefill.hold_plan(step, batch.plan(rows))
    out = gated_deltanet_prefill_op(qkv, z, b, a, *args[4:], step, hk, EPS)
    assert_close(out[:sum(lens)], ref, 1e-6, "device-planned output")
    assert torch.equal(args[8], host_args[8]), "conv windows and snapshots"
    assert_close(args[9], host_args[9], 1e-6, "device-planned states and snapshots")
    untouched = [i for i in range(n_slots) if i not in (0, 4, 7, 9)]
    assert torch.equal(args[9][untouched], host_args[9][untouched]) and torch.equal(args[8][untouched],
                                                                                    host_args[8][untouched])


def prefill_step(lens, slots) -> StepInput:
    """A StepInput of sequences of these lengths (only the GDN fields matter)."""
    total, dev = sum(lens), slots.device
    zeros = torch.zeros(total, dtype=torch.int64, device=dev)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    return StepInput(token_ids=zeros, positions=zeros, cu_seqlens=cu, max_seqlen_q=max(lens),
                     seqused_k=cu[1:] - cu[:-1], page_table=torch.zeros(len(lens), 1, dtype=torch.int32, device=dev),
                     slot_mapping=zeros, state_slots=slots, cu_seqlens_host=tuple(cu.tolist()))


def make_layer_inputs(gen, lens, hk, hv, dk, dv, dtype, n_slots, device=DEVICE):
    """model.ops.gated_deltanet's arguments before `step`: qkv, z, b, a, conv_w, A_log, dt_bias, norm_w,
    conv_states, recurrent_states (random nonzero pools)."""
    total, c = sum(lens), 2 * hk * dk + hv * dv
    r = lambda *s: torch.randn(*s, generator=gen)
    args = (r(total, c).to(dtype), r(total, hv, dv).to(dtype), r(total, hv).to(dtype), (r(total, hv) * 2).to(dtype),
            (r(c, CONV_K) * 0.5).to(dtype), torch.log(torch.rand(hv, generator=gen) * 15 + 1), r(hv),
            (1 + 0.2 * r(dv)).to(dtype), r(n_slots, c, CONV_K - 1).to(dtype), r(n_slots, hv, dk, dv) * 0.5)
    return [t.to(device) for t in args]


def check_op(lens, hk, hv, dk, dv, dtype, tol_out, tol_state, seed=0):
    """gated_deltanet_prefill_op (the router's GDN prefill) against model.ops._ref_gated_deltanet: output, conv
    windows (bit for bit), states."""
    gen = torch.Generator().manual_seed(seed)
    n_slots = len(lens) + 2
    args = make_layer_inputs(gen, lens, hk, hv, dk, dv, dtype, n_slots)
    slots = torch.randperm(n_slots, generator=gen)[:len(lens)].to(DEVICE)
    ref_args = [t.clone() for t in args]
    step = prefill_step(lens, slots)
    out = gated_deltanet_prefill_op(*args, step, hk, EPS)
    ref = _ref_gated_deltanet(*ref_args, step, hk, EPS)
    what = f"op lens={lens} {dtype}"
    assert_close(out, ref, tol_out, f"{what} output")
    assert torch.equal(args[8], ref_args[8]), f"{what}: conv_states differ"
    assert_close(args[9], ref_args[9], tol_state, f"{what} recurrent_states")


def test_op_matches_reference_prefill():
    # dv 16: the output norm runs inside the output pass
    assert gdn_prefill.fuses_output_gate(16)
    check_op([3, 66, 1], 1, 2, 16, 16, torch.float32, 1e-5, 1e-5)


def test_op_matches_reference_prefill_unfused_output_norm():
    # dv past OUTPUT_BV: the output pass splits dv, and the output norm runs as its own kernel
    dv = gdn_prefill.OUTPUT_BV + 16
    assert not gdn_prefill.fuses_output_gate(dv)
    check_op([3, 66], 1, 1, 16, dv, torch.float32, 1e-5, 1e-5, seed=3)


def test_layers_of_one_step_share_its_plan_and_workspaces():
    # two GDN layers (their own weights and pools) through one StepInput equal each through a fresh one, bit for bit:
    # the second layer reuses the plan the first built and its workspaces (the conv output among them), and the
    # first layer's output is not one of them
    lens, hk, hv, d = [3, 66, 1], 1, 2, 16
    gen = torch.Generator().manual_seed(7)
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    layers = [make_layer_inputs(gen, lens, hk, hv, d, d, torch.float32, 5) for _ in range(2)]
    alone = [gated_deltanet_prefill_op(*[t.clone() for t in args], prefill_step(lens, slots), hk, EPS)
             for args in layers]
    step = prefill_step(lens, slots)
    shared = [gated_deltanet_prefill_op(*args, step, hk, EPS) for args in layers]
    plan = step.plans["varlen"][1]
    assert all(torch.equal(a, b) for a, b in zip(alone, shared))
    assert shared[0].data_ptr() not in {t.data_ptr() for t in plan.buffers.values()}
    assert gdn_prefill.step_plan(step, sum(lens)) is plan
    # a step whose batch changed since gets a new plan
    step.cu_seqlens_host, step.cu_seqlens = (0, 3, 68, 70), torch.tensor([0, 3, 68, 70], dtype=torch.int32,
                                                                        device=DEVICE)
    assert gdn_prefill.step_plan(step, 70) is not plan


def test_a_plan_of_another_batch_is_refused():
    from kernels.causal_conv1d import causal_conv1d_varlen
    from kernels.varlen import plan_varlen
    gen = torch.Generator().manual_seed(8)
    x, w, pool = torch.randn(8, 4, generator=gen), torch.randn(4, CONV_K, generator=gen), torch.randn(3, 4, CONV_K - 1)
    slots, cu = torch.tensor([0, 1]), torch.tensor([0, 3, 8], dtype=torch.int32)
    other = plan_varlen(torch.tensor([0, 4, 8], dtype=torch.int32), 8, slots)
    with pytest.raises(ValueError, match="plan was built for another batch"):
        causal_conv1d_varlen(x, w, pool, slots, cu, plan=other)
    with pytest.raises(ValueError, match="plan was built for another batch"):
        causal_conv1d_varlen(x[:7], w, pool, slots, other.cu_seqlens, plan=other)


def test_output_gate_rejects_bad_arguments():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(5, 1, 16, generator=gen) for _ in range(3))
    g, beta = -torch.rand(5, 1, generator=gen), torch.rand(5, 1, generator=gen)
    kw = dict(recurrent_states=torch.zeros(1, 1, 16, 16), state_slots=torch.zeros(1, dtype=torch.int32),
              cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    z, w = torch.randn(5, 1, 16, generator=gen), torch.ones(16)
    for bad, match in (((z[:, :, :8], w, 1e-6), "z"), ((z, w[:8], 1e-6), "weight"),
                       ((z.double(), w, 1e-6), "z must have dtype")):
        with pytest.raises(ValueError, match=match):
            gdn_prefill.prefill_passes(q, k, v, g, beta, output_gate=bad, **kw)
    with pytest.raises(ValueError, match="exclusive"):
        gdn_prefill.prefill_passes(q, k, v, g, beta, output_gate=(z, w, 1e-6), out=torch.empty_like(v), **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_wy_pass_computes_the_gates_from_raw_a_and_b(dtype):
    # gate_params: the WY pass takes the in-projection's a, b (strided rows of one buffer) and computes g, beta
    # itself; the same as gdn_gates first
    gen = torch.Generator().manual_seed(11)
    q, k, v, _, _, cu, pool, slots = make_inputs(gen, [3, 66, 1], 1, 2, 16, 16, dtype, 5)
    ab = torch.randn(70, 7, generator=gen).to(dtype).to(DEVICE)  # a | b | other columns of one projection
    a, b = ab[:, :2], ab[:, 2:4]
    a_log, dt_bias = torch.rand(2, generator=gen).to(DEVICE), torch.randn(2, generator=gen).to(DEVICE)
    g, beta = R.gdn_gates(a, b, a_log, dt_bias)
    kw = dict(state_slots=slots, cu_seqlens=cu)
    ref_states, states = pool.clone(), pool.clone()
    ref = chunk_gated_delta_rule(q, k, v, g, beta, recurrent_states=ref_states, **kw)
    out, passes = gdn_prefill.prefill_passes(q, k, v, a, b, recurrent_states=states, gate_params=(a_log, dt_bias),
                                             **kw)
    for run_pass in passes:
        run_pass()
    assert_close(out, ref, 1e-6 if dtype == torch.float32 else 2e-3, f"raw gates {dtype} output")
    assert_close(states, ref_states, 1e-6, f"raw gates {dtype} states")
    for bad, match in (((a_log[:1], dt_bias), "A_log"), ((a_log, dt_bias.long()), "dt_bias")):
        with pytest.raises(ValueError, match=match):
            gdn_prefill.prefill_passes(q, k, v, a, b, recurrent_states=states, gate_params=bad, **kw)
    with pytest.raises(ValueError, match="^g"):
        gdn_prefill.prefill_passes(q, k, v, ab[:, 0:4:2], b, recurrent_states=states, gate_params=(a_log, dt_bias),
                                   **kw)


def test_op_dispatch():
    # the router (op gated_deltanet, keyed by gdn_prefill.gdn_key): steps of one token a sequence to the decode
    # kernel, longer ones to this prefill; the reference backend keeps the reference
    from kernels import registry
    gen = torch.Generator().manual_seed(9)
    slots = torch.tensor([1, 0], device=DEVICE)
    names = []
    for lens in ([1, 1], [2, 1], [64, 3]):
        key = gdn_prefill.gdn_key(*make_layer_inputs(gen, lens, 1, 2, 16, 16, torch.float32, 2),
                                  prefill_step(lens, slots), 1, EPS)
        names.append(registry.choose("gated_deltanet", key, "triton").name)
        assert registry.choose("gated_deltanet", key, "reference").name == "reference"
    assert names == ["gdn_decode", "gdn_prefill_chunked", "gdn_prefill_chunked"]
    assert [i.run for i in registry.impls("gated_deltanet", "triton") if i.name == "gdn_prefill_chunked"] == [
        gated_deltanet_prefill_op]


# ---- argument checks -----------------------------------------------------------------------------------------

def _valid_args():
    gen = torch.Generator().manual_seed(4)
    q, k, v, g, beta, cu, pool, slots = make_inputs(gen, [3, 2], 2, 4, 16, 16, torch.float32, 4)
    return dict(q=q, k=k, v=v, g=g, beta=beta, recurrent_states=pool, state_slots=slots, cu_seqlens=cu)


BAD_ARGS = [  # (the argument the error must name, a function of the valid arguments returning a bad value)
    ("q", lambda d: d["q"].double()),
    ("q", lambda d: d["q"][..., ::2]),
    ("k", lambda d: d["k"][1:]),
    ("k", lambda d: d["k"].half()),
    ("v", lambda d: d["v"][:, :3]),
    ("v", lambda d: d["v"][1:]),
    ("v", lambda d: d["v"].half()),
    ("g", lambda d: d["g"].half()),
    ("beta", lambda d: d["beta"][:, :1]),
    ("recurrent_states", lambda d: d["recurrent_states"].transpose(2, 3)),
    ("recurrent_states", lambda d: d["recurrent_states"][:, :1]),
    ("recurrent_states", lambda d: d["recurrent_states"].half()),
    ("state_slots", lambda d: d["state_slots"][:1]),
    ("state_slots", lambda d: d["state_slots"].float()),
    ("cu_seqlens", lambda d: torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)),
    ("cu_seqlens", lambda d: torch.tensor([0, 3, 2, 5], dtype=torch.int32, device=DEVICE)),
    ("out", lambda d: torch.empty(5, 4, 8, device=DEVICE)),
    ("cu_seqlens_host", lambda d: [0, 5]),
    ("cu_seqlens_host", lambda d: [0, 3.0, 5]),
    ("cu_seqlens_host", lambda d: [0, 6, 5]),
]


@pytest.mark.parametrize("name,bad", BAD_ARGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_ARGS)])
def test_rejects_bad_arguments(name, bad):
    args = _valid_args()
    args[name] = bad(args)
    with pytest.raises(ValueError, match=f"^{name}"):
        chunk_gated_delta_rule(**args)


def test_rejects_head_dim_below_16():
    args = _valid_args()
    args["q"], args["k"] = args["q"][..., :8].contiguous(), args["k"][..., :8].contiguous()
    args["recurrent_states"] = args["recurrent_states"][:, :, :8].contiguous()
    with pytest.raises(ValueError, match="^dk and dv"):
        chunk_gated_delta_rule(**args)


def test_rejects_mixed_devices():
    args = _valid_args()
    args["g"] = torch.empty(args["g"].shape, device="meta")
    with pytest.raises(ValueError, match="share one device"):
        chunk_gated_delta_rule(**args)


# ---- GPU: bf16 at Qwen3.5-9B shapes ----------------------------------------------------------------------------

QWEN9B = (16, 32, 128, 128)  # Hk, Hv, dk, dv
REAL_LENS = [1, 65, 1000, 4097]
BF16_TOL = 1e-2  # the bar for bf16 against fp32: S is carried in fp32, its products take bf16 operands


@pytest.mark.gpu
def test_gpu_bf16_real_shapes_varlen():
    check_against_oracle(REAL_LENS, *QWEN9B, torch.bfloat16, BF16_TOL, BF16_TOL, seed=5)


@pytest.mark.gpu
def test_gpu_bf16_single_long_sequence():
    check_against_oracle([4097], *QWEN9B, torch.bfloat16, BF16_TOL, BF16_TOL, seed=6)


@pytest.mark.gpu
def test_gpu_bf16_op_real_shapes():
    check_op([65, 1, 1000], *QWEN9B, torch.bfloat16, BF16_TOL, BF16_TOL, seed=7)


SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from kernels import gdn_prefill as G
common = dict(HV=32, GROUP=2, DK=128, DV=128, BT=64, BK=128, L2NORM=True, SNAPSHOT=True, GATE=True,
              RAW_GATES=True)
fp32 = ("g_ptr", "beta_ptr", "gcum_ptr", "state_ptr", "scratch_ptr")
one = lambda bv, stages: [triton.Config({"BV": bv}, num_warps=8, num_stages=stages)]
for io, prec in (("bf16", "tf32"), ("fp32", "ieee")):
    for kern, configs in ((G._chunk_wy_kernel, one(128, 1)), (G._chunk_state_kernel, one(G.STATE_BV, G.STATE_STAGES)),
                          (G._chunk_output_kernel, one(G.OUTPUT_BV, 1))):
        fn = kern.fn if isinstance(kern, triton.runtime.Autotuner) else kern  # the JITFunction
        for cfg in configs:
            const = {n: v for n, v in dict(common, PREC=prec, **cfg.kwargs).items() if n in fn.arg_names}
            i32 = ("chunk_ptr", "cu_ptr", "first_chunk_ptr", "cuts_ptr")
            sig = {n: "constexpr" if n in const else "*i32" if n in i32 else
                   "*i64" if n in ("slots_ptr", "snap_slots_ptr") else "*fp32" if n in fp32 else
                   f"*{io}" if n.endswith("_ptr") else "fp32" if n in ("scale", "eps") else "i32" for n in fn.arg_names}
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n.endswith("_ptr")}
            k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
            print(f"{fn.__name__}:{io}:BV{cfg.kwargs['BV']}:w{cfg.num_warps}:s{cfg.num_stages}", k.metadata.shared)
"""


def test_kernels_fit_sm90_shared_memory():
    """The interpreter skips Triton's compiler: compile the three kernels for sm_90a at Qwen3.5's shapes
    (dk = dv = 128) with the launcher's configs, and check each fits the 227 KB of shared memory an SM gives one CTA."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", SM90_COMPILE], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines()]
    kernels = {"_chunk_wy_kernel", "_chunk_state_kernel", "_chunk_output_kernel"}
    assert {row[0].split(":")[0] for row in rows} == kernels and len(rows) == 2 * len(kernels), run.stdout
    for name, smem in rows:
        assert int(smem) <= 227 * 1024, f"{name}: {smem} bytes of shared memory"


@pytest.mark.parametrize("backend, dtype", [("reference", torch.float32), ("triton", torch.float32),
                                            ("triton", torch.float16)])
@pytest.mark.parametrize("lens, offsets, slots, snap_slots", [
    ([70, 5, 33], (64, 0, 16), [5, 0, 2], [7, 1, 3]),  # slot 1 is sequence 1's dummy: it must stay untouched
    ([70], (17,), [4], [6]),  # one sequence (a returning turn)
])
def test_snapshot_inside_a_chunk(backend, dtype, lens, offsets, slots, snap_slots):
    """model.ops.gated_deltanet with snapshot_offsets: the output and final states equal the plain step's (fp16:
    within its rounding, the pieces restart at the cut), and each snapshot slot holds the state after the
    sequence's first `offset` tokens (a step of only those tokens)."""
    from model import ops
    hk, hv, d, n_slots = 1, 2, 16, 8
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    layer = lambda: make_layer_inputs(torch.Generator().manual_seed(21), lens, hk, hv, d, d, dtype, n_slots)
    args, plain, start = layer(), layer(), layer()
    slots, snap_slots = torch.tensor(slots, device=DEVICE), torch.tensor(snap_slots, device=DEVICE)
    first = [i for i, o in enumerate(offsets) if o]
    with ops.use_backend(backend):
        ref = ops.gated_deltanet(*plain, prefill_step(lens, slots), hk, EPS)
        step = prefill_step(lens, slots)
        step.snapshot_offsets, step.snapshot_slots = offsets, snap_slots
        out = ops.gated_deltanet(*args, step, hk, EPS)
        rows = torch.cat([torch.arange(sum(lens[:i]), sum(lens[:i]) + offsets[i]) for i in first]).to(DEVICE)
        ops.gated_deltanet(*[t[rows] for t in start[:4]], *start[4:], prefill_step([offsets[i] for i in first],
                           slots[first]), hk, EPS)
    assert_close(out, ref, tol, f"{backend}: output with snapshots")
    assert torch.equal(args[8][slots], plain[8][slots]), "final conv windows differ"
    assert_close(args[9][slots], plain[9][slots], tol, f"{backend}: final states")
    for i in first:
        assert torch.equal(args[8][snap_slots[i]], start[8][slots[i]]), f"sequence {i}: snapshot window"
        assert_close(args[9][snap_slots[i]], start[9][slots[i]], tol, f"{backend}: sequence {i} snapshot state")
    touched = set(slots.tolist()) | {int(snap_slots[i]) for i in first}
    untouched = [s for s in range(n_slots) if s not in touched]
    assert torch.equal(args[9][untouched], plain[9][untouched]), "slots outside the step changed"


def test_compile_variants_runs_every_state_block_and_keeps_the_states(monkeypatch):
    """The warm-up's state passes: one sequence count per dv split (a card of 8 SMs, 2 heads of dv 32: 16 columns
    up to 3 sequences, 32 from 4), each with and without snapshots, on a pool whose states it leaves as they were."""
    monkeypatch.setattr(gdn_prefill, "FEW_PROGRAMS", 8)
    states = torch.randn(10, 2, 16, 32, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    before = states.clone()
    assert [gdn_prefill.state_block(n, 2, 32) for n in (1, 3, 4)] == [16, 16, 32]
    assert gdn_prefill.compile_variants(1, states, torch.float32) == 4
    assert torch.equal(states, before)
