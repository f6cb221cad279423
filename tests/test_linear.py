"""The decode GEMV (kernels/linear.py) against reference.linear, errors measured against fp32 (fp64 for fp32).

Interpreter tests run fp32/fp16 at odd sizes (rows 1-4, K and N not multiples of any tile); `gpu` tests run
bf16 at Qwen3.5's decode shapes, with programmatic dependent launch on and off, inside a CUDA graph, and the
hand-off to torch's matmul above MAX_ROWS rows."""
import pytest
import torch
from conftest import assert_rel
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from kernels import linear as L

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 8e-3}


def _pair(m, n, k, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(dtype)
    return x, w


def _check(x, w, what, gated=False):
    # gated: x is (m, 2k) = [gate | up], judged against reference.silu_and_mul_linear
    ref = R.silu_and_mul_linear if gated else R.linear
    exact = ref(x.double(), w.double()) if x.dtype == torch.float32 else ref(x.float(), w.float())
    out = L.silu_and_mul_linear(x, w) if gated else L.linear(x, w)
    assert out.dtype == x.dtype
    assert_rel(out.double(), exact.double(), TOL[x.dtype], what)


def _gated_pair(m, n, k, dtype, seed=0):
    gate_up, w = _pair(m, n, 2 * k, dtype, seed)
    return gate_up, w[:, :k].contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 65, 33), (2, 300, 1000), (3, 7, 2049), (4, 129, 64)])
def test_linear_matches_reference(m, n, k, dtype):
    _check(*_pair(m, n, k, dtype), f"linear {m}x{k} @ {n}x{k} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (2, 65, 33), (3, 40, 1025), (4, 7, 300), (6, 9, 50)])
def test_silu_and_mul_linear_matches_reference(m, n, k, dtype):
    # one GEMV reading [gate | up] (SwiGLU's down projection); 6 rows take the silu_and_mul + matmul path
    _check(*_gated_pair(m, n, k, dtype), f"gated {m}x{k} @ {n}x{k} {dtype}", gated=True)


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, L.MAX_ROWS), n=st.integers(1, 300), k=st.integers(1, 1500), seed=st.integers(0, 99))
def test_linear_property(m, n, k, seed):
    _check(*_pair(m, n, k, torch.float32, seed), f"linear {m}x{k} @ {n}x{k} seed {seed}")


def test_linear_leading_dims_strided_rows_and_out():
    base, w = _pair(6, 70, 2 * 96, torch.float32)
    x = base.view(2, 3, 192)[..., :96]                       # (2, 3, 96) with row stride 192: 6 rows > MAX_ROWS
    w = w[:, :96].contiguous()
    _check(x[:1, :2], w, "strided 2 rows")                  # GEMV
    out = torch.empty(2, 3, 70, device=DEV)
    assert L.linear(x, w, out=out) is out                    # matmul above MAX_ROWS, into out
    assert_rel(out.double(), R.linear(x.double(), w.double()), 1e-6, "matmul path")
    small = torch.empty(1, 2, 70, device=DEV)
    assert L.linear(x[:1, :2], w, out=small) is small


def test_linear_bad_input():
    x, w = _pair(1, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        L.linear(x, w.half())
    with pytest.raises(ValueError, match="weight"):
        L.linear(x, w[:, :8])
    with pytest.raises(ValueError, match="weight"):
        L.linear(x, w.t().contiguous().t())                   # (8, 16) with stride 1 along N
    with pytest.raises(ValueError, match="out"):
        L.linear(x, w, out=torch.empty(1, 9, device=DEV))
    with pytest.raises(ValueError, match="x"):
        L.linear(x.long(), w)
    with pytest.raises(ValueError, match="gate_up"):
        L.silu_and_mul_linear(x, w)                              # [gate | up] must be twice the weight's K
    with pytest.raises(ValueError, match="gate_up"):
        R.silu_and_mul_linear(x, w)


SHAPES_2B = [(8224, 2048), (2048, 2048), (12288, 2048), (2048, 6144), (5120, 2048), (248320, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_linear_gpu_decode_shapes(m, pdl, dtype, monkeypatch):
    monkeypatch.setenv("QWEN_PDL", "1" if pdl else "0")
    for n, k in SHAPES_2B:
        _check(*_pair(m, n, k, dtype), f"linear {dtype} {m}x{k} @ {n}x{k} pdl={pdl}")
    _check(*_gated_pair(m, 2048, 6144, dtype), f"gated {dtype} {m} rows, down 2048x6144 pdl={pdl}", gated=True)


@pytest.mark.gpu
def test_linear_gpu_chain_in_a_cuda_graph():
    # a chain of dependent GEMVs (each reads the last one's output) replayed from a graph: PDL must keep the order
    x, _ = _pair(1, 1, 1024, torch.bfloat16)
    ws = [_pair(1, 1024, 1024, torch.bfloat16, seed=s)[1] for s in range(8)]
    outs = [torch.empty(1, 1024, device=DEV, dtype=torch.bfloat16) for _ in ws]

    def chain():
        h = x
        for w, o in zip(ws, outs):
            h = L.linear(h, w, out=o)
        return h

    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    x.copy_(torch.randn_like(x))
    graph.replay()
    h = x.float()
    for w in ws:
        h = (h @ w.float().t()).bfloat16().float()
    assert_rel(outs[-1].float(), h, 3e-2, "graph chain")
