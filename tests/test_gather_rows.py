"""kernels.gather_rows (a decode step's embeddings, page-table rows and RoPE rows in one launch) against
reference.gather_rows (index_select): one to four tables of different dtypes and widths (1, 65, chunk edges, rows
wider than a chunk), batches of 1, 2 and 5 with repeated indices, int32 and int64 indices, hypothesis over the
sizes; the bad-argument errors; on the GPU, replayed in a CUDA graph with new indices."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from kernels.gather_rows import CHUNK, MAX_TABLES, gather_rows
from tests.conftest import HAS_CUDA

DEV = "cuda" if HAS_CUDA else "cpu"
DTYPES = (torch.bfloat16, torch.int32, torch.float32, torch.float16)


def table_of(rows: int, width: int, dtype, gen) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(rows, width, generator=gen).to(dtype).to(DEV)
    return torch.randint(-2**30, 2**30, (rows, width), generator=gen, dtype=dtype).to(DEV)


def case(widths, batch, seed, index_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    tables = [table_of(3 + 2 * k, w, DTYPES[k % len(DTYPES)], gen) for k, w in enumerate(widths)]
    indices = [torch.randint(t.shape[0], (batch,), generator=gen).to(index_dtype).to(DEV) for t in tables]
    return tables, indices


def assert_gathers(tables, indices):
    got, want = gather_rows(tables, indices), R.gather_rows(tables, indices)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("widths", [[1], [65, 7], [CHUNK, CHUNK + 1, 3], [2050, 16, 33, 33]])
@pytest.mark.parametrize("batch", [1, 2, 5])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_rows_matches_index_select(widths, batch, index_dtype):
    assert_gathers(*case(widths, batch, seed=batch * 31 + len(widths), index_dtype=index_dtype))


def test_repeated_indices_and_strided_tables():
    """Two rows of the batch read one row; a table that is a column slice of a wider one (row stride > width)."""
    gen = torch.Generator().manual_seed(3)
    wide = table_of(6, 3 * CHUNK, torch.bfloat16, gen)
    tables = [wide[:, 5:5 + CHUNK + 7], table_of(4, 9, torch.int32, gen)]
    indices = [torch.tensor([2, 2, 5], device=DEV), torch.tensor([3, 0, 3], device=DEV, dtype=torch.int32)]
    assert_gathers(tables, indices)


@settings(max_examples=25, deadline=None)
@given(widths=st.lists(st.integers(1, 2 * CHUNK + 3), min_size=1, max_size=MAX_TABLES), batch=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_gather_rows_property(widths, batch, seed):
    assert_gathers(*case(widths, batch, seed))


def test_empty_batch_gives_empty_rows():
    tables, _ = case([5, 7], 1, seed=0)
    outs = gather_rows(tables, [torch.zeros(0, dtype=torch.int64, device=DEV)] * 2)
    assert [tuple(o.shape) for o in outs] == [(0, 5), (0, 7)]


@pytest.mark.parametrize("bad,match", [
    (lambda t, i: (t, i[:1]), "tables and indices"),
    (lambda t, i: ([], []), "tables and indices"),
    (lambda t, i: (t * 3, i * 3), "tables and indices"),
    (lambda t, i: ([t[0][0]] + t[1:], i), r"tables\[0\]"),
    (lambda t, i: (t, [i[0].float()] + i[1:]), r"indices\[0\]"),
    (lambda t, i: (t, [i[0], i[1][:1]]), r"indices\[1\] has 1 entries"),
    (lambda t, i: ([t[0], t[1].t()], i), r"tables\[1\] must have rows and be contiguous"),
    (lambda t, i: (t, [i[0], i[1].view(-1, 1)]), r"indices\[1\]"),
])
def test_bad_arguments_name_themselves(bad, match):
    tables, indices = case([8, 4], 2, seed=1)
    with pytest.raises(ValueError, match=match):
        gather_rows(*bad(tables, indices))


def test_reference_refuses_indices_past_the_table():
    tables, indices = case([8], 2, seed=2)
    with pytest.raises(ValueError, match=r"indices\[0\] must lie in \[0, 3\)"):
        R.gather_rows(tables, [indices[0] + 3])


@pytest.mark.gpu
def test_gather_rows_replays_in_a_cuda_graph():
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    tables, indices = case([1024, 4096, 32, 32], 3, seed=4)
    gather_rows(tables, indices)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = gather_rows(tables, indices)
    for seed in (5, 6):
        _, fresh = case([1024, 4096, 32, 32], 3, seed=seed)
        for idx, new in zip(indices, fresh):
            idx.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        for o, w in zip(outs, R.gather_rows(tables, indices)):
            assert torch.equal(o, w)
