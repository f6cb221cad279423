"""The TMA-ring GEMV in CuTe-DSL (kernels/tma_gemv.py) against reference.linear and silu_and_mul_linear.

CPU: the tile rule and the config's errors; which calls it takes (`available`); when nvidia-cutlass-dsl is installed,
a compile for sm_90a of plain and gated configs (one subprocess), checking the PTX: one TMA copy, the PDL wait and
release, a 16-byte shared load per tile row a warp owns and x's. `gpu` tests (H200): bf16 at odd N and K (N of 1,
65, 1000; K not a multiple of the 256-column tile), the 2B / 9B decode shapes, gated, in a CUDA graph, with NaN in
the weight rows' neighbours, and through kernels.linear with TMA_GEMV on; relative error against fp32.
"""
import json
import os

import pytest
import torch
from conftest import HAS_CUDA, assert_rel, compiled_script_output

import reference as R
from kernels import linear as L
from kernels import tma_gemv as T

needs_dsl = pytest.mark.skipif(not T.dsl_available(), reason="nvidia-cutlass-dsl is not installed")
gpu_sm90 = pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() < (9, 0), reason="needs sm_90")
TOL = 8e-3  # bf16 output


def test_choose_config_fills_the_sms_and_the_ring():
    assert T.choose_config(248320, 2048) == T.TmaGemvConfig(2048, 16, 16, consumer_warps=8)
    assert T.choose_config(4096, 4096).block_n == 16  # 256 blocks
    assert T.choose_config(2048, 2048).block_n == 8  # 16-row blocks would leave 4 SMs idle
    assert T.choose_config(1, 8).block_n == 8
    for cfg in (T.choose_config(n, 2048) for n in (1, 1024, 2048, 8192)):
        assert cfg.block_n * T.BLOCK_K * 2 * cfg.stages == T.RING_BYTES


@pytest.mark.parametrize("k, block_n, stages, match", [(0, 16, 8, "k must"), (12, 16, 8, "k must"),
                                                       (T.MAX_K + 8, 16, 8, "k must"), (64, 12, 8, "block_n"),
                                                       (64, 16, 1, "stages"), (64, 16, 33, "stages")])
def test_config_errors_name_the_field(k, block_n, stages, match):
    with pytest.raises(ValueError, match=match):
        T.TmaGemvConfig(k, block_n, stages).validate()


def test_available_only_for_one_bf16_row_on_a_gpu():
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    assert not T.available(torch.randn(1, 256, dtype=torch.bfloat16), w)  # CPU tensors
    if HAS_CUDA:
        wc = w.cuda()
        assert not T.available(torch.randn(2, 256, dtype=torch.bfloat16, device="cuda"), wc)  # two rows
        assert not T.available(torch.randn(1, 256, device="cuda"), wc.float())  # fp32
        assert not T.available(torch.randn(1, 256, dtype=torch.bfloat16, device="cuda"), wc[:, :128])  # strided
        assert not T.available(torch.randn(1, 256, dtype=torch.bfloat16, device="cuda"), wc, gated=True)  # not 2K


SM90_COMPILE = """
import json, sys
from kernels.tma_gemv import TmaGemvConfig, choose_config, compile_config
for n, k, gated in json.loads(sys.argv[1]):
    cfg = choose_config(n, k, gated)
    ptx = compile_config(cfg, keep_ptx=True).__ptx__
    print(json.dumps({"n": n, "k": k, "gated": gated, "block_n": cfg.block_n,
                      "tma": ptx.count("cp.async.bulk.tensor"), "wait": ptx.count("griddepcontrol.wait"),
                      "release": ptx.count("griddepcontrol.launch_dependents"),
                      "shared_v4": ptx.count("ld.shared.v4"), "ex2": ptx.count("ex2.approx")}), flush=True)
"""


@needs_dsl
def test_compiles_for_sm90(tmp_path):
    cases = [(2048, 2048, False), (248320, 4096, False), (2048, 6144, True), (1024, 264, False)]
    env_before = os.environ.get("CUTE_DSL_ARCH")
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ["CUTE_DSL_DUMP_DIR"] = str(tmp_path)
    try:
        out = compiled_script_output(SM90_COMPILE, json.dumps(cases), timeout=600)
    finally:
        if env_before is None:
            os.environ.pop("CUTE_DSL_ARCH")
        else:
            os.environ["CUTE_DSL_ARCH"] = env_before
        os.environ.pop("CUTE_DSL_DUMP_DIR")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(rows) == len(cases), out
    for row in rows:
        assert row["tma"] == 1 and row["wait"] == 1 and row["release"] == 1, row
        # a consumer's tile: one 16-byte shared load per row it owns, plus x's 8 columns
        assert row["shared_v4"] == row["block_n"] // 8 + 1, row
        assert (row["ex2"] > 0) == row["gated"], row  # silu's exp only when gated


def _pair(n, k, seed=0, gated=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, 2 * k if gated else k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    return x, w


def _reference(x, w, gated):
    return (R.silu_and_mul_linear if gated else R.linear)(x.float(), w.float())


@pytest.mark.gpu
@gpu_sm90
@needs_dsl
@pytest.mark.parametrize("n, k", [(1, 8), (65, 264), (1000, 1000), (2053, 2048), (2048, 2048), (4096, 12288),
                                  (8224, 2048), (24576, 4096)])
@pytest.mark.parametrize("gated", [False, True])
def test_matches_fp32(n, k, gated):
    x, w = _pair(n, k, seed=n + k, gated=gated)
    assert T.available(x, w, gated)
    out = T.tma_gemv(x, w, gated=gated)
    assert_rel(out.float(), _reference(x, w, gated), TOL, f"tma_gemv n{n} k{k} gated={gated}")


@pytest.mark.gpu
@gpu_sm90
@needs_dsl
def test_nan_beside_the_weight_does_not_leak():
    # the weight is a view of rows 1..n of a NaN-filled buffer, and K is not a multiple of the tile: neither the
    # rows after N nor the columns after K may reach an output
    n, k = 130, 520
    buf = torch.full((n + 2, k), float("nan"), dtype=torch.bfloat16, device="cuda")
    x, w = _pair(n, k)
    buf[1:n + 1] = w
    out = T.tma_gemv(x, buf[1:n + 1])
    assert_rel(out.float(), _reference(x, w, False), TOL, "NaN neighbours")


@pytest.mark.gpu
@gpu_sm90
@needs_dsl
def test_replays_in_a_cuda_graph_and_through_linear(monkeypatch):
    monkeypatch.setattr(L, "TMA_GEMV", True)
    calls, real = [], T.tma_gemv
    monkeypatch.setattr(T, "tma_gemv", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    x, w = _pair(1024, 8192, gated=True)  # 16.8 MB and K 8192: at least L.TMA_MIN_BYTES and L.TMA_GATED_MIN_K
    out = torch.empty(1, 1024, dtype=torch.bfloat16, device="cuda")
    L.silu_and_mul_linear(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        L.linear(x, w, out=out, gated=True)
    for seed in (1, 2):
        x.copy_(_pair(1024, 8192, seed=seed, gated=True)[0])
        graph.replay()
        assert_rel(out.float(), _reference(x, w, True), TOL, f"graph replay {seed}")
    eager = L.silu_and_mul_linear(x, w)
    assert torch.equal(eager, out)  # the same kernel eager and in the graph
    assert len(calls) == 3 and all(kw["gated"] for kw in calls)  # warm-up, capture, eager
    L.linear(*_pair(2048, 2048))  # 8 MB: the Triton GEMV
    L.silu_and_mul_linear(*_pair(2048, 6144, gated=True))  # 25 MB, but K 6144: the Triton GEMV
    assert len(calls) == 3
