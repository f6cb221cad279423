"""fa4.flash_attention (Triton FA4-style forward) against reference.attention / reference.paged_attention in fp32.

Interpreter tests (CPU, fp16/fp32, 1-4 heads): lengths 1, 2, 65, 127, chunks over a longer prefix and
q_len > k_len (rows with no key give 0), head dims 64/128, causal or not, GQA 1/2/4, varlen mixed lengths,
paged prefixes over shuffled pools (page sizes 16 and 64, unused slots NaN), both FA4 flags on and off, the
software exp2's error bound, backend selection and bad inputs; the kernel is also compiled for sm_90a (PTX and
cubin, no GPU needed) so Triton's compiler, which the interpreter skips, sees it. `gpu` tests: bf16 (and
fp16), GQA 1/2/4/8, head dims 64/128/256, lengths up to 4097, varlen and paged, relative error < 1e-2.
"""
import math

import pytest
import torch
import triton
import triton.language as tl
from conftest import compiled_script_output

import reference as R
from fa4 import flash_attention
from fa4 import triton_forward as TF
from fa4.softmax import EXP2_POLY_MAX_REL_ERR, exp2_poly
from tests.conftest import HAS_CUDA, assert_rel

DEV = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
POLY_TOL = 3e-4  # fp32 with software exp2 on some columns: per-element error <= 8.6e-5


def qkv(b, sq, sk, h, kv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=gen)
    k = torch.randn(b, sk, kv, d, generator=gen)
    v = torch.randn(b, sk, kv, d, generator=gen)
    return [t.to(DEV, dtype) for t in (q, k, v)]


def make_pool(lens, kv, d, page, dtype, seed, spare_pages=2):
    """Shuffled pages holding each sequence's keys; unused pages and slots are NaN.
    Returns k_pages, v_pages (num_pages, page, kv, d), page_table (B, max_pages) int32, seqused_k (B,) int32."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / page) for n in lens]
    n_pages = sum(need) + spare_pages
    pools = [torch.full((n_pages, page, kv, d), float("nan")) for _ in range(2)]
    perm = torch.randperm(n_pages, generator=gen)
    table = torch.zeros(len(lens), max(need) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        ids = perm[used:used + need[b]]
        used += need[b]
        table[b, :need[b]] = ids.int()
        slots = (ids[:, None] * page + torch.arange(page)).flatten()[:n]
        for pool in pools:
            pool.view(-1, kv, d)[slots] = torch.randn(n, kv, d, generator=gen)
    seqused = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEV) for t in (pools[0].to(dtype), pools[1].to(dtype), table, seqused)]


def check_dense(b, sq, sk, h, kv, d, dtype, causal, tol=None, **flags):
    q, k, v = qkv(b, sq, sk, h, kv, d, dtype)
    out = flash_attention(q, k, v, causal=causal, backend="triton", **flags)
    ref = R.attention(q.float(), k.float(), v.float(), causal=causal)
    assert out.dtype == dtype
    assert_rel(out.float(), ref, tol or TOL[dtype], f"b{b} sq{sq} sk{sk} h{h}/{kv} d{d} {dtype} causal={causal}")
    return out, ref


@pytest.mark.parametrize("causal,sq,sk,h,kv,d,dtype", [
    (True, 1, 1, 2, 1, 64, torch.float32),
    (False, 2, 2, 2, 2, 64, torch.float16),
    (True, 65, 65, 4, 2, 64, torch.float16),
    (False, 65, 65, 4, 1, 128, torch.float32),
    (True, 127, 127, 2, 2, 64, torch.float32),
    (False, 127, 65, 4, 2, 128, torch.float16),
    (True, 30, 100, 4, 4, 64, torch.float16),  # a chunk over a prefix: several unmasked tiles, then the diagonal
])
def test_attention_dense(causal, sq, sk, h, kv, d, dtype):
    check_dense(2, sq, sk, h, kv, d, dtype, causal)


def test_attention_rows_without_keys_are_zero():
    out, ref = check_dense(1, 100, 30, 2, 1, 64, torch.float32, causal=True)  # q_len > k_len: rows 0..69 see no key
    assert out[:, :70].abs().max() == 0 and ref[:, :70].abs().max() == 0
    assert (out[:, 70:].abs().amax(-1) > 0).all()


@pytest.mark.parametrize("threshold,fraction", [(0.0, 0.0), (8.0, 0.0), (0.0, 1.0), (8.0, 0.125), (8.0, 0.25),
                                                (8.0, 0.5), (15.0, 1.0)])
def test_attention_fa4_flags_exact(threshold, fraction):
    tol = TOL[torch.float32] if fraction == 0 else POLY_TOL
    check_dense(1, 65, 127, 4, 2, 64, torch.float32, True, tol, rescale_threshold=threshold,
                poly_exp2_fraction=fraction)


def test_attention_rescale_threshold_with_growing_scores():
    # keys whose scores rise along the sequence force a rescale in most tiles; fp16 P stays <= 2^8
    q, k, v = qkv(1, 65, 65, 2, 1, 64, torch.float16, seed=3)
    k = (k.float() * torch.linspace(0.1, 3.0, 65, device=DEV)[None, :, None, None]).half()
    ref = R.attention(q.float(), k.float(), v.float(), causal=False)
    for threshold in (0.0, 8.0):
        out = flash_attention(q, k, v, causal=False, backend="triton", rescale_threshold=threshold)
        assert_rel(out.float(), ref, TOL[torch.float16], f"threshold {threshold}")


def test_attention_softmax_scale():
    q, k, v = qkv(1, 9, 40, 2, 1, 64, torch.float32)
    out = flash_attention(q, k, v, causal=False, softmax_scale=0.3, backend="triton")
    assert_rel(out, R.attention(q, k, v, causal=False, softmax_scale=0.3), 1e-5, "softmax_scale 0.3")


@triton.jit
def _exp2_poly_kernel(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, exp2_poly(tl.load(x_ptr + i)))


def exp2_probe_points(device) -> torch.Tensor:
    """The polynomial exp2's test points: [-126, 8] evenly, then -inf and two underflows, zero-padded to 4096."""
    x = torch.cat([torch.linspace(-126.0, 8.0, 4093), torch.tensor([-float("inf"), -200.0, -126.5])])
    return torch.cat([x, torch.zeros(4096 - x.numel())]).to(device)


def check_exp2_poly(x: torch.Tensor, y: torch.Tensor) -> None:
    """y = exp2_poly(x): within EXP2_POLY_MAX_REL_ERR of 2^x (relative) where x >= -126, exactly 0 below."""
    exact = torch.exp2(x.double())
    finite = x >= -126.0
    err = ((y.double() - exact).abs() / exact)[finite].max().item()
    assert err <= EXP2_POLY_MAX_REL_ERR, f"max relative error {err:.3e}"
    assert (y[~finite] == 0).all()


def test_attention_exp2_poly_error_bound():
    x = exp2_probe_points(DEV)
    y = torch.empty_like(x)
    _exp2_poly_kernel[(1,)](x, y, N=4096)
    check_exp2_poly(x, y)


@pytest.mark.parametrize("causal,dtype", [(True, torch.float16), (False, torch.float32)])
def test_attention_varlen(causal, dtype):
    lens_q = [1, 65, 2, 33]
    lens_k = lens_q if causal else [3, 40, 0, 70]  # a sequence with no keys gives 0
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lens_q), 4, 64, generator=gen).to(DEV, dtype)
    k = torch.randn(sum(lens_k), 1, 64, generator=gen).to(DEV, dtype)
    v = torch.randn(sum(lens_k), 1, 64, generator=gen).to(DEV, dtype)
    cu_q = torch.tensor([0, *lens_q], device=DEV).cumsum(0).int()
    cu_k = torch.tensor([0, *lens_k], device=DEV).cumsum(0).int()
    out = flash_attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="triton")
    ref = R.attention(q.float(), k.float(), v.float(), causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert_rel(out.float(), ref, TOL[dtype], f"varlen causal={causal}")


@pytest.mark.parametrize("page,varlen,dtype,d", [(16, False, torch.float16, 64), (64, True, torch.float32, 64),
                                                 (16, True, torch.float32, 128)])
def test_attention_paged_prefix(page, varlen, dtype, d):
    if varlen:
        lens_q, lens_k = [5, 1, 40], [70, 1, 40]  # chunks over cached prefixes; one with no prefix
    else:
        lens_q, lens_k = [33, 33], [33, 100]
    k_pages, v_pages, table, seqused = make_pool(lens_k, 2, d, page, dtype, seed=page)
    gen = torch.Generator().manual_seed(2)
    if varlen:
        q = torch.randn(sum(lens_q), 4, d, generator=gen).to(DEV, dtype)
        cu_q = torch.tensor([0, *lens_q], device=DEV).cumsum(0).int()
    else:
        q = torch.randn(len(lens_q), lens_q[0], 4, d, generator=gen).to(DEV, dtype)
        cu_q = None
    out = flash_attention(q, k_pages, v_pages, causal=True, cu_seqlens_q=cu_q, page_table=table, seqused_k=seqused,
                          backend="triton", poly_exp2_fraction=0.25 if dtype == torch.float16 else 0.0)
    ref = R.paged_attention(q.float(), k_pages.float(), v_pages.float(), table, seqused, causal=True,
                            cu_seqlens_q=cu_q)
    assert_rel(out.float(), ref, TOL[dtype], f"paged page {page} varlen={varlen}")


def test_attention_auto_and_reference_backends():
    q, k, v = qkv(1, 5, 5, 2, 1, 32, torch.float32)  # head_dim 32: triton does not support it
    ref = R.attention(q, k, v, causal=True)
    assert torch.equal(flash_attention(q, k, v, causal=True), ref)
    assert torch.equal(flash_attention(q, k, v, causal=True, backend="reference"), ref)
    with pytest.raises(ValueError, match="head_dim 32"):
        flash_attention(q, k, v, causal=True, backend="triton")
    q, k, v = qkv(1, 5, 5, 2, 1, 64, torch.float32)
    assert_rel(flash_attention(q, k, v, causal=True), R.attention(q, k, v, causal=True), 1e-5, "auto -> triton")


def test_model_long_chunks_run_on_the_triton_forward(monkeypatch):
    """model.ops' paged attention sends a step with a chunk over 512 tokens (beside a decode row) to the Triton
    forward over the paged prefix where the forward fills the GPU (here a pretend 8-SM one), gated; it equals the
    reference op."""
    from kernels import paged_decode_attention as P
    from kernels.registry import DeviceInfo
    from model import ops
    here = P.device_info(torch.device(DEV))
    # 17 M-blocks x 2 sequences fill a pretend 8-SM card
    monkeypatch.setattr(P, "device_info", lambda device: DeviceInfo(here.type, here.capability, 8, here.interpret))
    from model.ops import _ref_paged_attention
    from model.step import StepInput
    lens, q_lens, h, kv, d = [600, 40], [520, 1], 2, 1, 64
    k_pages, v_pages, table, seqused = make_pool(lens, kv, d, 16, torch.float32, seed=3)
    n = sum(q_lens)
    gen = torch.Generator().manual_seed(4)
    q, gate = (torch.randn(n, h, d, generator=gen).to(DEV) for _ in range(2))
    cu = torch.tensor([0, q_lens[0], n], dtype=torch.int32, device=DEV)
    zeros = torch.zeros(n, dtype=torch.int64, device=DEV)
    step = StepInput(token_ids=zeros, positions=zeros, cu_seqlens=cu, max_seqlen_q=max(q_lens), seqused_k=seqused,
                     page_table=table, slot_mapping=zeros, state_slots=zeros[:2])
    called, forward = [], TF.triton_forward
    monkeypatch.setattr(TF, "triton_forward", lambda *a, **kw: called.append(1) or forward(*a, **kw))
    with ops.use_backend("triton"):
        out = ops.paged_attention(q, k_pages, v_pages, step, d ** -0.5, gate)
    assert called, "the long chunk did not go to fa4's Triton forward"
    assert_rel(out, _ref_paged_attention(q, k_pages, v_pages, step, d ** -0.5, gate), 1e-5, "long chunk step")


def _bad_calls():
    q, k, v = qkv(1, 4, 4, 2, 1, 64, torch.float32)
    k_pages, v_pages, table, seqused = make_pool([4], 1, 64, 16, torch.float32, seed=0)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEV)
    return {
        "cute fp32": (lambda: flash_attention(q, k, v, causal=True, backend="cute"), "cute. cannot run"),
        "unknown backend": (lambda: flash_attention(q, k, v, causal=True, backend="cuda"), "backend must be"),
        "dtype mismatch": (lambda: flash_attention(q, k.half(), v.half(), causal=True), "share a dtype"),
        "int dtype": (lambda: flash_attention(q.int(), k.int(), v.int(), causal=True), "dtype"),
        "q rank": (lambda: flash_attention(q[0], k, v, causal=True), "q must have 4 dims"),
        "k/v shapes": (lambda: flash_attention(q, k, v[:, :3], causal=True), "one shape"),
        "head_dim": (lambda: flash_attention(q, k[..., :32], v[..., :32], causal=True), "head_dim"),
        "gqa ratio": (lambda: flash_attention(q[:, :, :1], k.expand(-1, -1, 2, -1), v.expand(-1, -1, 2, -1),
                                              causal=True), "multiple of kv heads"),
        "batch": (lambda: flash_attention(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), causal=True),
                  "share batch"),
        "causal type": (lambda: flash_attention(q, k, v, causal=None), "causal must be a bool"),
        "scale": (lambda: flash_attention(q, k, v, causal=True, softmax_scale=-1.0), "softmax_scale"),
        "cu_seqlens_q alone": (lambda: flash_attention(q[0], k[0], v[0], causal=True, cu_seqlens_q=cu),
                               "given together"),
        "cu_seqlens total": (lambda: flash_attention(q[0], k[0], v[0], causal=True, cu_seqlens_q=cu + 1,
                                                     cu_seqlens_k=cu), "rise from 0"),
        "page_table without seqused_k": (lambda: flash_attention(q, k_pages, v_pages, causal=True,
                                                                 page_table=table), "needs seqused_k"),
        "seqused_k without page_table": (lambda: flash_attention(q, k, v, causal=True, seqused_k=seqused),
                                         "only read with page_table"),
        "seqused_k past capacity": (lambda: flash_attention(q, k_pages, v_pages, causal=True, page_table=table,
                                                            seqused_k=seqused + 100), "capacity"),
        "page out of pool": (lambda: flash_attention(q, k_pages, v_pages, causal=True, page_table=table + 50,
                                                     seqused_k=seqused), "outside the pool"),
        "paged with cu_seqlens_k": (lambda: flash_attention(q[0], k_pages, v_pages, causal=True, cu_seqlens_q=cu,
                                                            cu_seqlens_k=cu, page_table=table, seqused_k=seqused),
                                    "cu_seqlens_k cannot"),
        "poly fraction": (lambda: flash_attention(q, k, v, causal=True, poly_exp2_fraction=0.3), "poly_exp2_fraction"),
        "threshold": (lambda: flash_attention(q, k, v, causal=True, rescale_threshold=16.0), "rescale_threshold"),
        "non-contiguous head dim": (lambda: flash_attention(q.transpose(1, 3).contiguous().transpose(1, 3), k, v,
                                                            causal=True, backend="triton"), "contiguous"),
        "strided page_table": (lambda: flash_attention(q, k_pages, v_pages, causal=True, backend="triton",
                                                       page_table=table.repeat(1, 2)[:, ::2], seqused_k=seqused),
                               "page_table must be contiguous"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_attention_bad_inputs(case):
    call, match = _bad_calls()[case]
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter's bf16 limit only applies without a GPU")
def test_attention_bf16_interpreter_goes_to_reference():
    q, k, v = qkv(1, 3, 3, 2, 1, 64, torch.bfloat16)
    assert torch.equal(flash_attention(q, k, v, causal=True), R.attention(q, k, v, causal=True))
    with pytest.raises(ValueError, match="interpreter"):
        flash_attention(q, k, v, causal=True, backend="triton")


SM90_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from fa4 import triton_forward as TF
fn = TF._fwd_kernel.fn
const = dict(GROUP=2, HEAD_DIM=128, CAUSAL=True, VARLEN_Q=True, VARLEN_K=False, PAGED=True, PAGE_SIZE=16,
             RESCALE_THRESHOLD=8.0, POLY_LEVEL=int(sys.argv[1]), DOT_PRECISION="tf32", BLOCK_M=128, BLOCK_N=64)
sig = {n: "constexpr" if n in const else "*bf16" if n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr") else
       "*i32" if n.endswith("_ptr") else "fp32" if n == "qk_scale" else "i32" for n in fn.arg_names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
         if n.endswith("_ptr") or (n.startswith("stride") and n != "stride_ptb")}
k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 8, "num_stages": 3})
print("cp.async", k.asm["ttgir"].count("async_copy_global_to_local"), "wgmma", k.asm["ttgir"].count("warp_group_dot "))
"""


@pytest.mark.parametrize("level", [0, 2])
def test_attention_kernel_compiles_for_sm90(level):
    # the interpreter skips Triton's compiler; this runs it to PTX and cubin for sm_90a on the CPU
    out = compiled_script_output(SM90_COMPILE, str(level))
    counts = out.split()
    assert int(counts[1]) > 0 and int(counts[3]) > 0, out  # pipelined loads, wgmma


# every (head dim, GQA) pair, each with one dtype and one causal flag, so that every pair of the four values also
# occurs: a quarter of the full product, whose compiles (a kernel per GQA ratio, dtype, head dim, causal flag and
# autotuned config) would not fit one device call
GPU_DENSE = [(d, h, kv, (torch.bfloat16, torch.float16)[(i + j) % 2], (j // 2 + i) % 2 == 0)
             for i, d in enumerate((64, 128, 256)) for j, (h, kv) in enumerate(((8, 8), (8, 4), (8, 2), (16, 2)))]


@pytest.mark.gpu
@pytest.mark.parametrize("d,h,kv,dtype,causal", GPU_DENSE)
def test_attention_gpu_dense(d, h, kv, dtype, causal):
    for sq, sk in ((1, 1), (2, 2), (65, 65), (127, 127), (1000, 1000), (4097, 4097), (300, 1000)):
        check_dense(2, sq, sk, h, kv, d, dtype, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("flags", [{"rescale_threshold": 0.0}, {"poly_exp2_fraction": 0.125},
                                   {"poly_exp2_fraction": 0.25}, {"poly_exp2_fraction": 0.5},
                                   {"poly_exp2_fraction": 1.0}])
def test_attention_gpu_fa4_flags(d, flags):
    for causal in (True, False):
        for sq, sk in ((127, 127), (1000, 4097)):
            check_dense(2, sq, sk, 16, 2, d, torch.bfloat16, causal, **flags)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("h,kv", [(8, 1), (8, 8)])
def test_attention_gpu_varlen_bf16(d, h, kv):
    lens = [1, 2, 65, 127, 1000, 4097]
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(sum(lens), n, d, generator=gen).to(DEV, torch.bfloat16) for n in (h, kv, kv))
    cu = torch.tensor([0, *lens], device=DEV).cumsum(0).int()
    for causal in (True, False):
        out = flash_attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="triton",
                              poly_exp2_fraction=0.125)
        ref = R.attention(q.float(), k.float(), v.float(), causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
        assert_rel(out.float(), ref, TOL[torch.bfloat16], f"varlen d{d} h{h}/{kv} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("h,kv", [(8, 2), (16, 2)])
def test_attention_gpu_paged_bf16(page, d, h, kv):
    lens_q, lens_k = [1, 65, 127, 1000, 2], [4097, 65, 300, 1000, 2]
    k_pages, v_pages, table, seqused = make_pool(lens_k, kv, d, page, torch.bfloat16, seed=page + d)
    q = torch.randn(sum(lens_q), h, d, generator=torch.Generator().manual_seed(5)).to(DEV, torch.bfloat16)
    cu_q = torch.tensor([0, *lens_q], device=DEV).cumsum(0).int()
    out = flash_attention(q, k_pages, v_pages, causal=True, cu_seqlens_q=cu_q, page_table=table, seqused_k=seqused,
                          backend="triton", poly_exp2_fraction=0.125)
    ref = R.paged_attention(q.float(), k_pages.float(), v_pages.float(), table, seqused, causal=True,
                            cu_seqlens_q=cu_q)
    assert_rel(out.float(), ref, TOL[torch.bfloat16], f"paged page {page} d{d} h{h}/{kv}")
