"""Our Qwen35ForCausalLM against transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM on the same random
fp32 weights (CPU): prefill logits, prefill + cached decode, chunked prefill, greedy generation against
`generate`, and paged caches of several page sizes with shuffled pages."""
import pytest
import torch
from conftest import rel_err
from hf_oracle import hf_text_model, small_config

from model.generate import greedy
from model.loader import load_state_dict
from model.model import Qwen35ForCausalLM

TOL = 1e-4
VOCAB = 512  # small_config's vocabulary

CONFIGS = {
    "dense": dict(moe=False),
    "moe": dict(moe=True),
    # GQA ratio 4 (one KV head), head_dim 64 with half of it rotated, a rope theta of its own, a full-attention
    # layer first, and GDN with 1 key head for 4 value heads.
    "gqa4-full-first": dict(moe=False, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                            partial_rotary_factor=0.5, rope_theta=12345.0, linear_num_key_heads=1,
                            linear_num_value_heads=4,
                            layer_types=("full_attention", "linear_attention", "full_attention", "linear_attention")),
    # MoE with plain multi-head attention (ratio 1), top-3 routing, GDN key dim != value dim, 3 layers.
    "moe-mha-3layers": dict(moe=True, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                            num_experts_per_tok=3, linear_key_head_dim=32, linear_value_head_dim=16,
                            rope_theta=5e5, layer_types=("linear_attention", "full_attention", "linear_attention")),
}


def random_ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    """(cfg, transformers model, our model) on the same weights."""
    cfg = small_config(**CONFIGS[request.param])
    hf = hf_text_model(cfg, seed=list(CONFIGS).index(request.param) + 11)
    ours = load_state_dict(Qwen35ForCausalLM.empty(cfg), hf.state_dict()).eval()
    assert hf.config.rope_parameters["rope_theta"] == cfg.rope_theta
    assert list(hf.config.layer_types) == list(cfg.layer_types)
    return cfg, hf, ours


@torch.no_grad()
def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(input_ids=ids).logits.float()


def our_full(ours, ids: torch.Tensor, **cache_kw) -> torch.Tensor:
    return ours(ids, ours.new_cache(ids.shape[0], ids.shape[1], **cache_kw))


@pytest.mark.parametrize("length", [1, 2, 37, 65])
def test_prefill_logits_match_transformers(pair, length):
    cfg, hf, ours = pair
    ids = random_ids(2, length, seed=length)
    out, ref = our_full(ours, ids), hf_logits(hf, ids)
    assert out.shape == ref.shape == (2, length, cfg.vocab_size)
    err = rel_err(out, ref)
    assert err < TOL, f"prefill T={length}: rel err {err:.2e}"
    # each row of the batch alone gives the same logits (no leakage between sequences)
    for b in range(2):
        err_b = rel_err(our_full(ours, ids[b:b + 1])[0], out[b])
        assert err_b < 1e-5, f"row {b} alone vs in the batch: rel err {err_b:.2e}"


def test_decode_after_prefill_matches_full_forward(pair):
    cfg, hf, ours = pair
    prompt, steps = 37, 16
    ids = random_ids(2, prompt + steps, seed=101)
    cache = ours.new_cache(2, prompt + steps)
    pieces = [ours(ids[:, :prompt], cache)]
    for t in range(prompt, prompt + steps):
        pieces.append(ours(ids[:, t:t + 1], cache))
    assert cache.lengths == [prompt + steps] * 2
    stepped = torch.cat(pieces, dim=1)
    full, ref = our_full(ours, ids), hf_logits(hf, ids)
    err_self, err_hf = rel_err(stepped, full), rel_err(stepped, ref)
    assert err_self < TOL, f"prefill+decode vs our full forward: rel err {err_self:.2e}"
    assert err_hf < TOL, f"prefill+decode vs transformers' full forward: rel err {err_hf:.2e}"
    # the decode positions on their own, so that the prompt's logits cannot hide a decode error
    err_dec = rel_err(stepped[:, prompt:], ref[:, prompt:])
    assert err_dec < TOL, f"decode steps vs transformers: rel err {err_dec:.2e}"


def test_chunked_prefill_matches_full_forward(pair):
    cfg, hf, ours = pair
    chunks = (1, 6, 30, 2, 14)
    ids = random_ids(2, sum(chunks), seed=202)
    cache = ours.new_cache(2, sum(chunks), page_size=4, shuffle_pages=True, seed=3)
    pieces, start = [], 0
    for n in chunks:
        pieces.append(ours(ids[:, start:start + n], cache))
        start += n
    err = rel_err(torch.cat(pieces, dim=1), hf_logits(hf, ids))
    assert err < TOL, f"chunks {chunks} vs transformers' full forward: rel err {err:.2e}"


def test_greedy_matches_transformers_generate(pair):
    cfg, hf, ours = pair
    prompt, new = 9, 32
    ids = random_ids(2, prompt, seed=303)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                          eos_token_id=None, pad_token_id=0)
    assert out.shape == (2, prompt + new), f"transformers stopped early: {tuple(out.shape)}"
    expected = out[:, prompt:].tolist()
    # our greedy on a paged cache with shuffled pages (the paged test shows page layout does not matter)
    cache = ours.new_cache(2, prompt + new, page_size=3, shuffle_pages=True, seed=7)
    got = greedy(ours, ids, new, cache=cache).tolist()
    assert got == expected


def _paged_run(ours, ids, prompt, **cache_kw) -> torch.Tensor:
    cache = ours.new_cache(ids.shape[0], ids.shape[1], **cache_kw)
    pieces = [ours(ids[:, :prompt], cache)]
    for t in range(prompt, ids.shape[1]):
        pieces.append(ours(ids[:, t:t + 1], cache))
    return torch.cat(pieces, dim=1)


_baselines: dict = {}


def _paged_baseline(pair, ids, prompt) -> torch.Tensor:
    """page_size 16 with the pages in order, once per model."""
    key = pair[0]  # the config: one model per config in this module
    if key not in _baselines:
        _baselines[key] = _paged_run(pair[2], ids, prompt)
    return _baselines[key]


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_cache_page_sizes_and_shuffled_pages(pair, page_size):
    cfg, hf, ours = pair
    prompt, steps = 37, 8
    ids = random_ids(2, prompt + steps, seed=404)
    base = _paged_baseline(pair, ids, prompt)
    out = _paged_run(ours, ids, prompt, page_size=page_size, shuffle_pages=True, seed=page_size)
    err = rel_err(out, base)
    assert err < 1e-6, f"page_size {page_size}, shuffled pages: rel err {err:.2e} vs page_size 16 in order"
    err_hf = rel_err(out, hf_logits(hf, ids))
    assert err_hf < TOL, f"page_size {page_size} shuffled vs transformers: rel err {err_hf:.2e}"


def test_shuffled_pages_are_really_shuffled(pair):
    """Guard for the test above: a shuffled cache does not hand out pages in order."""
    cfg, hf, ours = pair
    plain = ours.new_cache(2, 45, page_size=3)
    shuffled = ours.new_cache(2, 45, page_size=3, shuffle_pages=True, seed=3)
    assert plain.page_table.flatten().tolist() == list(range(30))
    assert shuffled.page_table.flatten().tolist() != list(range(30))
    assert sorted(shuffled.page_table.flatten().tolist()) == list(range(30))
