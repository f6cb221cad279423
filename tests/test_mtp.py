"""The MTP head (`mtp.*`): our paged head against reference.mtp_hidden (dense, whole sequence), its KV read back by
later draft rows, and loading it from checkpoints in both expert layouts."""
import json
import logging

import pytest
import torch
from conftest import rel_err
from hf_oracle import hf_state_dict, small_config
from safetensors.torch import save_file

import reference as R
from model.loader import load_checkpoint
from model.model import Qwen35ForCausalLM

TOL = 1e-5


def mtp_weights(model) -> dict[str, torch.Tensor]:
    return {k[len("mtp."):]: v for k, v in hf_state_dict(model).items() if k.startswith("mtp.")}


def reference_rows(model, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """reference.mtp_hidden of rows 0..n-1 (tokens 1..n, hidden 0..n-1), through the lm_head: (n, vocab)."""
    cfg = model.config
    h = R.mtp_hidden(model.embed(tokens[1:]), hidden, mtp_weights(model), num_heads=cfg.num_attention_heads,
                     num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rotary_dim=cfg.rotary_dim,
                     rope_theta=cfg.rope_theta, eps=cfg.rms_norm_eps, top_k=cfg.num_experts_per_tok)
    return h @ model.lm_head.weight.T


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("length", [1, 7, 23])
def test_mtp_head_matches_reference(preset, length):
    model = Qwen35ForCausalLM.from_preset(preset, seed=3)
    gen = torch.Generator().manual_seed(length)
    tokens = torch.randint(0, model.config.vocab_size, (length + 2,), generator=gen)
    trunk = model.new_cache(1, 64, page_size=4, shuffle_pages=True, mtp=True)
    step = trunk.plan(tokens[None, :length + 1])
    _, hidden = model.forward_step(step, trunk.pools, all_logits=True, with_hidden=True)  # (length + 1, H)
    # the head's rows 0..length-1 in one step, then row `length` alone (its attention reads the first rows' KV)
    head = model.new_cache(1, 64, page_size=4, shuffle_pages=True, seed=1, mtp=True)
    first = head.plan(tokens[None, 1:length + 1])
    logits, out = model.forward_mtp(first, hidden[:length], head.pools, all_logits=True)
    head.advance(first)
    last_logits, _ = model.forward_mtp(head.plan(tokens[None, length + 1:]), hidden[length:], head.pools)
    ref = reference_rows(model, tokens, hidden)  # rows 0..length
    assert out.shape == (length, model.config.hidden_size)
    err = rel_err(torch.cat([logits, last_logits]), ref)
    assert err < TOL, f"{preset} length {length}: rel err {err:.2e} against reference.mtp_hidden"


def test_mtp_rows_depend_on_their_next_token():
    """Row t reads token t+1: changing the last token changes only the last row."""
    model = Qwen35ForCausalLM.from_preset("tiny", seed=1)
    tokens = torch.randint(0, 1000, (9,), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(8, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    other = tokens.clone()
    other[-1] += 1
    rows = [model.forward_mtp((c := model.new_cache(1, 16, mtp=True)).plan(t[None, 1:]), hidden, c.pools,
                              all_logits=True)[0] for t in (tokens, other)]
    assert torch.equal(rows[0][:-1], rows[1][:-1]) and not torch.equal(rows[0][-1], rows[1][-1])


@pytest.mark.parametrize("vocab", [1, 77, 999])
def test_a_reduced_draft_vocab_gives_the_first_ids_logits(vocab):
    """forward_mtp(vocab=n): the logits of token ids 0..n-1, as the full head gives them."""
    model = Qwen35ForCausalLM.from_preset("tiny", seed=2)
    tokens = torch.randint(0, 1000, (1, 6), generator=torch.Generator().manual_seed(vocab))
    hidden = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    full, part = [model.forward_mtp((c := model.new_cache(1, 16, mtp=True)).plan(tokens), hidden, c.pools,
                                    all_logits=True, vocab=v)[0] for v in (None, vocab)]
    assert part.shape == (6, vocab) and torch.allclose(part, full[:, :vocab], rtol=1e-5, atol=1e-5)


def test_forward_mtp_needs_its_head_and_its_kv_layer():
    model = Qwen35ForCausalLM.from_preset("tiny")
    cache = model.new_cache(1, 16)  # no MTP layer in the pools
    step = cache.plan(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="no layer for the MTP head"):
        model.forward_mtp(step, torch.randn(3, model.config.hidden_size), cache.pools)
    model.drop_mtp()
    with pytest.raises(ValueError, match="no MTP head"):
        model.forward_mtp(step, torch.randn(3, model.config.hidden_size), cache.pools)


def test_presets_draw_the_same_trunk_with_and_without_the_head():
    from model.config import get_preset
    with_head = Qwen35ForCausalLM.random(get_preset("tiny"), seed=2)
    without = Qwen35ForCausalLM.random(get_preset("tiny", mtp_num_hidden_layers=0), seed=2)
    trunk = dict(without.named_parameters())
    assert with_head.has_mtp and not without.has_mtp
    assert all(torch.equal(p, trunk[n]) for n, p in with_head.named_parameters() if not n.startswith("mtp."))


# ---- loading ------------------------------------------------------------------------------------------------

def write_checkpoint(path, model, *, per_expert: bool, drop=lambda name: False, vlm: bool = False) -> None:
    tensors = {k: v for k, v in hf_state_dict(model, per_expert=per_expert).items() if not drop(k)}
    if vlm:
        tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
                   for k, v in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(model.config.to_hf()))


@pytest.mark.parametrize("moe, per_expert", [(False, False), (True, False), (True, True)],
                         ids=["dense", "moe-packed", "moe-per-expert"])
def test_load_checkpoint_with_mtp(tmp_path, moe, per_expert):
    source = Qwen35ForCausalLM.random(small_config(moe, mtp_num_hidden_layers=1), seed=4)
    write_checkpoint(tmp_path, source, per_expert=per_expert, vlm=moe)
    ours = load_checkpoint(tmp_path, dtype=torch.float32, progress=False)
    assert ours.has_mtp
    mine = dict(ours.named_parameters())
    for name, p in source.named_parameters():
        assert torch.equal(mine[name], p), name


def test_checkpoint_without_mtp_serves_without_the_head(tmp_path, caplog):
    source = Qwen35ForCausalLM.random(small_config(mtp_num_hidden_layers=1), seed=4)
    write_checkpoint(tmp_path, source, per_expert=False, drop=lambda k: k.startswith("mtp."))
    with caplog.at_level(logging.INFO, logger="model.loader"):
        ours = load_checkpoint(tmp_path, dtype=torch.float32, progress=False)
    assert not ours.has_mtp and ours.mtp is None
    assert any("no mtp.* tensors" in r.getMessage() for r in caplog.records)


def test_checkpoint_with_part_of_the_head_is_refused(tmp_path):
    source = Qwen35ForCausalLM.random(small_config(mtp_num_hidden_layers=1), seed=4)
    write_checkpoint(tmp_path, source, per_expert=False, drop=lambda k: k == "mtp.fc.weight")
    with pytest.raises(ValueError, match=r"missing tensors: \['mtp.fc.weight'\]"):
        load_checkpoint(tmp_path, dtype=torch.float32, progress=False)
