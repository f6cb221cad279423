"""Scheduler: decodes first, then the fast lane of returning sessions, then cold prefills in page-aligned chunks."""
import pytest
import torch

from model.model import Qwen35ForCausalLM
from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.sequence import SamplingParams, Sequence
from tests.hf_oracle import small_config

PAGE = 4


@pytest.fixture(scope="module")
def model():
    return Qwen35ForCausalLM.random(small_config(vocab_size=512), seed=1)


def engine_with_budget(model, budget: int) -> LLMEngine:
    return LLMEngine(model, EngineConfig(num_pages=64, page_size=PAGE, max_num_seqs=4, snapshot_slots=4,
                                         max_num_batched_tokens=budget, fast_lane_tokens=8))


def prompt(n: int, first: int = 1) -> list[int]:
    return [(first + 7 * i) % 512 for i in range(n)]


def test_decodes_then_fast_lane_then_cold_prefill(model):
    engine = engine_with_budget(model, budget=16)
    earlier = engine.generate([prompt(12)], SamplingParams(max_tokens=4))[0]
    decoding = engine.add_request(prompt(5, first=3), SamplingParams(max_tokens=10))
    engine.step()  # its whole prefill (the snapshot at the last page boundary, 4, inside the step): it decodes
    cold = engine.add_request(prompt(40, first=5))
    returning = engine.add_request(earlier.prompt_ids + earlier.output_ids + [1, 2])  # 18 tokens, hit at 12
    chunks = engine.scheduler.schedule()
    # the returning session computes its 6 new tokens in one chunk (snapshot at its prompt's last page boundary,
    # 16, inside it) and overtakes the cold prefill, which gets the rest of the budget (9) rounded down to a page
    assert [(c.seq.id, c.start, c.num_tokens) for c in chunks] == [
        (decoding, 5, 1), (returning, 12, 6), (cold, 0, 8)]
    seq = engine.sequences[returning]
    assert seq.pending_snapshot_tokens == 16 and seq.pending_snapshot_slot is not None


def test_a_tiny_budget_goes_to_decodes(model):
    engine = engine_with_budget(model, budget=2)
    ids = [engine.add_request(prompt(3, first=i)) for i in range(2)]
    for _ in range(3):
        engine.step()  # three budget-2 steps prefill both 3-token prompts: both decode from now on
    assert all(engine.sequences[i].num_uncomputed_tokens == 1 for i in ids)
    engine.add_request(prompt(20, first=9))
    chunks = engine.scheduler.schedule()
    assert [(c.seq.id, c.num_tokens) for c in chunks] == [(ids[0], 1), (ids[1], 1)]


@pytest.mark.parametrize("start, budget, cached_pages_end, cache_point, size, point", [
    (0, 100, 0, 0, 21, 20),   # reaches the sequence's end, passing the prompt's last page boundary (20): snapshot
    (0, 20, 0, 0, 20, None),  # ends on that boundary: the commit snapshots there
    (0, 10, 0, 0, 8, None),   # budget-limited: ends on a page boundary
    (0, 3, 0, 0, 3, None),    # less than a page of budget: a partial chunk rather than none
    (3, 6, 0, 0, 5, None),    # realigns a partial start
    (0, 100, 12, 0, 20, 12),  # two points: the branch point (12) in the step, the chunk stops at the second (20)
    (0, 100, 0, 11, 20, 8),   # a shared prefix ending at 11: a point at its page boundary (8), then 20
    (0, 100, 12, 14, 20, 12),  # the same page boundary (12) as the branch point: one point
    (12, 100, 0, 11, 9, 20),  # a chunk past the shared prefix: only the prompt's boundary
])
def test_plan_chunk(model, start, budget, cached_pages_end, cache_point, size, point):
    engine = engine_with_budget(model, budget=64)
    seq = Sequence(0, prompt(21), SamplingParams(), torch.Generator())
    seq.cached_pages_end, seq.cache_point = cached_pages_end, cache_point
    assert engine.scheduler.plan_chunk(seq, start, budget) == (size, point)


def test_snapshot_inside_a_chunk_falls_back_without_a_free_slot(model):
    """With every snapshot slot private (rolling snapshots of running decodes), a chunk stops at its snapshot point
    instead, and commit snapshots there; a scheduled snapshot that never commits (preemption) gives its slot back."""
    engine = LLMEngine(model, EngineConfig(num_pages=64, page_size=PAGE, max_num_seqs=4, snapshot_slots=1,
                                           max_num_batched_tokens=64))
    seq = engine.sequences[engine.add_request(prompt(10))]
    chunks = engine.scheduler.schedule()
    assert [(c.start, c.num_tokens) for c in chunks] == [(0, 10)] and seq.pending_snapshot_tokens == 8
    engine.scheduler.preempt(seq)  # the step never ran
    assert seq.pending_snapshot_slot is None and len(engine.state_cache.free_slots) == 1
    engine.state_cache.reserve()  # now no slot can be had
    chunks = engine.scheduler.schedule()
    assert [(c.start, c.num_tokens) for c in chunks] == [(0, 8)] and seq.pending_snapshot_slot is None


# ---- found by the engine fuzzer (tests/engine_fuzzer.py) ----------------------------------------------------------

@pytest.fixture(scope="module")
def varied_model():
    """tiny with a 1024-token vocabulary and random weights everywhere: varied greedy outputs (the preset's own init
    repeats one token), so a wrong KV page shows in the tokens."""
    from model.config import get_preset
    from tests.hf_oracle import randomize_
    m = Qwen35ForCausalLM.random(get_preset("tiny", vocab_size=1024), seed=0)
    randomize_(m, 0)
    return m.eval()


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_prefix_hit_is_looked_up_when_admitted(varied_model):
    # X's last chunk, scheduled before W's admission in the same step, evicts A's last cached page and takes it;
    # W's hit, looked up at the start of the step, still named that page: W shared X's page and decoded [232, 9]
    from model.generate import greedy
    eng = LLMEngine(varied_model, EngineConfig(num_pages=9, page_size=4, max_num_seqs=2, snapshot_slots=8,
                                               max_num_batched_tokens=8, fast_lane_tokens=0, interleave_slices=0,
                                               decode_ahead=False))
    a, b, x = random_prompt(12, 1), random_prompt(5, 2), random_prompt(22, 3)
    eng.generate([a], SamplingParams(max_tokens=1))
    eng.generate([b], SamplingParams(max_tokens=1))
    w = a + random_prompt(3, 60)  # hits A's 3 pages and their snapshot; cold (fast lane off)
    ix, iw = (eng.add_request(p, SamplingParams(max_tokens=2)) for p in (x, w))
    while eng.has_unfinished:
        eng.step()
        bm = eng.block_manager
        assert not any(r > 1 and bm.hash_of_page[p] is None for p, r in enumerate(bm.refcount)), \
            "an uncached page is shared"
    for i, p in ((ix, x), (iw, w)):
        assert eng.pop_output(i).output_ids == greedy(varied_model, torch.tensor([p]), 2)[0].tolist()


def test_running_prefills_that_outgrow_the_pool_finish(varied_model):
    # two running prefills need more pages than the pool holds; newcomers from the fast lane were admitted and
    # preempted in turn, every step, and the running prefills never got a page (a livelock: no token for ever)
    eng = LLMEngine(varied_model, EngineConfig(num_pages=40, page_size=1, max_num_seqs=4, snapshot_slots=7,
                                               max_num_batched_tokens=7, fast_lane_tokens=512))
    p1 = random_prompt(38, 712)
    p7 = p1[:4] + random_prompt(24, 305)
    requests = [(random_prompt(1, 1024), 1), (p1, 1), (random_prompt(1, 3843), 11), (p1[:1], 1), (p1, 1),
                (random_prompt(1, 0), 1), (random_prompt(1, 3843), 1), (p7, 1), (p7[:8], 19), (p7, 2)]
    ids = [eng.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in requests]
    for _ in range(500):
        if not eng.has_unfinished:
            break
        eng.step()
    assert not eng.has_unfinished, f"stuck: {eng.scheduler.num_preemptions} preemptions"
    assert [len(eng.pop_output(i).output_ids) for i in ids] == [m for _, m in requests]


def test_the_fast_lane_leaves_running_prefills_their_pages():
    # a one-token budget, 6 pages of 8: after a preemption freed two pages, a fast-lane newcomer took them (its hit
    # page back from the cache, and a new one) before the two starved running prefills, was preempted in its turn,
    # and so on: no token for 400+ steps. The requests as that fuzzer run sent them (tests/data).
    import json
    from pathlib import Path

    from model.config import get_preset
    from tests.hf_oracle import randomize_
    case = json.loads((Path(__file__).parent / "data" / "scheduler_livelock_fast_lane.json").read_text())
    m = Qwen35ForCausalLM.random(get_preset("tiny", vocab_size=1024, layer_types=(
        "linear_attention", "full_attention", "linear_attention", "full_attention")), seed=0)
    randomize_(m, 0)
    config = EngineConfig(**{**case["config"], "eos_token_ids": tuple(case["config"]["eos_token_ids"])})
    eng = LLMEngine(m.eval(), config, pad_decode=case["pad_decode"])
    ids = []
    for r in case["requests"]:
        for _ in range(r["steps_before"]):
            if eng.has_unfinished:
                eng.step()
        ids.append(eng.add_request(r["prompt"], SamplingParams(max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"],
                                                               stop_token_ids=tuple(r["stop_token_ids"]))))
    for _ in range(1000):
        if not eng.has_unfinished:
            break
        eng.step()
    assert not eng.has_unfinished, f"stuck: {eng.scheduler.num_preemptions} preemptions"
    assert all(eng.pop_output(i).finish_reason in ("stop", "length") for i in ids)
