"""kernels.moe (routing on the device, pairs sorted into expert blocks, grouped SwiGLU GEMMs, the top-k sum) against
reference.moe: batch 1 to 64, odd hidden and expert sizes, top-k 1 to 8, experts that no token chose, all tokens on
one expert, tied router scores, expert-parallel slices, the shared expert; fp32 in the interpreter on the CPU, bf16
on the GPU (and replayed in a CUDA graph there); the block alignment's invariants; bad arguments."""
import argparse
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from kernels import moe, registry
from kernels.moe import fused_moe, route_and_align, tiles_for
from kernels.moe_gemv import moe_row_gemv
from kernels.tuning import KernelTuning, MoeGemvPlan, MoeTiles
from tests.conftest import HAS_CUDA, assert_rel, compiled_script_output

DEV = "cuda" if HAS_CUDA else "cpu"
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32
TOL = 2e-2 if HAS_CUDA else 1e-5


def weights(experts: int, hidden: int, inter: int, seed: int, shared_inter: int | None = None):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DTYPE).to(DEV)
    router = rand(experts, hidden)
    gate_up, down = rand(experts, 2 * inter, hidden, scale=hidden ** -0.5), rand(experts, hidden, inter,
                                                                                  scale=inter ** -0.5)
    shared = None
    if shared_inter:
        shared = (rand(shared_inter, hidden, scale=hidden ** -0.5), rand(shared_inter, hidden, scale=hidden ** -0.5),
                  rand(hidden, shared_inter, scale=shared_inter ** -0.5), rand(1, hidden, scale=hidden ** -0.5))
    return router, gate_up, down, shared


def tokens(n: int, hidden: int, seed: int):
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)).to(DTYPE).to(DEV)


def check(x, router, gate_up, down, top_k, shared=None, expert_start=None, what="", moe_fn=fused_moe):
    got = moe_fn(x, router, gate_up, down, top_k, shared, expert_start)
    want = R.moe(x.float(), router.float(), gate_up.float(), down.float(), top_k,
                 None if shared is None else tuple(t.float() for t in shared), expert_start)
    assert got.dtype == x.dtype
    if want.norm() == 0:  # an expert-parallel slice that none of the token's experts fell in
        assert torch.equal(got, torch.zeros_like(got)), what
        return
    assert_rel(got.float(), want, TOL, what)


@pytest.mark.parametrize("n, experts, top_k, hidden, inter", [
    (1, 8, 2, 64, 32),     # a decode row
    (5, 16, 4, 96, 48),    # the verify rows of speculative decoding, odd sizes
    (64, 32, 8, 80, 40),   # a batch of 64: every expert chosen by some
    (3, 64, 8, 72, 24),    # most experts chosen by no token
    (17, 6, 1, 48, 100),   # top-1, an intermediate wider than a column block
    (150, 4, 2, 40, 24),   # a prefill chunk's density: 75 pairs an expert, in the prefill tiles' blocks
])
@pytest.mark.parametrize("one_launch_routing", [True, False], ids=["one-launch-routing", "three-launch-routing"])
def test_equals_the_reference(n, experts, top_k, hidden, inter, one_launch_routing, monkeypatch):
    if not one_launch_routing:
        monkeypatch.setattr(moe, "ROUTE_ALIGN_MAX_PAIRS", 0)
    router, gate_up, down, shared = weights(experts, hidden, inter, seed=n, shared_inter=inter + 3)
    x = tokens(n, hidden, seed=n + 1)
    check(x, router, gate_up, down, top_k, shared, what=f"n={n} E={experts} k={top_k}")
    check(x, router, gate_up, down, top_k, None, what="without the shared expert")


def test_all_tokens_on_one_expert_and_tied_scores():
    router, gate_up, down, _ = weights(8, 64, 32, seed=3)
    router[:] = 0
    router[5] = 1.0  # every token's top expert is 5 (x has positive entries); the rest tie at 0
    gate_up[1::2] = gate_up[0::2]  # tied experts share weights, so any choice among a tie gives the same sum
    down[1::2] = down[0::2]
    x = tokens(40, 64, seed=4).abs() + 0.1
    check(x, router, gate_up, down, 1, what="one expert")
    router[4] = router[5]  # experts 4 and 5 tie exactly, and their weights are the same
    gate_up[4], down[4] = gate_up[5], down[5]
    check(x, router, gate_up, down, 2, what="a tie")


@pytest.mark.parametrize("start, local", [(0, 4), (4, 4), (6, 2)])
def test_an_expert_parallel_slice_adds_only_its_experts(start, local):
    router, gate_up, down, _ = weights(8, 64, 32, seed=5)
    x = tokens(9, 64, seed=6)
    check(x, router, gate_up[start:start + local].contiguous(), down[start:start + local].contiguous(), 3,
          expert_start=start, what=f"experts [{start}, {start + local})")


def poison_empty(monkeypatch):
    """torch.empty's floating-point memory filled with NaN, so that a buffer read before it is written shows."""
    empty = torch.empty

    def poisoned(*shape, **kw):
        t = empty(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("shared_inter", [None, 24])
def test_every_slot_is_written_where_every_expert_is_local(monkeypatch, shared_inter):
    # the per-pair buffer is not zeroed when every expert is here: poison the memory it gets (NaN) and the sum must
    # still be the reference's, so each slot the sum reads was written
    poison_empty(monkeypatch)
    router, gate_up, down, shared = weights(8, 64, 32, seed=11, shared_inter=shared_inter)
    x = tokens(13, 64, seed=12)
    check(x, router, gate_up, down, 3, shared, what="poisoned per-pair buffer")


# ---- one token: the chosen experts as GEMVs (kernels.moe_gemv) ---------------------------------------------------

@pytest.mark.parametrize("experts, top_k, hidden, inter, shared_inter", [
    (8, 2, 64, 32, 32),      # a small layer
    (16, 1, 72, 24, 35),     # top-1, odd sizes, a shared expert wider than the experts
    (256, 8, 80, 40, 24),    # 35B-A3B's routing (256 experts, top-8), small matrices
    (12, 5, 48, 100, None),  # an intermediate wider than a column block, no shared expert
])
def test_one_token_gemvs_equal_the_reference(experts, top_k, hidden, inter, shared_inter):
    router, gate_up, down, shared = weights(experts, hidden, inter, seed=experts + top_k, shared_inter=shared_inter)
    for seed in range(3):
        check(tokens(1, hidden, seed=seed), router, gate_up, down, top_k, shared, moe_fn=moe_row_gemv,
              what=f"E={experts} k={top_k} seed={seed}")


@pytest.mark.parametrize("plan", [MoeGemvPlan(1, 16, 1, 16, 1), MoeGemvPlan(16, 1024, 32, 64, 8)])
def test_other_gemv_plans_give_the_reference(plan):
    router, gate_up, down, shared = weights(16, 96, 40, seed=21, shared_inter=24)
    with registry.use(tuning=KernelTuning(moe_row_gemv=plan)):
        check(tokens(1, 96, seed=22), router, gate_up, down, 4, shared, moe_fn=moe_row_gemv, what=str(plan))


@pytest.mark.parametrize("shared_inter", [16, None])
@pytest.mark.parametrize("start, local", [(0, 4), (4, 4), (6, 2)])
def test_one_token_on_an_expert_parallel_slice(start, local, shared_inter):
    router, gate_up, down, shared = weights(8, 64, 32, seed=23, shared_inter=shared_inter)
    for seed in range(4):
        x = tokens(1, 128, seed=seed)[:, ::2] if seed == 3 else tokens(1, 64, seed=seed)  # seed 3: a strided row
        check(x, router, gate_up[start:start + local].contiguous(),
              down[start:start + local].contiguous(), 3, shared, expert_start=start, moe_fn=moe_row_gemv,
              what=f"experts [{start}, {start + local}) seed={seed}")


def test_one_token_writes_every_unit(monkeypatch):
    # the per-unit buffers are not zeroed (a slice's experts of other ranks write 0): poison what they get (NaN)
    poison_empty(monkeypatch)
    router, gate_up, down, shared = weights(8, 64, 32, seed=24, shared_inter=40)
    check(tokens(1, 64, seed=25), router, gate_up[2:6].contiguous(), down[2:6].contiguous(), 4, shared,
          expert_start=2, moe_fn=moe_row_gemv, what="poisoned per-unit buffers")


def test_the_router_sends_one_token_to_the_gemvs():
    router, gate_up, down, shared = weights(8, 64, 32, seed=26, shared_inter=16)
    with registry.use("triton"):
        for rows, tuning, name in ((1, KernelTuning(), "moe_row_gemv"), (2, KernelTuning(), "fused_moe"),
                                   (1, KernelTuning(moe_row_gemv=None), "fused_moe")):
            with registry.use(tuning=tuning):
                assert registry.chosen("moe", tokens(rows, 64, 1), router, gate_up, down, 2, shared).name == name
    with pytest.raises(ValueError, match="x must be one token"):
        moe_row_gemv(tokens(2, 64, 1), router, gate_up, down, 2, shared)
    with pytest.raises(ValueError, match="gate_up_n"):
        MoeGemvPlan(gate_up_n=3)


def test_blocks_grow_where_experts_have_many_pairs():
    tuning = KernelTuning()
    assert tiles_for(8, 256, tuning) is tuning.moe_decode and tiles_for(8192 * 8, 256, tuning) is tuning.moe_prefill
    assert tiles_for(16 * 256, 256, tuning) is tuning.moe_decode  # 16 pairs an expert still fill a decode block


@pytest.mark.parametrize("tiles", [MoeTiles(32, 16, 32, 2, 2), MoeTiles(128, 128, 16, 8, 4),
                                   MoeTiles(16, 16, 32, 4, 2, down=MoeTiles(16, 64, 16, 2, 3))])
def test_other_tiles_give_the_reference(tiles):
    # a tuning's tiles (an A/B of profiles.bench_moe --tiles): other block, column and K sizes give the same sum
    router, gate_up, down, shared = weights(16, 96, 40, seed=8, shared_inter=24)
    with registry.use(tuning=KernelTuning(moe_decode=tiles, moe_prefill=tiles)):
        for n in (3, 70):  # decode's density and prefill's (over 16 experts, 70 x 4 pairs is 17.5 an expert)
            check(tokens(n, 96, seed=n), router, gate_up, down, 4, shared, what=f"{tiles} n={n}")


@pytest.mark.parametrize("bad", [dict(block_m=8), dict(block_n=48), dict(block_k=0), dict(warps=3), dict(stages=0),
                                 dict(down=MoeTiles(32, 64)), dict(down=MoeTiles(16, 64, down=MoeTiles(16, 32)))])
def test_tiles_refuse_what_tl_dot_cannot_run(bad):
    # and a down plan must share the pairs' blocks and have no down of its own
    with pytest.raises(ValueError, match=next(iter(bad))):
        MoeTiles(**{**dict(block_m=16, block_n=64), **bad})


def test_down_tiles_default_to_the_gate_up_tiles():
    tiles = MoeTiles(16, 32, 128, 4, 4)
    assert tiles.down_tiles is tiles and MoeTiles(16, 32, down=MoeTiles(16, 64)).down_tiles == MoeTiles(16, 64)


def assert_aligned(pairs, block_expert, flat, num_pairs: int, local: int, block_m: int):
    """Each pair of ours (flat: its local expert) once, in a block of its expert; other slots padding; real blocks
    first, -1 after."""
    pairs, block_expert = pairs.cpu(), block_expert.cpu()
    mine = ((flat >= 0) & (flat < local)).nonzero().flatten()
    real = pairs[pairs < num_pairs]
    assert sorted(real.tolist()) == mine.tolist()
    for b, e in enumerate(block_expert.tolist()):
        block = pairs[b * block_m:(b + 1) * block_m]
        block = block[block < num_pairs]
        if e < 0:
            assert not block.numel()
        else:
            assert block.numel() and (flat[block.long()] == e).all()
    used = (block_expert >= 0).nonzero().flatten()
    assert used.numel() == 0 or used.tolist() == list(range(used.numel()))


def drawn_case(top_k: int, experts: int, seed: int):
    """(top_k at most experts, a generator, an expert-parallel slice [start, start + local) of the experts)."""
    start = experts // 4
    return min(top_k, experts), torch.Generator().manual_seed(seed), start, experts - start - experts // 5


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 70), st.integers(1, 8), st.integers(2, 40), st.integers(0, 2**16), st.sampled_from([16, 64]),
       st.booleans())
def test_route_and_align_routes_as_torch_and_aligns(n, top_k, experts, seed, block_m, one_launch):
    """Both paths (one program for decode sizes; three launches above ROUTE_ALIGN_MAX_PAIRS, forced here, with
    token blocks of ROUTE_TOKENS and a last one partial): the reference's routing, and each pair of a local expert
    once in a block of its expert, the other slots padding, the real blocks first."""
    top_k, gen, start, local = drawn_case(top_k, experts, seed)
    x = torch.randn(n, 16, generator=gen).to(DEV)  # fp32: bf16 logits would tie, and ties may pick either expert
    router = torch.randn(experts, 16, generator=gen).to(DEV)
    limit = moe.ROUTE_ALIGN_MAX_PAIRS if one_launch else 0
    with mock.patch.object(moe, "ROUTE_ALIGN_MAX_PAIRS", limit):
        got_w, pairs, block_expert = route_and_align(x, router, top_k, local, start, block_m)
    want_w, ids = R.topk_route(x, router, top_k)
    assert torch.allclose(got_w, want_w, rtol=1e-5, atol=1e-6)
    assert_aligned(pairs, block_expert, ids.reshape(-1).cpu() - start, ids.numel(), local, block_m)


@pytest.mark.parametrize("bad, match", [
    (lambda a: a.update(x=a["x"][0]), "x"),
    (lambda a: a.update(top_k=0), "top_k"),
    (lambda a: a.update(down_w=a["down_w"][:, :, :-1].contiguous()), "down_w"),
    (lambda a: a.update(gate_up_w=a["gate_up_w"].double()), "gate_up_w"),
    (lambda a: a.update(expert_start=7), "expert_start"),
])
def test_bad_arguments_name_themselves(bad, match):
    router, gate_up, down, _ = weights(8, 64, 32, seed=7)
    args = dict(x=tokens(3, 64, seed=8), router_w=router, gate_up_w=gate_up, down_w=down, top_k=2)
    bad(args)
    with pytest.raises(ValueError, match=match):
        fused_moe(**args)


@pytest.mark.gpu
def test_replays_in_a_cuda_graph_with_new_tokens():
    router, gate_up, down, shared = weights(64, 256, 128, seed=9, shared_inter=128)
    x = tokens(4, 256, seed=10)
    fused_moe(x, router, gate_up, down, 8, shared)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, router, gate_up, down, 8, shared)
    x.copy_(tokens(4, 256, seed=11))
    graph.replay()
    want = R.moe(x.float(), router.float(), gate_up.float(), down.float(), 8, tuple(t.float() for t in shared))
    assert_rel(out.float(), want, TOL, "graph replay")


def test_bench_moe_reads_tiles():
    from profiles.bench_moe import parse_tiles, tiles_name
    assert parse_tiles(" 128x64x32w8s4") == MoeTiles(128, 64, 32, 8, 4)
    both = parse_tiles("16x32x128w4s4/16x64x128w4s3")
    assert both == MoeTiles(16, 32, 128, 4, 4, down=MoeTiles(16, 64, 128, 4, 3))
    assert tiles_name(both) == "16x32x128w4s4/16x64x128w4s3"
    for bad in ("128x64x32w8", "12x64x64w4s3", "16x32x128w4s4/32x64x128w4s3", "16x32x128w4s4/"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_tiles(bad)
    from profiles.bench_moe import parse_row_gemv
    assert parse_row_gemv(" off") is None and parse_row_gemv("16x128/8x256w8") == MoeGemvPlan(16, 128, 8, 256, 8)
    for bad in ("8x256/4x512", "6x256/4x512w4", "8x256/4x512w3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_row_gemv(bad)


MOE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from kernels import moe as M
from kernels.tuning import KernelTuning
io = ("x_ptr", "wg_ptr", "wu_ptr", "h_ptr", "w_ptr", "gate_ptr")
for tiles in (KernelTuning().moe_decode, KernelTuning().moe_prefill):
    for fn in (M._gate_up_kernel, M._down_kernel):
        for dense in (False, True):
            const = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_PRECISION="tf32",
                         DENSE=dense)
            # the dense mode gets x for its tables and weights, as _expert_gemms passes them
            x_typed = io + (("pairs_ptr", "block_expert_ptr", "weight_ptr") if dense else ())
            fp32 = ("weight_ptr", "y_ptr")
            sig = {n: "constexpr" if n in const else "*bf16" if n in x_typed else "*fp32" if n in fp32
                   else "*i32" if n.endswith("_ptr") else "i32" for n in fn.arg_names}
            triton.compile(ASTSource(fn, sig, const, {}), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": tiles.warps, "num_stages": tiles.stages})
            print(fn.__name__, dense)
sig = dict(y_ptr="*fp32", out_ptr="*bf16", slots="i32", hidden="i32", SLOTS="constexpr", BLOCK_H="constexpr")
triton.compile(ASTSource(M._sum_slots_kernel, sig, dict(SLOTS=16, BLOCK_H=1024), {}), target=GPUTarget("cuda", 90, 32),
               options={"num_warps": 4})
print("_sum_slots_kernel", "-")
routing = dict(TOP_K=8, K_PAD=8, E_PAD=256, BLOCK_T=16)
for fn, const in ((M._route_align_kernel, dict(routing, P_PAD=8, BLOCK_M=16, CHUNK=64, BLOCK_T=1)),
                  (M._route_rank_kernel, routing),
                  (M._align_kernel, dict(E_PAD=256, BLOCK_M=64, CHUNK=64)),
                  (M._scatter_pairs_kernel, dict(BLOCK=1024))):
    sig = {n: "constexpr" if n in const else "*fp32" if n in ("weights_ptr", "logits_ptr") else "*i32"
           if n.endswith("_ptr") else "i32" for n in fn.arg_names}
    triton.compile(ASTSource(fn, sig, const, {}), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print(fn.__name__, "-")
"""


def test_grouped_kernels_compile_for_sm90():
    # the interpreter skips Triton's compiler: compile both modes at the default tiles for sm_90a (a GPU run once
    # refused the dense mode's early return, which the interpreter had run), the slots' sum and the routing kernels
    lines = compiled_script_output(MOE_SM90).split()
    assert len(lines) == 2 * (2 * 2 * 2 + 1 + 4)


MOE_GEMV_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from kernels import moe_gemv as G
from kernels.tuning import KernelTuning
plan = KernelTuning().moe_row_gemv
fp32, i32 = ("weights_ptr", "scale_ptr", "logits_ptr"), ("ids_ptr",)
for fn, const in ((G._route_kernel, dict(TOP_K=8, K_PAD=8, E_PAD=256, BLOCK_T=1)),
                  (G._gate_up_kernel, dict(TOP_K=8, BLOCK_N=plan.gate_up_n, BLOCK_K=plan.gate_up_k)),
                  (G._down_kernel, dict(TOP_K=8, BLOCK_N=plan.down_n, BLOCK_K=plan.down_k))):
    sig = {n: "constexpr" if n in const else "*fp32" if n in fp32 else "*i32" if n in i32 else "*bf16"
           if n.endswith("_ptr") else "i32" for n in fn.arg_names}
    triton.compile(ASTSource(fn, sig, const, {}), target=GPUTarget("cuda", 90, 32), options={"num_warps": plan.warps})
    print(fn.__name__)
"""


def test_one_token_kernels_compile_for_sm90():
    # the interpreter skips Triton's compiler: the routing, gate_up and down kernels at the default plan, for sm_90a
    assert compiled_script_output(MOE_GEMV_SM90).split() == ["_route_kernel", "_gate_up_kernel", "_down_kernel"]
