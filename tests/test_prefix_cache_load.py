"""The hybrid prefix cache under more sessions than a toy run: the server's defaults keep a prompt's snapshot across
40 unrelated requests, a system prompt's end is a snapshot point for the next session, and eviction by worth keeps
what many sessions share through a flood of one-off requests."""
import random

import pytest
import torch

from model.load import load_model
from model.tokenizer import tokenizer_for_model
from serving.engine import LLMEngine
from serving.openai_protocol import ServedModel, parse_chat
from serving.sequence import SamplingParams
from serving.server import ServerArgs, engine_config


@pytest.fixture(scope="module")
def served():
    tokenizer = tokenizer_for_model("tiny")
    model = load_model("tiny", "cpu")
    engine = LLMEngine(model, engine_config(ServerArgs(), torch.device("cpu"), tokenizer.eos_token_ids))
    return engine, tokenizer, ServedModel("tiny", 65536, model.config.vocab_size)


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma"]) for _ in range(n))


def chat(engine: LLMEngine, tokenizer, served_model, system: str, user: str, max_tokens: int = 4):
    """One chat request as the server parses it; returns (prompt tokens, cached tokens)."""
    body = {"model": "tiny", "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    req = parse_chat(body, tokenizer, served_model)
    seq_id = engine.add_request(req.prompt_ids, req.params, req.cache_point)
    while engine.has_unfinished:
        engine.step()
    return len(req.prompt_ids), engine.pop_output(seq_id).cached_tokens


def test_a_prompt_keeps_its_snapshot_across_40_unrelated_requests_and_its_sibling_hits_the_system_prompt(served):
    engine, tokenizer, served_model = served
    system, user = words(600, seed=1), words(90, seed=2)
    n, cached = chat(engine, tokenizer, served_model, system, user)
    assert n > 650 and cached == 0
    for i in range(40):
        chat(engine, tokenizer, served_model, words(600, seed=100 + i), words(90, seed=200 + i))
    again, cached = chat(engine, tokenizer, served_model, system, user)
    assert cached >= 0.95 * again, f"{cached} of {again} from the cache"
    n, cached = chat(engine, tokenizer, served_model, system, words(90, seed=3))  # a sibling: same system prompt
    head = parse_chat({"model": "tiny", "messages": [{"role": "system", "content": system},
                                                     {"role": "user", "content": "x"}]}, tokenizer, served_model)
    assert head.cache_point > 600 and cached == head.cache_point // 16 * 16


def test_a_shared_system_prompt_outlives_a_flood_of_one_off_requests():
    """Six snapshot slots; a system prompt that three sessions restored, then nine one-off requests (two snapshots
    each). By age alone the system prompt's snapshot would go after six; by worth (tokens x sessions) it stays."""
    model = load_model("tiny", "cpu")
    engine = LLMEngine(model, engine_config(ServerArgs(snapshot_slots=6, kv_tokens=16384), torch.device("cpu"), ()))
    rng = random.Random(0)
    vocab = model.config.vocab_size

    def run(prompt: list[int], cache_point: int = 0) -> int:
        seq_id = engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True), cache_point)
        while engine.has_unfinished:
            engine.step()
        return engine.pop_output(seq_id).cached_tokens

    system = [rng.randrange(vocab) for _ in range(256)]
    hits = [run(system + [rng.randrange(vocab) for _ in range(40)], cache_point=256) for _ in range(4)]
    assert hits == [0, 256, 256, 256]
    for _ in range(9):
        run([rng.randrange(vocab) for _ in range(300)])
    evictions = engine.state_cache.num_evictions
    assert evictions >= 6  # the flood did turn the pool over
    assert run(system + [rng.randrange(vocab) for _ in range(40)], cache_point=256) == 256
