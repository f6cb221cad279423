"""Triton attention prep (kernels/attention_prep.py) against the reference composition in model.ops:
q/k RMSNorm, partial NeoX RoPE, and the paged K/V write with shuffled pages and skipped slots."""
import pytest
import torch
from conftest import rel_err

import reference as R
from kernels.attention_prep import attention_prep, attention_prep_op
from model import ops
from model.step import StepInput

EPS = 1e-6
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-3}
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def _case(n, h, kv, d, page_size, dtype, seed=0):
    """Raw projections, norm weights, rope of random positions (R = D/4), random pages and a slot mapping
    over shuffled pages with every fifth token skipped (-1)."""
    torch.manual_seed(seed)
    q = _randn(n, h, 2 * d, dtype=dtype, scale=2.0)[..., :d]          # (N, H, D) view of q_proj, as the model has it
    k, v = _randn(n, kv, d, dtype=dtype, scale=2.0), _randn(n, kv, d, dtype=dtype)
    q_w, k_w = _randn(d, dtype=dtype, scale=0.2), _randn(d, dtype=dtype, scale=0.2)
    cos, sin = R.rope_cos_sin(torch.randint(0, 40000, (n,), device=DEV), d // 4, 1e7)
    num_pages = -(-n // page_size) + 2
    pages = torch.randperm(num_pages, device=DEV)
    tokens = torch.arange(n, device=DEV)
    slots = pages[tokens // page_size] * page_size + tokens % page_size
    slots[1::5] = -1
    k_pages = _randn(num_pages, page_size, kv, d, dtype=dtype)
    return q, k, v, q_w, k_w, cos, sin, k_pages, torch.randn_like(k_pages), slots


def _reference(q, k, v, q_w, k_w, cos, sin, k_pages, v_pages, slots):
    """(q_out, k_pages, v_pages) of the reference, on copies of the pages."""
    k_ref, v_ref = k_pages.clone(), v_pages.clone()
    step = StepInput(None, None, None, 0, None, None, slots, None, cos, sin)
    return ops._ref_attention_prep(q, k, v, q_w, k_w, step, k_ref, v_ref, EPS), k_ref, v_ref


def _check(q_out, k_pages, v_pages, before, ref, slots):
    """q_out and the written slots match the reference; every other slot keeps its old bytes."""
    ref_q, ref_k, ref_v = ref
    written = torch.zeros(k_pages.shape[0] * k_pages.shape[1], dtype=torch.bool, device=DEV)
    written[slots[slots >= 0]] = True
    flat = lambda t: t.view(-1, *t.shape[2:])
    tol = TOL[q_out.dtype]
    err = rel_err(q_out, ref_q)
    assert err < tol, f"q_out: relative error {err:.2e} >= {tol:.0e}"
    err = rel_err(flat(k_pages)[written], flat(ref_k)[written])
    assert err < tol, f"k_pages written slots: relative error {err:.2e} >= {tol:.0e}"
    assert torch.equal(flat(v_pages)[written], flat(ref_v)[written]), "v_pages: written slots differ from v"
    for name, pages, old in (("k_pages", k_pages, before[0]), ("v_pages", v_pages, before[1])):
        assert torch.equal(flat(pages)[~written], flat(old)[~written]), f"{name}: a slot not in slot_mapping changed"


CASES = [  # (N, H, KV, D, page_size, dtype)
    (1, 4, 2, 64, 16, torch.float32),
    (2, 2, 2, 128, 64, torch.float16),
    (65, 4, 2, 64, 16, torch.float16),
    (65, 2, 2, 128, 64, torch.float32),
    (3, 6, 2, 512, 16, torch.float32),       # 4 heads per program: the second one holds q and k heads
]


@pytest.mark.parametrize("n,h,kv,d,page_size,dtype", CASES)
def test_attention_prep(n, h, kv, d, page_size, dtype):
    q, k, v, q_w, k_w, cos, sin, k_pages, v_pages, slots = _case(n, h, kv, d, page_size, dtype)
    before = k_pages.clone(), v_pages.clone()
    ref = _reference(q, k, v, q_w, k_w, cos, sin, k_pages, v_pages, slots)
    q_out = attention_prep(q, k, v, q_w, k_w, cos, sin, k_pages, v_pages, slots, EPS)
    _check(q_out, k_pages, v_pages, before, ref, slots)


def test_attention_prep_op_out_and_int32_slots():
    q, k, v, q_w, k_w, cos, sin, k_pages, v_pages, slots = _case(5, 4, 2, 64, 16, torch.float32, seed=1)
    before = k_pages.clone(), v_pages.clone()
    ref = _reference(q, k, v, q_w, k_w, cos, sin, k_pages, v_pages, slots)
    out = torch.empty(5, 4, 64, device=DEV)
    assert attention_prep(q, k, v, q_w, k_w, cos, sin, k_pages, v_pages, slots.int(), EPS, out=out) is out
    _check(out, k_pages, v_pages, before, ref, slots)
    k_pages.copy_(before[0]), v_pages.copy_(before[1])
    step = StepInput(None, None, None, 0, None, None, slots, None, cos, sin)
    _check(attention_prep_op(q, k, v, q_w, k_w, step, k_pages, v_pages, EPS), k_pages, v_pages, before, ref, slots)




@pytest.mark.parametrize("name,change", [
    ("q", lambda t: t.transpose(0, 2)),
    ("q", lambda t: t[..., ::2]),
    ("q", lambda t: t.to(torch.int32)),
    ("k", lambda t: t[:2]),
    ("k", lambda t: t.half()),
    ("v", lambda t: t[:, :1]),
    ("k", lambda t: torch.cat([t, t[:, :1]], dim=1)),       # 3 kv heads for 4 q heads
    ("q_norm_w", lambda t: t[:63]),
    ("k_norm_w", lambda t: t[None]),
    ("cos", lambda t: torch.cat([t, t], dim=1)[:, :33]),    # R = 66 > D
    ("cos", lambda t: t[:2]),
    ("sin", lambda t: t.half()),
    ("sin", lambda t: t[:, :4]),
    ("k_pages", lambda t: t.half()),
    ("k_pages", lambda t: t.transpose(0, 1)),
    ("v_pages", lambda t: t[:, :, :1]),
    ("slot_mapping", lambda t: t[:2]),
    ("slot_mapping", lambda t: t.float()),
    ("out", lambda _: torch.empty(3, 4, 32, device=DEV)),
])
def test_attention_prep_errors(name, change):
    names = ("q", "k", "v", "q_norm_w", "k_norm_w", "cos", "sin", "k_pages", "v_pages", "slot_mapping")
    args = dict(zip(names, _case(3, 4, 2, 64, 16, torch.float32)), eps=EPS)
    args[name] = change(args.get(name))
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        attention_prep(**args)


# ---- GPU: bf16 at real sizes, CUDA graphs ----------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("h,kv", [(16, 4), (8, 2), (24, 4), (32, 2), (12, 4)])
@pytest.mark.parametrize("n", [1, 7, 300])
def test_attention_prep_bf16_gpu(n, h, kv, page_size):
    q, k, v, q_w, k_w, cos, sin, k_pages, v_pages, slots = _case(n, h, kv, 256, page_size, torch.bfloat16)
    before = k_pages.clone(), v_pages.clone()
    ref = _reference(q, k, v, q_w, k_w, cos, sin, k_pages, v_pages, slots)
    q_out = attention_prep(q, k, v, q_w, k_w, cos, sin, k_pages, v_pages, slots, EPS)
    _check(q_out, k_pages, v_pages, before, ref, slots)


@pytest.mark.gpu
def test_attention_prep_cuda_graph():
    q, k, v, q_w, k_w, cos, sin, k_pages, v_pages, slots = _case(9, 16, 4, 256, 16, torch.bfloat16)
    out = torch.empty(q.shape, dtype=q.dtype, device=DEV)
    args = (q, k, v, q_w, k_w, cos, sin, k_pages, v_pages, slots, EPS)
    attention_prep(*args, out=out)                      # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention_prep(*args, out=out)
    for seed in (2, 3):
        new = _case(9, 16, 4, 256, 16, torch.bfloat16, seed=seed)
        for dst, src in zip(args[:10], new):
            dst.copy_(src)
        before = k_pages.clone(), v_pages.clone()
        ref = _reference(*args[:10])
        graph.replay()
        torch.cuda.synchronize()
        _check(out, k_pages, v_pages, before, ref, slots)
