"""kernels/argmax.py against torch.argmax (the oracle: the sampler's greedy token), bit for bit.

Interpreter tests run odd row widths around the chunk size, ties across chunks, NaN and -inf rows; the `gpu` test runs
the 248320-wide vocabulary in bf16 at decode batch sizes, inside a CUDA graph."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.argmax import CHUNK, argmax_rows

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _check(logits: torch.Tensor) -> None:
    tokens = argmax_rows(logits)
    assert tokens.dtype == torch.int64 and tokens.shape == (logits.shape[0],)
    assert torch.equal(tokens, logits.argmax(-1)), (tokens, logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, n", [(1, 1), (2, 2), (3, 65), (1, CHUNK), (2, CHUNK + 1), (3, 2 * CHUNK + 905)])
def test_matches_torch_argmax(rows, n, dtype):
    _check((3 * torch.randn(rows, n, device=DEV)).to(dtype))


def test_ties_go_to_the_first_index_across_chunks():
    logits = torch.randn(3, 3 * CHUNK + 7, device=DEV)
    logits[0, [5, CHUNK + 5, 2 * CHUNK]] = 9.0  # the first chunk holds the first of three equal maxima
    logits[1, [CHUNK + 1, 3 * CHUNK + 6]] = 9.0  # the first is in the second chunk
    logits[2] = 1.0  # every column ties
    _check(logits)
    assert argmax_rows(logits).tolist() == [5, CHUNK + 1, 0]


def test_nan_wins_as_in_torch_and_minus_inf_rows_give_zero():
    logits = torch.randn(4, 2 * CHUNK + 3, device=DEV)
    logits[0, CHUNK + 9] = float("nan")
    logits[0, 3] = float("inf")  # an earlier +inf: the NaN still wins
    logits[1, [7, CHUNK]] = float("nan")
    logits[2] = float("-inf")
    logits[3, -1] = float("inf")
    _check(logits)
    assert argmax_rows(logits).tolist() == [CHUNK + 9, 7, 0, 2 * CHUNK + 2]


def test_a_strided_batch_of_rows():
    wide = torch.randn(3, 2 * CHUNK + 300, device=DEV)
    wide[:, CHUNK + 150:] = float("nan")  # past each row: would win if read
    _check(wide[:, : CHUNK + 150])  # rows a wider stride apart


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 3 * CHUNK), levels=st.integers(1, 40), seed=st.integers(0, 999))
def test_property_few_distinct_values(rows, n, levels, seed):
    # few distinct values: many ties, at random places
    g = torch.Generator().manual_seed(seed)
    _check(torch.randint(levels, (rows, n), generator=g).float().to(DEV))


@pytest.mark.parametrize("bad, match", [(torch.zeros(5), "logits"), (torch.zeros(2, 4, dtype=torch.int32), "logits"),
                                        (torch.zeros(4, 3).t(), "unit stride"), (torch.zeros(2, 0), "column")])
def test_bad_input_names_logits(bad, match):
    with pytest.raises(ValueError, match=match):
        argmax_rows(bad.to(DEV))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_vocabulary_rows_in_a_cuda_graph(rows):
    logits = torch.randn(rows, 248320, device="cuda").to(torch.bfloat16)
    argmax_rows(logits)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens = argmax_rows(logits)
    for seed in (1, 2):
        logits.copy_(torch.randn(rows, 248320, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        assert torch.equal(tokens, logits.argmax(-1)), seed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_sampler_takes_it_when_switched_on(monkeypatch):
    from serving import sampler
    calls = []
    monkeypatch.setattr(sampler, "_argmax_rows", lambda logits: calls.append(logits.shape) or argmax_rows(logits))
    logits = torch.randn(3, 248320, device="cuda").to(torch.bfloat16)
    for on in (False, True):
        monkeypatch.setattr(sampler, "TRITON_ARGMAX", on)
        assert torch.equal(sampler.sample(logits, [None] * 3, [None] * 3), logits.argmax(-1))
    assert calls == [(3, 248320)]
