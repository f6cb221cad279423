"""The TMA-ring GEMV in CuTe-DSL (kernels/tma_gemv.py) against reference.linear and silu_and_mul_linear.

CPU: the tile rule and the config's errors; which calls it takes (`available`) and which kernels.linear routes to
it; when nvidia-cutlass-dsl is installed, a compile for sm_90a of plain, gated and normed (with and without the
residual) configs (one subprocess), checking the PTX: one TMA copy, the PDL wait and release, x's staging loads
issued at once, a 16-byte shared load per tile row a warp owns and x's. `gpu` tests (H200): bf16 at odd N and K (N
of 1, 65, 1000; K not a multiple of the 256-column tile), the 2B / 9B decode shapes, gated, in a CUDA graph, with NaN
in the weight rows' neighbours, the norm input (with and without the residual: s exact), and through kernels.linear
where its router takes it; relative error against fp32. Chains (tma_gemv_chain, kernels.linear.out_proj_mlp): the
config's rules, the routing, a compile with its grid syncs, and on the GPU bit-exact against its GEMVs launched apart,
against fp32, and in CUDA graph replays.
"""
import dataclasses
import json
import os

import pytest
import torch
from conftest import HAS_CUDA, assert_rel, compiled_script_output
from sm90_compile import CHAIN_CTA_REGS, CHAIN_CTA_SMEM

import reference as R
from kernels import linear as L
from kernels import registry
from kernels import tma_gemv as T
from kernels.registry import H200
from kernels.tuning import KernelTuning

needs_dsl = pytest.mark.skipif(not T.dsl_available(), reason="nvidia-cutlass-dsl is not installed")
gpu_sm90 = pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() < (9, 0), reason="needs sm_90")
TOL = 8e-3  # bf16 output
BF16 = torch.bfloat16


def test_choose_config_fills_the_sms_and_the_ring():
    assert T.choose_config(248320, 2048) == T.TmaGemvConfig(2048, 16, T.RING_BYTES // (T.SLOT_ROWS * 512),
                                                            consumer_warps=8)
    assert T.choose_config(4096, 4096).block_n == 16  # 256 blocks
    assert T.choose_config(2048, 2048).block_n == 16  # one 16-row block a CTA, or two 8-row ones: 16
    assert T.choose_config(1024, 2048).block_n == 8  # 64 16-row blocks would leave 68 SMs idle
    assert T.choose_config(1, 8).block_n == 8
    for cfg in (T.choose_config(n, 2048, slot_rows=rows) for n in (1, 1024, 2048, 8192) for rows in (16, 32)):
        assert cfg.slot_bytes * cfg.stages == T.RING_BYTES
        assert cfg.boxes(cfg.inputs[0]) * cfg.block_n == cfg.slot_rows  # a slot: 16-row boxes or 8-row ones
    cfg = T.choose_config(1, 8, slot_rows=32)
    assert [cfg.width(T.GemvInput(k, block_n=bn)) for k in (264, 520) for bn in (8, 16)] == [1024, 512, 1024, 1024]


@pytest.mark.parametrize("fields, match", [((0, 16, 8), "k must"), ((12, 16, 8), "k must"),
                                           ((T.MAX_K + 8, 16, 8), "k must"), ((64, 12, 8), "block_n"),
                                           ((64, 4, 8), "block_n"), ((64, 16, 1), "stages"), ((64, 16, 33), "stages"),
                                           ((64, 8, 8, False, 1, 16), "consumer_warps"),
                                           ((T.MAX_K, 16, 14, False, 1, 8), "shared memory"),
                                           ((64, 16, 8, True, 1, 4, True), "one of plain, gated, norm"),
                                           ((64, 16, 8, False, 1, 4, False, True), "add only with norm")])
def test_config_errors_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        T.TmaGemvConfig(*fields).validate()


@pytest.mark.parametrize("chain, fields, match", [
    ((T.GemvInput(64, norm=True), T.GemvInput(64, norm=True)), {}, "at most one"),
    ((T.GemvInput(12),), {}, "k must"), ((T.GemvInput(64, gated=True, norm=True),), {}, "one of plain"),
    ((T.GemvInput(64),), {"ctas_per_sm": 2}, "ctas_per_sm must be 1"),
    ((T.GemvInput(64),), {"boundary_slots": 17}, "boundary_slots must be")])
def test_chain_config_errors_name_the_field(chain, fields, match):
    with pytest.raises(ValueError, match=match):
        T.TmaGemvConfig(**{**dict(k=64, block_n=16, stages=16, consumer_warps=8, chain=chain), **fields}).validate()


def test_chain_config_keeps_the_ring_and_the_inputs():
    chain = (T.GemvInput(2048, norm=True, add=True), T.GemvInput(6144, gated=True))
    cfg = T.choose_config(2048, 2048, chain=chain)
    assert cfg.inputs == (T.GemvInput(2048), *chain) and cfg.x_width == 6144
    assert cfg.slot_bytes * cfg.stages == T.RING_BYTES
    assert cfg.boundary_slots == 0
    assert T.choose_config(2048, 2048, chain=chain, boundary_bytes=80 * 1024).boundary_slots == 5
    assert T.choose_config(2048, 2048, boundary_bytes=80 * 1024).boundary_slots == 0  # no chain, no pause


def test_available_only_for_one_bf16_row_on_a_gpu():
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    assert not T.available(torch.randn(1, 256, dtype=torch.bfloat16), w)  # CPU tensors
    if HAS_CUDA:
        wc = w.cuda()
        assert not T.available(torch.randn(2, 256, dtype=torch.bfloat16, device="cuda"), wc)  # two rows
        assert not T.available(torch.randn(1, 256, device="cuda"), wc.float())  # fp32
        assert not T.available(torch.randn(1, 256, dtype=torch.bfloat16, device="cuda"), wc[:, :128])  # strided
        assert not T.available(torch.randn(1, 256, dtype=torch.bfloat16, device="cuda"), wc, gated=True)  # not 2K


def _keys_as_on_an_h200(monkeypatch):
    """CPU stand-in for CUDA tensors on an H200: kernels.linear's keys (linear_key, norm_linear_key, chain_key) name
    the H200 and, for one bf16 row, take tma_gemv.available / chain_available (faked by the tests) as a CUDA row's
    keys do (a CPU tensor never meets the TMA layout)."""
    real_linear, real_norm, real_chain = L.linear_key, L.norm_linear_key, L.chain_key

    def one_bf16_row(key):
        return key.rows == 1 and key.dtype == torch.bfloat16

    def linear_key(x, weight, out=None, gated=False):
        key = real_linear(x, weight, out, gated)
        return key._replace(device=H200, tma_layout=one_bf16_row(key) and T.available(x.view(1, -1), weight, gated))

    def norm_linear_key(x, residual, norm_weight, eps, weight):
        key = real_norm(x, residual, norm_weight, eps, weight)
        res = None if residual is None else residual.view(1, -1)
        return key._replace(device=H200, tma_layout=one_bf16_row(key) and T.available(
            x.view(1, -1), weight, norm_weight=norm_weight, residual=res))

    def chain_key(o, residual, out_weight, norm_weight, eps, gate_up_weight, down_weight):
        key = real_chain(o, residual, out_weight, norm_weight, eps, gate_up_weight, down_weight)
        weights = (out_weight, gate_up_weight, down_weight)
        return key._replace(device=H200, chain_layout=one_bf16_row(key) and T.chain_available(
            o, weights, L._chain_inputs(*weights), norm_weight=norm_weight, residual=residual))

    monkeypatch.setattr(L, "linear_key", linear_key)
    monkeypatch.setattr(L, "norm_linear_key", norm_linear_key)
    monkeypatch.setattr(L, "chain_key", chain_key)


def test_a_cpu_row_never_meets_the_tma_layout(monkeypatch):
    # the keys ask tma_gemv only for a CUDA row: on the CPU the router keeps the Triton kernels
    monkeypatch.setattr(T, "available", lambda *a, **kw: True)
    monkeypatch.setattr(T, "chain_available", lambda *a, **kw: True)
    x, w, norm_w = torch.randn(1, 32, dtype=BF16), torch.randn(64, 32, dtype=BF16), torch.randn(32, dtype=BF16)
    key = L.linear_key(x, w)
    assert not key.tma_layout and key.device.type == "cpu"
    assert not L.norm_linear_key(x, x.clone(), norm_w, 1e-6, w).tma_layout
    square = torch.randn(32, 32, dtype=BF16)
    assert not L.chain_key(x, x.clone(), square, norm_w, 1e-6, w, square).chain_layout
    with registry.use(tuning=KernelTuning(tma_min_bytes=0)):
        assert registry.choose("linear", key, "triton").name == "gemv"


def test_linear_routes_one_row_by_size_and_input(monkeypatch):
    """kernels.linear's routing (CPU: the keys as on an H200, available() faked, the TMA call recorded): one bf16
    row, a weight of KernelTuning.tma_min_bytes and more, gated only from tma_gated_min_k, no sweep plan; the
    pre-norm projection in one TMA call where its input meets the layout, else (past fused_norm_max_k)
    add_rms_norm and then the plain TMA call."""
    calls = []
    _keys_as_on_an_h200(monkeypatch)
    monkeypatch.setattr(T, "available", lambda *a, **kw: True)
    monkeypatch.setattr(T, "tma_gemv", lambda x, w, out, **kw: calls.append((tuple(w.shape), kw)) or out.zero_())
    w, small = torch.randn(64, 32, dtype=BF16), torch.randn(32, 32, dtype=BF16)
    tuning = KernelTuning(tma_min_bytes=64 * 32 * 2)
    with registry.use(tuning=tuning):
        L.linear(torch.randn(1, 32, dtype=BF16), w)
        assert calls == [((64, 32), {"gated": False})]
        for x, weight, kw in ((torch.randn(2, 32, dtype=BF16), w, {}), (torch.randn(1, 32, dtype=BF16), small, {}),
                              (torch.randn(1, 32, dtype=BF16), w, {"plan": (4, 32, 4)}),
                              (torch.randn(1, 64, dtype=BF16), w, {"gated": True})):
            L.linear(x, weight, **kw)  # two rows, 2 KB, a sweep's plan, gated below tma_gated_min_k: Triton
        assert len(calls) == 1
    with registry.use(tuning=dataclasses.replace(tuning, tma_gated_min_k=32)):
        L.linear(torch.randn(1, 64, dtype=BF16), w, gated=True)
    assert calls[-1] == ((64, 32), {"gated": True}) and len(calls) == 2
    x, residual, norm_w = torch.randn(1, 32, dtype=BF16), torch.randn(1, 32, dtype=BF16), torch.randn(32, dtype=BF16)
    with registry.use(tuning=dataclasses.replace(tuning, tma_min_bytes=64 * 32 * 2 + 1)):
        L.add_rms_norm_linear(x, residual.clone(), norm_w, 1e-6, w)  # under tma_min_bytes: the GEMV's own norm
    assert len(calls) == 2
    monkeypatch.setattr(T, "available", lambda *a, norm_weight=None, **kw: norm_weight is None)
    with registry.use(tuning=dataclasses.replace(tuning, fused_norm_max_k=16)):  # K 32: past the GEMV's own norm
        L.add_rms_norm_linear(x, residual.clone(), norm_w, 1e-6, w)  # no normed TMA input: add_rms_norm, TMA GEMV
    assert calls[-1] == ((64, 32), {"gated": False}) and len(calls) == 3
    monkeypatch.setattr(T, "available", lambda *a, **kw: True)
    with registry.use(tuning=tuning):
        _, s = L.add_rms_norm_linear(x, residual, norm_w, 1e-6, w)
    (shape, kw), = calls[3:]
    assert shape == (64, 32) and kw["norm_weight"] is norm_w and kw["residual"] is not None
    assert kw["s_out"].data_ptr() == s.data_ptr() and kw["eps"] == 1e-6


def test_out_proj_mlp_routes_one_row_to_the_chain(monkeypatch):
    """kernels.linear.out_proj_mlp (CPU: the keys as on an H200, chain_available faked, the chained call recorded):
    one bf16 row meeting the chain's layout is one tma_gemv_chain call of the three weights (plain, norm with the
    residual, gated); else the three ops, each on the router's choice."""
    calls = []
    _keys_as_on_an_h200(monkeypatch)
    monkeypatch.setattr(T, "chain_available", lambda *a, **kw: True)
    monkeypatch.setattr(T, "tma_gemv_chain", lambda o, weights, inputs, out, **kw: calls.append((weights, inputs, kw))
                        or out.zero_())
    o, residual, norm_w = torch.randn(1, 48, dtype=BF16), torch.randn(1, 32, dtype=BF16), torch.randn(32, dtype=BF16)
    out_w, gate_up_w, down_w = (torch.randn(32, 48, dtype=BF16), torch.randn(128, 32, dtype=BF16),
                                torch.randn(32, 64, dtype=BF16))
    out, s = L.out_proj_mlp(o, residual, out_w, norm_w, 1e-6, gate_up_w, down_w)
    (weights, inputs, kw), = calls
    assert [w.data_ptr() for w in weights] == [w.data_ptr() for w in (out_w, gate_up_w, down_w)]
    assert inputs == (T.GemvInput(48), T.GemvInput(32, norm=True, add=True), T.GemvInput(64, gated=True))
    assert kw["residual"] is residual and kw["norm_weight"] is norm_w and kw["s_out"] is s and out.shape == (1, 32)
    monkeypatch.setattr(T, "chain_available", lambda *a, **kw: False)  # the three ops (the Triton GEMVs here)
    monkeypatch.setattr(T, "available", lambda *a, **kw: False)
    out, s = L.out_proj_mlp(o, residual, out_w, norm_w, 1e-6, gate_up_w, down_w)
    ref, ref_s = R.out_proj_mlp(o.float(), residual.float(), out_w.float(), norm_w.float(), 1e-6, gate_up_w.float(),
                                down_w.float())
    assert len(calls) == 1
    assert_rel(out.float(), ref, 3e-2, "out_proj_mlp by its ops")
    assert_rel(s.float(), ref_s, TOL, "s")


SM90_CHAIN_COMPILE = """
import json
from kernels.tma_gemv import BOUNDARY_BYTES, GemvInput, choose_config, compile_config
from tests.sm90_compile import cuda_ptxas, parity_resets_in_loops, ptxas_sm90a
chain = (GemvInput(2048, norm=True, add=True), GemvInput(6144, gated=True))
unpaused = compile_config(choose_config(2048, 2048, chain=chain), keep_ptx=True).__ptx__
cfg = choose_config(2048, 2048, chain=chain, boundary_bytes=BOUNDARY_BYTES)
ptx = compile_config(cfg, keep_ptx=True).__ptx__
print(json.dumps({"regs": ptxas_sm90a(ptx, cuda_ptxas())["regs"], "threads": 32 * (cfg.consumer_warps + 1),
                  "smem": cfg.stages * cfg.slot_bytes + 2 * cfg.x_width + 1024,
                  "tma": ptx.count("cp.async.bulk.tensor."), "wait": ptx.count("griddepcontrol.wait"),
                  "fences": ptx.count("fence.acq_rel.gpu"), "nc_loads": ptx.count("ld.global.nc"),
                  "arrive": ptx.count("atom.global.release.add.u64"), "poll": ptx.count("ld.acquire.gpu"),
                  "rsqrt": ptx.count("rsqrt"), "ex2": ptx.count("ex2.approx"),
                  "resets": [parity_resets_in_loops(p) for p in (unpaused, ptx)],
                  "pause": [ptx.count(op) - unpaused.count(op) for op in ("mbarrier.arrive", "mbarrier.try_wait")]}))
"""

SM90_COMPILE = """
import json, sys
from kernels.tma_gemv import TmaGemvConfig, choose_config, compile_config
from tests.sm90_compile import parity_resets_in_loops, ptx_counts
for n, k, gated, norm, add, pdl in json.loads(sys.argv[1]):
    cfg = choose_config(n, k, gated, norm=norm, add=add, pdl=pdl)
    ptx = compile_config(cfg, keep_ptx=True).__ptx__
    print(json.dumps({"n": n, "k": k, "gated": gated, "norm": norm, "add": add, "pdl": pdl, "block_n": cfg.block_n,
                      "resets": parity_resets_in_loops(ptx),
                      **ptx_counts(ptx, {"tma": "cp.async.bulk.tensor", "wait": "griddepcontrol.wait",
                                         "release": "griddepcontrol.launch_dependents", "shared_v4": "ld.shared.v4",
                                         "ex2": "ex2.approx", "rsqrt": "rsqrt", "global_v4": "ld.global.v4",
                                         "store_v4": "st.global.v4"})}), flush=True)
"""


@needs_dsl
def test_compiles_for_sm90(tmp_path):
    cases = [(2048, 2048, False, False, False, True), (248320, 4096, False, False, False, True),
             (2048, 6144, True, False, False, True), (1024, 264, False, False, False, True),
             (8224, 2048, False, True, False, True), (16448, 4096, False, True, True, True),
             (2048, 2048, False, False, False, False)]
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
        boxes = T.SLOT_ROWS // row["block_n"]
        assert row["resets"] == 0, row  # the ring's state carried across a CTA's blocks (not restarted at slot 0)
        assert row["tma"] == boxes, row  # a copy a box of the slot
        assert row["wait"] == row["release"] == row["pdl"], row  # QWEN_PDL=0: no PDL
        assert (row["ex2"] > 0) == row["gated"] and (row["rsqrt"] == 1) == row["norm"], row  # silu; the norm
        # staging: x's (and [gate | up]'s up, the residual's and the norm weight's) chunks issued at once: one
        # 16-byte load of each a step, a step per 2048 columns; only the sum s stored (CTA 0)
        steps = -(-row["k"] // 2048)
        assert row["global_v4"] == steps * (1 + row["gated"] + row["add"] + row["norm"]), row
        assert row["store_v4"] == steps * row["add"], row
        if not row["norm"]:  # a consumer's slot: a 16-byte shared load per row it owns and box, plus x's a box
            assert row["shared_v4"] == (row["block_n"] // 8 + 1) * boxes, row


@needs_dsl
def test_chain_compiles_for_sm90(monkeypatch):
    # a 2B layer's out_proj -> norm -> gate_up -> gated down: a TMA copy a box of each GEMV's slot, one PDL wait,
    # two grid syncs (a release add and an acquire poll each), the norm's rsqrt and the gate's exp
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    out = compiled_script_output(SM90_CHAIN_COMPILE, timeout=600)
    row = json.loads(out.splitlines()[-1])
    assert row["tma"] == 3 * T.SLOT_ROWS // 16 and row["wait"] == 1 and row["arrive"] == row["poll"] == 2, row
    assert row["rsqrt"] == 1 and row["ex2"] > 0, row
    assert row["resets"] == [0] * 2, row  # each ring state carried across blocks and GEMVs
    # no explicit fence around a sync's release add and acquire poll: the outputs are published by the release add
    # after the CTA barrier and read after the acquire poll and a barrier, so they must be read with coherent loads
    # (no ld.global.nc, whose non-coherent cache the acquire does not invalidate)
    assert row["fences"] == 0 and row["nc_loads"] == 0, row
    # BOUNDARY_BYTES: a consumer's arrive a grid sync; the producer's wait in gate_up's loop and after it (for a CTA
    # with too few of its slots to reach the first), and in down's loop
    assert row["pause"] == [2, 3], row
    # what an SM must hold for it (the decode split's 32-key tiles leave room for this: test_decode_attention)
    assert -(-row["regs"] // 8) * 8 * row["threads"] <= CHAIN_CTA_REGS and row["smem"] <= CHAIN_CTA_SMEM, row


def _pair(n, k, seed=0, gated=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, 2 * k if gated else k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    return x, w


def _recorded(monkeypatch, name, what):
    """Wrap T.<name> so that each call also appends what(args, kwargs) to the returned list."""
    calls, real = [], getattr(T, name)
    monkeypatch.setattr(T, name, lambda *a, **kw: calls.append(what(a, kw)) or real(*a, **kw))
    return calls


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
@pytest.mark.parametrize("n, k", [(65, 264), (8224, 2048), (16448, 4096)])
@pytest.mark.parametrize("add", [False, True])
def test_norm_input_matches_fp32(n, k, add):
    # the product of rms_norm(x + residual): out against fp32, s (the new residual) exactly as torch's bf16 add
    x, w = _pair(n, k, seed=n)
    g = torch.Generator(device="cuda").manual_seed(k)
    residual = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16) if add else None
    norm_w = (0.1 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
    s = torch.empty_like(x) if add else None
    assert T.available(x, w, norm_weight=norm_w, residual=residual)
    out = T.tma_gemv(x, w, norm_weight=norm_w, eps=1e-6, residual=residual, s_out=s)
    summed = x if residual is None else x + residual
    ref, _ = R.add_rms_norm_linear(summed.float(), None, norm_w.float(), 1e-6, w.float())
    assert_rel(out.float(), ref, TOL, f"norm n{n} k{k} add={add}")
    if add:
        assert torch.equal(s, summed)


@pytest.mark.gpu
@gpu_sm90
@needs_dsl
def test_add_rms_norm_linear_takes_it_in_one_launch(monkeypatch):
    calls = _recorded(monkeypatch, "tma_gemv", lambda a, kw: kw)
    x, w = _pair(8224, 2048)
    residual = torch.randn_like(x)
    norm_w = (0.1 * torch.randn(2048, device="cuda")).to(torch.bfloat16)
    out, s = L.add_rms_norm_linear(x, residual.clone(), norm_w, 1e-6, w)
    assert len(calls) == 1 and calls[0]["residual"] is not None
    unfused, s_unfused = L.add_rms_norm_linear(x, residual.clone(), norm_w, 1e-6, w, fused=False)
    assert torch.equal(s, s_unfused) and len(calls) == 2  # unfused: add_rms_norm, then the plain TMA GEMV
    assert_rel(out.float(), unfused.float(), TOL, "fused against unfused")


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
    calls = _recorded(monkeypatch, "tma_gemv", lambda a, kw: kw)
    x, w = _pair(1024, 8192, gated=True)  # 16.8 MB and K 8192: at least the tuning's tma_min_bytes, tma_gated_min_k
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
    L.linear(*_pair(1024, 2048))  # 4 MB: the Triton GEMV
    L.silu_and_mul_linear(*_pair(2048, 6144, gated=True))  # 25 MB, but K 6144: the Triton GEMV
    assert len(calls) == 3


def _layer_tail(hidden, width, inter, seed=0):
    # (o, residual, out_w, norm_w, gate_up_w, down_w) of a dense layer's second stretch at one row
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda", generator=g)).to(torch.bfloat16)
    return (rand(1, width), rand(1, hidden), rand(hidden, width, scale=width ** -0.5), rand(hidden, scale=0.1),
            rand(2 * inter, hidden, scale=hidden ** -0.5), rand(hidden, inter, scale=inter ** -0.5))


def _chain(o, residual, out_w, norm_w, gate_up_w, down_w, boundary_bytes=T.BOUNDARY_BYTES):
    s = torch.empty_like(residual)
    inputs = (T.GemvInput(out_w.shape[1]), T.GemvInput(gate_up_w.shape[1], norm=True, add=True),
              T.GemvInput(down_w.shape[1], gated=True))
    assert T.chain_available(o, (out_w, gate_up_w, down_w), inputs, norm_weight=norm_w, residual=residual)
    return T.tma_gemv_chain(o, (out_w, gate_up_w, down_w), inputs, norm_weight=norm_w, eps=1e-6, residual=residual,
                            s_out=s, boundary_bytes=boundary_bytes), s


@pytest.mark.gpu
@gpu_sm90
@needs_dsl
@pytest.mark.parametrize("hidden, width, inter, pause", [
    (1000, 520, 1384, 16), (1024, 2048, 3584, 0), (1024, 2048, 3584, None), (2048, 2048, 6144, None),
    (2048, 2048, 6144, 128), (4096, 4096, 12288, None)])
def test_chain_matches_its_gemvs_and_fp32(hidden, width, inter, pause):
    # one launch: bit for bit the three TMA GEMVs launched apart (the same sums in the same order), s exactly
    # torch's bf16 add, and the output against the fp32 reference of the whole stretch; with the producer's pause
    # at each grid sync after `pause` KiB (None: BOUNDARY_BYTES; 0: none; 128: the whole ring)
    o, residual, out_w, norm_w, gate_up_w, down_w = _layer_tail(hidden, width, inter, seed=hidden + inter)
    out, s = _chain(o, residual, out_w, norm_w, gate_up_w, down_w,
                    T.BOUNDARY_BYTES if pause is None else pause * 1024)
    y = T.tma_gemv(o, out_w)
    s_apart = torch.empty_like(s)
    gate_up = T.tma_gemv(y, gate_up_w, norm_weight=norm_w, eps=1e-6, residual=residual, s_out=s_apart)
    assert torch.equal(s, y + residual) and torch.equal(s, s_apart)
    assert torch.equal(out, T.tma_gemv(gate_up, down_w, gated=True))
    ref, _ = R.out_proj_mlp(o.float(), residual.float(), out_w.float(), norm_w.float(), 1e-6, gate_up_w.float(),
                            down_w.float())
    assert_rel(out.float(), ref, 2 * TOL, f"chain hidden {hidden} width {width} inter {inter}")


@pytest.mark.gpu
@gpu_sm90
@needs_dsl
def test_chain_available_refuses_inconsistent_calls():
    o, residual, out_w, norm_w, gate_up_w, down_w = _layer_tail(2048, 2048, 6144)
    weights = (out_w, gate_up_w, down_w)
    inputs = (T.GemvInput(2048), T.GemvInput(2048, norm=True, add=True), T.GemvInput(6144, gated=True))
    assert T.chain_available(o, weights, inputs, norm_weight=norm_w, residual=residual)
    assert not T.chain_available(o, weights, inputs, residual=residual)  # a norm input without its weight
    assert not T.chain_available(o, weights, inputs, norm_weight=norm_w)  # add without the residual
    assert not T.chain_available(o, weights[:2], inputs, norm_weight=norm_w, residual=residual)  # 2 weights, 3 inputs
    assert not T.chain_available(o, (out_w, down_w, gate_up_w), inputs, norm_weight=norm_w, residual=residual)


@pytest.mark.gpu
@gpu_sm90
@needs_dsl
def test_chain_replays_in_a_cuda_graph_and_through_out_proj_mlp(monkeypatch):
    # the grid-sync counter only grows: replays after an eager warm-up and eager calls after them stay exact
    calls = _recorded(monkeypatch, "tma_gemv_chain", lambda a, kw: len(a[1]))  # tma_gemv is a chain of one
    o, residual, out_w, norm_w, gate_up_w, down_w = _layer_tail(2048, 2048, 6144)
    L.out_proj_mlp(o, residual, out_w, norm_w, 1e-6, gate_up_w, down_w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, s = L.out_proj_mlp(o, residual, out_w, norm_w, 1e-6, gate_up_w, down_w)
    for seed in (1, 2, 3):
        fresh = _layer_tail(2048, 2048, 6144, seed=seed)
        o.copy_(fresh[0])
        residual.copy_(fresh[1])
        graph.replay()
        eager, eager_s = _chain(o, residual, out_w, norm_w, gate_up_w, down_w)
        assert torch.equal(out, eager) and torch.equal(s, eager_s), seed
    assert calls == [3] * (2 + 3)  # warm-up, capture, the eager calls
    monkeypatch.setattr(T, "chain_available", lambda *a, **kw: False)  # the three ops, each on the router's choice
    apart, apart_s = L.out_proj_mlp(o, residual, out_w, norm_w, 1e-6, gate_up_w, down_w)
    assert calls.count(3) == 5 and torch.equal(apart_s, s)
    assert_rel(out.float(), apart.float(), 2 * TOL, "chain against the ops apart")
