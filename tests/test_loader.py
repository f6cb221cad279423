"""load_checkpoint on directories that transformers itself wrote (`save_pretrained`): text-only and sharded,
tied embeddings, MoE experts per expert (as on disk) and fused, the VLM layout with `model.visual.*` and a
hand-added `mtp.*`, and rope theta / layer types read from config.json. Logits are compared with transformers'."""
import copy
import json
import logging

import pytest
import torch
from conftest import rel_err
from hf_oracle import hf_text_model, randomize_, small_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from model.loader import load_checkpoint
from model.model import Qwen35ForCausalLM

TOL = 1e-5
VOCAB = 512


def random_ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def disk_keys(path) -> set[str]:
    keys = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            keys |= set(sf.keys())
    return keys


def load(path, **kw) -> Qwen35ForCausalLM:
    return load_checkpoint(path, dtype=torch.float32, progress=False, **kw)


def assert_logits_match(ours: Qwen35ForCausalLM, hf, ids: torch.Tensor, what: str, tol: float = TOL) -> float:
    with torch.no_grad():
        ref = hf(input_ids=ids).logits.float()
    out = ours(ids, ours.new_cache(*ids.shape))
    err = rel_err(out, ref)
    assert err < tol, f"{what}: rel err {err:.2e} vs transformers"
    return err


def vlm(cfg, seed: int, mrope: bool = True, tie: bool = False):
    """transformers' Qwen3_5[Moe]ForConditionalGeneration with a one-block vision tower and text config `cfg`."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )
    text = cfg.to_hf()
    text.pop("model_type")
    if mrope:  # as in the released checkpoints: interleaved M-RoPE, which reduces to 1-D rope for text
        half = cfg.rotary_dim // 2
        text["rope_parameters"].update(mrope_section=[half - 2 * (half // 3), half // 3, half // 3],
                                       mrope_interleaved=True)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, num_position_embeddings=16, out_hidden_size=cfg.hidden_size)
    if cfg.is_moe:
        text.pop("intermediate_size", None)
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision,
                                                                     tie_word_embeddings=tie))
    else:
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision,
                                                               tie_word_embeddings=tie))
    model = model.float().eval()
    randomize_(model, seed)
    return model


# ---- text-only layout -------------------------------------------------------------------------------------

@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_text_checkpoint_logits_match(tmp_path, sharded):
    cfg = small_config(False)
    hf = hf_text_model(cfg, seed=1)
    hf.save_pretrained(tmp_path, **({"max_shard_size": "200KB"} if sharded else {}))
    index = tmp_path / "model.safetensors.index.json"
    assert index.exists() == sharded
    if sharded:
        shards = set(json.loads(index.read_text())["weight_map"].values())
        assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    assert {k for k in disk_keys(tmp_path) if k.startswith("model.layers.0.mlp.")} == {
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight"}
    ours = load(tmp_path)
    assert ours.config == cfg
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in ours.parameters())
    assert_logits_match(ours, hf, random_ids(2, 37, seed=1), "text checkpoint")


def test_sharded_load_reads_only_what_the_index_assigns(tmp_path):
    """A stray tensor left in a shard but absent from the index is not loaded; an index entry whose shard
    lacks the tensor is a clear error."""
    hf = hf_text_model(small_config(False), seed=2)
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = tmp_path / index["weight_map"]["model.norm.weight"]
    tensors = load_file(shard)
    save_file({**tensors, "model.layers.0.stray.weight": torch.randn(3)}, shard, metadata={"format": "pt"})
    assert_logits_match(load(tmp_path), hf, random_ids(1, 9, seed=2), "stray tensor outside the index")
    elsewhere = next(n for n, f in index["weight_map"].items() if f != shard.name)
    index["weight_map"][elsewhere] = shard.name
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="does not hold"):
        load(tmp_path)


def test_tied_embeddings(tmp_path):
    cfg = small_config(False, tie_word_embeddings=True)
    hf = hf_text_model(cfg, seed=2)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    hf.save_pretrained(tmp_path)
    assert "lm_head.weight" not in disk_keys(tmp_path)  # transformers writes the tied tensor once
    ours = load(tmp_path)
    assert ours.config.tie_word_embeddings
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    torch.testing.assert_close(ours.lm_head.weight, hf.model.embed_tokens.weight, rtol=0, atol=0)
    assert_logits_match(ours, hf, random_ids(2, 21, seed=2), "tied checkpoint")


def test_untied_model_keeps_its_own_lm_head(tmp_path):
    cfg = small_config(False)
    hf = hf_text_model(cfg, seed=3)
    hf.save_pretrained(tmp_path)
    ours = load(tmp_path)
    assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(ours.lm_head.weight, hf.lm_head.weight, rtol=0, atol=0)


# ---- MoE ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_hf():
    return hf_text_model(small_config(True), seed=4)


def test_moe_per_expert_on_disk(tmp_path, moe_hf):
    moe_hf.save_pretrained(tmp_path, max_shard_size="200KB")
    keys = disk_keys(tmp_path)
    n = moe_hf.config.num_experts
    for e in range(n):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.0.mlp.experts.{e}.{proj}.weight" in keys
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)
    assert "model.layers.0.mlp.gate.weight" in keys
    assert "model.layers.0.mlp.shared_expert.gate_proj.weight" in keys
    ours = load(tmp_path)
    assert ours.config.num_experts == n and ours.config.is_moe
    assert_logits_match(ours, moe_hf, random_ids(2, 37, seed=4), "MoE, experts per expert")


def test_moe_fused_experts_on_disk(tmp_path, moe_hf):
    """transformers' in-memory layout (experts.gate_up_proj (E, 2I, H), experts.down_proj (E, H, I)), written
    by hand with safetensors, also loads."""
    moe_hf.save_pretrained(tmp_path)
    sd = {k: v.contiguous() for k, v in moe_hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd and "model.layers.0.mlp.experts.down_proj" in sd
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    keys = disk_keys(tmp_path)
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys
    assert not any(".experts.0." in k for k in keys)
    ours = load(tmp_path)
    assert_logits_match(ours, moe_hf, random_ids(2, 37, seed=5), "MoE, fused experts")


# ---- VLM layout -------------------------------------------------------------------------------------------

MTP = {  # the shapes of a real MTP head (fc over cat(norm(emb), norm(h)), one decoder layer, norms)
    "mtp.fc.weight": (64, 128),
    "mtp.pre_fc_norm_embedding.weight": (64,),
    "mtp.pre_fc_norm_hidden.weight": (64,),
    "mtp.layers.0.self_attn.q_proj.weight": (256, 64),
    "mtp.norm.weight": (64,),
}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_vlm_layout_skips_visual_and_mtp(tmp_path, caplog, moe):
    cfg = small_config(moe)
    hf = vlm(cfg, seed=6)
    mtp = {k: torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, (k, s) in enumerate(MTP.items())}
    if moe:  # one file: rewrite model.safetensors with the mtp tensors added
        hf.save_pretrained(tmp_path)
        sd = load_file(str(tmp_path / "model.safetensors"))
        save_file({**sd, **mtp}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    else:  # sharded: add a shard and its index entries
        hf.save_pretrained(tmp_path, max_shard_size="200KB")
        save_file(mtp, str(tmp_path / "model-mtp.safetensors"), metadata={"format": "pt"})
        index_path = tmp_path / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        index["weight_map"].update({k: "model-mtp.safetensors" for k in mtp})
        index_path.write_text(json.dumps(index))
    config = json.loads((tmp_path / "config.json").read_text())
    assert "text_config" in config and "vision_config" in config
    keys = disk_keys(tmp_path)
    visual = [k for k in keys if k.startswith("model.visual.")]
    assert visual and any(k.startswith("model.language_model.layers.") for k in keys)
    assert not any(k.startswith("model.layers.") for k in keys)
    assert set(MTP) <= keys

    with caplog.at_level(logging.INFO, logger="model.loader"):
        ours = load(tmp_path)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert skipped == [f"skipped {len(visual) + len(MTP)} tensors (model.visual.*, or mtp.* of a model built "
                       "without its head)"], skipped
    assert ours.config.is_moe == moe and ours.config.hidden_size == cfg.hidden_size
    ids = random_ids(2, 37, seed=6)
    assert_logits_match(ours, hf, ids, "VLM layout, text-only input")
    # and the same as transformers' language model on its own (the VLM adds nothing for text-only input)
    with torch.no_grad():
        h = hf.model.language_model(input_ids=ids).last_hidden_state
        ref = hf.lm_head(h)
    err = rel_err(ours(ids, ours.new_cache(*ids.shape)), ref)
    assert err < TOL, f"VLM layout vs transformers' language model: rel err {err:.2e}"


@pytest.mark.parametrize("top, inner", [(True, False), (False, True)])
def test_vlm_tie_word_embeddings_follows_the_top_level(tmp_path, top, inner):
    """In a nested VLM config transformers ties lm_head by the top-level `tie_word_embeddings`, whatever the
    text_config says; reading the other flag would load lm_head and the embedding into one tensor."""
    cfg = small_config(False)
    hf = vlm(cfg, seed=7, mrope=False, tie=top)
    hf.config.text_config.tie_word_embeddings = inner
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["tie_word_embeddings"] == top and config["text_config"]["tie_word_embeddings"] == inner
    assert ("lm_head.weight" in disk_keys(tmp_path)) == (not top)
    ours = load(tmp_path)
    assert ours.config.tie_word_embeddings == top
    assert_logits_match(ours, hf, random_ids(1, 13, seed=7), f"VLM tie top={top} text_config={inner}")


# ---- config.json: rope theta, rotary fraction, layer types ----------------------------------------------

LAYER_TYPES = ("full_attention", "linear_attention", "full_attention", "full_attention", "linear_attention")


def test_rope_theta_and_layer_types_read_from_config(tmp_path):
    from transformers import AutoModelForCausalLM
    cfg = small_config(False, num_hidden_layers=5, layer_types=LAYER_TYPES, rope_theta=12345.0,
                       partial_rotary_factor=0.5)
    hf = hf_text_model(cfg, seed=8)
    hf.save_pretrained(tmp_path)
    text = json.loads((tmp_path / "config.json").read_text())
    assert text["rope_parameters"]["rope_theta"] == 12345.0 and text["layer_types"] == list(LAYER_TYPES)
    ours = load(tmp_path)
    assert ours.config.rope_theta == 12345.0
    assert ours.config.layer_types == LAYER_TYPES
    assert ours.config.rotary_dim == cfg.head_dim // 2
    assert [layer.layer_type for layer in ours.model.layers] == list(LAYER_TYPES)
    ids = random_ids(2, 37, seed=8)
    assert_logits_match(ours, hf, ids, "theta 12345, custom layer types")

    # Proof that theta is read (and matters): another theta in config.json, same weights -> other logits,
    # and transformers reading the same directory agrees with us again.
    text["rope_parameters"]["rope_theta"] = 1e6
    (tmp_path / "config.json").write_text(json.dumps(text))
    ours_1e6 = load(tmp_path)
    assert ours_1e6.config.rope_theta == 1e6
    out_1e6 = ours_1e6(ids, ours_1e6.new_cache(*ids.shape))
    with torch.no_grad():
        ref_12345 = hf(input_ids=ids).logits
    assert rel_err(out_1e6, ref_12345) > 1e-3, "rope theta in config.json made no difference"
    hf_1e6 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf_1e6.config.rope_parameters["rope_theta"] == 1e6
    assert_logits_match(ours_1e6, hf_1e6, ids, "theta 1e6 after editing config.json")


def test_full_attention_interval_without_layer_types(tmp_path):
    """An older config.json with `full_attention_interval` and no `layer_types`."""
    from transformers import AutoModelForCausalLM
    cfg = small_config(False, layer_types=("linear_attention", "full_attention") * 2, rope_theta=3e4)
    hf = hf_text_model(cfg, seed=9)
    hf.save_pretrained(tmp_path)
    text = json.loads((tmp_path / "config.json").read_text())
    del text["layer_types"]
    text["full_attention_interval"] = 2
    (tmp_path / "config.json").write_text(json.dumps(text))
    ours = load(tmp_path)
    assert ours.config.layer_types == cfg.layer_types
    hf2 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert list(hf2.config.layer_types) == list(cfg.layer_types)
    assert_logits_match(ours, hf2, random_ids(2, 19, seed=9), "full_attention_interval 2")


def test_legacy_top_level_rope_theta(tmp_path):
    """A config.json with `rope_theta` at the top level and no `rope_parameters`."""
    cfg = small_config(False, rope_theta=54321.0)
    hf = hf_text_model(cfg, seed=10)
    hf.save_pretrained(tmp_path)
    text = json.loads((tmp_path / "config.json").read_text())
    rope = text.pop("rope_parameters")
    text.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"])
    (tmp_path / "config.json").write_text(json.dumps(text))
    ours = load(tmp_path)
    assert ours.config.rope_theta == 54321.0
    assert_logits_match(ours, hf, random_ids(2, 19, seed=10), "top-level rope_theta")


# ---- dtype and progress bar -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_dense(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense")
    hf = hf_text_model(small_config(False), seed=12)
    hf.save_pretrained(path, max_shard_size="200KB")
    return path, hf


def test_progress_bar_default_and_off(saved_dense, capsys):
    path, hf = saved_dense
    n_shards = len(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))
    capsys.readouterr()
    load_checkpoint(path, dtype=torch.float32)  # progress bar on by default
    err = capsys.readouterr().err
    assert f"loading {path.name}" in err and f"{n_shards}/{n_shards}" in err
    load_checkpoint(path, dtype=torch.float32, progress=False)
    assert capsys.readouterr().err == ""


def test_default_dtype_is_bfloat16(saved_dense):
    path, hf = saved_dense
    ours = load_checkpoint(path, progress=False)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    ids = random_ids(2, 19, seed=13)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        ref_bf16 = copy.deepcopy(hf).to(torch.bfloat16)(input_ids=ids).logits
    # these random models amplify rounding: judge our bf16 error by transformers' own bf16 error
    err, err_hf = rel_err(ours(ids, ours.new_cache(2, 19)).float(), ref), rel_err(ref_bf16, ref)
    assert err < 2 * err_hf + 1e-2, f"bf16 load: rel err {err:.2e} vs fp32, transformers' bf16 {err_hf:.2e}"

