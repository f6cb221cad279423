"""fa4.flash_attention(backend="cute"): the CuTe-DSL forward for sm_90a (fa4/cute) against reference.attention.

CPU: the configuration and its errors (no DSL needed); what the backend refuses, with the reason (d64, fp16,
page sizes that fit no TMA box, CPU tensors); and, when nvidia-cutlass-dsl is installed, a compile for sm_90a
of the representative set (d128/d256 x causal/non-causal, GQA packing, FA4 flags, varlen, paged with pages of
64 (a tile per page) and 16 (a TMA box per page), the persistent scheduler) in a subprocess with
CUTE_DSL_ARCH=sm_90a, checking the PTX for TMA, wgmma and setmaxnreg, plus the compile cache.
`gpu` tests (H200): bf16, GQA 1/2/4/8, head dims 128/256, the lengths of tests/test_attention_prefill.py (1, 2,
65, 127, 1000, 4097, and q_len != k_len), causal and not, FA4 flags on and off, rows without keys; varlen
(cu_seqlens) and paged prefixes (make_pool: shuffled pages of 8/16/48/64/128/256 keys, NaN in unused slots), a
sequence full of NaN/Inf that must not leak into its neighbours, the persistent scheduler; relative error < 1e-2
against the fp32 reference.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import reference as R
from fa4 import flash_attention
from fa4.cute.config import (
    AttentionConfig,
    choose_config,
    default_tile_n,
    pack_factor,
    paged_tile_n,
    representative_configs,
)
from fa4.cute.entry import dsl_available
from tests.conftest import HAS_CUDA, assert_rel
from tests.test_attention_prefill import TOL, check_exp2_poly, exp2_probe_points, make_pool, qkv

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
    # ping-pong everywhere but dense d128 (default_pingpong), causal or not; an override wins
    pingpong = {(d, causal, mode): choose_config(d, causal, 16, 4, varlen_q=mode == "varlen",
                                                 kv_mode=mode, page_size=64 if mode == "paged" else 0).pingpong
                for d in (128, 256) for causal in (True, False) for mode in ("dense", "varlen", "paged")}
    assert {key for key, on in pingpong.items() if not on} == {(128, True, "dense"), (128, False, "dense")}
    assert choose_config(128, False, 8, 8, pingpong=True).pingpong
    # our own QK^T descriptors only where they were timed faster: dense d128 causal (default_hoisted_qk_desc)
    hoisted = {(d, causal, mode): choose_config(d, causal, 16, 4, varlen_q=mode == "varlen",
                                                kv_mode=mode, page_size=64 if mode == "paged" else 0).hoisted_qk_desc
               for d in (128, 256) for causal in (True, False) for mode in ("dense", "varlen", "paged")}
    assert {key for key, on in hoisted.items() if on} == {(128, True, "dense")}
    assert not choose_config(128, True, 8, 8, hoisted_qk_desc=False).hoisted_qk_desc
    # the persistent scheduler only where it was timed faster: dense d128 non-causal (default_persistent)
    persistent = {(d, causal, mode): choose_config(d, causal, 16, 4, varlen_q=mode == "varlen",
                                                   kv_mode=mode, page_size=64 if mode == "paged" else 0).persistent
                  for d in (128, 256) for causal in (True, False) for mode in ("dense", "varlen", "paged")}
    assert {key for key, on in persistent.items() if on} == {(128, False, "dense")}
    assert not choose_config(128, False, 8, 8, persistent=False).persistent
    assert hash(c) == hash(choose_config(128, True, 32, 4))  # a cache key
    for cfg in representative_configs():
        assert cfg.smem_bytes() <= 227 * 1024
    # paged: the K/V tile lies inside a page
    assert [paged_tile_n(128, p) for p in (8, 16, 32, 48, 64, 128, 256, 1024)] == [128] * 3 + [16] + [128] * 4
    assert [paged_tile_n(256, p) for p in (16, 64, 128, 96, 48)] == [64, 64, 64, 32, 16]
    for page in (24, 40, 0):
        with pytest.raises(ValueError, match=f"page_size {page} is not supported"):
            paged_tile_n(128, page)
    c = choose_config(128, True, 16, 2, varlen_q=True, kv_mode="paged", page_size=16)
    assert (c.tile_n, c.kv_box_rows, c.page_size, c.kv_mode, c.varlen_q) == (128, 16, 16, "paged", True)
    c = choose_config(256, True, 16, 2, kv_mode="paged", page_size=256)
    assert (c.tile_n, c.kv_box_rows) == (64, 64)


@pytest.mark.parametrize("fields,match", [
    (dict(head_dim=64), "head_dim 64"),
    (dict(dtype="float16"), "dtype float16"),
    (dict(pack_gqa=3), "pack_gqa"),
    (dict(tile_n=72), "tile_n"),
    (dict(poly_exp2_fraction=0.3), "poly_exp2_fraction"),
    (dict(rescale_threshold=16.0), "rescale_threshold"),
    (dict(kv_stages=4), "shared memory"),  # d128: 32 + 4 x 64 KiB does not fit (3 stages do)
    (dict(consumer_regs=256), "setmaxnreg"),
    (dict(kv_mode="ragged"), "kv_mode"),
    (dict(kv_mode="paged", page_size=96), "page_size 96 neither is a multiple of the K/V tile"),
    (dict(kv_mode="paged", page_size=4), "page_size 4 neither"),
    (dict(page_size=64), "only read with kv_mode 'paged'"),
])
def test_cute_config_rejects(fields, match):
    base = dict(head_dim=128, causal=False)
    with pytest.raises(ValueError, match=match):
        AttentionConfig(**{**base, **fields}).validate()


@pytest.mark.parametrize("case,match", [
    ("d64", "head_dim 64 is not one of"),
    ("fp16", "dtype torch.float16 is not supported"),
    ("page24", "page_size 24 is not supported: a K/V TMA box must lie inside one page"),
])
def test_cute_refuses_unsupported(case, match):
    d = 64 if case == "d64" else 128
    dtype = torch.float16 if case == "fp16" else BF16
    q, k, v = qkv(1, 8, 8, 2, 1, d, dtype)
    kwargs = {}
    if case == "page24":
        k, v, table, seqused = make_pool([30], 1, d, 24, dtype, seed=0)
        kwargs = dict(page_table=table, seqused_k=seqused)
    with pytest.raises(ValueError, match=f"'cute' cannot run this attention call: {match}"):
        flash_attention(q, k, v, causal=True, backend="cute", **kwargs)


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal of CPU tensors")
def test_cute_refuses_cpu_tensors():
    q, k, v = qkv(1, 8, 8, 2, 1, 128, BF16)
    reason = "not CUDA" if dsl_available() else "nvidia-cutlass-dsl is not installed"
    with pytest.raises(ValueError, match=reason):
        flash_attention(q, k, v, causal=True, backend="cute")


def test_auto_takes_cute_where_it_runs(monkeypatch):
    # auto (the router, fa4.routes) takes cute where its key_unsupported says it runs (after the split-KV kernel's
    # paged chunks) and never falls past it; where cute cannot, it goes on to triton / the reference (fp32 on the
    # CPU here)
    from fa4.cute import entry as CE
    from kernels import registry
    q, k, v = qkv(1, 65, 65, 4, 2, 128, torch.float32)
    calls = []
    monkeypatch.setattr(registry, "_choices", {})  # a fresh cache of choices under the patched predicate
    monkeypatch.setattr(CE, "key_unsupported", lambda *a, **kw: None)
    monkeypatch.setattr(CE, "cute_attention", lambda q, k, v, **kw: calls.append(kw) or torch.full_like(q, 7.0))
    out = flash_attention(q, k, v, causal=True, backend="auto", rescale_threshold=0.0)
    assert len(calls) == 1 and calls[0]["rescale_threshold"] == 0.0 and bool((out == 7.0).all())
    monkeypatch.setattr(registry, "_choices", {})
    monkeypatch.setattr(CE, "key_unsupported", lambda *a, **kw: "not here")
    out = flash_attention(q, k, v, causal=True, backend="auto")
    assert len(calls) == 1
    assert_rel(out.float(), R.attention(q, k, v, causal=True), 1e-5, "auto without cute")


# ------------------------------------------------------------------ CPU: compile for sm_90a

# representative configs compiled again with hoisted_qk_desc (d128 full, d256 causal): their PTX against the default's
HOISTED_BASES = (0, 3)
SM90_COMPILE = """
import dataclasses, json, re, time, traceback
from fa4.cute.config import representative_configs
from fa4.cute.compile_cache import compile_config
from profiles.ptx_wgmma import compare
from tests.sm90_compile import cuda_ptxas, parity_resets_in_loops, ptxas_sm90a
HOISTED_BASES = {hoisted_bases}
default_ptx = {}
for index, cfg in enumerate(representative_configs()):
    start = time.time()
    try:
        ptx = compile_config(cfg, keep_ptx=True).__ptx__
    except Exception:
        print(json.dumps({"index": index, "error": traceback.format_exc()[-4000:]}), flush=True)
        continue
    if index in HOISTED_BASES:
        default_ptx[index] = ptx
    info = ptxas_sm90a(ptx, cuda_ptxas())
    print(json.dumps({"index": index, "seconds": time.time() - start, "wgmma": ptx.count("wgmma.mma_async"),
                      "tma": ptx.count("cp.async.bulk.tensor"), "setmaxnreg": ptx.count("setmaxnreg"),
                      "ex2": ptx.count("ex2.approx"), "o_stores": re.findall(r"st\\.global[.a-z0-9]*", ptx),
                      "spill_bytes": info["spill"], "resets": parity_resets_in_loops(ptx),
                      "injected_fences": info["injected_fences"], "config": repr(cfg)}), flush=True)
for base in default_ptx:
    try:
        ptx = compile_config(dataclasses.replace(representative_configs()[base], hoisted_qk_desc=True),
                             keep_ptx=True).__ptx__
        problems, pairs = compare(default_ptx[base], ptx)
    except Exception:
        print(json.dumps({"index": f"hoisted{base}", "error": traceback.format_exc()[-4000:]}), flush=True)
        continue
    info = ptxas_sm90a(ptx, cuda_ptxas())
    print(json.dumps({"index": f"hoisted{base}", "problems": problems, "pairs": pairs, "spill_bytes": info["spill"],
                      "injected_fences": info["injected_fences"], "regs": info["regs"]}), flush=True)
""".replace("{hoisted_bases}", repr(HOISTED_BASES))


@pytest.fixture(scope="module")
def sm90_compiles(tmp_path_factory):
    """Compiles the representative set once, in one subprocess (one DSL import): {index: stats or error}."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=str(tmp_path_factory.mktemp("ptx")))
    run = subprocess.run([sys.executable, "-c", SM90_COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    stats = {}
    for line in run.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            stats[row["index"]] = row
    return stats, run.stderr[-4000:]


@needs_dsl
@pytest.mark.parametrize("index", range(len(representative_configs())),
                         ids=[f"d{c.head_dim}-{'causal' if c.causal else 'full'}-pack{c.pack_gqa}"
                              f"{'-overlap' if c.intra_wg_overlap else ''}{'-varlen' if c.varlen_q else ''}"
                              f"{'-kvvarlen' if c.kv_mode == 'varlen' else ''}"
                              f"{f'-paged{c.page_size}' if c.kv_mode == 'paged' else ''}"
                              f"{'-persistent' if c.persistent else ''}"
                              f"{f'-n{c.tile_n}' if c.tile_n != default_tile_n(c.head_dim) else ''}"
                              f"{'-always-rescale' if c.rescale_threshold == 0 else ''}"
                              for c in representative_configs()])
def test_cute_kernel_compiles_for_sm90(index, sm90_compiles):
    all_stats, stderr = sm90_compiles
    assert index in all_stats, stderr
    stats = all_stats[index]
    assert "error" not in stats, stats.get("error")
    print(stats)
    cfg = representative_configs()[index]
    # the overlapped loop has a peeled first QK^T/softmax and last PV, and its body twice: for the tiles that need
    # a mask, then for the rest without the mask's branch
    copies = 3 if cfg.intra_wg_overlap else 1
    k_blocks_qk, k_blocks_pv = cfg.head_dim // 16, cfg.tile_n // 16
    assert stats["wgmma"] == copies * (k_blocks_qk + k_blocks_pv), stats  # one per k-block of QK^T and of PV
    # TMA: Q (a box per consumer warpgroup), K and V (a box per page inside a tile), each split in 64-column boxes
    q_boxes, kv_boxes, col_boxes = cfg.num_consumer_wg, cfg.tile_n // cfg.kv_box_rows, cfg.head_dim // 64
    assert stats["tma"] == col_boxes * (q_boxes + 2 * kv_boxes) and stats["setmaxnreg"] == 2, stats
    cols = cfg.tile_n // 4  # per thread and row: 2 rows of 64 x tile_n over 128 threads
    assert stats["ex2"] == copies * (2 * cols * (1 - cfg.poly_exp2_fraction) + 2), stats  # + 2 rescale factors
    # O leaves 16 bytes a store: a thread's 64 x D / 128 values in D / 64 vector stores (the row stride is declared
    # a multiple of D; undeclared, the copy fell back to one 2-byte store a value)
    assert stats["o_stores"] == ["st.global.v4.b32"] * (cfg.head_dim // 16), stats
    # ptxas: no register spills, and no wgmma fence of its own (C7519: registers a wgmma reads were written after
    # our fence, as when P's conversion sinks past the next QK^T's issue; softmax.store_p pins it)
    assert stats["spill_bytes"] == 0 and stats["injected_fences"] == 0, stats
    assert stats["resets"] == 0, stats  # the Q, K and V ring states carried across tiles (not restarted at slot 0)


@needs_dsl
@pytest.mark.parametrize("base", HOISTED_BASES)
def test_cute_hoisted_qk_desc_issues_the_default_wgmmas(base, sm90_compiles):
    # hoisted_qk_desc builds QK^T's descriptors itself (fa4/cute/wgmma_desc.py): every QK^T wgmma group of its PTX
    # equals one of the default config's (instruction, scale-d and transpose operands, descriptor values at each
    # smem base, warpgroup and ring stage, and what reads the accumulator: its register order), profiles.ptx_wgmma;
    # ptxas spills nothing and injects no wgmma fence
    all_stats, stderr = sm90_compiles
    stats = all_stats.get(f"hoisted{base}")
    assert stats is not None, stderr
    assert "error" not in stats, stats.get("error")
    print(stats)
    copies = 3 if representative_configs()[base].intra_wg_overlap else 1
    assert stats["problems"] == [] and len(stats["pairs"]) == copies, stats
    assert stats["spill_bytes"] == 0 and stats["injected_fences"] == 0, stats


@needs_dsl
def test_cute_exp2_poly_probe_compiles_to_fma(tmp_path):
    # the CuTe softmax's polynomial exp2, mapped over a vector (tests/cute_exp2_probe.py), compiled for sm_90a in a
    # subprocess (its PTX copy goes to a temporary folder): FMAs, no MUFU ex2
    script = ("from tests.cute_exp2_probe import compile_probe; ptx = compile_probe(keep_ptx=True).__ptx__; "
              "print(ptx.count('ex2.approx'), ptx.count('fma.rn.f32'))")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ex2, fma = map(int, run.stdout.split()[-2:])
    assert ex2 == 0 and fma >= 3, run.stdout


@needs_dsl
@pytest.mark.skipif(HAS_CUDA, reason="CPU compile (the gpu tests cover the cache there)")
def test_cute_compile_cache_reuses():
    from fa4.cute import compile_cache as CC
    cfg = representative_configs()[0]
    before = CC.cache_size()
    first = CC.get_kernel(cfg)
    assert CC.get_kernel(AttentionConfig(**vars(cfg))) is first  # an equal config: no second compile
    assert CC.cache_size() == before + 1


@needs_dsl
@pytest.mark.skipif(HAS_CUDA, reason="fakes the launch on the CPU")
def test_cute_entry_passes_what_the_kernel_was_compiled_for(monkeypatch):
    """cute_attention's launch arguments (CPU tensors, a recording kernel): as many as the compile placeholders,
    None exactly where the config has no such tensor, and the sizes of dense, varlen and paged calls."""
    from fa4.cute import compile_cache as CC
    from fa4.cute import entry as CE
    calls = []

    def fake_get_kernel(config):
        def launch(*args):
            calls.append((config, args))
        return launch

    class Stream:
        cuda_stream = 0

    monkeypatch.setattr(CC, "get_kernel", fake_get_kernel)
    monkeypatch.setattr(CE, "num_sms", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(CE, "_KERNELS", {})
    q, k, v = qkv(2, 70, 90, 8, 2, 128, BF16)
    qv = q.reshape(-1, 8, 128)
    cu_q = torch.tensor([0, 30, 140], dtype=torch.int32)
    cu_k = torch.tensor([0, 100, 180], dtype=torch.int64)
    k_pages, v_pages, table, seqused = make_pool([50, 33], 2, 128, 16, BF16, seed=0)
    cases = {
        "dense": (q, k, v, {}, (140, 180, 8, 2, 0, 2, 70, 90)),
        "varlen": (qv, k.reshape(-1, 2, 128), v.reshape(-1, 2, 128), dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k),
                   (140, 180, 8, 2, 0, 2, 110, 0)),
        "paged": (qv, k_pages, v_pages, dict(cu_seqlens_q=cu_q, page_table=table, seqused_k=seqused),
                  (140, k_pages.shape[0] * 16, 8, 2, table.shape[1], 2, 110, 0)),
        "paged dense q": (q, k_pages, v_pages, dict(page_table=table, seqused_k=seqused),
                          (140, k_pages.shape[0] * 16, 8, 2, table.shape[1], 2, 70, 0)),
    }
    for name, (qq, kk, vv, index, sizes) in cases.items():
        out = CE.cute_attention(qq, kk, vv, causal=True, softmax_scale=0.1, **index)
        assert out.shape == qq.shape
        config, args = calls[-1]
        example = CC._example_args(config)
        assert len(args) == len(example), name
        assert [a is None for a in args] == [a is None for a in example], name
        assert tuple(args[8:16]) == sizes, name
        keys = table.shape[1] * 16 if "page_table" in index else sizes[1] // 2  # per sequence, as the host knows
        assert args[-2] == CE.pairs_per_section(keys, 128, 2, 16) == 16, name  # all 16 pairs' K/V fit in L2
        assert (config.varlen_q, config.kv_mode) == ("cu_seqlens_q" in index,
                                                    "paged" if "page_table" in index else
                                                    "varlen" if "cu_seqlens_k" in index else "dense"), name
    assert calls[2][0].page_size == 16 and calls[2][0].kv_box_rows == 16


@needs_dsl
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("m_blocks,groups,batch,section", [(5, 3, 2, 4), (64, 32, 4, 6), (7, 1, 1, 1), (3, 4, 3, 100)])
def test_persistent_order_visits_every_tile_once_a_section_at_a_time(m_blocks, groups, batch, section, causal):
    """The persistent loop's linear order: each (m_block, head group, sequence) tile once; the tiles of a section of
    `section` pairs are consecutive, m_block outer (longest first when causal) and the pairs inner, so the CTAs at
    work at once share a few pairs' K/V in L2."""
    from fa4.cute.tile_scheduler import persistent_order
    tiles = [persistent_order(t, m_blocks, groups, batch, section, causal) for t in range(m_blocks * groups * batch)]
    assert sorted(tiles) == [(m, g, b) for m in range(m_blocks) for g in range(groups) for b in range(batch)]
    for t, (m, g, b) in enumerate(tiles):
        assert (b * groups + g) // section == t // (section * m_blocks)  # its pair lies in its section
        if t and t // (section * m_blocks) == (t - 1) // (section * m_blocks):
            step = tiles[t - 1][0] - m if causal else m - tiles[t - 1][0]
            assert step in (0, 1)  # within a section: one Q tile of every pair, then the next (shorter) one
    assert _pairs_for(8192, 128) == 6 and _pairs_for(16384, 256) == 1  # the B4 S8k d128 and B1 S16k d256 rows


def _pairs_for(keys: int, head_dim: int) -> int:
    from fa4.cute.entry import pairs_per_section
    return pairs_per_section(keys, head_dim, 2, 10**6)


# ------------------------------------------------------------------ GPU


# every (head dim, GQA) pair with one causal flag, every (causal, head dim) and (causal, GQA) pair among them: half
# the product, as in the Triton forward's GPU matrix (each combination is its own compiled kernel)
GPU_DENSE = [(d, h, kv, (i + j) % 2 == 0) for i, d in enumerate((128, 256)) for j, (h, kv) in enumerate(GQA)]


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("d,h,kv,causal", GPU_DENSE)
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
def test_cute_gpu_exp2_poly_error_bound():
    # the polynomial's own error over its input range, as the kernel's softmax computes it on the GPU
    import cutlass

    from fa4.cute.compile_cache import gmem_ptr
    from kernels.cute_runtime import cu_stream
    from tests.cute_exp2_probe import compile_probe
    x = exp2_probe_points(DEV)
    y = torch.full_like(x, float("nan"))
    compile_probe()(gmem_ptr(x, cutlass.Float32), gmem_ptr(y, cutlass.Float32), x.numel(),
                    cu_stream(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()
    check_exp2_poly(x, y)


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
@pytest.mark.parametrize("d,overrides", [(128, dict(intra_wg_overlap=False)), (256, dict(intra_wg_overlap=False)),
                                         (128, dict(pingpong=True)),
                                         (256, dict(poly_exp2_fraction=0.25)),
                                         (128, dict(intra_wg_overlap=False, pingpong=False)), (128, dict(kv_stages=1)),
                                         (128, dict(tile_n=64)), (256, dict(pingpong=False)),
                                         (256, dict(tile_n=32, kv_stages=3)), (128, dict(tile_n=176)),
                                         (128, dict(kv_stages=3)), (256, dict(tile_n=80)),
                                         (128, dict(rescale_threshold=0.0, pingpong=True)),
                                         (128, dict(hoisted_qk_desc=True)), (256, dict(hoisted_qk_desc=True)),
                                         (128, dict(hoisted_qk_desc=True, pingpong=True, intra_wg_overlap=False))],
                         ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else f"d{x}")
def test_cute_gpu_config_variants(d, overrides):
    check_cute_config(d, overrides, ((1, 1), (65, 65), (1000, 1000), (300, 1000), (1000, 300)))


def check_cute_config(d, overrides, lengths):
    """The kernel entry with config overrides, dense B2 H16/KV2, causal and not, at each (sq, sk)."""
    from fa4.cute.entry import cute_attention
    for causal in (True, False):
        for sq, sk in lengths:
            q, k, v = qkv(2, sq, sk, 16, 2, d, BF16)
            out = cute_attention(q, k, v, causal=causal, softmax_scale=d ** -0.5, **overrides)
            ref = R.attention(q.float(), k.float(), v.float(), causal=causal)
            assert_rel(out.float(), ref, TOL[BF16], f"d{d} {overrides} sq{sq} sk{sk} causal={causal}")


def _varlen_qkv(lens_q, lens_k, h, kv, d, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, generator=gen).to(DEV, BF16)
    k, v = (torch.randn(sum(lens_k), kv, d, generator=gen).to(DEV, BF16) for _ in range(2))
    cu_q = torch.tensor([0, *lens_q], device=DEV).cumsum(0).int()
    cu_k = torch.tensor([0, *lens_k], device=DEV).cumsum(0).int()
    return q, k, v, cu_q, cu_k


VARLEN_LENS = [1, 2, 65, 127, 1000, 4097]


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("h,kv", GQA)
def test_cute_gpu_varlen(d, h, kv):
    q, k, v, cu, _ = _varlen_qkv(VARLEN_LENS, VARLEN_LENS, h, kv, d, seed=4)
    for causal in (True, False):
        out = flash_attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="cute",
                              poly_exp2_fraction=0.125)
        ref = R.attention(q.float(), k.float(), v.float(), causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
        assert_rel(out.float(), ref, TOL[BF16], f"varlen d{d} h{h}/{kv} causal={causal}")
    # q_len != k_len per sequence: chunks over longer keys, rows without keys (causal), a sequence with no keys
    lens_q, lens_k = [65, 1, 300, 2, 1000, 7], [1000, 3, 65, 0, 4097, 7]
    q, k, v, cu_q, cu_k = _varlen_qkv(lens_q, lens_k, h, kv, d, seed=5)
    for causal in (True, False):
        out = flash_attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="cute")
        ref = R.attention(q.float(), k.float(), v.float(), causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        assert_rel(out.float(), ref, TOL[BF16], f"varlen q!=k d{d} h{h}/{kv} causal={causal}")


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_cute_gpu_varlen_neighbours_do_not_leak(d, poison):
    """Tiles read rows past a sequence's end (the next sequence's): those keys must never reach the softmax or O,
    so a sequence full of NaN/Inf leaves its neighbours exact."""
    lens = [65, 127, 1, 1000, 2, 200]
    bad = 2  # its q, k and v are poisoned; it sits after a ragged 127 and before a long sequence
    q, k, v, cu, _ = _varlen_qkv(lens, lens, 16, 2, d, seed=6)
    rows = slice(int(cu[bad]), int(cu[bad + 1]))
    for t in (q, k, v):
        t[rows] = poison
    for causal in (True, False):
        out = flash_attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="cute")
        ref = R.attention(q.float(), k.float(), v.float(), causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
        keep = torch.ones(q.shape[0], dtype=torch.bool, device=DEV)
        keep[rows] = False
        assert_rel(out[keep].float(), ref[keep], TOL[BF16], f"neighbours of a {poison} sequence, causal={causal}")


def check_paged(lens_q, lens_k, h, kv, d, page, varlen_q=True, seed=0, **flags):
    k_pages, v_pages, table, seqused = make_pool(lens_k, kv, d, page, BF16, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if varlen_q:
        q = torch.randn(sum(lens_q), h, d, generator=gen).to(DEV, BF16)
        cu_q = torch.tensor([0, *lens_q], device=DEV).cumsum(0).int()
    else:
        q = torch.randn(len(lens_q), lens_q[0], h, d, generator=gen).to(DEV, BF16)
        cu_q = None
    out = flash_attention(q, k_pages, v_pages, causal=True, cu_seqlens_q=cu_q, page_table=table, seqused_k=seqused,
                          backend="cute", **flags)
    ref = R.paged_attention(q.float(), k_pages.float(), v_pages.float(), table, seqused, causal=True,
                            cu_seqlens_q=cu_q)
    assert_rel(out.float(), ref, TOL[BF16], f"paged page {page} d{d} h{h}/{kv} varlen_q={varlen_q} {flags}")


PAGES = [8, 16, 48, 64, 128, 256]  # d128 (tile 128): boxes of 8/16/64 keys, gcd tile 16, whole tiles


def _paged_cases(h, kv, d, page, seed):
    check_paged([1, 65, 127, 1000, 2], [4097, 65, 300, 1000, 2], h, kv, d, page, seed=seed)
    check_paged([33, 33], [33, 100], h, kv, d, page, varlen_q=False, seed=seed + 1)  # dense q
    check_paged([5, 1, 40], [70, 1, 0], h, kv, d, page, seed=seed + 2)  # one sequence without keys


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("page", PAGES)
def test_cute_gpu_paged(page, d):
    # page sizes x head dims; the GQA group turns with the page (each config compiles once)
    h, kv = GQA[PAGES.index(page) % len(GQA)]
    _paged_cases(h, kv, d, page, seed=page + d)


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("h,kv", GQA)
def test_cute_gpu_paged_gqa(h, kv, d):
    # the engine's page size (16) over GQA 1/2/4/8, with the software exp2 on
    _paged_cases(h, kv, d, 16, seed=d + h + kv)
    check_paged([1, 65, 127, 1000, 2], [4097, 65, 300, 1000, 2], h, kv, d, 16, seed=3, poly_exp2_fraction=0.125)


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("d,page", [(128, 128), (256, 64), (128, 16)])
def test_cute_gpu_paged_agent_turn(d, page):
    # a chunk over a long cached prefix, the agent-turn shape at a smaller size
    check_paged([800], [20000], 16, 4, d, page, seed=7)


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("overrides", [dict(persistent=True), dict(persistent=True, intra_wg_overlap=False)])
def test_cute_gpu_persistent(d, overrides):
    from fa4.cute.entry import cute_attention
    check_cute_config(d, overrides, ((1, 1), (1000, 1000), (300, 1000), (1000, 300), (4097, 4097)))
    q, k, v, cu, _ = _varlen_qkv(VARLEN_LENS, VARLEN_LENS, 16, 2, d, seed=8)
    out = cute_attention(q, k, v, causal=True, softmax_scale=d ** -0.5, cu_seqlens_q=cu, cu_seqlens_k=cu,
                         **overrides)
    ref = R.attention(q.float(), k.float(), v.float(), causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert_rel(out.float(), ref, TOL[BF16], f"persistent varlen d{d} {overrides}")
    k_pages, v_pages, table, seqused = make_pool([4097, 65, 300], 2, d, 64, BF16, seed=9)
    qp = torch.randn(1 + 65 + 127, 16, d, generator=torch.Generator().manual_seed(10)).to(DEV, BF16)
    cu_q = torch.tensor([0, 1, 66, 193], dtype=torch.int32, device=DEV)
    out = cute_attention(qp, k_pages, v_pages, causal=True, softmax_scale=d ** -0.5, cu_seqlens_q=cu_q,
                         page_table=table, seqused_k=seqused, **overrides)
    ref = R.paged_attention(qp.float(), k_pages.float(), v_pages.float(), table, seqused, causal=True,
                            cu_seqlens_q=cu_q)
    assert_rel(out.float(), ref, TOL[BF16], f"persistent paged d{d} {overrides}")
