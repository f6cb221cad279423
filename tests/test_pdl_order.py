"""Programmatic dependent launch in Triton's interpreter: what the previous kernel of a decode step writes holds NaN
from each program's start until its `pdl.wait_for_producer`, so a kernel that reads it before the wait (a load moved
above the wait by mistake) computes NaN or a wrong answer here. The interpreter runs programs one at a time, and on
a GPU the wait is the only ordering: these tests are the CPU check of what each kernel loads before it (the split-KV
attention's sequence lengths, the GDN decode's states and conv windows, the greedy argmax)."""
import collections
import contextlib
import math

import pytest
import torch
from conftest import record_launches, rel_err
from test_decode_attention import make_cache, reference
from test_gdn_decode import EPS, decode_step, make_layer, make_token

import kernels.gdn_decode as gdn_decode
import kernels.paged_decode_attention as attention
from kernels import pdl
from kernels.argmax import CHUNK, argmax
from model.ops import _ref_gated_deltanet

interpreter = pytest.importorskip("triton.runtime.interpreter")
pytestmark = pytest.mark.skipif(not hasattr(interpreter, "interpreter_builder"),
                                reason="needs Triton's interpreter (its per-program hook)")


@contextlib.contextmanager
def written_by_the_previous_kernel(monkeypatch, regions: list[tuple[torch.Tensor, torch.Tensor]], restore=True):
    """regions: (tensor, bool mask) the step's previous kernel writes. Each program starts with them NaN; its wait
    puts the real values back (not with restore=False: then every read of them is NaN, the check of this check)."""
    real = [t[m].clone() for t, m in regions]

    def poison():
        for t, m in regions:
            t[m] = float("nan")

    def publish(PDL):
        if restore:
            for (t, m), r in zip(regions, real):
                t[m] = r

    builder = interpreter.interpreter_builder
    start = builder.set_grid_idx
    monkeypatch.setattr(builder, "set_grid_idx", lambda *idx: (start(*idx), poison()))
    monkeypatch.setattr(pdl, "wait_for_producer", publish)
    try:
        yield
    finally:
        for (t, m), r in zip(regions, real):
            t[m] = r


def new_key_slots(k_pages, table, seqused, q_lens, page) -> torch.Tensor:
    """(num_pages, page) bool: the slots of the keys the step's own tokens wrote (attention_prep's)."""
    mask = torch.zeros(k_pages.shape[:2], dtype=torch.bool)
    for b, (n, q_len) in enumerate(zip(seqused.tolist(), q_lens)):
        for pos in range(max(0, n - q_len), n):
            mask[int(table[b, pos // page]), pos % page] = True
    return mask


ATTENTION_CASES = [  # (lens, q_len, page, splits): first tiles of new keys only, pages that are not whole tiles
    ([1, 5, 70], 1, 16, 1), ([2, 64, 130], 2, 64, 3), ([5, 129], 5, 24, 9), ([300], 1, 16, 7),
]


@pytest.mark.parametrize("lens,q_len,page,splits", ATTENTION_CASES)
def test_split_kernel_reads_the_new_keys_and_q_after_the_wait(monkeypatch, lens, q_len, page, splits):
    k_pages, v_pages, table, seqused = make_cache(lens, 2, 64, page, torch.float32, seed=len(lens) + page)
    q = torch.randn(len(lens), q_len, 8, 64, generator=torch.Generator().manual_seed(splits))
    ref = reference(q, k_pages, v_pages, table, seqused)
    new = new_key_slots(k_pages, table, seqused, [q_len] * len(lens), page)[:, :, None, None].expand(k_pages.shape)
    regions = [(q, torch.ones_like(q, dtype=torch.bool)), (k_pages, new), (v_pages, new)]
    with written_by_the_previous_kernel(monkeypatch, regions):
        out = attention.paged_decode_attention(q, k_pages, v_pages, table, seqused, num_splits=splits)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-5, f"lens {lens}: {rel_err(out, ref):.2e}"


# one pass over a key head's value heads (EARLY: the states loaded before the wait), and 3 value heads a key head
# one a pass (loaded inside it)
@pytest.mark.parametrize("hk,hv,bsz,early", [(2, 4, 1, True), (1, 2, 3, True), (2, 2, 1, True), (1, 3, 2, False)])
def test_gdn_decode_reads_the_projection_after_the_wait(monkeypatch, hk, hv, bsz, early):
    launches = record_launches(monkeypatch, gdn_decode, "_gdn_decode_kernel")
    gen = torch.Generator().manual_seed(hk * 10 + hv + bsz)
    conv_w, a_log, dt_bias, norm_w, conv, states = make_layer(gen, hk, hv, 16, 16, torch.float32, bsz + 2, "cpu")
    slots = torch.randperm(bsz + 2, generator=gen)[:bsz]
    qkv, z, b, a = make_token(gen, bsz, hk, hv, 16, 16, torch.float32, "cpu")
    conv_ref, states_ref = conv.clone(), states.clone()
    ref = _ref_gated_deltanet(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, conv_ref, states_ref, decode_step(slots),
                              hk, EPS)
    regions = [(t, torch.ones_like(t, dtype=torch.bool)) for t in (qkv, z, b, a)]  # the in-projection's output
    with written_by_the_previous_kernel(monkeypatch, regions):
        out = gdn_decode.gdn_decode_step(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, conv, states, slots, hk, EPS)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-4
    assert torch.equal(conv, conv_ref) and rel_err(states, states_ref) < 1e-4
    assert [kwargs["EARLY"] for _, kwargs in launches] == [early]


@pytest.mark.parametrize("q_len", [1, 20])  # the decode variant's split and combine; the chunk variant's
def test_attention_programs_release_their_dependents_where_told(monkeypatch, q_len):
    """Every program of the split kernel (decode or chunk variant) waits, then lets the next kernel launch; every
    combine program lets it launch before its wait (the out-proj chain after it may launch while the split runs)."""
    events = []
    builder = interpreter.interpreter_builder
    start = builder.set_grid_idx
    monkeypatch.setattr(builder, "set_grid_idx", lambda *idx: (start(*idx), events.append("start")))
    monkeypatch.setattr(pdl, "wait_for_producer", lambda PDL: events.append("wait"))
    monkeypatch.setattr(pdl, "release_dependents", lambda PDL: events.append("release"))
    k_pages, v_pages, table, seqused = make_cache([70, 25], 2, 64, 16, torch.float32, seed=4)
    q = torch.randn(2, q_len, 8, 64, generator=torch.Generator().manual_seed(4))
    attention.paged_decode_attention(q, k_pages, v_pages, table, seqused, num_splits=2)
    kinds = collections.Counter(p.strip() for p in " ".join(events).split("start")[1:])
    assert set(kinds) == {"wait release", "release wait"}, kinds


def test_argmax_reads_the_logits_after_the_wait(monkeypatch):
    logits = torch.randn(2, 2 * CHUNK + 3, generator=torch.Generator().manual_seed(5))
    ref = logits.argmax(-1)
    with written_by_the_previous_kernel(monkeypatch, [(logits, torch.ones_like(logits, dtype=torch.bool))]):
        out = argmax(logits)
    assert torch.equal(out, ref)


@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_the_check_fails_a_read_it_does_not_publish(monkeypatch):
    """With the wait publishing nothing, the attention output is wrong: the poisoning reaches the kernel (and q is
    whole again after the check)."""
    k_pages, v_pages, table, seqused = make_cache([70], 2, 64, 16, torch.float32, seed=3)
    q = torch.randn(1, 1, 8, 64)
    ref = reference(q, k_pages, v_pages, table, seqused)
    with written_by_the_previous_kernel(monkeypatch, [(q, torch.ones_like(q, dtype=torch.bool))], restore=False):
        out = attention.paged_decode_attention(q, k_pages, v_pages, table, seqused, num_splits=2)
    assert not (torch.isfinite(out).all() and rel_err(out, ref) < 1e-2)
    assert not math.isnan(float(q.sum()))
