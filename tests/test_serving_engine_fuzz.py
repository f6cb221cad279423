"""LLMEngine under random workloads (hypothesis): every greedy request decodes exactly model.generate.greedy's tokens
and nothing is lost or leaked, whatever the pool, budget, fast lane, snapshots, arrivals and aborts.

A scenario draws an engine config (page size 1-16, 1-4 running sequences, 0-8 snapshot slots, token budgets from 1,
fast lane on or off, small pools, so that chunking, eviction and preemption happen) and 10-40 operations: requests
(fresh prompts, prompts sharing a long prefix with an earlier one, exact repeats, truncations, and returning sessions
that send an earlier prompt plus its reply plus new tokens), runs of steps, and aborts of running or waiting
requests. After each step the page refcounts equal their holders and every page and state slot is accounted for;
a shared page is a cached full page; outputs so far are prefixes of greedy. At the end every request has ended and
the pool and slots are all free. CPU, fp32, the reference ops; the `tiny` preset with a 1024-token vocabulary and
random weights everywhere (its own init repeats one token, which would check little). This is the short CI form of
tests/engine_fuzzer.py, whose long runs (thousands of examples, also checking logits and cached page contents) found
a stale prefix hit (wrong tokens) and a livelock; tests/test_serving_scheduler.py keeps both cases, which this short
form does not reach in 150 examples. A second test runs the same workloads with MTP speculation, its drafts forced
to greedy's tokens up to a random length.
"""
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model.config import get_preset
from model.generate import greedy
from model.model import Qwen35ForCausalLM
from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.sequence import SamplingParams, SequenceStatus
from tests.hf_oracle import randomize_

VOCAB = 1024
MAX_NEW = 12
_REFERENCE: dict[tuple, list[int]] = {}


@pytest.fixture(scope="module")
def model():
    m = Qwen35ForCausalLM.random(get_preset("tiny", vocab_size=VOCAB), seed=0)
    randomize_(m, 0)
    return m.eval()


def reference(model, prompt: list[int]) -> list[int]:
    key = tuple(prompt)
    if key not in _REFERENCE:
        _REFERENCE[key] = greedy(model, torch.tensor([prompt]), MAX_NEW)[0].tolist()
    return _REFERENCE[key]


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CONFIGS = st.fixed_dictionaries(dict(
    page_size=st.sampled_from([1, 2, 4, 5, 16]), max_num_seqs=st.integers(1, 4), snapshot_slots=st.integers(0, 8),
    budget=st.one_of(st.integers(1, 12), st.sampled_from([32, 512])), fast_lane=st.sampled_from([0, 8, 512]),
    cap_tokens=st.integers(16, 160), extra_pages=st.integers(0, 4)))
ADD = st.fixed_dictionaries(dict(
    op=st.just("add"), kind=st.sampled_from(["fresh", "share", "share", "repeat", "extend", "extend", "truncate"]),
    src=st.integers(0, 20), length=st.integers(1, 120), suffix=st.integers(0, 16), seed=st.integers(0, 10**6),
    max_tokens=st.integers(1, MAX_NEW)))
OPS = st.lists(st.one_of(ADD, ADD, ADD, st.fixed_dictionaries(dict(op=st.just("step"), n=st.integers(1, 5))),
                         st.fixed_dictionaries(dict(op=st.just("abort"), which=st.integers(0, 10)))),
               min_size=10, max_size=40)


def prompt_for(op: dict, earlier: list[dict], cap: int) -> list[int]:
    base = earlier[op["src"] % len(earlier)] if earlier else None
    kind = op["kind"] if base else "fresh"
    if kind == "fresh":
        prompt = random_tokens(op["length"], op["seed"])
    elif kind == "share":  # a common prefix, then tokens of its own
        prompt = base["prompt"][:op["length"]] + random_tokens(op["suffix"], op["seed"])
    elif kind == "repeat":
        prompt = list(base["prompt"])
    elif kind == "extend":  # a returning session: the old prompt, its reply as far as it got, new tokens
        prompt = base["prompt"] + base["seq"].output_ids + random_tokens(op["suffix"], op["seed"])
    else:
        prompt = base["prompt"][:op["length"]]
    return prompt[:cap] or [1]


def check_pages_and_slots(engine: LLMEngine) -> None:
    bm, scheduler, cfg = engine.block_manager, engine.scheduler, engine.cfg
    holders = Counter(p for seq in scheduler.running for p in seq.pages)
    assert all(seq.status is SequenceStatus.WAITING and not seq.pages for seq in scheduler.waiting)
    assert [bm.refcount[p] for p in range(cfg.num_pages)] == [holders[p] for p in range(cfg.num_pages)]
    free, cached = set(bm.free_pages), set(bm.evictable)
    assert not free & cached and len(free) + len(cached) + sum(r > 0 for r in bm.refcount) == cfg.num_pages
    for seq in scheduler.running:
        full = seq.num_computed_tokens // cfg.page_size
        for i, p in enumerate(seq.pages):
            assert bm.refcount[p] == 1 or (bm.hash_of_page[p] is not None and i < full), \
                f"page {p} of seq {seq.id} is shared but not a cached full page"
    slots = [seq.state_slot for seq in scheduler.running]
    assert sorted(slots + scheduler.free_state_slots) == list(range(cfg.max_num_seqs))


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(config=CONFIGS, ops=OPS)
def test_random_workloads_decode_greedy_and_leak_nothing(model, config, ops):
    run_workload(model, config, ops)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(config=CONFIGS, ops=OPS, drafts=st.integers(1, 4), seed=st.integers(0, 10**6))
def test_random_workloads_with_speculation(model, config, ops, drafts, seed):
    """The same with MTP speculation, K drafts a step: the drafts are forced to greedy's next tokens up to a random
    length (then wrong), so that verify steps keep 1..K+1 tokens and roll back anywhere."""
    rng = random.Random(seed)

    def forced(seq, draft_ids):
        truth = reference(model, seq.prompt_ids)[len(seq.output_ids):][:len(draft_ids)]
        truth += [1] * (len(draft_ids) - len(truth))
        n = rng.randint(0, len(draft_ids))
        return truth[:n] + [(t + 1) % VOCAB for t in truth[n:]]

    run_workload(model, config, ops, speculative_tokens=drafts, replace_drafts=forced)


def run_workload(model, config, ops, speculative_tokens: int = 0, replace_drafts=None) -> None:
    page = config["page_size"]
    num_pages = -(-config["cap_tokens"] // page) + config["extra_pages"]
    engine = LLMEngine(model, EngineConfig(num_pages=num_pages, page_size=page, max_num_seqs=config["max_num_seqs"],
                                           snapshot_slots=config["snapshot_slots"],
                                           max_num_batched_tokens=config["budget"],
                                           fast_lane_tokens=config["fast_lane"], eos_token_ids=(),
                                           interleave_slices=0, decode_ahead=False,
                                           speculative_tokens=speculative_tokens))
    if replace_drafts is not None:
        engine.speculator.replace_drafts = replace_drafts
    requests: dict[int, dict] = {}
    cap = num_pages * page

    def step():
        for out in engine.step():
            r = requests[out.seq_id]
            assert r["output"] is None, f"a token for request {out.seq_id} after it ended"
            if out.finished:
                r["output"] = engine.pop_output(out.seq_id)
        check_pages_and_slots(engine)
        for r in requests.values():
            got = r["seq"].output_ids if r["output"] is None else r["output"].output_ids
            assert got == reference(model, r["prompt"])[:len(got)], "an output left greedy's tokens"

    for op in ops:
        if op["op"] == "add":
            max_tokens = min(op["max_tokens"], cap - 1)
            prompt = prompt_for(op, list(requests.values()), cap - max_tokens)
            rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            requests[rid] = dict(prompt=prompt, max_tokens=max_tokens, seq=engine.sequences[rid], output=None)
        elif op["op"] == "step":
            for _ in range(op["n"]):
                if engine.has_unfinished:
                    step()
        else:  # abort a live request, as serving.async_engine does
            live = sorted(rid for rid, r in requests.items() if r["output"] is None)
            if live:
                rid = live[op["which"] % len(live)]
                seq = engine.sequences[rid]
                if seq.status is SequenceStatus.RUNNING:
                    engine.scheduler.finish(seq, "abort")
                else:
                    engine.scheduler.waiting.remove(seq)
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                requests[rid]["output"] = engine.pop_output(rid)
                check_pages_and_slots(engine)
    for _ in range(5000):
        if not engine.has_unfinished:
            break
        step()
    assert not engine.has_unfinished and not engine.sequences, "requests never ended"
    for r in requests.values():
        out = r["output"]
        if out.finish_reason != "abort":
            assert out.output_ids == reference(model, r["prompt"])[:r["max_tokens"]]
        assert out.cached_tokens % page == 0 and out.cached_tokens <= len(r["prompt"]) - 1
    bm = engine.block_manager
    assert not any(bm.refcount) and len(bm.free_pages) + len(bm.evictable) == num_pages
    assert len(engine.scheduler.free_state_slots) == engine.cfg.max_num_seqs
