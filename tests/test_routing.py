"""The router (kernels.registry): today's choices pinned over a table of shapes on an H200, the choice cached once a
key, named implementations refusing calls they cannot run, and the ops the next issues add (MoE, a multi-token
verify step, GDN prefill by sequence length) expressible as entries."""
import pytest
import torch

from fa4.routes import AttentionKey
from kernels import registry
from kernels.gdn_decode import GdnKey
from kernels.linear import ChainKey, LinearKey, NormLinearKey
from kernels.paged_decode_attention import PagedKey
from kernels.registry import H200, DeviceInfo, Impl
from model import ops

BF16 = torch.bfloat16
MIB = 2**20
CPU = DeviceInfo("cpu")
ops.set_backend("reference")  # importing both sets of entries; every choice below names its backend
ops._load("triton")

# (heads, KV heads, page size, new tokens, cached tokens, batch) -> the implementation, head_dim 256, bf16
PAGED = {
    **{(h, kv, p, 1, 8192, b): "split_kv" for h, kv in ((16, 4), (8, 2)) for p in (16, 128) for b in (1, 16)},
    **{(h, kv, p, q, c, 1): "split_kv" for h, kv in ((16, 4), (8, 2)) for p in (16, 128) for q in (64, 512)
       for c in (8192, 50000)},
    # 800 new: the forward's 25 M-blocks x KV heads fill half the 132 SMs at KV4 (CuTe), not at KV2 (split-KV)
    **{(16, 4, p, 800, c, 1): "cute_forward" for p in (16, 128) for c in (8192, 50000)},
    **{(8, 2, p, 800, c, 1): "split_kv" for p in (16, 128) for c in (8192, 50000)},
}


@pytest.mark.parametrize("shape, expected", sorted(PAGED.items()))
def test_paged_attention_choices(shape, expected):
    heads, kv, page, q_len, ctx, batch = shape
    key = PagedKey(batch, q_len, heads, kv, 256, page, ctx + q_len if q_len > 512 else 0, BF16, H200)
    assert registry.choose("paged_attention", key, "triton").name == expected


def test_paged_attention_without_the_cute_forward():
    # fp16 has no CuTe forward: 800 new fill less than all SMs of the Triton forward (split-KV), 4096 fill them; the
    # CPU without the interpreter runs the reference
    key = PagedKey(1, 800, 16, 4, 256, 128, 50800, torch.float16, H200)
    assert registry.choose("paged_attention", key, "triton").name == "split_kv"
    key = key._replace(q_len=4096, seqlen_k=54096)
    assert registry.choose("paged_attention", key, "triton").name == "triton_forward"
    assert registry.choose("paged_attention", key._replace(device=CPU), "triton").name == "reference"


def linear_key(rows, n=12288, k=2048, padded=None, gated=False, tma=True):
    return LinearKey(rows, rows if padded is None else padded, n, k, BF16, H200, gated, tma and rows == 1)


@pytest.mark.parametrize("key, expected", [
    (linear_key(1), "tma_gemv"),  # 2B's gate_up, 50 MB
    (linear_key(1, n=1024), "gemv"),  # 4 MB: under tma_min_bytes
    (linear_key(1, n=2048, k=6144, gated=True), "gemv"),  # 2B's down projection: K under tma_gated_min_k
    (linear_key(1, n=4096, k=12288, gated=True), "tma_gemv"),  # 9B's
    (linear_key(2), "skinny_gemm"),  # 2-4 rows: the skinny GEMM (a verify step's; tuning.gemv_max_rows)
    (linear_key(4), "skinny_gemm"),
    (linear_key(5), "skinny_gemm"),  # in a decode graph: unpadded
    (linear_key(5, padded=64), "cublas"),  # an eager prefill: rows padded for cuBLAS
    (linear_key(16), "skinny_gemm"),
    (linear_key(17), "cublas"),
    (linear_key(17, padded=64), "cublas"),
])
def test_linear_choices(key, expected):
    assert registry.choose("linear", key, "triton").name == expected


@pytest.mark.parametrize("key, expected", [
    (NormLinearKey(1, 12288, 2048, BF16, H200, True), "tma_norm_gemv"),
    (NormLinearKey(2, 6176, 1024, BF16, H200, False), "norm_gemv"),  # 0.8B's K: the norm inside the GEMV
    (NormLinearKey(2, 8224, 2048, BF16, H200, False), "norm_then_linear"),
    (NormLinearKey(16, 8224, 2048, BF16, H200, False), "norm_then_linear"),
])
def test_pre_norm_projection_choices(key, expected):
    assert registry.choose("add_rms_norm_linear", key, "triton").name == expected


def test_out_proj_mlp_choices():
    assert registry.choose("out_proj_mlp", ChainKey(1, BF16, H200, True), "triton").name == "tma_chain"
    assert registry.choose("out_proj_mlp", ChainKey(4, BF16, H200, False), "triton").name == "by_ops"
    assert registry.choose("out_proj_mlp", ChainKey(1, BF16, CPU, False), "triton").name == "reference"


@pytest.mark.parametrize("key, expected", [
    (GdnKey(1, 16, 16, 128, 128, BF16, H200, True), "gdn_decode_cute"),  # 0.8B and 2B
    (GdnKey(1, 16, 32, 128, 128, BF16, H200, False), "gdn_decode"),  # 9B: two value heads a key head
    (GdnKey(64, 16, 16, 128, 128, BF16, H200, False), "gdn_prefill_chunked"),
    (GdnKey(1, 16, 16, 128, 128, torch.float32, CPU, False), "reference"),
    (GdnKey(4, 16, 16, 128, 128, BF16, H200, False, True), "gdn_verify"),  # a verify step of 3 drafts
])
def test_gated_deltanet_choices(key, expected):
    assert registry.choose("gated_deltanet", key, "triton").name == expected


@pytest.mark.parametrize("key, expected", [
    (AttentionKey("dense", True, 4, 0, 32, 32, 128, 0, 0, BF16, H200, ""), "cute"),
    (AttentionKey("dense", True, 4, 0, 32, 8, 64, 0, 0, BF16, H200, ""), "triton"),  # no d64 CuTe tile
    (AttentionKey("paged", True, 1, 64, 16, 4, 256, 128, 8192, BF16, H200, ""), "split_kv"),
    (AttentionKey("paged", True, 1, 800, 16, 4, 256, 128, 50048, BF16, H200, ""), "cute"),
    (AttentionKey("paged", False, 1, 64, 16, 4, 256, 128, 8192, BF16, H200, ""), "cute"),  # split-KV: causal only
    (AttentionKey("dense", True, 4, 0, 32, 32, 128, 0, 0, BF16, CPU, ""), "reference"),
])
def test_flash_attention_choices(key, expected):
    assert registry.choose("attention", key, "triton").name == expected


def test_the_reference_backend_runs_the_reference():
    key = linear_key(1)
    assert registry.choose("linear", key, "reference").name == "reference"


def test_a_choice_is_made_once_a_key():
    asked = []
    registry.define("routing_probe", lambda x: (x.shape[0],))
    registry.register("routing_probe", Impl("one", "triton", lambda x: 1, lambda key, t: asked.append(key)))
    with registry.use(backend="triton"):
        for _ in range(3):
            assert registry.run("routing_probe", torch.zeros(5)) == 1
    assert asked == [(5,)]


def test_a_named_implementation_never_falls_back():
    key = AttentionKey("dense", True, 4, 0, 32, 8, 64, 0, 0, BF16, H200, "")
    with pytest.raises(ValueError, match="head_dim 64"):
        registry.named("attention", "cute", key)
    with pytest.raises(ValueError, match="no implementation 'nosuch'"):
        registry.named("attention", "nosuch", key)


def test_the_next_ops_are_expressible():
    # MoE by (tokens, experts, top-k); a verify step of 2-5 tokens a sequence; the GDN prefill by sequence length
    registry.define("moe_probe", lambda x, experts, top_k: (x.shape[0], experts, top_k))
    registry.register("moe_probe", Impl("grouped_gemv", "triton", lambda *a: "gemv",
                                        lambda key, t: None if key[0] * key[2] <= 80 else "too many rows"))
    registry.register("moe_probe", Impl("grouped_gemm", "triton", lambda *a: "gemm", cost=1.0))
    with registry.use(backend="triton"):
        assert registry.run("moe_probe", torch.zeros(1, 8), 256, 8) == "gemv"
        assert registry.run("moe_probe", torch.zeros(64, 8), 256, 8) == "gemm"
    registry.define("gdn_by_length_probe")
    registry.register("gdn_by_length_probe", Impl("recurrent_verify", "triton", lambda: None,
                                                  lambda key, t: None if 2 <= key.q_len <= 5 else "not a verify step"))
    registry.register("gdn_by_length_probe", Impl("context_parallel", "triton", lambda: None,
                                                  lambda key, t: None if key.q_len >= 8192 else "short", 1.0))
    registry.register("gdn_by_length_probe", Impl("chunked", "triton", lambda: None, cost=2.0))
    base = GdnKey(4, 16, 16, 128, 128, BF16, H200, False)
    assert [registry.choose("gdn_by_length_probe", base._replace(q_len=q), "triton").name for q in (4, 64, 32768)] \
        == ["recurrent_verify", "chunked", "context_parallel"]


def test_a_tuning_is_part_of_the_choice():
    from kernels.tuning import KernelTuning
    key = linear_key(1, n=1024)  # 4 MB
    assert registry.choose("linear", key, "triton").name == "gemv"
    assert registry.choose("linear", key, "triton", KernelTuning(tma_min_bytes=2 * MIB)).name == "tma_gemv"
    with pytest.raises(ValueError, match="tma_min_bytes"):
        KernelTuning(tma_min_bytes=-1)
    # gemv_max_rows 4 takes 2-4 rows back to the GEMV; one row stays on the GEMVs either way; the norm inside the
    # GEMV keeps its own rule (up to GEMV_MAX_ROWS rows at a small K)
    gemv4 = KernelTuning(gemv_max_rows=4)
    assert [registry.choose("linear", linear_key(r), "triton", gemv4).name for r in (1, 2, 4, 5)] == \
        ["tma_gemv", "gemv", "gemv", "skinny_gemm"]
    for tuning in (gemv4, KernelTuning()):
        assert registry.choose("add_rms_norm_linear", NormLinearKey(2, 6176, 1024, BF16, H200, False), "triton",
                               tuning).name == "norm_gemv"
    for bad in (0, 5, True):
        with pytest.raises(ValueError, match="gemv_max_rows"):
            KernelTuning(gemv_max_rows=bad)


def test_the_debug_switch_checks_the_op_path(monkeypatch):
    # the op path launches unchecked (the engine built its arguments); QWEN_CHECK_OPS runs the public checks instead
    x, weight = torch.randn(3, 32), torch.randn(16, 32)
    with ops.use_backend("triton"):
        assert torch.allclose(ops.linear(x, weight), x @ weight.t(), atol=1e-4)
        monkeypatch.setattr(registry, "CHECK_OPS", True)
        with pytest.raises(ValueError, match="weight"):
            ops.linear(x, weight.to(torch.float64))
        assert torch.allclose(ops.linear(x, weight), x @ weight.t(), atol=1e-4)
