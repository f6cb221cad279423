"""Paged decode attention (kernels/paged_decode_attention.py) against reference.paged_attention in fp32.

Interpreter tests (CPU, fp16/fp32, small head counts) cover head dims 64/128, contexts 1, 2, 65 and ~300,
page sizes 16, 24 and 64 over shuffled pages of a bigger pool whose unused slots hold NaN, GQA 1/2/4/8,
q_len 1, 2 and 5, varlen batches, more splits than keys (empty splits) and the fused gate. `gpu` tests cover
bf16/fp16, head dims 128/256, contexts up to 33k, q_len 1..8 and CUDA-graph replay with new lengths.
"""
import math

import pytest
import torch

import reference as R
from kernels.paged_decode_attention import (
    MAX_SPLITS,
    DecodeWorkspace,
    alloc_workspace,
    captured_splits,
    captured_work_grid,
    choose_num_splits,
    paged_attention_op,
    paged_decode_attention,
    step_splits,
    work_items,
)
from model.ops import _ref_paged_attention
from model.step import StepInput
from tests.conftest import HAS_CUDA, compiled_script_output, rel_err
from tests.sm90_compile import CHAIN_CTA_REGS, CHAIN_CTA_SMEM

DEV = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make_cache(lens, kv, d, page, dtype, seed, spare_pages=3):
    """A shuffled page pool holding len tokens per sequence; unused pages and slots past each length are NaN.
    Returns k_pages, v_pages (num_pages, page, kv, d), page_table (B, max_pages) int32, seqused_k (B,) int32."""
    gen = torch.Generator().manual_seed(seed)
    vals = torch.Generator(device=DEV).manual_seed(seed)  # values drawn on the device: 50k-token caches are quick
    need = [math.ceil(n / page) for n in lens]
    n_pages = sum(need) + spare_pages
    k_pages = torch.full((n_pages, page, kv, d), float("nan"), device=DEV)
    v_pages = torch.full((n_pages, page, kv, d), float("nan"), device=DEV)
    perm = torch.randperm(n_pages, generator=gen)
    table = torch.zeros(len(lens), max(need) + 1, dtype=torch.int32)  # one spare column past every sequence
    used = 0
    for b, n in enumerate(lens):
        ids = perm[used:used + need[b]]
        used += need[b]
        table[b, :need[b]] = ids.int()
        slots = (ids[:, None] * page + torch.arange(page)).flatten()[:n].to(DEV)
        k_pages.view(-1, kv, d)[slots] = torch.randn(n, kv, d, generator=vals, device=DEV)
        v_pages.view(-1, kv, d)[slots] = torch.randn(n, kv, d, generator=vals, device=DEV)
    seqused = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEV) for t in (k_pages.to(dtype), v_pages.to(dtype), table, seqused)]


def reference(q, k_pages, v_pages, table, seqused, gate=None, cu_seqlens_q=None):
    """reference.paged_attention in fp32 (times sigmoid(gate) when given)."""
    o = R.paged_attention(q.float(), k_pages.float(), v_pages.float(), table, seqused, causal=True,
                          cu_seqlens_q=cu_seqlens_q)
    return o if gate is None else o * torch.sigmoid(gate.float())


def assert_close(out, ref, dtype, what):
    assert out.shape == ref.shape and out.dtype == dtype, f"{what}: got {tuple(out.shape)} {out.dtype}"
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"{what}: ||out-ref||/||ref|| = {err:.2e} > {TOL[dtype]:.0e}"


def randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEV)


# ---- interpreter (and GPU) tests at small sizes ------------------------------------------------------------

CASES = [  # (dtype, head_dim, heads, kv_heads, page, lens, q_len, num_splits, gate)
    (torch.float16, 64, 2, 2, 16, [1, 2, 65, 300], 1, 1, False),  # GQA 1, one split: direct store
    (torch.float32, 128, 4, 2, 64, [65, 300], 2, 4, True),  # GQA 2, splits of 128 keys
    (torch.float16, 64, 8, 2, 24, [5, 65], 5, 3, False),  # GQA 4, pages that are not a whole tile
    (torch.float16, 128, 8, 1, 64, [300], 1, 9, True),  # GQA 8, 9 splits for 5 tiles: empty splits
]


@pytest.mark.parametrize("dtype,d,h,kv,page,lens,q_len,splits,gated", CASES)
def test_matches_reference(dtype, d, h, kv, page, lens, q_len, splits, gated):
    k_pages, v_pages, table, seqused = make_cache(lens, kv, d, page, dtype, seed=d + h)
    q = randn(len(lens), q_len, h, d, dtype=dtype, seed=1)
    gate = randn(*q.shape, dtype=dtype, seed=2) if gated else None
    out = paged_decode_attention(q, k_pages, v_pages, table, seqused, gate=gate, num_splits=splits)
    ref = reference(q, k_pages, v_pages, table, seqused, gate)
    assert_close(out, ref, dtype, f"{dtype} d{d} H{h}/KV{kv} page {page} lens {lens} q_len {q_len} splits {splits}")


def test_varlen_with_given_buffers():
    """Flat q with cu_seqlens_q (q_lens 1, 2, 5), caller's out and a NaN-filled workspace, gate fused."""
    dtype, d, h, kv, page, splits = torch.float16, 64, 4, 2, 16, 3
    lens, q_lens = [2, 65, 130], [1, 2, 5]
    k_pages, v_pages, table, seqused = make_cache(lens, kv, d, page, dtype, seed=5)
    cu = torch.tensor([0, 1, 3, 8], dtype=torch.int32, device=DEV)
    q = randn(sum(q_lens), h, d, dtype=dtype, seed=6)
    gate = randn(*q.shape, dtype=dtype, seed=7)
    out = torch.empty_like(q)
    ws = alloc_workspace(q.shape[0], h, splits, d, DEV)
    ws.o.fill_(float("nan"))
    ws.lse.fill_(float("nan"))
    got = paged_decode_attention(q, k_pages, v_pages, table, seqused, cu_seqlens_q=cu, max_seqlen_q=max(q_lens),
                                 gate=gate, num_splits=splits, out=out, workspace=ws)
    assert got is out
    ref = reference(q, k_pages, v_pages, table, seqused, gate, cu_seqlens_q=cu)
    assert_close(out, ref, dtype, f"varlen q_lens {q_lens} lens {lens}")


def test_splits_on_the_device_equal_that_many_splits():
    """A grid of 6 splits told on the device to use k of them (a captured prefill step's attention) equals k
    splits on the host, and the reference: the splits past k see no key, so their NaN workspace rows are never
    read; k = 1 goes through the workspace as well."""
    dtype, d, h, kv, page = torch.float32, 64, 4, 2, 16
    lens, q_lens = [70, 300], [20, 11]
    k_pages, v_pages, table, seqused = make_cache(lens, kv, d, page, dtype, seed=17)
    cu = _ints([0, 20, 31])
    q = randn(sum(q_lens), h, d, dtype=dtype, seed=18)
    gate = randn(*q.shape, dtype=dtype, seed=19)
    ref = reference(q, k_pages, v_pages, table, seqused, gate, cu_seqlens_q=cu)
    args = dict(cu_seqlens_q=cu, max_seqlen_q=max(q_lens), gate=gate)
    for k in (1, 3, 6):
        ws = alloc_workspace(q.shape[0], h, 6, d, DEV)
        ws.o.fill_(float("nan"))
        on_device = paged_decode_attention(q, k_pages, v_pages, table, seqused, num_splits=6, kv_splits=_ints([k]),
                                           workspace=ws, **args)
        lse = ws.lse.view(q.shape[0], h, 6)
        assert torch.isfinite(lse[..., 0]).all() and (lse[..., k:] == float("-inf")).all(), f"kv_splits {k}"
        on_host = paged_decode_attention(q, k_pages, v_pages, table, seqused, num_splits=k, **args)
        assert torch.equal(on_device, on_host), f"kv_splits {k}: {rel_err(on_device, on_host):.2e}"
        assert_close(on_device, ref, dtype, f"kv_splits {k} of 6")


@pytest.mark.parametrize("q_lens,group", [((1, 40, 2, 13), 2), ((5, 1, 33), 4), ((40, 3), 1),
                                          ((0, 37, 1, 50, 0, 0), 2)])  # two big sequences of several M-blocks
def test_a_work_list_equals_the_eager_grid_bit_for_bit(q_lens, group):
    """A work-list launch (a prefill graph of several sequences: programs take the real (sequence, M-block, split)
    triples in turn, the rest exit) equals the eager grid of the same splits bit for bit, and the reference, with
    decode rows beside chunks (the short launch) and programs to spare or none; too few programs are refused."""
    dtype, d, kv, page = torch.float32, 64, 2, 16
    h = kv * group
    lens = [q + c for q, c in zip(q_lens, (70, 300, 5, 129, 40, 2))]
    k_pages, v_pages, table, seqused = make_cache(lens, kv, d, page, dtype, seed=21 + group)
    cu = _ints([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    q = randn(sum(q_lens), h, d, dtype=dtype, seed=22)
    gate = randn(*q.shape, dtype=dtype, seed=23)
    ref = reference(q, k_pages, v_pages, table, seqused, gate, cu_seqlens_q=cu)
    # the graph plans at its row bucket (64), the eager call at the longest sequence: the same 64-row tile here;
    # sequences without tokens (a graph's lanes past its step) have no items
    args = dict(cu_seqlens_q=cu, max_seqlen_q=64, gate=gate)
    items = work_items(q_lens, group, d, 4, 64)
    assert items[0] >= 1 and items[1] == sum(1 <= q <= 32 // group for q in q_lens)  # 32: SHORT_ROWS
    for used in (1, 3):
        eager = paged_decode_attention(q, k_pages, v_pages, table, seqused, num_splits=used, **args)
        for spare in (0, 5):
            programs = tuple(max(i * used, 1) + spare for i in items)
            ws = alloc_workspace(q.shape[0], h, 4, d, DEV)
            ws.o.fill_(float("nan"))
            ws.lse.fill_(float("nan"))  # splits past `used` are never written: the combine must not read them
            got = paged_decode_attention(q, k_pages, v_pages, table, seqused, num_splits=4, kv_splits=_ints([used]),
                                         work_programs=programs, workspace=ws, **args)
            assert torch.equal(got, eager), f"{used} splits, programs {programs}: {rel_err(got, eager):.2e}"
        assert_close(eager, ref, dtype, f"q_lens {q_lens}, {used} splits")
    short = (items[0] * 3 - 1, max(items[1] * 3, 1))
    with pytest.raises(ValueError, match=r"work_programs .* cannot hold this step's"):
        paged_decode_attention(q, k_pages, v_pages, table, seqused, num_splits=4, kv_splits=_ints([3]),
                               work_programs=short, **args)


@pytest.mark.parametrize("rows,low", [(128, 64), (512, 256)])
def test_a_captured_work_grid_holds_every_step_of_its_bucket(rows, low):
    """captured_work_grid's programs hold items x splits of every step of its bucket whose longest sequence takes
    the chunk plan (random steps of 2..16 sequences, at power-of-two key bounds and the capacity, 16 sequences
    included), at least one split of any step; and far fewer programs than the eager grid padded to the longest."""
    k_pages = torch.empty(1, 16, 2, 256, dtype=torch.bfloat16).expand(1034, -1, -1, -1)
    cpu = torch.device("cpu")
    splits, big, short = captured_work_grid(16, range(low + 1, rows + 1), 8, k_pages, 1034, cpu)
    gen = torch.Generator().manual_seed(rows)
    for _ in range(300):
        seqs = int(torch.randint(2, 17, (1,), generator=gen))
        n = int(torch.randint(max(low + 1, seqs), rows + 1, (1,), generator=gen))
        cuts = sorted(torch.randperm(n - 1, generator=gen)[:seqs - 1].add(1).tolist())
        q_lens = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
        items = work_items(q_lens, 4, 256, 2, rows)
        assert items[0] <= big and items[1] <= short, q_lens  # one split always fits
        for bound in (1 << 10, 1 << 12, 1034 * 16):
            s = step_splits(seqs, max(q_lens), 8, k_pages, bound, cpu)
            if max(q_lens) > 8:  # the chunk plan (group 4: more than 32 rows): sized exactly
                assert s <= splits and items[0] * s <= big and items[1] * s <= short, (q_lens, bound, s)
    assert big < 16 * (rows * 4 // 128) * splits  # 16 sequences x the longest's M-blocks, the eager grid


def test_a_captured_grid_holds_the_splits_of_every_step_it_serves():
    # a prefill graph of 128 rows serves steps of 65..128 tokens (fewer M-blocks: more splits) over 1034 pages
    k_pages = torch.empty(1, 16, 2, 256, dtype=torch.bfloat16).expand(1034, -1, -1, -1)
    grid = captured_splits(1, range(65, 129), 8, k_pages, 1034, k_pages.device)
    asks = {step_splits(1, q, 8, k_pages, keys, k_pages.device) for q in range(65, 129)
            for keys in (*(2 ** i for i in range(15)), 1034 * 16)}  # power-of-two bounds and the capacity
    assert max(asks) == grid and len(asks) > 1
    top = captured_splits(1, range(128, 129), 8, k_pages, 1034, k_pages.device)
    assert top < grid  # the bucket's top alone asks fewer
    # the first bucket's steps of up to 8 tokens run the decode variant eagerly: they do not size the grid
    chunk_asks = {step_splits(1, q, 8, k_pages, keys, k_pages.device) for q in range(9, 65)
                  for keys in (*(2 ** i for i in range(15)), 1034 * 16)}
    assert captured_splits(1, range(5, 65), 8, k_pages, 1034, k_pages.device) == max(chunk_asks)


def test_gate_fused_equals_unfused():
    dtype, d, h, kv, page = torch.float16, 64, 4, 2, 16
    k_pages, v_pages, table, seqused = make_cache([70], kv, d, page, dtype, seed=8)
    q = randn(1, 1, h, d, dtype=dtype, seed=9)
    gate = randn(*q.shape, dtype=dtype, seed=10)
    for splits in (1, 2):
        plain = paged_decode_attention(q, k_pages, v_pages, table, seqused, num_splits=splits)
        fused = paged_decode_attention(q, k_pages, v_pages, table, seqused, gate=gate, num_splits=splits)
        unfused = R.sigmoid_gate_mul(plain, gate)
        assert rel_err(fused, unfused) <= 1e-3, f"splits {splits}: fused gate differs by {rel_err(fused, unfused):.2e}"


def test_model_op_routes_by_the_chunk(monkeypatch):
    """model.ops.paged_attention on the triton backend: the router runs the kernel (paged_attention_op) where
    split_kv_pays and a prefill forward elsewhere (the Triton one on the CPU), the key's context bound being the
    step's max_seqlen_k (else the page table's capacity) for chunks over ALWAYS_Q_LEN; the kernel's op entry
    itself runs any chunk."""
    import fa4.triton_forward as TF
    import kernels.paged_decode_attention as P
    from kernels import registry
    from model import ops
    dtype, d, h, kv, page = torch.float32, 64, 2, 1, 16
    k_pages, v_pages, table, seqused = make_cache([3, 40], kv, d, page, dtype, seed=11)
    monkeypatch.setattr(registry, "_choices", {})  # a fresh cache of choices: ALWAYS_Q_LEN is patched below
    forward_calls, forward = [], TF.triton_forward
    monkeypatch.setattr(TF, "triton_forward", lambda *a, **kw: forward_calls.append(1) or forward(*a, **kw))
    for q_lens, always, max_k in (([1, 3], 512, None), ([1, 12], 512, 40), ([1, 12], 8, 40), ([1, 12], 8, None)):
        monkeypatch.setattr(P, "ALWAYS_Q_LEN", always)  # 8: the 12-token chunk needs splits to run here
        forward_calls.clear()
        cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=DEV)
        n = sum(q_lens)
        step = StepInput(token_ids=torch.zeros(n, dtype=torch.long), positions=torch.zeros(n, dtype=torch.long),
                         cu_seqlens=cu, max_seqlen_q=max(q_lens), seqused_k=seqused, page_table=table,
                         slot_mapping=torch.zeros(n, dtype=torch.long), state_slots=torch.arange(2),
                         max_seqlen_k=max_k)
        q = randn(n, h, d, dtype=dtype, seed=12)
        gate = randn(n, h, d, dtype=dtype, seed=13)
        ref = _ref_paged_attention(q, k_pages, v_pages, step, 0.3, gate)
        out = paged_attention_op(q, k_pages, v_pages, step, 0.3, gate)
        assert rel_err(out, ref) <= TOL[dtype], f"q_lens {q_lens}: {rel_err(out, ref):.2e}"
        assert not forward_calls
        long = max(q_lens) > always
        key = P.paged_key(q, k_pages, v_pages, step, 0.3, gate)
        assert key.seqlen_k == ((max_k or table.shape[1] * page) if long else 0)
        with ops.use_backend("triton"):
            routed = ops.paged_attention(q, k_pages, v_pages, step, 0.3, gate)
        assert rel_err(routed, ref) <= TOL[dtype], f"q_lens {q_lens} routed: {rel_err(routed, ref):.2e}"
        # 2 sequences x 1 M-block x 1 KV head over 40 keys: the one 64-key tile cannot split, so no split pays
        assert bool(forward_calls) == long, f"q_lens {q_lens}, always up to {always}"
        assert registry.choose("paged_attention", key, "triton").name == ("triton_forward" if long else "split_kv")
    assert [i.run for i in registry.impls("paged_attention", "triton") if i.name == "split_kv"] == [paged_attention_op]


SM90_SPLIT_COMPILE = """
from tests.sm90_compile import split_kernel_sm90
for page in (64, 16):  # 16: the engine's default (a page lookup per key)
    r = split_kernel_sm90(PAGE_SIZE=page)
    prefetch = "cp.async.bulk.prefetch.L2.global"
    print(page, r["smem"], r["regs"], r["spill"], r["ptx"].split("griddepcontrol.wait")[0].count(prefetch),
          r["ptx"].count(prefetch), flush=True)
"""
SM_REGS, SM_SMEM, CTA_RESERVED_SMEM = 65536, 228 * 1024, 1024
COMBINE_REGS = 56 * 128  # a combine program (sm_90a ptxas: 55 registers, 128 threads)


def test_split_kernel_keeps_two_programs_an_sm():
    # the decode split kernel at the 2B attention shape (bf16 d256 GQA 4), compiled for sm_90a on the CPU, at pages
    # of 64 and 16 keys: two programs fit an SM (shared memory and registers; the measured condition for full
    # bandwidth), no spills; the first tile's L2 prefetches (K and V) stand before the PDL wait, and none after it.
    # Two programs leave no room for the out-proj chain's CTA and a combine program: the chain, launched early by
    # the combine, becomes resident on SMs that hold one
    room = {}
    for line in compiled_script_output(SM90_SPLIT_COMPILE, timeout=600).splitlines()[-2:]:
        page, smem, regs, spill, early, total = map(int, line.split())
        assert 2 * smem <= 227 * 1024 and 2 * 128 * regs <= SM_REGS and spill == 0, (smem, regs, spill)
        assert early >= 2 and total == early, (early, total)
        regs_held = 2 * 128 * -(-regs // 8) * 8 + CHAIN_CTA_REGS + COMBINE_REGS
        smem_held = 2 * (smem + CTA_RESERVED_SMEM) + CHAIN_CTA_SMEM + CTA_RESERVED_SMEM
        room[page] = regs_held <= SM_REGS and smem_held <= SM_SMEM
    assert room == {64: False, 16: False}, room


def test_split_kv_pays_for_long_chunks_only_when_the_forward_underfills():
    from kernels.paged_decode_attention import CUTE_FORWARD_FILL, MAX_Q_LEN, split_kv_pays
    assert split_kv_pays(1, 512, 4, 4, 256, 2, 100)  # up to 512: always
    # 800 new over 50k: 2B (H8/KV2) gives the forward 50 programs, 9B-like H16/KV4 100: both split
    assert split_kv_pays(1, 800, 4, 2, 256, 2, 50800) and split_kv_pays(1, 800, 4, 4, 256, 2, 50800)
    assert not split_kv_pays(1, 2048, 4, 2, 256, 2, 12000)  # 64 M-blocks x 2 heads nearly fill 132 SMs
    assert not split_kv_pays(8, 800, 4, 4, 256, 2, 50800)  # 800 programs: no split
    assert not split_kv_pays(1, MAX_Q_LEN + 1, 4, 2, 256, 2, 50800)
    # against the CuTe forward (half the SMs suffice): H16/KV4's 100 programs go to the forward, H8/KV2's 50 split
    assert not split_kv_pays(1, 800, 4, 4, 256, 2, 50800, 132, CUTE_FORWARD_FILL)
    assert split_kv_pays(1, 800, 4, 2, 256, 2, 50800, 132, CUTE_FORWARD_FILL)


def test_long_chunks_split_against_the_forward_that_takes_them(monkeypatch):
    # a long chunk's split pays against the CuTe forward where that takes the call (it needs half the SMs:
    # CUTE_FORWARD_FILL), else against the Triton forward (all of them): 800 new over 50k at H16/KV4 give a
    # forward 100 programs on 132 SMs; chunks up to ALWAYS_Q_LEN always split
    from fa4.cute import entry as CE
    from kernels import registry
    from kernels.paged_decode_attention import ALWAYS_Q_LEN, PagedKey
    from kernels.registry import H200
    from model import ops
    ops._load("triton")  # fa4's forwards registered
    key = PagedKey(1, 800, 16, 4, 256, 128, 50800, torch.bfloat16, H200)
    asked = []
    for unsupported, expected in ((None, "cute_forward"), ("no cute here", "split_kv")):
        monkeypatch.setattr(registry, "_choices", {})  # a fresh cache of choices under the patched predicate
        monkeypatch.setattr(CE, "key_unsupported", lambda *a, r=unsupported: asked.append(a) or r)
        assert registry.choose("paged_attention", key, "triton").name == expected
        assert registry.choose("paged_attention", key._replace(q_len=ALWAYS_Q_LEN, seqlen_k=0),
                               "triton").name == "split_kv"
    assert asked and all(a == (torch.bfloat16, 256, 128, H200) for a in asked)


def test_decode_stages_by_the_tiles_a_split_walks():
    from kernels.paged_decode_attention import decode_stages
    assert decode_stages(15648, choose_num_splits(1, 2, 15648), 64) == 1  # the serving c1 run: 2 tiles a split
    assert decode_stages(8448, choose_num_splits(1, 2, 8448), 64) == 1  # step_stamps at 8k
    assert decode_stages(65792, choose_num_splits(1, 2, 65792), 64) == 2  # 64k: ~9 tiles a split
    assert decode_stages(4352, choose_num_splits(16, 2, 4352), 64) == 2  # B16 over 4k


def test_choose_num_splits():
    assert choose_num_splits(64, 4, 8192) == 1  # 256 programs already fill two waves
    assert choose_num_splits(1, 4, 64) == 1  # one tile cannot be split
    for batch, kv, ctx in [(1, 4, 32768), (1, 2, 131072), (8, 4, 32768)]:
        s = choose_num_splits(batch, kv, ctx)
        assert 1 < s <= MAX_SPLITS and batch * kv * s >= 100, f"B{batch} KV{kv} {ctx}: {s} splits"


# ---- bad input ---------------------------------------------------------------------------------------------

def _good():
    k_pages, v_pages, table, seqused = make_cache([20, 40], 2, 64, 16, torch.float16, seed=14)
    q = randn(2, 1, 4, 64, dtype=torch.float16, seed=15)
    return dict(q=q, k_pages=k_pages, v_pages=v_pages, page_table=table, seqused_k=seqused)


def _col_major(t):
    # the same values with a strided last dim
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


CU = [0, 1, 2]
BAD = [  # (regex the message must match, the arguments to override given the good ones)
    ("k_pages must have dtype", lambda g: dict(q=g["q"].float())),
    ("k_pages must have dtype", lambda g: dict(k_pages=g["k_pages"].float())),
    ("v_pages .* must match", lambda g: dict(v_pages=g["v_pages"][:, :8])),
    ("head_dim", lambda g: dict(q=g["q"][..., :32], k_pages=g["k_pages"][..., :32], v_pages=g["v_pages"][..., :32])),
    ("kv heads", lambda g: dict(q=g["q"][:, :, :3])),
    ("q_len", lambda g: dict(q=g["q"].expand(2, 2049, 4, 64))),
    ("page_table", lambda g: dict(page_table=g["page_table"].long())),
    ("seqused_k has 1 entries", lambda g: dict(seqused_k=g["seqused_k"][:1])),
    ("seqused_k must have dtype", lambda g: dict(seqused_k=g["seqused_k"].long())),
    ("q has batch", lambda g: dict(q=g["q"][:1])),
    ("q must have 3 dims", lambda g: dict(cu_seqlens_q=torch.tensor(CU, dtype=torch.int32, device=DEV))),
    ("max_seqlen_q", lambda g: dict(q=g["q"][:, 0], cu_seqlens_q=torch.tensor(CU, dtype=torch.int32, device=DEV))),
    ("max_seqlen_q", lambda g: dict(q=g["q"][:, 0], cu_seqlens_q=torch.tensor(CU, dtype=torch.int32, device=DEV),
                                    max_seqlen_q=2049)),
    ("cu_seqlens_q has 2 entries", lambda g: dict(q=g["q"][:, 0], max_seqlen_q=1,
                                                  cu_seqlens_q=torch.tensor(CU[:2], dtype=torch.int32, device=DEV))),
    ("gate", lambda g: dict(gate=g["q"][:, :, :2])),
    ("q must be contiguous along its last dim", lambda g: dict(q=_col_major(g["q"]))),
    ("page_table must be contiguous", lambda g: dict(page_table=g["page_table"].t().contiguous().t())),
    ("seqused_k must be contiguous", lambda g: dict(seqused_k=g["seqused_k"].repeat_interleave(2)[::2])),
    ("out must have dtype", lambda g: dict(out=torch.empty_like(g["q"], dtype=torch.float32))),
    ("out must be contiguous", lambda g: dict(out=_col_major(torch.empty_like(g["q"])))),
    ("cu_seqlens_q must be a torch.Tensor", lambda g: dict(q=g["q"][:, 0], cu_seqlens_q=CU, max_seqlen_q=1)),
    ("num_splits", lambda g: dict(num_splits=0)),
    ("block_m", lambda g: dict(block_m=48)),
    ("rescale_threshold", lambda g: dict(rescale_threshold=-1.0)),
    ("workspace must be a DecodeWorkspace", lambda g: dict(num_splits=2, workspace=(g["q"], g["q"]))),
    ("workspace too small", lambda g: dict(num_splits=2, workspace=alloc_workspace(1, 4, 2, 64, DEV))),
    ("kv_splits must have dtype", lambda g: dict(kv_splits=_ints([1]).long(), num_splits=2)),
    ("kv_splits must hold one value", lambda g: dict(kv_splits=_ints([1, 1]), num_splits=2)),
    ("kv_splits needs an int num_splits", lambda g: dict(kv_splits=_ints([1]))),
    ("kv_splits is for the chunk variant", lambda g: dict(kv_splits=_ints([1]), num_splits=2)),
    ("work_programs must be None or two positive ints", lambda g: dict(work_programs=(4, 0))),
    ("work_programs needs kv_splits", lambda g: dict(work_programs=(4, 4))),
    (r"kv_splits\[0\] must be in 1..num_splits \(2\), got 3",
     lambda g: dict(q=randn(2, 9, 4, 64, dtype=torch.float16, seed=16), kv_splits=_ints([3]), num_splits=2)),
]


def _ints(values):
    return torch.tensor(values, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("message,override", BAD, ids=[f"{i}-{m.split()[0]}" for i, (m, _) in enumerate(BAD)])
def test_rejects_bad_input(message, override):
    good = _good()
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**{**good, **override(good)})


def test_workspace_helper_shape():
    ws = alloc_workspace(3, 4, 5, 64, DEV)
    assert isinstance(ws, DecodeWorkspace) and ws.o.numel() == 3 * 4 * 5 * 64 and ws.lse.numel() == 3 * 4 * 5


# ---- GPU ---------------------------------------------------------------------------------------------------

GPU_LENS = [1, 2, 65, 1000, 33000]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("q_len", [1, 3, 8])
def test_gpu_matches_reference(dtype, d, group, q_len):
    kv, page = 2, (16 if group in (1, 4) else 64)
    lens = [max(n, q_len) for n in GPU_LENS]
    k_pages, v_pages, table, seqused = make_cache(lens, kv, d, page, dtype, seed=group * 10 + q_len)
    q = randn(len(lens), q_len, kv * group, d, dtype=dtype, seed=q_len)
    gate = randn(*q.shape, dtype=dtype, seed=3) if q_len == 3 else None
    out = paged_decode_attention(q, k_pages, v_pages, table, seqused, gate=gate)
    ref = reference(q, k_pages, v_pages, table, seqused, gate)
    assert_close(out, ref, dtype, f"{dtype} d{d} GQA {group} q_len {q_len} page {page}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(torch.float32, 256), (torch.float16, 64)])
def test_gpu_largest_tile_and_small_head_dim(dtype, d):
    """q_len 8 x GQA 8 = 64 rows: fp32 d256 is the largest shared-memory footprint; d64 the smallest head dim."""
    k_pages, v_pages, table, seqused = make_cache([8, 1000, 5000], 1, d, 64, dtype, seed=40)
    q = randn(3, 8, 8, d, dtype=dtype, seed=41)
    out = paged_decode_attention(q, k_pages, v_pages, table, seqused)
    assert_close(out, reference(q, k_pages, v_pages, table, seqused), dtype, f"{dtype} d{d} q_len 8 GQA 8")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 7, 64])
def test_gpu_varlen_mixed_q_lens(splits):
    dtype, d, h, kv, page = torch.bfloat16, 256, 16, 4, 64
    q_lens = [1, 8, 3, 5, 2, 7, 4, 6]
    lens = [8, 70, 1000, 33000, 4, 513, 20000, 129]
    k_pages, v_pages, table, seqused = make_cache(lens, kv, d, page, dtype, seed=20)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = randn(sum(q_lens), h, d, dtype=dtype, seed=21)
    gate = randn(*q.shape, dtype=dtype, seed=22)
    out = paged_decode_attention(q, k_pages, v_pages, table, seqused, cu_seqlens_q=cu, max_seqlen_q=8, gate=gate,
                                 num_splits=splits)
    ref = reference(q, k_pages, v_pages, table, seqused, gate, cu_seqlens_q=cu)
    assert_close(out, ref, dtype, f"varlen q_lens {q_lens} splits {splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 4])
def test_gpu_cuda_graph_replay_with_new_lengths(q_len):
    """Capture once with fixed buffers and a fixed split count; replay after writing new seqused_k values."""
    dtype, d, h, kv, page, max_ctx = torch.bfloat16, 256, 16, 4, 64, 40000
    batch = 3
    k_pages, v_pages, table, seqused = make_cache([max_ctx] * batch, kv, d, page, dtype, seed=30)
    k_pages.nan_to_num_(0.0)  # every slot may become visible when lengths change
    v_pages.nan_to_num_(0.0)
    q = randn(batch, q_len, h, d, dtype=dtype, seed=31)
    splits = choose_num_splits(batch, kv, max_ctx)
    out = torch.empty_like(q)
    ws = alloc_workspace(batch * q_len, h, splits, d, DEV)
    run = lambda: paged_decode_attention(q, k_pages, v_pages, table, seqused, num_splits=splits, out=out,
                                         workspace=ws)
    seqused.copy_(torch.tensor([1000, 20, 30000], dtype=torch.int32))
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lens in ([1000, 20, 30000], [40000, 39999, 12345], [q_len, 65, 7], [2000, 1, 40000]):
        lens = [max(n, q_len) for n in lens]
        seqused.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, reference(q, k_pages, v_pages, table, seqused), dtype, f"graph replay lens {lens}")
