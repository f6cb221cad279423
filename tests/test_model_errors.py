"""Bad configs, bad checkpoints, bad inputs and misused caches: each is a ValueError that names the problem."""
import json
import shutil

import pytest
import torch
from hf_oracle import hf_text_model, small_config
from safetensors.torch import load_file, save_file

from model.config import Qwen35Config, get_preset
from model.generate import stream
from model.loader import load_checkpoint, load_state_dict
from model.model import Qwen35ForCausalLM

VOCAB = 512


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small dense checkpoint written by transformers, copied per test and then damaged."""
    path = tmp_path_factory.mktemp("dense")
    hf_text_model(small_config(False), seed=21).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_disk(tmp_path_factory):
    """An MoE state dict as on disk (experts per expert), via save_pretrained."""
    path = tmp_path_factory.mktemp("moe")
    hf_text_model(small_config(True), seed=22).save_pretrained(path)
    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def model():
    return Qwen35ForCausalLM.random(small_config(False), seed=23)


def copy_of(saved, tmp_path):
    dest = tmp_path / "ckpt"
    shutil.copytree(saved, dest)
    return dest


def edit_weights(path, edit) -> None:
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def edit_config(path, edit) -> None:
    f = path / "config.json"
    config = json.loads(f.read_text())
    edit(config)
    f.write_text(json.dumps(config))


def load(path):
    return load_checkpoint(path, dtype=torch.float32, progress=False)


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---- config ------------------------------------------------------------------------------------------------

def test_unknown_layer_type_in_config_json(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    edit_config(path, lambda c: c.update(layer_types=["linear_attention", "sliding_attention",
                                                      "linear_attention", "full_attention"]))
    with pytest.raises(ValueError, match=r"unknown layer_types entries \['sliding_attention'\]"):
        Qwen35Config.from_json(path / "config.json")
    with pytest.raises(ValueError, match=r"unknown layer_types entries \['sliding_attention'\]"):
        load(path)


def test_layer_types_of_the_wrong_length(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    edit_config(path, lambda c: c.update(layer_types=["linear_attention", "full_attention", "full_attention"]))
    with pytest.raises(ValueError, match="layer_types has 3 entries for 4 layers"):
        load(path)


def test_unsupported_rope_type(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    edit_config(path, lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0))
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        load(path)


@pytest.mark.parametrize("overrides, message", [
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_attention_heads must be a multiple"),
    (dict(linear_num_key_heads=3, linear_num_value_heads=4), "linear_num_value_heads must be a multiple"),
    (dict(moe=True, num_experts_per_tok=7), r"num_experts_per_tok must be in \[1, 6\]"),
    (dict(moe=True, num_experts_per_tok=0), r"num_experts_per_tok must be in \[1, 6\]"),
])
def test_inconsistent_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"unknown preset 'qwen3\.5-1t'; known: .*'qwen3\.5-9b'"):
        get_preset("qwen3.5-1t")
    with pytest.raises(ValueError, match="unknown preset 'tinyy'"):
        Qwen35ForCausalLM.from_preset("tinyy")
    assert get_preset("TINY") == get_preset("tiny")  # names are case-insensitive


# ---- checkpoint files -------------------------------------------------------------------------------------

def test_no_config_json(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        load(path)


def test_no_safetensors(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no safetensors files"):
        load(path)


def test_index_names_an_absent_shard(tmp_path):
    hf_text_model(small_config(False), seed=24).save_pretrained(tmp_path, max_shard_size="200KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"names shard files that are not in .*{shard.name}"):
        load(tmp_path)


@pytest.mark.parametrize("name", [
    "model.layers.1.linear_attn.A_log",
    "model.layers.3.self_attn.q_norm.weight",
    "model.layers.0.mlp.gate_proj.weight",  # half of our stacked gate_up_proj: named as on disk
    "model.norm.weight",
    "lm_head.weight",  # untied: lm_head is its own tensor
])
def test_missing_tensor_is_listed(saved, tmp_path, name):
    path = copy_of(saved, tmp_path)
    edit_weights(path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"1 missing tensors: \['{name}'\]"):
        load(path)


def test_missing_tensors_are_all_listed(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    names = ["model.layers.2.linear_attn.dt_bias", "model.layers.3.mlp.up_proj.weight"]
    edit_weights(path, lambda t: [t.pop(n) for n in names])
    with pytest.raises(ValueError, match=r"2 missing tensors: \['model.layers.2.linear_attn.dt_bias', "
                                         r"'model.layers.3.mlp.up_proj.weight'\]"):
        load(path)


def test_unexpected_tensor_is_listed(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    bogus = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    edit_weights(path, lambda t: t.update({"model.layers.0.mlp.bogus.weight": bogus}))
    with pytest.raises(ValueError, match=r"1 unexpected tensors: \['model.layers.0.mlp.bogus.weight'\]"):
        load(path)


def test_missing_and_unexpected_in_one_message(saved, tmp_path):
    path = copy_of(saved, tmp_path)

    def edit(t):  # a renamed tensor: missing under its name, unexpected under the other
        t["model.layers.0.linear_attn.A_logg"] = t.pop("model.layers.0.linear_attn.A_log")
    edit_weights(path, edit)
    with pytest.raises(ValueError, match=r"missing tensors: \['model.layers.0.linear_attn.A_log'\]; "
                                         r"1 unexpected tensors: \['model.layers.0.linear_attn.A_logg'\]"):
        load(path)


def test_tensor_of_the_wrong_shape(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    wrong = torch.randn(65, 64, generator=torch.Generator().manual_seed(2))
    edit_weights(path, lambda t: t.update({"model.layers.3.self_attn.k_proj.weight": wrong}))
    with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn\.k_proj\.weight has shape \(65, 64\), "
                                         r"expected \(64, 64\)"):
        load(path)


def test_config_does_not_match_the_weights(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    edit_config(path, lambda c: c.update(hidden_size=96))
    with pytest.raises(ValueError, match=r"checkpoint tensor \S+ has shape \(\d+, 64\), expected \(\d+, 96\)"):
        load(path)


def test_tied_config_with_a_different_lm_head(saved, tmp_path):
    """config.json says tie_word_embeddings but the file holds a distinct lm_head: loading either into the one
    shared tensor would silently drop the other."""
    path = copy_of(saved, tmp_path)
    edit_config(path, lambda c: c.update(tie_word_embeddings=True))
    with pytest.raises(ValueError, match=r"differs from .*\(tie_word_embeddings\)"):
        load(path)


def test_tied_config_with_an_equal_lm_head_loads(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    edit_config(path, lambda c: c.update(tie_word_embeddings=True))
    edit_weights(path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    ours = load(path)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_moe_missing_expert_piece_is_named_as_on_disk(moe_disk):
    cfg = small_config(True)
    for name in ("model.layers.1.mlp.experts.3.up_proj.weight", "model.layers.2.mlp.experts.5.down_proj.weight",
                 "model.layers.0.mlp.shared_expert.gate_proj.weight", "model.layers.3.mlp.gate.weight"):
        sd = {k: v for k, v in moe_disk.items() if k != name}
        with pytest.raises(ValueError, match=rf"1 missing tensors: \['{name}'\]"):
            load_state_dict(Qwen35ForCausalLM.empty(cfg), sd)


def test_moe_expert_out_of_range_is_unexpected(moe_disk):
    extra = "model.layers.0.mlp.experts.6.gate_proj.weight"  # experts 0..5
    sd = {**moe_disk, extra: torch.randn(40, 64, generator=torch.Generator().manual_seed(3))}
    with pytest.raises(ValueError, match=rf"1 unexpected tensors: \['{extra}'\]"):
        load_state_dict(Qwen35ForCausalLM.empty(small_config(True)), sd)


def test_moe_checkpoint_into_a_dense_model(moe_disk):
    with pytest.raises(ValueError, match=r"missing tensors: .*model\.layers\.0\.mlp\.gate_proj\.weight.*"
                                         r"unexpected tensors: .*model\.layers\.0\.mlp\.experts\.0\."):
        load_state_dict(Qwen35ForCausalLM.empty(small_config(False)), moe_disk)


# ---- inputs ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1, VOCAB, VOCAB + 1000])
def test_token_ids_outside_the_vocabulary(model, bad):
    ids = random_ids(2, 7, seed=bad % 97)
    ids[1, 3] = bad
    cache = model.new_cache(2, 8)
    with pytest.raises(ValueError, match=rf"input_ids must lie in \[0, {VOCAB}\), got min .* and max"):
        model(ids, cache)
    assert cache.lengths == [0, 0]  # nothing was written
    model(random_ids(2, 7, seed=5), cache)  # and the cache is still usable


def test_token_ids_must_be_integers(model):
    with pytest.raises(ValueError, match="input_ids must be an integer tensor, got torch.float32"):
        model(random_ids(1, 4).float(), model.new_cache(1, 4))


def test_token_ids_must_be_2d(model):
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seqlen\), got shape \(5,\)"):
        model(random_ids(1, 5)[0], model.new_cache(1, 5))


# ---- caches ------------------------------------------------------------------------------------------------

def test_cache_of_another_batch(model):
    cache = model.new_cache(2, 16)
    with pytest.raises(ValueError, match="input_ids has batch 3 but the cache was made for batch 2"):
        model(random_ids(3, 5), cache)


def test_cache_of_another_config(model):
    other = Qwen35ForCausalLM.random(small_config(False, rope_theta=5e5), seed=1)
    with pytest.raises(ValueError, match="the cache was made for another model config"):
        model(random_ids(1, 5), other.new_cache(1, 16))
    moe = Qwen35ForCausalLM.random(small_config(True), seed=1)
    with pytest.raises(ValueError, match="the cache was made for another model config"):
        moe(random_ids(1, 5), model.new_cache(1, 16))


def test_more_tokens_than_the_cache_holds(model):
    cache = model.new_cache(2, 10, page_size=3)
    with pytest.raises(ValueError, match="11 new tokens do not fit: cache holds 0 of 10"):
        model(random_ids(2, 11), cache)
    model(random_ids(2, 8, seed=1), cache)
    with pytest.raises(ValueError, match="3 new tokens do not fit: cache holds 8 of 10"):
        model(random_ids(2, 3, seed=2), cache)
    model(random_ids(2, 2, seed=3), cache)  # exactly full is fine
    with pytest.raises(ValueError, match="1 new tokens do not fit: cache holds 10 of 10"):
        model(random_ids(2, 1, seed=4), cache)


def test_empty_step(model):
    with pytest.raises(ValueError, match="0 new tokens do not fit"):
        model(torch.empty(1, 0, dtype=torch.int64), model.new_cache(1, 4))


@pytest.mark.parametrize("batch, max_tokens", [(0, 4), (2, 0)])
def test_cache_sizes_must_be_positive(model, batch, max_tokens):
    with pytest.raises(ValueError, match="batch and max_tokens must be positive"):
        model.new_cache(batch, max_tokens)


def test_stream_needs_a_batch_one_cache(model):
    with pytest.raises(ValueError, match="stream needs a batch-1 cache, got batch 2"):
        next(stream(model, model.new_cache(2, 8), [1, 2, 3], 4))


# ---- found in review: what once loaded silently wrong or crashed deep inside ---------------------------------

@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_size=-64), "hidden_size must be a positive int"),
    (dict(hidden_size="64"), "hidden_size must be a positive int"),
    (dict(num_key_value_heads=0), "num_key_value_heads must be a positive int"),
    (dict(linear_num_key_heads=0), "linear_num_key_heads must be a positive int"),
    (dict(vocab_size=True), "vocab_size must be a positive int"),
    (dict(moe=True, num_experts_per_tok="2"), "num_experts_per_tok must be a non-negative int"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps must be a finite non-negative number"),
    (dict(rms_norm_eps="x"), "rms_norm_eps must be a finite non-negative number"),
    (dict(rope_theta=0.0), "rope_theta must be a finite positive number"),
    (dict(partial_rotary_factor=-0.25), "partial_rotary_factor must be a finite positive number at most 1.0"),
    (dict(partial_rotary_factor=1.5), "partial_rotary_factor must be a finite positive number at most 1.0"),
    (dict(intermediate_size=0), "the MLP needs intermediate_size >= 1"),
    (dict(head_dim=60, partial_rotary_factor=0.25), "even rotary width"),
    (dict(eos_token_ids=("x",)), "eos_token_ids must be ints"),
])
def test_config_numbers_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(model_type="llama"), "model_type 'llama' is not a Qwen3.5 one"),
    (lambda c: c.update(quantization_config={"quant_method": "fp8"}), "quantized checkpoints are not supported"),
    (lambda c: c.update(layer_types=None, full_attention_interval=0), "full_attention_interval must be a positive"),
    (lambda c: c.update(eos_token_id="x"), "eos_token_id must be an int or a list of ints"),
    (lambda c: c.update(layer_types="linear_attention"), "layer_types must be a list"),
])
def test_config_json_values_are_checked(saved, tmp_path, edit, message):
    path = copy_of(saved, tmp_path)
    edit_config(path, edit)
    with pytest.raises(ValueError, match=message):
        load(path)


def test_config_json_that_is_not_an_object(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    for text, message in (("[]", "must be a JSON object"), ("{", "is not valid JSON")):
        (path / "config.json").write_text(text)
        with pytest.raises(ValueError, match=message):
            load(path)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float8_e4m3fn])
def test_a_tensor_that_is_not_float_is_refused(saved, tmp_path, dtype):
    path = copy_of(saved, tmp_path)
    edit_weights(path, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(dtype)}))
    with pytest.raises(ValueError, match="checkpoint tensor model.norm.weight has dtype"):
        load(path)


def test_a_tensor_held_twice_is_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    save_file({"model.norm.weight": torch.zeros(small_config(False).hidden_size)}, str(path / "zz-old.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="both fill model.norm.weight"):
        load(path)


@pytest.mark.parametrize("content", [b"", b"garbage" * 10, b"version https://git-lfs.github.com/spec/v1\n"])
def test_a_file_that_is_not_safetensors_is_named(saved, tmp_path, content):
    path = copy_of(saved, tmp_path)
    (path / "model.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        load(path)


@pytest.mark.parametrize("index", ['{"metadata": {}}', "[]", '{"weight_map": {"model.norm.weight": null}}', "{"])
def test_a_malformed_index_is_named(saved, tmp_path, index):
    path = copy_of(saved, tmp_path)
    (path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match="model.safetensors.index.json is not a safetensors index"):
        load(path)


def test_load_dtype_must_be_a_float_dtype(saved):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_checkpoint(saved, dtype="bfloat16", progress=False)


def test_tensor_parallel_checks_the_whole_shape(saved, tmp_path):
    # at TP=2 each rank reads its slice; a tensor with an extra row used to lose it silently
    from model.parallel import ParallelContext
    path = copy_of(saved, tmp_path)
    name = "model.layers.3.self_attn.k_proj.weight"
    edit_weights(path, lambda t: t.update({name: torch.cat([t[name], t[name][:1]])}))
    with pytest.raises(ValueError, match=f"checkpoint tensor {name} has shape"):
        load_checkpoint(path, dtype=torch.float32, progress=False, tp=ParallelContext(0, 2))
