"""The CuTe-DSL Gated DeltaNet decode (kernels/gdn_decode_cute.py), where the router takes it
(gdn_decode_cute.supports): its routing, its sm_90a compile (barriers after the PDL wait, registers beside a GEMV
CTA), and on the GPU the reference op's output, conv windows and fp32 states over consecutive steps at 2B's shape
(bf16), with scattered slots of both integer types, rows that are views of one projection, and CUDA-graph replay."""
import json

import pytest
import torch
from conftest import compiled_script_output, record_launches
from test_gdn_decode import EPS, assert_close, check_graph_replay, decode_step, make_layer, run_steps

from kernels import gdn_decode, gdn_decode_cute
from kernels.cute_runtime import dsl_available
from model.ops import _ref_gated_deltanet

needs_dsl = pytest.mark.skipif(not dsl_available(), reason="nvidia-cutlass-dsl is not installed")
QWEN2B = (16, 16, 128, 128)  # Hk, Hv, dk, dv
SM90_REGS = 65536


@pytest.fixture
def cute_calls(monkeypatch):
    """The list of the CuTe kernel's launches (their outputs' shapes)."""
    calls, real = [], gdn_decode_cute.launch
    monkeypatch.setattr(gdn_decode_cute, "launch", lambda *a, **kw: calls.append(a[-1].shape) or real(*a, **kw))
    return calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU route")
def test_cpu_calls_stay_on_the_triton_kernel(cute_calls, monkeypatch):
    # what the CuTe kernel cannot run (here: CPU tensors, fp32, 2 value heads a key head) goes to the Triton kernel
    launches = record_launches(monkeypatch, gdn_decode, "_gdn_decode_kernel")
    run_steps(2, 4, 16, 16, torch.float32, 2, n_slots=4, steps=1, tol_out=1e-5, tol_state=1e-5)
    run_steps(2, 2, 16, 16, torch.float32, 1, n_slots=2, steps=1, tol_out=1e-5, tol_state=1e-5)
    assert cute_calls == [] and len(launches) == 2


SM90_COMPILE = """
import json, re, sys
from kernels.gdn_decode_cute import GdnDecodeConfig, compile_config
from tests.sm90_compile import cuda_ptxas, ptxas_sm90a
CASES = ((4, False, "BFloat16"), (8, False, "Float32"), (4, True, "Float32"), (8, True, "BFloat16"))
for warps, stamps, gates in CASES:
    ptx = compile_config(GdnDecodeConfig(warps=warps, stamps=stamps, gate_dtype=gates), keep_ptx=True).__ptx__
    wait = ptx.find("griddepcontrol.wait")
    info = ptxas_sm90a(ptx, cuda_ptxas())
    print(json.dumps({"warps": warps, "stamps": stamps, "waits": ptx.count("griddepcontrol.wait"),
                      "launches": ptx.count("griddepcontrol.launch_dependents"),
                      "bars_after_wait": len(re.findall(r"bar\\.sync|barrier\\.sync", ptx[wait:])),
                      "loads_after_wait": len(re.findall(r"ld\\.global", ptx[wait:])),
                      "regs": info["regs"], "spill": info["spill"]}), flush=True)
"""


@needs_dsl
def test_compiles_for_sm90(monkeypatch):
    # one PDL wait and release; after the wait only q | k | v, z, a and b are loaded (4 loads a thread) and two
    # barriers (the conv's outputs, the partial sums); a program's registers leave half the SM to the GEMV CTA that
    # fills its ring beside it (stamps add their end barrier)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    rows = [json.loads(line) for line in compiled_script_output(SM90_COMPILE, timeout=600).splitlines()
            if line.startswith("{")]
    assert len(rows) == 4, rows
    for row in rows:
        assert row["waits"] == row["launches"] == 1 and row["loads_after_wait"] == 4, row
        assert row["bars_after_wait"] == 2 + row["stamps"], row
        assert row["regs"] * 32 * row["warps"] <= SM90_REGS // 2, row
        assert row["spill"] is None or row["spill"] <= (0 if row["warps"] == 4 else 64), row


gpu_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                              reason="needs an sm_90 GPU")


@pytest.mark.gpu
@gpu_sm90
@needs_dsl
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("bsz,slot_dtype", [(1, torch.int64), (3, torch.int32), (64, torch.int64)])
def test_gpu_matches_reference_20_steps(cute_calls, monkeypatch, warps, bsz, slot_dtype):
    monkeypatch.setattr(gdn_decode_cute, "WARPS", warps)
    run_steps(*QWEN2B, torch.bfloat16, bsz, n_slots=bsz + 5, steps=20, tol_out=1e-2, tol_state=1e-3, seed=bsz,
              slot_dtype=slot_dtype)
    assert len(cute_calls) == 20


@pytest.mark.gpu
@gpu_sm90
@needs_dsl
def test_gpu_rows_as_views_of_one_projection(cute_calls):
    hk, hv, dk, dv = QWEN2B
    gen = torch.Generator().manual_seed(4)
    conv_w, a_log, dt_bias, norm_w, conv, rec = make_layer(gen, hk, hv, dk, dv, torch.bfloat16, 6)
    conv_w, norm_w = conv_w.to(torch.bfloat16), norm_w.to(torch.bfloat16)  # the gates' weights stay fp32
    c = 2 * hk * dk + hv * dv
    proj = torch.randn(3, c + hv * dv + 2 * hv + 8, generator=gen).to("cuda", torch.bfloat16)  # padded rows
    qkv, z, b, a, _ = proj.split([c, hv * dv, hv, hv, 8], dim=-1)
    z = z.view(3, hv, dv)
    slots = torch.tensor([5, 0, 2], device="cuda")
    r_conv, r_rec = conv.clone(), rec.clone()
    out = gdn_decode.gdn_decode_step(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, conv, rec, slots, hk, EPS)
    ref = _ref_gated_deltanet(qkv.contiguous(), z.contiguous(), b.contiguous(), a.contiguous(), conv_w, a_log,
                              dt_bias, norm_w, r_conv, r_rec, decode_step(slots), hk, EPS)
    assert len(cute_calls) == 1
    assert_close(out, ref, 1e-2, "strided rows output")
    assert torch.equal(conv, r_conv)
    assert_close(rec, r_rec, 1e-3, "strided rows recurrent_states")


@pytest.mark.gpu
@gpu_sm90
@needs_dsl
def test_gpu_cuda_graph_replay(cute_calls):
    check_graph_replay(QWEN2B, bsz=2, n_slots=8, seed=12, gate_dtype=torch.bfloat16)
    assert len(cute_calls) == 2  # the warm-up and the capture

