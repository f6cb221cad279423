"""The decode GEMV (kernels/linear.py) against reference.linear, silu_and_mul_linear and add_rms_norm_linear (the
three inputs it multiplies), errors measured against fp32 (fp64 for fp32).

Interpreter tests run fp32/fp16 at odd sizes (one row on the GEMV, 2-16 on the skinny GEMM, and 2-4 on the GEMV too
under KernelTuning(gemv_max_rows=4); K and N not multiples of any tile); `gpu` tests run bf16 at Qwen3.5's decode
shapes, with programmatic dependent launch on and off, inside a CUDA graph, and the hand-off to torch's matmul
above DOT_MAX_ROWS rows and for padded (eager) rows."""
import math

import pytest
import torch
from conftest import assert_rel, compiled_script_output, record_launches
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from kernels import linear as L
from kernels import registry
from kernels import row_buckets as RB
from kernels.gdn_pointwise import gated_rms_norm
from kernels.tuning import KernelTuning

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
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 65, 33), (2, 300, 1000), (3, 7, 2049), (4, 129, 64), (5, 1, 1),
                                   (6, 65, 33), (9, 129, 1025), (16, 40, 300), (17, 7, 70)])
@pytest.mark.parametrize("gemv_rows", [1, 4])
def test_linear_matches_reference(m, n, k, dtype, gemv_rows):
    with registry.use(tuning=KernelTuning(gemv_max_rows=gemv_rows)):
        _check(*_pair(m, n, k, dtype), f"linear {m}x{k} @ {n}x{k} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (2, 65, 33), (3, 40, 1025), (4, 7, 300), (6, 9, 50), (13, 33, 257),
                                   (17, 9, 50)])
@pytest.mark.parametrize("gemv_rows", [1, 4])
def test_silu_and_mul_linear_matches_reference(m, n, k, dtype, gemv_rows):
    # one GEMV (or skinny GEMM, 2-16 rows) reading [gate | up] (SwiGLU's down projection); 17 rows take the
    # silu_and_mul + matmul path
    with registry.use(tuning=KernelTuning(gemv_max_rows=gemv_rows)):
        _check(*_gated_pair(m, n, k, dtype), f"gated {m}x{k} @ {n}x{k} {dtype}", gated=True)


def _normed_inputs(m, k, dtype, seed, with_residual=True):
    g = torch.Generator(device=DEV).manual_seed(seed + 100)
    x = torch.randn(m, k, device=DEV, generator=g).to(dtype)
    residual = torch.randn(m, k, device=DEV, generator=g).to(dtype) if with_residual else None
    norm_w = (0.1 * torch.randn(k, device=DEV, generator=g)).to(dtype)
    return x, residual, norm_w


def _check_normed(m, n, k, dtype, with_residual, seed=0, tol=None):
    # the pre-norm projection against reference.add_rms_norm_linear in fp64 (fp32 for 16-bit inputs)
    x, residual, norm_w = _normed_inputs(m, k, dtype, seed, with_residual)
    _, w = _pair(m, n, k, dtype, seed)
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    exact, exact_s = R.add_rms_norm_linear(x.to(wide), None if residual is None else residual.to(wide),
                                           norm_w.to(wide), 1e-6, w.to(wide))
    summed = x if residual is None else x + residual  # in x's dtype, as the model's residual stream rounds
    out, s = L.add_rms_norm_linear(x, None if residual is None else residual.clone(), norm_w, 1e-6, w, fused=True)
    assert out.dtype == dtype and out.shape == (m, n)
    assert torch.equal(s, summed), "the returned residual is x + residual in x's dtype"
    assert (s is x) == (residual is None)
    assert_rel(out.double(), exact.double(), tol or TOL[dtype], f"normed {m}x{k} @ {n}x{k} {dtype}")


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (2, 65, 33), (3, 40, 1025), (4, 7, 300), (6, 9, 50)])
def test_add_rms_norm_linear_matches_reference(m, n, k, dtype, with_residual):
    # the GEMV norms the rows itself (6 rows: add_rms_norm, then the skinny GEMM)
    _check_normed(m, n, k, dtype, with_residual)


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_linear_unfused_equals_the_two_ops(with_residual):
    # fused=False (the router's choice above KernelTuning.fused_norm_max_k) is add_rms_norm, then the GEMV
    x, residual, norm_w = _normed_inputs(2, 96, torch.float32, 3, with_residual)
    _, w = _pair(2, 50, 96, torch.float32, 3)
    out, s = L.add_rms_norm_linear(x, None if residual is None else residual.clone(), norm_w, 1e-6, w, fused=False)
    h = R.rms_norm(x if residual is None else x + residual, norm_w, 1e-6)
    assert torch.equal(s, x if residual is None else x + residual)
    assert_rel(out.double(), R.linear(h.double(), w.double()), 1e-6, "unfused")


@pytest.mark.parametrize("k,max_k,fused", [(96, None, True), (1024, None, True), (1025, None, False),
                                           (96, 64, False), (1025, 2048, True)])
def test_add_rms_norm_linear_fuses_up_to_max_k(k, max_k, fused):
    # the router has the GEMV norm its rows itself up to the tuning's fused_norm_max_k (default 1024; s: a new
    # tensor), beyond it add_rms_norm runs first (s: the residual, summed in place)
    x, residual, norm_w = _normed_inputs(1, k, torch.float32, 5, True)
    _, w = _pair(1, 9, k, torch.float32, 5)
    tuning = KernelTuning() if max_k is None else KernelTuning(fused_norm_max_k=max_k)
    with registry.use(tuning=tuning):
        out, s = L.add_rms_norm_linear(x, residual, norm_w, 1e-6, w)
    assert (s is not residual) == fused == (k <= tuning.fused_norm_max_k)
    assert_rel(out.double(), R.linear(R.rms_norm(s, norm_w, 1e-6).double(), w.double()), 1e-5, f"k {k}")


@settings(max_examples=8, deadline=None)
@given(m=st.integers(1, L.MAX_ROWS), n=st.integers(1, 200), k=st.integers(1, 1200), seed=st.integers(0, 99),
       with_residual=st.booleans())
def test_add_rms_norm_linear_property(m, n, k, seed, with_residual):
    _check_normed(m, n, k, torch.float32, with_residual, seed)


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, RB.DOT_MAX_ROWS + 2), n=st.integers(1, 300), k=st.integers(1, 1500), seed=st.integers(0, 99))
def test_linear_property(m, n, k, seed):
    _check(*_pair(m, n, k, torch.float32, seed), f"linear {m}x{k} @ {n}x{k} seed {seed}")


@pytest.mark.parametrize("shape", [(2, 3), (3, 6)])
def test_linear_leading_dims_strided_rows_and_out(shape):
    # 6 rows: the skinny GEMM; 18 rows: torch's matmul
    base, w = _pair(math.prod(shape), 70, 2 * 96, torch.float32)
    x = base.view(*shape, 192)[..., :96]                     # (*shape, 96) with row stride 192
    w = w[:, :96].contiguous()
    _check(x[:1, :2], w, "strided 2 rows")                  # GEMV
    out = torch.empty(*shape, 70, device=DEV)
    assert L.linear(x, w, out=out) is out
    assert_rel(out.double(), R.linear(x.double(), w.double()), 1e-6, f"{shape} rows")
    small = torch.empty(1, 2, 70, device=DEV)
    assert L.linear(x[:1, :2], w, out=small) is small


@pytest.mark.parametrize("m,n,k,split", [(5, 65, 1000, 3), (16, 7, 33, 4), (9, 40, 300, 2), (13, 129, 2049, 8)])
def test_skinny_gemm_split_over_k_matches_reference(m, n, k, split):
    # kernels.split_k: each column block's programs take runs of K's tiles (uneven runs, runs with no tile when K
    # has fewer tiles than splits); the last one sums the partials in split order: the same bits on a second call,
    # and every ticket back at zero after it
    from kernels import split_k
    x, w = _pair(m, n, k, torch.float32, seed=k)
    plan = (16, 32, 2, 1, split)
    out = L.linear(x, w, plan=plan)
    assert_rel(out.double(), R.linear(x.double(), w.double()), 1e-6, f"split {split}: {m}x{k} @ {n}x{k}")
    assert torch.equal(L.linear(x, w, plan=plan), out)
    assert not split_k.workspace(x.device)[1].any()
    with pytest.raises(ValueError, match="SPLIT must be 1 to 8"):
        L.linear(x, w, plan=(16, 32, 2, 1, 9))


def test_skinny_gemm_splits_as_its_plan_says(monkeypatch):
    # a plan's SPLIT is the grid's second dimension (SPLIT programs a column block); SPLIT 1: one a block
    launches = record_launches(monkeypatch, L, "_rows_dot_kernel")
    x, w = _pair(6, 40, 300, torch.float32)
    for split in (4, 1):
        out = L.linear(x, w, plan=(16, 32, 2, 1, split))
        assert_rel(out.double(), R.linear(x.double(), w.double()), 1e-6, f"split {split}")
    assert [(grid, kwargs["SPLIT"]) for grid, kwargs in launches] == [((3, 4), 4), ((3, 1), 1)]


@pytest.mark.parametrize("m,kernel,gemv_max_rows", [(4, "gemv", 4), (5, "dot", 4), (16, "dot", 4),
                                                   (17, "matmul", 4), (2, "dot", 1), (4, "dot", 3), (3, "gemv", 3)])
def test_linear_routes_rows_to_the_kernel_for_them(m, kernel, gemv_max_rows, monkeypatch):
    # unpadded rows (the CPU, CUDA-graph capture): up to tuning.gemv_max_rows the GEMV, up to DOT_MAX_ROWS the
    # skinny GEMM (gated: after silu_and_mul, as matmul)
    calls = []
    for name in ("_gemv", "_rows_dot", "matmul_rows"):
        real = getattr(L, name)
        monkeypatch.setattr(L, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    for gated in (False, True):
        x, w = _gated_pair(m, 24, 40, torch.float32) if gated else _pair(m, 24, 40, torch.float32)
        with registry.use(tuning=KernelTuning(gemv_max_rows=gemv_max_rows)):
            _check(x, w, f"{m} rows", gated=gated)
    assert calls == 2 * [{"gemv": "_gemv", "dot": "_rows_dot", "matmul": "matmul_rows"}[kernel]]


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
    norm_w = torch.randn(16, device=DEV)
    with pytest.raises(ValueError, match="residual"):
        L.add_rms_norm_linear(x, x[:, :8], norm_w, 1e-6, w)
    with pytest.raises(ValueError, match="residual"):
        L.add_rms_norm_linear(x, x.half(), norm_w, 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight"):
        L.add_rms_norm_linear(x, x, norm_w[:8], 1e-6, w)
    with pytest.raises(ValueError, match="weight"):
        L.add_rms_norm_linear(x, None, norm_w, 1e-6, w[:, :8])


SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from kernels import linear as L
for mode, add in ((L.PLAIN, False), (L.GATED, False), (L.NORM, False), (L.NORM, True)):
    const = dict(ROWS=2, BLOCK_N=4, BLOCK_K=512, NORM_BLOCK=2048, INPUT=mode.value, ADD=add, STAMPS=False, PDL=True)
    sig = {n: "constexpr" if n in const else "*bf16" if n.endswith("_ptr") else "fp32" if n == "eps" else "i32"
           for n in L._linear_kernel.arg_names}
    ptx = triton.compile(ASTSource(L._linear_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    before_wait = ptx[:ptx.find("griddepcontrol.wait")]
    print(ptx.count("griddepcontrol"), ptx.count("st.global"), before_wait.count("ld.global"), flush=True)
for warps, split in ((1, 1), (4, 1), (2, 4)):
    const = dict(ROWS=16, BLOCK_N=16 * warps, BLOCK_K=256, STAGES=4, SPLIT=split, DOT_PRECISION="tf32", PDL=True)
    ptrs = {"part_ptr": "*fp32", "ticket_ptr": "*i32"} if split > 1 else {}  # unsplit: the output stands in
    sig = {n: "constexpr" if n in const else ptrs.get(n, "*bf16") if n.endswith("_ptr") else "i32"
           for n in L._rows_dot_kernel.arg_names}
    aligned = {(L._rows_dot_kernel.arg_names.index(n),): [["tt.divisibility", 16]]  # as the JIT specializes
               for n in ("x_ptr", "w_ptr", "out_ptr", "K", "x_stride", "w_stride", "out_stride")}
    ptx = triton.compile(ASTSource(L._rows_dot_kernel, sig, const, aligned), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": warps}).asm["ptx"]
    print(ptx.count("griddepcontrol"), ptx.count("mma."), ptx.count("cp.async"), ptx.count("atom."), flush=True)
"""


def test_gemv_variants_compile_for_sm90():
    # the interpreter skips Triton's compiler: each input mode to PTX for sm_90a on the CPU, with PDL's
    # griddepcontrol pair and its first weight tile loaded before the wait; the add-and-norm variant also stores
    # the summed residual
    out = compiled_script_output(SM90_COMPILE)
    counts = [tuple(map(int, line.split())) for line in out.splitlines()]
    gemv, dot = counts[:4], counts[4:]
    assert len(gemv) == 4 and all(pdl == 2 and loads > 0 for pdl, _, loads in gemv), out
    assert gemv[3][1] > gemv[2][1], out
    # the skinny GEMM: PDL, tensor-core MMAs, and weight tiles copied asynchronously into its shared-memory ring;
    # split over K, the ticket's atomics (the draw and the reset)
    assert len(dot) == 3 and all(pdl == 2 and mma > 0 and cp > 0 for pdl, mma, cp, _ in dot), out
    assert [atoms > 0 for *_, atoms in dot] == [False, False, True], out


SHAPES_2B = [(8224, 2048), (2048, 2048), (12288, 2048), (2048, 6144), (5120, 2048), (248320, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 16])
def test_linear_gpu_decode_shapes(m, pdl, dtype, monkeypatch):
    with registry.use(tuning=KernelTuning(pdl=pdl)):
        for n, k in SHAPES_2B:
            _check(*_pair(m, n, k, dtype), f"linear {dtype} {m}x{k} @ {n}x{k} pdl={pdl}")
        _check(*_gated_pair(m, 2048, 6144, dtype), f"gated {dtype} {m} rows, down 2048x6144 pdl={pdl}", gated=True)
        for n in (8224, 12288):  # GDN in_proj, MLP gate_up: normed inside the GEMV
            _check_normed(m, n, 2048, dtype, True, tol=1e-2 if dtype == torch.bfloat16 else None)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_linear_gpu_chain_in_a_cuda_graph(m):
    # a chain of dependent GEMVs or skinny GEMMs (each reads the last one's output) replayed from a graph (rows
    # unpadded, as in a decode graph): PDL must keep the order
    x, _ = _pair(m, 1, 1024, torch.bfloat16)
    ws = [_pair(1, 1024, 1024, torch.bfloat16, seed=s)[1] for s in range(8)]
    outs = [torch.empty(m, 1024, device=DEV, dtype=torch.bfloat16) for _ in ws]

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


@pytest.mark.gpu
@pytest.mark.parametrize("split", [2, 4, 8])
def test_skinny_gemm_split_over_k_in_a_cuda_graph(split):
    # 16 decode rows of 2B's narrow projections split over K: replayed from a graph, the same bits as eagerly (the
    # tickets reset themselves), within bf16 tolerance of fp32
    from kernels import split_k
    for n, k in ((2048, 2048), (2048, 6144)):
        x, w = _pair(16, n, k, torch.bfloat16, seed=split)
        plan = (16, 256, 4, 2, split)
        with RB.decode_step_rows():  # eagerly, as a decode step runs it (else 16 rows go to cuBLAS, padded)
            eager = L.linear(x, w, plan=plan)
        out = torch.empty_like(eager)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            L.linear(x, w, out=out, plan=plan)
        for _ in range(3):
            graph.replay()
        assert torch.equal(out, eager), f"split {split} {n}x{k}: graph and eager differ"
        assert not split_k.workspace(x.device)[1].any()
        assert_rel(out.float(), x.float() @ w.float().t(), TOL[torch.bfloat16], f"split {split} {n}x{k}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [5, 300, 2051])
def test_linear_gpu_prefill_rows(m):
    # prefill rows go to cuBLAS padded to a row bucket (gated: after silu_and_mul, into a buffer with room to pad)
    _check(*_pair(m, 2048, 2048, torch.bfloat16, seed=m), f"prefill {m} rows")
    _check(*_gated_pair(m, 2048, 1536, torch.bfloat16, seed=m), f"gated prefill {m} rows", gated=True)


@pytest.mark.parametrize("m,rows", [(5, 64), (65, 128), (128, 128), (7, 7)])
def test_matmul_rows_on_padded_rows(m, rows):
    # prefill rows run on cuBLAS padded to `rows`: the first m rows are the product, into out too
    a, w = _pair(m, 33, 70, torch.float32, seed=m)
    exact = R.linear(a.double(), w.double())
    y = L.matmul_rows(a, w, rows=rows)
    assert y.shape == (m, 33) and y.is_contiguous()
    assert_rel(y.double(), exact, 1e-6, f"{m} rows padded to {rows}")
    out = torch.full((m, 33), float("nan"))
    assert L.matmul_rows(a, w, out, rows=rows) is out
    assert_rel(out.double(), exact, 1e-6, "padded into out")


def test_eager_decode_steps_pad_only_above_dot_max_rows(monkeypatch):
    # an eager decode step runs the kernels its CUDA graph captured: the skinny GEMM up to DOT_MAX_ROWS rows
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cuda, top = torch.device("cuda"), RB.DOT_MAX_ROWS
    assert [RB.padded_rows(m, cuda) for m in (RB.GEMV_MAX_ROWS, top, top + 1)] == [RB.GEMV_MAX_ROWS, 64, 64]
    with RB.decode_step_rows():
        assert [RB.padded_rows(m, cuda) for m in (RB.GEMV_MAX_ROWS, top, top + 1)] == [RB.GEMV_MAX_ROWS, top, 64]
    assert RB.padded_rows(top, cuda) == 64 and RB.padded_rows(top, torch.device("cpu")) == top


def test_padded_operand_views_a_storage_with_room_else_copies():
    base = torch.randn(128, 24)
    roomy = base[:70]
    view = RB.padded_operand(roomy, 128)
    assert view.shape == (128, 24) and view.data_ptr() == roomy.data_ptr() and torch.equal(view[:70], roomy)
    for tight in (torch.randn(70, 24), base[:70, :20], base[60:]):  # no room / not row-major / too near the end
        padded = RB.padded_operand(tight, 128)
        assert padded.shape == (128, tight.shape[1]) and padded.data_ptr() != tight.data_ptr()
        assert torch.equal(padded[:len(tight)], tight)


def test_prefill_chain_pads_without_copies(monkeypatch):
    # with padding on (as on CUDA), the norm's output has room for the padded rows: the projection views it in place
    # (no copy), the rows past it are dropped, and the result equals the unpadded product
    monkeypatch.setattr(RB, "padded_rows", lambda rows, device: -(-rows // RB.MATMUL_ROW_BUCKET) * RB.MATMUL_ROW_BUCKET)
    monkeypatch.setattr(L, "padded_rows", RB.padded_rows)
    real, views = RB.padded_operand, []

    def spy(a2, rows):
        padded = real(a2, rows)
        views.append(padded.data_ptr() == a2.data_ptr())
        return padded

    monkeypatch.setattr(L, "padded_operand", spy)
    x, residual, norm_w = _normed_inputs(70, 96, torch.float32, 5, True)
    _, w = _pair(70, 50, 96, torch.float32, 5)
    out, s = L.add_rms_norm_linear(x, residual.clone(), norm_w, 1e-6, w)
    assert views == [True], "the normed rows were copied to pad them"
    assert_rel(out.double(), R.linear(R.rms_norm(s, norm_w, 1e-6).double(), w.double()), 1e-6, "padded chain")
    gate_up, w_down = _gated_pair(70, 40, 48, torch.float32, seed=6)
    y = L.silu_and_mul_linear(gate_up, w_down)
    assert views == [True, True], "SwiGLU's rows were copied to pad them"
    assert_rel(y.double(), R.silu_and_mul_linear(gate_up.double(), w_down.double()), 1e-6, "padded gated")
    o = gated_rms_norm(*(torch.randn(70, 3, 16) for _ in range(2)), torch.randn(16), 1e-6)
    assert o.untyped_storage().nbytes() >= 128 * 3 * 16 * 4, "the GDN output norm leaves no room for padded rows"
