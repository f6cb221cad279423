"""Agent-turn attention: the chunk variant of kernels/paged_decode_attention.py (1..512 new query tokens per
sequence over a paged prefix) against reference.paged_attention in fp32.

Interpreter tests (CPU, fp16/fp32, d64/d128, tiny sizes): q_len 3..20 over contexts 0..130 with shuffled pages
(16, 24, 64) whose unused slots hold NaN, GQA 1/2/4/8, several M-blocks (forced small block_m), varlen batches
mixing decode rows with chunks, rows that see no key, empty splits, the fused gate, both rescale modes, a
hypothesis property test, the host plan for the benchmark shapes, fa4.flash_attention's auto routing, and an
sm_90a compile of the kernel (shared memory, wgmma, registers, spills). `gpu` tests: bf16/fp16, d128/d256, GQA
1/2/4/8, pages 16/64, q_len 1, 3, 17, 64, 200, 512 over contexts 1, 100, 4097 and 50k, alone and in one
varlen batch, CUDA-graph replay with new lengths, relative error < 1e-2 in bf16.
"""

import pytest
import torch
from conftest import compiled_script_output
from hypothesis import given, settings
from hypothesis import strategies as st

from fa4 import flash_attention
from fa4.routes import attention_key
from kernels import registry
from kernels.paged_decode_attention import (
    MAX_Q_LEN,
    Plan,
    alloc_workspace,
    choose_num_splits,
    paged_decode_attention,
    plan,
)
from tests.conftest import rel_err
from tests.test_decode_attention import DEV, TOL, assert_close, make_cache, randn, reference


def cu_of(q_lens):
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)


def run_case(dtype, d, h, kv, page, ctx, q_lens, *, gated=False, seed=0, **kw):
    """Sequences of q_lens[i] new tokens over ctx[i] cached ones (seqused = ctx + q_len), varlen; checked."""
    lens = [c + n for c, n in zip(ctx, q_lens)]
    k_pages, v_pages, table, seqused = make_cache(lens, kv, d, page, dtype, seed=seed)
    cu = cu_of(q_lens)
    q = randn(sum(q_lens), h, d, dtype=dtype, seed=seed + 1)
    gate = randn(*q.shape, dtype=dtype, seed=seed + 2) if gated else None
    out = paged_decode_attention(q, k_pages, v_pages, table, seqused, cu_seqlens_q=cu, max_seqlen_q=max(q_lens),
                                 gate=gate, **kw)
    ref = reference(q, k_pages, v_pages, table, seqused, gate, cu_seqlens_q=cu)
    assert_close(out, ref, dtype, f"{dtype} d{d} H{h}/KV{kv} page {page} ctx {ctx} q_lens {q_lens} {kw}")
    return out


# ---- interpreter (and GPU) tests at small sizes ------------------------------------------------------------

CASES = [  # (dtype, head_dim, heads, kv_heads, page, cached ctx, q_lens, kwargs)
    (torch.float32, 64, 4, 2, 16, [100], [17], {}),  # 34 rows: one 64-row M-block, auto splits
    (torch.float16, 64, 8, 2, 64, [110, 0, 17], [20, 1, 3], dict(num_splits=3)),  # 80 rows: M-block 128, decode row
    (torch.float32, 64, 8, 1, 24, [48, 0], [17, 17], dict(num_splits=2, block_m=16)),  # GQA 8: 9 M-blocks
    (torch.float16, 128, 2, 2, 16, [130, 5], [9, 3], dict(num_splits=1, block_m=32)),  # GQA 1, direct store
    (torch.float32, 64, 4, 1, 16, [60], [12], dict(num_splits=5, rescale_threshold=0.0)),  # GQA 4, always rescale
]


def test_chunk_longer_than_always_q_len():
    """A 600-token chunk (fp32's 64-row M-blocks: 10 of them) beside a decode row, over a short prefix, 2 splits."""
    run_case(torch.float32, 64, 1, 1, 16, [37, 5], [600, 1], seed=21, num_splits=2)


@pytest.mark.parametrize("dtype,d,h,kv,page,ctx,q_lens,kw", CASES)
def test_chunk_matches_reference(dtype, d, h, kv, page, ctx, q_lens, kw):
    run_case(dtype, d, h, kv, page, ctx, q_lens, gated=dtype == torch.float16, **kw)


def test_rows_without_keys_and_empty_splits():
    """q_len > seqused (the first rows see no key: 0), seqused 0, and more splits than tiles: finite, exact."""
    dtype, d, h, kv, page = torch.float32, 64, 4, 2, 16
    lens, q_lens = [3, 0, 70], [6, 2, 5]
    k_pages, v_pages, table, seqused = make_cache([max(n, 1) for n in lens], kv, d, page, dtype, seed=3)
    seqused = torch.tensor(lens, dtype=torch.int32, device=DEV)
    cu = cu_of(q_lens)
    q = randn(sum(q_lens), h, d, dtype=dtype, seed=4)
    out = paged_decode_attention(q, k_pages, v_pages, table, seqused, cu_seqlens_q=cu, max_seqlen_q=6,
                                 num_splits=4, block_m=16)
    ref = reference(q, k_pages, v_pages, table, seqused, cu_seqlens_q=cu)
    assert torch.isfinite(out).all()
    assert (out[:3] == 0).all() and (out[6:8] == 0).all(), "rows that see no key must be 0"
    assert rel_err(out, ref) <= TOL[dtype]


def test_split_count_does_not_change_the_result():
    dtype, d, h, kv, page = torch.float32, 64, 4, 1, 16
    k_pages, v_pages, table, seqused = make_cache([130], kv, d, page, dtype, seed=5)
    q = randn(1, 10, h, d, dtype=dtype, seed=6)
    one = paged_decode_attention(q, k_pages, v_pages, table, seqused, num_splits=1)
    for splits in (2, 3):
        many = paged_decode_attention(q, k_pages, v_pages, table, seqused, num_splits=splits)
        assert rel_err(many, one) <= 1e-6, f"{splits} splits differ from one by {rel_err(many, one):.2e}"


def test_given_buffers_and_nan_workspace():
    """out= and a NaN-filled workspace sized by alloc_workspace: every row the combine reads is written."""
    dtype, d, h, kv, page, splits = torch.float16, 64, 4, 2, 16, 3
    ctx, q_lens = [40, 90], [11, 1]
    lens = [c + n for c, n in zip(ctx, q_lens)]
    k_pages, v_pages, table, seqused = make_cache(lens, kv, d, page, dtype, seed=7)
    q = randn(sum(q_lens), h, d, dtype=dtype, seed=8)
    out = torch.empty_like(q)
    ws = alloc_workspace(q.shape[0], h, splits, d, DEV)
    ws.o.fill_(float("nan"))
    ws.lse.fill_(float("nan"))
    cu = cu_of(q_lens)
    got = paged_decode_attention(q, k_pages, v_pages, table, seqused, cu_seqlens_q=cu, max_seqlen_q=11,
                                 num_splits=splits, out=out, workspace=ws)
    assert got is out
    assert_close(out, reference(q, k_pages, v_pages, table, seqused, cu_seqlens_q=cu), dtype, "given buffers")


def test_mixed_step_decode_rows_in_small_tiles():
    """A mixed varlen step (decode rows beside a 20-token chunk, GQA 4): the decode rows run in a 32-row tile
    launch, the chunk in 128-row tiles; equal to one launch of big tiles and to the reference."""
    dtype, d, h, kv, page = torch.float32, 64, 8, 2, 16
    ctx, q_lens = [90, 30, 0, 64], [1, 20, 1, 8]
    lens = [c + n for c, n in zip(ctx, q_lens)]
    k_pages, v_pages, table, seqused = make_cache(lens, kv, d, page, dtype, seed=20)
    q = randn(sum(q_lens), h, d, dtype=dtype, seed=21)
    cu = cu_of(q_lens)
    args = (q, k_pages, v_pages, table, seqused)
    split = paged_decode_attention(*args, cu_seqlens_q=cu, max_seqlen_q=20, num_splits=2)
    joint = paged_decode_attention(*args, cu_seqlens_q=cu, max_seqlen_q=20, num_splits=2, split_decode_rows=False)
    assert rel_err(split, joint) <= 1e-6
    assert_close(split, reference(q, k_pages, v_pages, table, seqused, cu_seqlens_q=cu), dtype, "mixed step")


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_chunk_property(data):
    """Random tiny varlen batches (fp32, d64): q_len 1..12 over contexts 0..70, GQA 1/2/4, pages 16/24."""
    group = data.draw(st.sampled_from([1, 2, 4]))
    batch = data.draw(st.integers(1, 2))
    q_lens = data.draw(st.lists(st.integers(1, 12), min_size=batch, max_size=batch))
    ctx = data.draw(st.lists(st.integers(0, 70), min_size=batch, max_size=batch))
    page = data.draw(st.sampled_from([16, 24]))
    splits = data.draw(st.integers(1, 3))
    block_m = data.draw(st.sampled_from([16, 32, None]))  # None: rows <= 8 x group may take the short tiles
    run_case(torch.float32, 64, group, 1, page, ctx, q_lens, seed=sum(ctx), num_splits=splits, block_m=block_m)


# ---- host plan and routing ---------------------------------------------------------------------------------

def test_plan_and_splits_for_the_benchmark_shapes():
    assert plan(1, 4, 256, 2) == Plan(False, 16, 1, 64, 4, 1, 2)  # decode: one stage (DECODE_STAGES), 64 keys
    assert plan(8, 8, 128, 2) == Plan(False, 64, 1, 64, 4, 1, 2)
    for q_len, ctx, batch, want_splits in [(64, 50000, 1, 16), (256, 50000, 1, 4), (500, 8000, 1, 2),
                                           (64, 32768, 8, 2), (512, 50000, 1, 2)]:
        tile = plan(q_len, 4, 256, 2)
        assert tile.chunk and tile.block_m == 128 and tile.num_warps == 8 and tile.programs_per_sm == 1
        assert tile.m_blocks == -(-q_len * 4 // 128) and tile.block_n == 64
        s = choose_num_splits(batch, 4, ctx + q_len, m_blocks=tile.m_blocks, programs_per_sm=1, block_n=tile.block_n)
        assert s == want_splits, f"{batch} x {q_len} over {ctx}: {s} splits"
    assert plan(17, 1, 256, 2).block_m == 32 and plan(3, 4, 64, 2, block_m=16).chunk


def test_q_len_limit():
    k_pages, v_pages, table, seqused = make_cache([600], 1, 64, 64, torch.float32, seed=9)
    q = torch.zeros(1, MAX_Q_LEN + 1, 2, 64, device=DEV)
    with pytest.raises(ValueError, match="q_len"):
        paged_decode_attention(q, k_pages, v_pages, table, seqused)


def test_fa4_auto_routes_short_paged_chunks_here():
    dtype, d, h, kv, page = torch.float32, 64, 4, 2, 16
    ctx, q_lens = [50, 20], [7, 1]
    lens = [c + n for c, n in zip(ctx, q_lens)]
    k_pages, v_pages, table, seqused = make_cache(lens, kv, d, page, dtype, seed=10)
    q = randn(sum(q_lens), h, d, dtype=dtype, seed=11)
    cu = cu_of(q_lens)
    auto = flash_attention(q, k_pages, v_pages, causal=True, cu_seqlens_q=cu.long(), page_table=table.long(),
                           seqused_k=seqused.long(), softmax_scale=0.2)
    ours = paged_decode_attention(q, k_pages, v_pages, table, seqused, cu_seqlens_q=cu, max_seqlen_q=7,
                                  softmax_scale=0.2)
    assert torch.equal(auto, ours), "auto must run the split-KV kernel for a causal paged chunk of <= 512 tokens"
    # the router's reasons (fa4.routes, op "attention"): 2048 tokens x GQA 2 in fp32's 64-row M-blocks: 2 sequences
    # x 64 M-blocks x 2 KV heads fill the SMs; past MAX_Q_LEN the kernel takes no chunk
    key = attention_key(q, k_pages, v_pages, True, cu, None, table, seqused)
    assert key.q_len == 7 and registry.choose("attention", key, "triton").name == "split_kv"

    def why(**fields):
        return registry.why_not("attention", key._replace(**fields))["split_kv"]
    assert why() is None
    assert why(q_len=MAX_Q_LEN + 1) == "max q_len 2049 is not in 1..2048"
    assert why(q_len=2048).startswith("max q_len 2048 fills the GPU")
    assert why(causal=False) == why(layout="varlen", page_size=0) == "the split-KV kernel takes causal paged calls only"
    assert why(strided="page_table") == "page_table must be contiguous along its last dim"


SM90_COMPILE = """
from kernels import paged_decode_attention as P
from tests.sm90_compile import triton_sm90
for d, work_seqs in ((256, 0), (256, 16)):  # the eager grid, and a captured work list of 16 sequences
    t = P.plan(64, 4, d, 2)
    const = dict(VARLEN=True, GROUP=4, HEAD_DIM=d, PAGE_SIZE=64, BLOCK_M=t.block_m, BLOCK_N=P.BLOCK_N, DIRECT=False,
                 HAS_GATE=False, RESCALE_THRESHOLD=P.RESCALE_THRESHOLD, DOT_PRECISION="tf32", PDL=True, Q_MIN=9,
                 Q_MAX=0, SPLITS_ON_DEVICE=work_seqs > 0, WORK_SEQS=work_seqs)
    arg_type = lambda n: ("*bf16" if n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "gate_ptr") else
                          "*fp32" if n.startswith("ws_") else "*i32" if n.endswith("_ptr") else
                          "fp32" if n == "qk_scale" else "i32")
    r = triton_sm90(P._chunk_kernel, const, arg_type, t.num_warps, t.num_stages)
    print(d, r["smem"], r["wgmma"], r["cp_async"], r["regs"], r["spill"])
"""


def test_chunk_kernel_compiles_for_sm90():
    """The interpreter skips Triton's compiler: compile the chunk kernel (M-block 128, bf16, d256; its eager grid
    and its work list) for sm_90a on the CPU and check each fits one CTA's shared memory, uses wgmma and cp.async,
    and spills little."""
    lines = compiled_script_output(SM90_COMPILE, timeout=600).strip().splitlines()
    assert len(lines) == 2, lines
    for line in lines:
        d, smem, wgmma, cp_async, regs, spill = map(int, line.split())
        assert smem <= 227 * 1024 and wgmma > 0 and cp_async > 0, line
        assert regs <= 255 and spill <= 128, f"d{d}: {regs} registers, {spill} bytes spilled"


# ---- GPU ---------------------------------------------------------------------------------------------------

GPU_Q_LENS = [1, 3, 17, 64, 200, 512]
GPU_CTX = [1, 100, 4097, 50000]


# every (head dim, GQA ratio) pair, each with one page size, so that every pair of the three values also occurs:
# half the full product, whose compiles and 50k fp32 references dominated the GPU suite's time
GPU_MATRIX = [(d, group, 16 if (d == 128) == (group in (1, 4)) else 64) for d in (128, 256) for group in (1, 2, 4, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("d,group,page", GPU_MATRIX)
def test_gpu_chunk_matrix(d, group, page):
    """Every q_len over every context, one batch per q_len (the decode variant for q_len 1 and 3, the chunk
    variant otherwise), then all of them in one varlen batch (decode rows beside 512-token chunks)."""
    dtype, kv = torch.bfloat16, 2
    for q_len in GPU_Q_LENS:
        run_case(dtype, d, kv * group, kv, page, GPU_CTX, [q_len] * len(GPU_CTX), seed=q_len, gated=q_len == 17)
    pairs = [(c, n) for c in GPU_CTX for n in GPU_Q_LENS]
    run_case(dtype, d, kv * group, kv, page, [c for c, _ in pairs], [n for _, n in pairs], seed=7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(torch.float16, 256), (torch.float16, 64), (torch.float32, 128)])
def test_gpu_other_dtypes_and_head_dims(dtype, d):
    run_case(dtype, d, 16, 4, 64, [4097, 100, 0], [200, 64, 17], seed=d, gated=True)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m,threshold", [(64, 8.0), (128, 0.0), (32, 8.0)])
def test_gpu_tile_and_rescale_variants(block_m, threshold):
    run_case(torch.bfloat16, 256, 16, 4, 64, [50000, 300], [64, 200], seed=block_m, block_m=block_m,
             rescale_threshold=threshold)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [800, 2048])
def test_gpu_long_chunks_over_a_long_prefix(q_len):
    """Chunks past ALWAYS_Q_LEN, which the engine sends here when the forward would leave SMs idle (2B's 8 heads)."""
    run_case(torch.bfloat16, 256, 8, 2, 16, [50000], [q_len], seed=q_len, gated=True)


@pytest.mark.gpu
def test_gpu_rows_without_keys():
    dtype, d, h, kv, page = torch.bfloat16, 256, 16, 4, 64
    lens, q_lens = [3, 0, 5000], [100, 64, 300]
    k_pages, v_pages, table, seqused = make_cache([max(n, 1) for n in lens], kv, d, page, dtype, seed=12)
    seqused = torch.tensor(lens, dtype=torch.int32, device=DEV)
    cu = cu_of(q_lens)
    q = randn(sum(q_lens), h, d, dtype=dtype, seed=13)
    out = paged_decode_attention(q, k_pages, v_pages, table, seqused, cu_seqlens_q=cu, max_seqlen_q=300)
    assert torch.isfinite(out).all() and (out[:97] == 0).all() and (out[100:164] == 0).all()
    assert_close(out, reference(q, k_pages, v_pages, table, seqused, cu_seqlens_q=cu), dtype, "rows without keys")


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_chunks():
    """Capture once (max_seqlen_q 256, fixed splits and buffers); replay with new q_lens and context lengths."""
    dtype, d, h, kv, page, max_ctx, batch, max_q = torch.bfloat16, 256, 16, 4, 64, 40000, 3, 256
    k_pages, v_pages, table, seqused = make_cache([max_ctx] * batch, kv, d, page, dtype, seed=14)
    k_pages.nan_to_num_(0.0)  # every slot may become visible when lengths change
    v_pages.nan_to_num_(0.0)
    n_tokens = batch * max_q
    q = randn(n_tokens, h, d, dtype=dtype, seed=15)
    cu = cu_of([max_q] * batch)
    tile = plan(max_q, h // kv, d, 2)
    splits = choose_num_splits(batch, kv, max_ctx, m_blocks=tile.m_blocks, programs_per_sm=tile.programs_per_sm)
    out = torch.empty_like(q)
    ws = alloc_workspace(n_tokens, h, splits, d, DEV)
    run = lambda: paged_decode_attention(q, k_pages, v_pages, table, seqused, cu_seqlens_q=cu, max_seqlen_q=max_q,
                                         num_splits=splits, out=out, workspace=ws)
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for q_lens, ctx in (([256, 1, 64], [30000, 5, 39000]), ([1, 1, 1], [100, 40000 - 1, 7]),
                        ([200, 256, 17], [0, 12345, 4097])):
        cu.copy_(cu_of(q_lens))
        seqused.copy_(torch.tensor([c + n for c, n in zip(ctx, q_lens)], dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        used = sum(q_lens)
        ref = reference(q[:used], k_pages, v_pages, table, seqused, cu_seqlens_q=cu)
        assert_close(out[:used], ref, dtype, f"graph replay q_lens {q_lens} ctx {ctx}")


@pytest.mark.gpu
def test_gpu_fa4_auto_matches_reference():
    dtype, d, h, kv, page = torch.bfloat16, 256, 16, 4, 128
    ctx, q_lens = [50000, 8000], [64, 500]
    lens = [c + n for c, n in zip(ctx, q_lens)]
    k_pages, v_pages, table, seqused = make_cache(lens, kv, d, page, dtype, seed=16)
    q = randn(sum(q_lens), h, d, dtype=dtype, seed=17)
    cu = cu_of(q_lens)
    out = flash_attention(q, k_pages, v_pages, causal=True, cu_seqlens_q=cu, page_table=table, seqused_k=seqused)
    ours = paged_decode_attention(q, k_pages, v_pages, table, seqused, cu_seqlens_q=cu, max_seqlen_q=500)
    assert torch.equal(out, ours)
    assert_close(out, reference(q, k_pages, v_pages, table, seqused, cu_seqlens_q=cu), dtype, "auto")



def test_compile_variants_runs_every_launch_variant(monkeypatch):
    """compile_variants (LLMEngine.warm_up on the GPU) calls the kernel once per decode q_len, chunk M-block, with
    one and two splits, a mixed step, and every power-of-two split count up to MAX_SPLITS, writing nothing into
    the pool. Each call runs."""
    from kernels import paged_decode_attention as P
    calls, kernel = [], P.paged_decode_attention
    monkeypatch.setattr(P, "paged_decode_attention", lambda q, *a, **kw: calls.append(
        (kw["max_seqlen_q"], kw["num_splits"])) or kernel(q, *a, **kw))
    pool = torch.randn(2, 16, 2, 64, generator=torch.Generator().manual_seed(3)).to(torch.float16).to(DEV)
    before = pool.clone()
    n = P.compile_variants(8, pool, pool.clone(), width=5)
    assert n == len(calls) and torch.equal(pool, before)
    assert {(q, s) for q, s in calls if q <= 8} >= {(q, s) for q in range(1, 9) for s in (1, 2)}
    assert {s for _, s in calls} == {1, 2, 4, 8, 16, 32, 64, 128}
    assert {P.plan(q, 4, 64, 2).block_m for q, _ in calls if q > 8} == {64, 128}
