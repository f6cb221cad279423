"""kernels.argmax (the greedy tokens of a decode step) against reference.argmax (torch.argmax): the first maximum
of each row, a NaN counting as the largest; rows of 1, 2, 65 and more columns, chunk boundaries, ties across chunks,
-inf rows, strided rows; hypothesis over sizes and ties; the GPU test at Qwen3.5's vocabulary, replayed in a CUDA
graph (each launch leaves its tickets at zero for the next)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from kernels.argmax import CHUNK, argmax
from tests.conftest import HAS_CUDA, compiled_script_output

DEV = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def logits_of(rows: int, v: int, dtype, seed: int) -> torch.Tensor:
    return torch.randn(rows, v, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,v", [(1, 1), (1, 2), (3, 65), (2, CHUNK - 1), (1, CHUNK), (2, CHUNK + 1),
                                    (1, 3 * CHUNK + 5)])
def test_argmax_matches_torch(dtype, rows, v):
    x = logits_of(rows, v, dtype, seed=rows * 7 + v)
    assert torch.equal(argmax(x), R.argmax(x))


@pytest.mark.parametrize("cols", [[5, CHUNK + 5], [CHUNK + 5, 2 * CHUNK + 1], [0, 2 * CHUNK], [7, 8]])
def test_ties_take_the_first_index(cols):
    """The maximum repeated in two chunks (or twice in one): the earlier column wins, whichever chunk ends last."""
    x = logits_of(2, 3 * CHUNK, torch.bfloat16, seed=1)
    x[:, cols] = 10.0
    assert argmax(x).tolist() == [cols[0], cols[0]] == R.argmax(x).tolist()


def test_nan_wins_and_the_first_nan_is_taken():
    x = logits_of(4, 2 * CHUNK + 3, torch.float32, seed=2)
    x[0, [CHUNK + 3, 9]] = float("nan")  # the first NaN is in the first chunk
    x[1, 2 * CHUNK + 1] = float("nan")  # a NaN in the last, ragged chunk
    x[1, 4] = float("inf")
    x[2] = float("-inf")  # all -inf: column 0
    x[3, 100] = float("inf")
    got = argmax(x)
    assert got.tolist() == [9, 2 * CHUNK + 1, 0, 100] == R.argmax(x).tolist()


def test_strided_rows_and_out():
    x = logits_of(3, 2 * CHUNK + 40, torch.bfloat16, seed=3)[:, 17:CHUNK + 60]  # row stride != width
    out = torch.full((3,), -1, dtype=torch.int64, device=DEV)
    assert argmax(x, out=out) is out and torch.equal(out, R.argmax(x))


def test_repeated_launches_reuse_their_tickets():
    """The last program of a row resets its ticket: a second launch of the same shape elects a last program again."""
    for seed in range(3):
        x = logits_of(2, CHUNK + 7, torch.float32, seed=seed)
        assert torch.equal(argmax(x), R.argmax(x))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 3), v=st.integers(1, 3 * CHUNK), ties=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_argmax_property(rows, v, ties, seed):
    x = logits_of(rows, v, torch.bfloat16, seed)
    gen = torch.Generator().manual_seed(seed)
    cols = torch.randint(0, v, (ties,), generator=gen).tolist()
    x[:, cols] = 8.0  # bf16 ties, possibly across chunks
    assert torch.equal(argmax(x), R.argmax(x))


def advance_case(bs: int, page: int, width: int, seed: int) -> R.DecodeAdvance:
    """Decode inputs (5, bs) of random rows (a dummy-slot padding row last when bs > 1) over a random page table;
    positions reach page boundaries and the table's last column."""
    gen = torch.Generator().manual_seed(seed)
    slots, dummy = torch.randperm(6, generator=gen)[:bs].int(), 7
    if bs > 1:
        slots[-1] = dummy
    positions = torch.randint(0, page * width, (bs,), generator=gen).int()
    positions[0] = page - 1  # the next position opens a page
    if bs > 2:
        positions[1] = page * width - 1  # the next position is past the table: its column is clamped
    table = torch.randint(0, 1000, (8, width), generator=gen).int()
    kv = table[slots.long(), (positions // page).long()] * page + positions % page
    inputs = torch.stack([torch.randint(0, 50, (bs,), generator=gen).int(), positions, slots, kv, positions + 1])
    return R.DecodeAdvance(inputs.to(DEV), table.to(DEV), page, dummy)


@pytest.mark.parametrize("bs,page,width", [(1, 16, 4), (3, 16, 3), (5, 24, 6)])
def test_advance_writes_the_next_decode_inputs(bs, page, width):
    """argmax(logits, advance): the tokens as before, and advance.inputs moved on one position (the token, position,
    KV slot through the page table, cached tokens) for every row but the dummy slot's, as the reference does."""
    x = logits_of(bs, 2 * CHUNK + 9, torch.float32, seed=bs)
    got, want = advance_case(bs, page, width, seed=bs), advance_case(bs, page, width, seed=bs)
    before = got.inputs.clone()
    tokens = argmax(x, got)
    R.advance_decode_inputs(R.argmax(x), want)
    assert torch.equal(tokens, R.argmax(x)) and torch.equal(got.inputs, want.inputs)
    moved = before[2] != got.dummy_slot
    assert torch.equal(got.inputs[1], torch.where(moved, before[1] + 1, before[1]))
    assert torch.equal(got.inputs[:, ~moved], before[:, ~moved])  # padding rows as they were
    assert int(got.inputs[3, 0]) == int(got.table[got.inputs[2, 0], 1]) * page  # the first slot of the next page


@pytest.mark.parametrize("bs,ring_rows", [(1, 2), (3, 4), (5, 3)])
def test_advance_lands_tokens_in_the_ring(bs, ring_rows):
    """advance.token_ring: each real row's token also at [position % R, row] (its position before the advance), as the
    reference leaves it; padding rows and the other ring cells untouched. On CUDA the ring is pinned host memory."""
    x = logits_of(bs, CHUNK + 17, torch.bfloat16, seed=30 + bs)
    rings = [torch.full((ring_rows, bs), -1, dtype=torch.int64, pin_memory=HAS_CUDA) for _ in range(2)]
    got, want = (advance_case(bs, 16, 4, seed=bs)._replace(token_ring=r) for r in rings)
    positions, slots = got.inputs[1].cpu().long(), got.inputs[2].cpu()
    tokens = argmax(x, got)
    if HAS_CUDA:
        torch.cuda.synchronize()
    R.advance_decode_inputs(R.argmax(x), want)
    assert torch.equal(rings[0], rings[1]) and torch.equal(got.inputs, want.inputs)
    real = slots != got.dummy_slot
    expect = torch.full((ring_rows, bs), -1, dtype=torch.int64)
    expect[positions[real] % ring_rows, real.nonzero()[:, 0]] = tokens.cpu()[real]
    assert torch.equal(rings[0], expect)


@pytest.mark.parametrize("ring,match", [
    (lambda bs: torch.zeros(4, bs, dtype=torch.int32), "token_ring"),
    (lambda bs: torch.zeros(4, bs + 1, dtype=torch.int64), r"\(R >= 2, 3\)"),
    (lambda bs: torch.zeros(1, bs, dtype=torch.int64), r"\(R >= 2, 3\)"),
    (lambda bs: torch.zeros(bs, 4, dtype=torch.int64).t(), "contiguous along B"),
])
def test_bad_token_ring_names_the_argument(ring, match):
    advance = advance_case(3, 16, 4, seed=3)._replace(token_ring=ring(3))
    with pytest.raises(ValueError, match=match):
        argmax(logits_of(3, 70, torch.float32, 3), advance)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_token_ring_in_unpinned_host_memory_is_refused():
    # a CUDA kernel cannot store into pageable host memory: a clear error, not a fault
    advance = advance_case(3, 16, 4, seed=3)._replace(token_ring=torch.zeros(4, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="pinned host memory"):
        argmax(logits_of(3, 70, torch.float32, 3), advance)


SM90_ADVANCE = """
from kernels import argmax as A
from tests.sm90_compile import triton_sm90
arg_type = lambda n: {"logits_ptr": "*bf16", "part_val_ptr": "*fp32", "stamps_ptr": "*i64", "out_ptr": "*i64",
                      "ring_ptr": "*i64"}.get(n, "*i32" if n.endswith("_ptr") else "i32")
for advance, ring in ((False, False), (True, False), (True, True)):
    r = triton_sm90(A._argmax_kernel, dict(CHUNK=A.CHUNK, P=122, PB=128, ADVANCE=advance, RING=ring, STAMPS=False,
                                           PDL=True), arg_type, A.NUM_WARPS, 1)
    print(r["regs"], r["spill"], r["ptx"].count("st.global"), r["ptx"].count("ld.global"), flush=True)
"""


def test_advance_compiles_for_sm90_into_the_last_program():
    # sm_90a on the CPU: the advance adds the next inputs' four stores and its three loads (state slot, position,
    # page-table entry), the token ring one store more; no spill, no more registers than the argmax's
    lines = compiled_script_output(SM90_ADVANCE).splitlines()
    plain, advance, ring = [tuple(map(int, line.split())) for line in lines]
    assert advance[1] == plain[1] == ring[1] == 0 and max(advance[0], ring[0]) <= max(plain[0], 64), lines
    assert advance[2] - plain[2] == 4 and advance[3] - plain[3] == 3, (plain, advance)
    assert ring[2] - advance[2] == 1 and ring[3] == advance[3], (advance, ring)


@pytest.mark.parametrize("bad,match", [
    (lambda: torch.randn(4, device=DEV), "logits"),
    (lambda: torch.randint(0, 5, (2, 8), device=DEV), "logits"),
    (lambda: torch.randn(8, 2, device=DEV).t(), "contiguous within a row"),
    (lambda: torch.randn(2, 0, device=DEV), "1 <= V"),
])
def test_bad_input_names_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        argmax(bad())


def test_bad_out_names_the_argument():
    with pytest.raises(ValueError, match="out"):
        argmax(torch.randn(2, 8, device=DEV), out=torch.empty(2, dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("field,bad,match", [
    ("inputs", lambda a: a.inputs[:4], r"advance.inputs must be \(5, 2\)"),
    ("inputs", lambda a: a.inputs.long(), "advance.inputs must have dtype"),
    ("table", lambda a: a.table.t(), "advance.table must be contiguous"),
    ("page_size", lambda a: 0, "advance.page_size"),
])
def test_bad_advance_names_the_argument(field, bad, match):
    advance = advance_case(2, 16, 4, seed=0)
    with pytest.raises(ValueError, match=match):
        argmax(logits_of(2, 8, torch.float32, seed=0), advance._replace(**{field: bad(advance)}))


def test_empty_batch():
    assert argmax(torch.randn(0, 8, device=DEV)).shape == (0,)


@pytest.mark.gpu
def test_argmax_in_a_cuda_graph_at_the_vocabulary():
    """Qwen3.5's 248320 columns at the decode graph's batch sizes, captured once and replayed on new logits."""
    for rows in (1, 4, 64):
        x = logits_of(rows, 248320, torch.bfloat16, seed=rows)
        argmax(x)  # the workspace, outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = argmax(x)
        for seed in range(3):
            x.copy_(logits_of(rows, 248320, torch.bfloat16, seed=100 + seed))
            x[0, [70000, 200000]] = 30.0  # a tie across chunks
            graph.replay()
            assert torch.equal(out, R.argmax(x)) and out[0] == 70000


def test_workspace_grows_and_keeps_what_graphs_were_captured_with():
    """A call that needs more room gets a bigger workspace; the smaller one stays allocated (a graph captured with it
    still writes there), and later smaller calls take the newest."""
    import kernels.argmax as A
    dev = torch.device(DEV)
    first = A._workspace(dev, 1, 2)
    bigger = A._workspace(dev, 3, 4)
    assert bigger[0].numel() >= 12 and bigger[2].numel() >= 3 and A._workspace(dev, 1, 2) is bigger
    assert any(w is first for w in A._workspaces[dev])
