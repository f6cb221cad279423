"""fa4.flash_attention(backend="cute"): the CuTe-DSL forward for sm_90a (fa4/cute) against reference.attention.

CPU: the configuration and its errors (no DSL needed); what the backend refuses, with the reason (d64, fp16,
varlen/paged, CPU tensors); and, when nvidia-cutlass-dsl is installed, a compile for sm_90a of the
representative set (d128/d256 x causal/non-causal, GQA packing, FA4 flags) in a subprocess with
CUTE_DSL_ARCH=sm_90a, checking the PTX for TMA, wgmma and setmaxnreg, plus the compile cache.
`gpu` tests (H200): bf16, GQA 1/2/4/8, head dims 128/256, the lengths of tests/test_attention_prefill.py (1, 2,
65, 127, 1000, 4097, and q_len != k_len), causal and not, FA4 flags on and off, rows without keys, relative
error < 1e-2 against the fp32 reference.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import reference as R
from fa4 import flash_attention
from fa4.cute.config import AttentionConfig, choose_config, pack_factor, representative_configs
from fa4.cute.entry import dsl_available
from tests.conftest import HAS_CUDA, assert_rel
from tests.test_attention_prefill import TOL, qkv

DEV = "cuda" if HAS_CUDA else "cpu"
if not HAS_CUDA:  # CuTe-DSL reads the target when it is first imported; without a GPU, compile for sm_90a
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
BF16 = torch.bfloat16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_dsl = pytest.mark.skipif(not dsl_available(), reason="nvidia-cutlass-dsl is not installed")
# (seqlen_q, seqlen_k): the lengths of the triton GPU matrix; (1000, 300) has causal rows with no key
DENSE_LENGTHS = ((1, 1), (2, 2), (65, 65), (127, 127), (1000, 1000), (4097, 4097), (300, 1000), (1000, 300))
GQA = [(8, 8), (8, 4), (8, 2), (16, 2)]  # group 1, 2, 4, 8


def check_cute(b, sq, sk, h, kv, d, causal, tol=TOL[BF16], seed=0, **flags):
    q, k, v = qkv(b, sq, sk, h, kv, d, BF16, seed=seed)
    out = flash_attention(q, k, v, causal=causal, backend="cute", **flags)
    ref = R.attention(q.float(), k.float(), v.float(), causal=causal)
    assert out.dtype == BF16 and out.shape == q.shape
    assert_rel(out.float(), ref, tol, f"cute b{b} sq{sq} sk{sk} h{h}/{kv} d{d} causal={causal} {flags}")
    return out, ref


# ------------------------------------------------------------------ CPU: configuration and refusals


def test_cute_config_choice():
    assert [pack_factor(g) for g in (1, 2, 3, 4, 6, 8, 16, 128)] == [1, 2, 1, 4, 2, 8, 16, 64]
    c = choose_config(128, True, 32, 4)
    assert (c.pack_gqa, c.tile_n, c.tile_m, c.num_threads) == (8, 128, 128, 384)
    assert choose_config(256, False, 16, 16).tile_n == 64
    assert hash(c) == hash(choose_config(128, True, 32, 4))  # a cache key
    for cfg in representative_configs():
        assert cfg.smem_bytes() <= 227 * 1024


@pytest.mark.parametrize("fields,match", [
    (dict(head_dim=64), "head_dim 64"),
    (dict(dtype="float16"), "dtype float16"),
    (dict(pack_gqa=3), "pack_gqa"),
    (dict(tile_n=72), "tile_n"),
    (dict(poly_exp2_fraction=0.3), "poly_exp2_fraction"),
    (dict(rescale_threshold=16.0), "rescale_threshold"),
    (dict(kv_stages=3), "shared memory"),  # d128: 32 + 3 x 64 KiB does not fit
    (dict(consumer_regs=256), "setmaxnreg"),
])
def test_cute_config_rejects(fields, match):
    base = dict(head_dim=128, causal=False)
    with pytest.raises(ValueError, match=match):
        AttentionConfig(**{**base, **fields}).validate()


@pytest.mark.parametrize("case,match", [
    ("d64", "head_dim 64 is not one of"),
    ("fp16", "dtype torch.float16 is not supported"),
    ("varlen", "varlen and paged KV"),
])
def test_cute_refuses_unsupported(case, match):
    d = 64 if case == "d64" else 128
    dtype = torch.float16 if case == "fp16" else BF16
    q, k, v = qkv(1, 8, 8, 2, 1, d, dtype)
    kwargs = {}
    if case == "varlen":
        q, k, v = q[0], k[0], v[0]
        cu = torch.tensor([0, 8], dtype=torch.int32, device=DEV)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match=f"backend 'cute' cannot run this call: {match}"):
        flash_attention(q, k, v, causal=True, backend="cute", **kwargs)


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal of CPU tensors")
def test_cute_refuses_cpu_tensors():
    q, k, v = qkv(1, 8, 8, 2, 1, 128, BF16)
    reason = "not CUDA" if dsl_available() else "nvidia-cutlass-dsl is not installed"
    with pytest.raises(ValueError, match=reason):
        flash_attention(q, k, v, causal=True, backend="cute")


# ------------------------------------------------------------------ CPU: compile for sm_90a

SM90_COMPILE = """
import json, os, sys, time
from fa4.cute.config import representative_configs
from fa4.cute.compile_cache import compile_config
cfg = representative_configs()[int(sys.argv[1])]
start = time.time()
ptx = compile_config(cfg, keep_ptx=True).__ptx__
print(json.dumps({"seconds": time.time() - start, "wgmma": ptx.count("wgmma.mma_async"),
                  "tma": ptx.count("cp.async.bulk.tensor"), "setmaxnreg": ptx.count("setmaxnreg"),
                  "ex2": ptx.count("ex2.approx"), "config": repr(cfg)}))
"""


@needs_dsl
@pytest.mark.parametrize("index", range(len(representative_configs())),
                         ids=[f"d{c.head_dim}-{'causal' if c.causal else 'full'}-pack{c.pack_gqa}"
                              f"{'-overlap' if c.intra_wg_overlap else ''}" for c in representative_configs()])
def test_cute_kernel_compiles_for_sm90(index, tmp_path):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", SM90_COMPILE, str(index)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    stats = json.loads(run.stdout.strip().splitlines()[-1])
    print(stats)
    cfg = representative_configs()[index]
    copies = 2 if cfg.intra_wg_overlap else 1  # the overlapped loop has a peeled first QK^T/softmax and last PV
    k_blocks_qk, k_blocks_pv = cfg.head_dim // 16, cfg.tile_n // 16
    assert stats["wgmma"] == copies * (k_blocks_qk + k_blocks_pv), stats  # one per k-block of QK^T and of PV
    assert stats["tma"] > 0 and stats["setmaxnreg"] == 2, stats
    cols = cfg.tile_n // 4  # per thread and row: 2 rows of 64 x tile_n over 128 threads
    assert stats["ex2"] == copies * (2 * cols * (1 - cfg.poly_exp2_fraction) + 2), stats  # + 2 rescale factors


@needs_dsl
@pytest.mark.skipif(HAS_CUDA, reason="CPU compile (the gpu tests cover the cache there)")
def test_cute_compile_cache_reuses():
    from fa4.cute import compile_cache as CC
    cfg = representative_configs()[0]
    before = CC.cache_size()
    first = CC.get_kernel(cfg)
    assert CC.get_kernel(AttentionConfig(**vars(cfg))) is first  # an equal config: no second compile
    assert CC.cache_size() == before + 1


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("h,kv", GQA)
@pytest.mark.parametrize("causal", [True, False])
def test_cute_gpu_dense(d, h, kv, causal):
    for sq, sk in DENSE_LENGTHS:
        check_cute(2, sq, sk, h, kv, d, causal)


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("flags", [{"rescale_threshold": 0.0}, {"poly_exp2_fraction": 0.125},
                                   {"poly_exp2_fraction": 0.25}, {"poly_exp2_fraction": 0.5},
                                   {"poly_exp2_fraction": 1.0}, {"rescale_threshold": 15.0}])
def test_cute_gpu_fa4_flags(d, flags):
    for causal in (True, False):
        for sq, sk in ((127, 127), (1000, 4097)):
            check_cute(2, sq, sk, 16, 2, d, causal, **flags)


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("threshold", [0.0, 8.0])
def test_cute_gpu_rescale_with_growing_scores(threshold):
    # keys whose scores rise along the sequence force the running max up tile after tile
    q, k, v = qkv(1, 300, 1000, 8, 2, 128, BF16, seed=3)
    k = (k.float() * torch.linspace(0.1, 4.0, 1000, device=DEV)[None, :, None, None]).to(BF16)
    ref = R.attention(q.float(), k.float(), v.float(), causal=False)
    out = flash_attention(q, k, v, causal=False, backend="cute", rescale_threshold=threshold)
    assert_rel(out.float(), ref, TOL[BF16], f"threshold {threshold}")


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("d", [128, 256])
def test_cute_gpu_rows_without_keys(d):
    out, ref = check_cute(1, 100, 30, 8, 2, d, causal=True)  # q_len > k_len: rows 0..69 see no key
    assert torch.isfinite(out).all()
    assert out[:, :70].abs().max() == 0 and ref[:, :70].abs().max() == 0
    assert (out[:, 70:].float().abs().amax(-1) > 0).all()
    q, k, v = qkv(1, 5, 0, 2, 1, d, BF16)  # no keys at all
    assert flash_attention(q, k, v, causal=False, backend="cute").abs().max() == 0


@pytest.mark.gpu
@needs_dsl
def test_cute_gpu_softmax_scale_and_cache():
    from fa4.cute import compile_cache as CC
    q, k, v = qkv(2, 65, 200, 8, 2, 128, BF16)
    ref = R.attention(q.float(), k.float(), v.float(), causal=True, softmax_scale=0.3)
    out = flash_attention(q, k, v, causal=True, softmax_scale=0.3, backend="cute")
    assert_rel(out.float(), ref, TOL[BF16], "softmax_scale 0.3")
    size = CC.cache_size()
    q2, k2, v2 = qkv(3, 77, 500, 8, 2, 128, BF16, seed=1)  # other shapes, same config: no compile
    flash_attention(q2, k2, v2, causal=True, backend="cute")
    assert CC.cache_size() == size


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("d,overrides", [(128, dict(intra_wg_overlap=True)), (256, dict(intra_wg_overlap=True)),
                                         (128, dict(intra_wg_overlap=True, pingpong=False)),
                                         (256, dict(intra_wg_overlap=True, poly_exp2_fraction=0.25)),
                                         (128, dict(pingpong=False)), (128, dict(kv_stages=1)),
                                         (128, dict(tile_n=64)), (256, dict(pingpong=False)),
                                         (256, dict(tile_n=32, kv_stages=3))])
def test_cute_gpu_config_variants(d, overrides):
    from fa4.cute.entry import cute_attention
    for causal in (True, False):
        for sq, sk in ((1, 1), (65, 65), (1000, 1000), (300, 1000), (1000, 300)):
            q, k, v = qkv(2, sq, sk, 16, 2, d, BF16)
            out = cute_attention(q, k, v, causal=causal, softmax_scale=d ** -0.5, **overrides)
            ref = R.attention(q.float(), k.float(), v.float(), causal=causal)
            assert_rel(out.float(), ref, TOL[BF16], f"d{d} {overrides} sq{sq} sk{sk} causal={causal}")
