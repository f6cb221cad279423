"""Triton norms and gated activations (kernels/norms.py, kernels/activations.py) against reference/.

Interpreter tests run fp32/fp16 at small odd sizes; `gpu` tests run bf16 at Qwen3.5's sizes and check
CUDA-graph capture with preallocated outputs."""
import pytest
import torch
from conftest import rel_err

import reference as R
from kernels.activations import sigmoid_gate_mul, silu_and_mul
from kernels.norms import add_rms_norm, rms_norm

EPS = 1e-6
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-3}
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _close(name, out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"{name}: {out.dtype} {out.shape} vs {ref.shape}"
    err = rel_err(out, ref)
    assert err < TOL[ref.dtype], f"{name}: relative error {err:.2e} >= {TOL[ref.dtype]:.0e} ({ref.dtype})"


def _randn(*shape, dtype, scale=1.0, device=DEV):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


# ---- rms_norm / add_rms_norm -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [64, 200])
@pytest.mark.parametrize("rows", [1, 2, 65])
def test_rms_norm(rows, n, dtype):
    x, w = _randn(rows, n, dtype=dtype, scale=3.0), _randn(n, dtype=dtype, scale=0.2)
    _close("rms_norm", rms_norm(x, w, EPS), R.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [64, 200])
@pytest.mark.parametrize("rows", [1, 2, 65])
def test_add_rms_norm_in_place(rows, n, dtype):
    x, res = _randn(rows, n, dtype=dtype), _randn(rows, n, dtype=dtype, scale=4.0)
    w = _randn(n, dtype=dtype, scale=0.2)
    ref_normed, ref_sum = R.add_rms_norm(x, res, w, EPS)
    normed, summed = add_rms_norm(x, res, w, EPS)
    assert summed.data_ptr() == res.data_ptr(), "the sum must be written into residual"
    _close("add_rms_norm sum", summed, ref_sum)
    _close("add_rms_norm normed", normed, ref_normed)


def test_add_rms_norm_without_residual_is_the_plain_norm():
    # a first layer has no residual yet: the norm of x, and x itself as the residual
    x, w = _randn(3, 65, dtype=torch.float32), _randn(65, dtype=torch.float32, scale=0.2)
    for impl in (add_rms_norm, R.add_rms_norm):
        normed, summed = impl(x, None, w, EPS)
        assert summed is x
        _close("add_rms_norm without residual", normed, R.rms_norm(x, w, EPS))


def test_norms_strided_rows_and_out():
    # x: every other 200-wide half of a (3, 5, 400) tensor -> rows with stride 400; fp32 weight on fp16 x
    base = _randn(3, 5, 400, dtype=torch.float16)
    x, w = base[..., :200], _randn(200, dtype=torch.float32, scale=0.2)
    out = torch.empty(3, 5, 200, dtype=torch.float16, device=DEV)
    assert rms_norm(x, w, EPS, out=out) is out
    _close("rms_norm strided", out, R.rms_norm(x, w, EPS))
    res = _randn(3, 5, 200, dtype=torch.float16)
    ref_normed, ref_sum = R.add_rms_norm(x, res, w, EPS)
    normed, summed = add_rms_norm(x, res, w, EPS, out=out)
    assert normed is out and summed is res
    _close("add_rms_norm strided sum", summed, ref_sum)
    _close("add_rms_norm strided normed", normed, ref_normed)


def test_norm_errors():
    x, w = _randn(4, 64, dtype=torch.float32), _randn(64, dtype=torch.float32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:63], EPS)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.randn(128, device=DEV)[::2], EPS)
    with pytest.raises(ValueError, match="x"):
        rms_norm(x.to(torch.int32), w, EPS)
    with pytest.raises(ValueError, match="x"):
        rms_norm(x.t(), w, EPS)
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, w, EPS, out=torch.empty(4, 32, device=DEV))
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, w, EPS, out=torch.empty(4, 64, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, x[:3].clone(), w, EPS)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, x.half(), w, EPS)


# ---- silu_and_mul / sigmoid_gate_mul ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,inter", [(1, 64), (2, 200), (65, 64), (65, 200), (3, 1100)])  # 1100: 2 blocks
def test_silu_and_mul(rows, inter, dtype):
    gate_up = _randn(rows, 2 * inter, dtype=dtype, scale=3.0)
    _close("silu_and_mul", silu_and_mul(gate_up), R.silu_and_mul(gate_up))


def test_silu_and_mul_strided_out():
    gate_up = _randn(7, 3, 2 * 200, dtype=torch.float32, scale=3.0)
    out = torch.empty(7, 3, 200, device=DEV)
    assert silu_and_mul(gate_up, out=out) is out
    _close("silu_and_mul 3d", out, R.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 65])
def test_sigmoid_gate_mul_q_proj_gate(rows, dtype):
    # gate: the second D of each (rows, H, 2D) q_proj head, a strided view, as the attention output gate uses it
    x, q_proj = _randn(rows, 2, 64, dtype=dtype), _randn(rows, 2, 128, dtype=dtype, scale=3.0)
    gate = q_proj[..., 64:]
    _close("sigmoid_gate_mul", sigmoid_gate_mul(x, gate), R.sigmoid_gate_mul(x, gate))


def test_activation_errors():
    with pytest.raises(ValueError, match="gate_up"):
        silu_and_mul(_randn(4, 63, dtype=torch.float32))
    with pytest.raises(ValueError, match="gate_up"):
        silu_and_mul(_randn(64, 4, dtype=torch.float32).t())
    with pytest.raises(ValueError, match="out"):
        silu_and_mul(_randn(4, 64, dtype=torch.float32), out=torch.empty(4, 64, device=DEV))
    x = _randn(4, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="gate"):
        sigmoid_gate_mul(x, x[:, :32])
    with pytest.raises(ValueError, match="gate"):
        sigmoid_gate_mul(x, x.half())


# ---- GPU: bf16 at real sizes, CUDA graphs ----------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n", [128, 256, 1024, 2048, 4096, 5120, 8192])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_norms_bf16_gpu(rows, n):
    x, res = _randn(rows, n, dtype=torch.bfloat16), _randn(rows, n, dtype=torch.bfloat16, scale=8.0)
    w = _randn(n, dtype=torch.bfloat16, scale=0.2)
    _close("rms_norm bf16", rms_norm(x, w, EPS), R.rms_norm(x, w, EPS))
    ref_normed, ref_sum = R.add_rms_norm(x, res, w, EPS)
    normed, summed = add_rms_norm(x, res, w, EPS)
    _close("add_rms_norm bf16 sum", summed, ref_sum)
    _close("add_rms_norm bf16 normed", normed, ref_normed)


@pytest.mark.gpu
@pytest.mark.parametrize("inter", [512, 3584, 12288, 17408])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_activations_bf16_gpu(rows, inter):
    gate_up = _randn(rows, 2 * inter, dtype=torch.bfloat16, scale=3.0)
    _close("silu_and_mul bf16", silu_and_mul(gate_up), R.silu_and_mul(gate_up))
    x, q_proj = _randn(rows, 16, 256, dtype=torch.bfloat16), _randn(rows, 16, 512, dtype=torch.bfloat16)
    gate = q_proj[..., 256:]
    _close("sigmoid_gate_mul bf16", sigmoid_gate_mul(x, gate), R.sigmoid_gate_mul(x, gate))


@pytest.mark.gpu
def test_fused_ops_cuda_graph():
    rows, hidden, inter = 5, 4096, 12288
    x, res = _randn(rows, hidden, dtype=torch.bfloat16), _randn(rows, hidden, dtype=torch.bfloat16)
    w = _randn(hidden, dtype=torch.bfloat16, scale=0.2)
    gate_up = _randn(rows, 2 * inter, dtype=torch.bfloat16)
    normed, act = torch.empty_like(x), torch.empty(rows, inter, dtype=torch.bfloat16, device=DEV)
    add_rms_norm(x, res.clone(), w, EPS, out=normed)  # compile outside the capture
    silu_and_mul(gate_up, out=act)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_rms_norm(x, res, w, EPS, out=normed)
        silu_and_mul(gate_up, out=act)
    for _ in range(2):
        x.copy_(_randn(rows, hidden, dtype=torch.bfloat16))
        res.copy_(_randn(rows, hidden, dtype=torch.bfloat16))
        gate_up.copy_(_randn(rows, 2 * inter, dtype=torch.bfloat16))
        ref_normed, ref_sum = R.add_rms_norm(x, res, w, EPS)
        graph.replay()
        torch.cuda.synchronize()
        _close("graph add_rms_norm sum", res, ref_sum)
        _close("graph add_rms_norm normed", normed, ref_normed)
        _close("graph silu_and_mul", act, R.silu_and_mul(gate_up))
