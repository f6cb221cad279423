"""The varlen causal conv1d with slot states (kernels/causal_conv1d.py) against reference.causal_conv1d: outputs
within a relative error against the fp32 reference, new windows bit for bit, untouched slots unchanged. Runs in
Triton's interpreter on the CPU at small sizes; `gpu` tests at Qwen3.5's widths."""
import pytest
import torch
from conftest import assert_rel
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from kernels.causal_conv1d import causal_conv1d_varlen

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make(lens, channels, k, dtype, seed, n_slots=None, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    n_slots = n_slots or len(lens) + 3
    x = torch.randn(sum(lens), channels, generator=gen).to(dtype)
    w = (torch.randn(channels, k, generator=gen) * 0.5).to(dtype)
    pool = torch.randn(n_slots, channels, k - 1, generator=gen).to(dtype)
    slots = torch.randperm(n_slots, generator=gen)[:len(lens)]
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return [t.to(device) for t in (x, w, pool, slots, cu)]


def check(lens, channels=40, k=4, dtype=torch.float32, seed=0, host_cu=True, activation="silu"):
    x, w, pool, slots, cu = make(lens, channels, k, dtype, seed)
    ref_y, ref_windows = R.causal_conv1d(x.float(), w.float(), initial_state=pool[slots].float(), cu_seqlens=cu,
                                         activation=activation)
    ref_y_io, _ = R.causal_conv1d(x, w, initial_state=pool[slots], cu_seqlens=cu, activation=activation)
    states = pool.clone()
    y = causal_conv1d_varlen(x, w, states, slots, cu, cu_seqlens_host=tuple(cu.tolist()) if host_cu else None,
                             activation=activation)
    what = f"lens={lens} C={channels} K={k} {dtype}"
    assert y.dtype == dtype
    if sum(lens):
        assert_rel(y.float(), ref_y, TOL[dtype], f"{what} output vs fp32")
        assert_rel(y.float(), ref_y_io.float(), TOL[dtype], f"{what} output vs the io-dtype reference")
    assert torch.equal(states[slots], ref_windows.to(dtype)), f"{what}: new windows differ"
    others = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    others[slots] = False
    assert torch.equal(states[others], pool[others]), f"{what}: slots outside state_slots changed"


@pytest.mark.parametrize("lens", [[1], [2], [65], [3, 0, 1, 130, 2], [64, 64, 1]])
def test_matches_reference_fp32(lens):
    check(lens, seed=len(lens))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_reference_16bit(dtype):
    check([17, 1, 70], channels=136, dtype=dtype, seed=3)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_other_kernel_widths_and_no_activation(k):
    check([1, 2, 9], k=k, seed=k, activation=None if k == 3 else "silu")


def test_device_cu_seqlens_only():
    check([5, 66], host_cu=False, seed=9)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 140), min_size=1, max_size=5), st.integers(1, 150), st.integers(0, 10**6))
def test_property_any_lengths_and_widths(lens, channels, seed):
    check(lens, channels=channels, seed=seed)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 140), st.data())
def test_property_split_sequence_matches_one_call_bit_for_bit(n, data):
    """A sequence convolved in two calls (its first p tokens, then the rest from the window they left: a prefix-cache
    hit) gives the very outputs of one call, bit for bit in fp32: the window's taps are summed in the same order as
    the tokens'."""
    p = data.draw(st.integers(0, n), label="split")
    x, w, pool, slots, _ = make([n], 24, 4, torch.float32, seed=n)
    whole, parts = pool.clone(), pool.clone()
    y = causal_conv1d_varlen(x, w, whole, slots, torch.tensor([0, n], dtype=torch.int32, device=DEVICE))
    ys = [causal_conv1d_varlen(x[lo:hi], w, parts, slots, torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE))
          for lo, hi in ((0, p), (p, n))]
    assert torch.equal(torch.cat(ys), y), f"split at {p} of {n}"
    assert torch.equal(parts, whole)


BAD = [  # (the argument the error must name, a change to the valid arguments)
    ("x", lambda a: a.update(x=a["x"][:, None])),
    ("x", lambda a: a.update(x=a["x"].to(torch.int32))),
    ("weight", lambda a: a.update(weight=a["weight"][:5])),
    ("conv_states", lambda a: a.update(conv_states=a["conv_states"][:, :, :2])),
    ("state_slots", lambda a: a.update(state_slots=a["state_slots"][:1])),
    ("state_slots", lambda a: a.update(state_slots=a["state_slots"].float())),
    ("cu_seqlens", lambda a: a.update(cu_seqlens=a["cu_seqlens"] + 1, cu_seqlens_host=None)),
    ("cu_seqlens", lambda a: a.update(cu_seqlens=a["cu_seqlens"][:, None])),
    ("cu_seqlens_host", lambda a: a.update(cu_seqlens_host=(0, 1, 2))),
    ("activation", lambda a: a.update(activation="gelu")),
    ("out", lambda a: a.update(out=torch.empty(3, 3, device=DEVICE))),
]


@pytest.mark.parametrize("name, change", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_arguments_name_the_argument(name, change):
    x, w, pool, slots, cu = make([3, 4], 8, 4, torch.float32, 1)
    args = dict(x=x, weight=w, conv_states=pool, state_slots=slots, cu_seqlens=cu, cu_seqlens_host=tuple(cu.tolist()))
    change(args)
    with pytest.raises(ValueError, match=name):
        causal_conv1d_varlen(args.pop("x"), args.pop("weight"), args.pop("conv_states"), args.pop("state_slots"),
                             args.pop("cu_seqlens"), **args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_qwen_widths(dtype):
    """Qwen3.5-2B's GDN conv (6144 channels) and 9B's (8192), over a varlen batch with a decode-like row."""
    check([800, 1, 3, 2048], channels=6144, dtype=dtype, seed=11)
    check([4097, 65], channels=8192, dtype=dtype, seed=12)


@pytest.mark.parametrize("lens, offsets", [([70, 5, 3], (64, 0, 1)), ([9], (2,)), ([2, 66], (1, 65))])
def test_snapshot_windows(lens, offsets):
    """snapshot_offsets: the window after each sequence's first offset tokens goes to its snapshot slot (offsets
    below K-1 keep part of the old window), the outputs and final windows are unchanged, other slots untouched."""
    x, w, pool, slots, cu = make(lens, 24, 4, torch.float32, seed=sum(lens), n_slots=2 * len(lens) + 1)
    snap = torch.tensor([s for s in range(pool.shape[0]) if s not in slots.tolist()][:len(lens)], device=DEVICE)
    plain, states = pool.clone(), pool.clone()
    y_plain = causal_conv1d_varlen(x, w, plain, slots, cu)
    y = causal_conv1d_varlen(x, w, states, slots, cu, snapshot_offsets=offsets, snapshot_slots=snap)
    assert torch.equal(y, y_plain) and torch.equal(states[slots], plain[slots])
    for i, o in enumerate(offsets):
        if o:
            start = int(cu[i])
            _, window = R.causal_conv1d(x[None, start:start + o], w, initial_state=pool[slots[i]][None])
            assert torch.equal(states[snap[i]], window[0]), f"sequence {i}: snapshot window after {o} tokens"
    kept = [s for s in range(pool.shape[0]) if s not in slots.tolist() and s not in snap[[i for i, o in
            enumerate(offsets) if o]].tolist()]
    assert torch.equal(states[kept], pool[kept])
