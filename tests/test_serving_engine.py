"""LLMEngine on the reference ops (CPU, fp32): greedy output equals model.generate.greedy token for token,
through batching, the hybrid prefix cache, chunked prefill and preemption; and nothing leaks. `padded` runs
decode batches as the CUDA graphs would (padded to the ladder with dummy rows, decode rows of mixed steps split
off), without capturing."""
import pytest
import torch

from model.generate import greedy
from model.model import Qwen35ForCausalLM
from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.sequence import SamplingParams
from tests.hf_oracle import small_config

VOCAB = 512


@pytest.fixture(scope="module")
def model():
    return Qwen35ForCausalLM.random(small_config(vocab_size=VOCAB), seed=0)


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def expected(model, prompt: list[int], max_tokens: int) -> list[int]:
    return greedy(model, torch.tensor([prompt]), max_tokens)[0].tolist()


def small_engine(model, padded: bool = False, **fields) -> LLMEngine:
    cfg = dict(num_pages=64, page_size=8, max_num_seqs=4, snapshot_slots=8, max_num_batched_tokens=128)
    return LLMEngine(model, EngineConfig(**{**cfg, **fields}), pad_decode=padded)


padded = pytest.mark.parametrize("padded", [False, True], ids=["exact-batch", "padded"])


def assert_nothing_leaks(engine: LLMEngine) -> None:
    """Every page is free or cached with refcount 0; every running slot is free; no private snapshot is left."""
    bm, cfg = engine.block_manager, engine.cfg
    assert not engine.scheduler.has_work
    assert all(r == 0 for r in bm.refcount)
    assert len(bm.free_pages) + len(bm.evictable) == cfg.num_pages
    assert len(engine.scheduler.free_state_slots) == cfg.max_num_seqs
    assert len(engine.state_cache.free_slots) + len(engine.state_cache) == cfg.snapshot_slots


def test_one_request_equals_greedy(model):
    engine = small_engine(model, padded=padded)
    prompt = random_prompt(21, seed=1)
    out = engine.generate([prompt], SamplingParams(max_tokens=10))[0]
    assert out.output_ids == expected(model, prompt, 10)
    assert (out.prompt_tokens, out.cached_tokens, out.finish_reason) == (21, 0, "length")
    assert_nothing_leaks(engine)


@padded
def test_batched_requests_of_different_lengths_equal_greedy(model, padded):
    engine = small_engine(model, max_num_seqs=3, padded=padded)  # five requests: two wait for a slot
    prompts = [random_prompt(n, seed=n) for n in (1, 7, 8, 30, 17)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=9))
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == expected(model, prompt, 9)
    assert_nothing_leaks(engine)


@padded
def test_returning_session_hits_the_prefix_cache(model, padded):
    engine = small_engine(model)
    first = random_prompt(27, seed=2)
    reply = engine.generate([first], SamplingParams(max_tokens=14))[0].output_ids
    second = first + reply + random_prompt(5, seed=3)  # the client sends the history back unchanged
    out = engine.generate([second], SamplingParams(max_tokens=8))[0]
    # the rolling decode snapshot at 40 computed tokens (27 + 13) was published at finish
    assert out.cached_tokens == 40
    assert out.output_ids == expected(model, second, 8)
    assert_nothing_leaks(engine)


def test_resent_prompt_hits_the_prefill_snapshot(model):
    engine = small_engine(model)
    prompt = random_prompt(29, seed=4)
    engine.generate([prompt], SamplingParams(max_tokens=3))
    out = engine.generate([prompt + [7, 8]], SamplingParams(max_tokens=6))[0]
    assert out.cached_tokens == 24  # the prompt's last page boundary
    assert out.output_ids == expected(model, prompt + [7, 8], 6)


def test_shared_system_prompt_across_sessions(model):
    engine = small_engine(model)
    system = random_prompt(35, seed=5)
    sessions = [system + random_prompt(6 + i, seed=10 + i) for i in range(3)]
    outs = [engine.generate([p], SamplingParams(max_tokens=5))[0] for p in sessions]
    # the second session finds the first's pages but no snapshot inside the system prompt: it snapshots at the
    # branch point (32, the end of the shared full pages), which the third then hits
    assert [o.cached_tokens for o in outs] == [0, 0, 32]
    for prompt, out in zip(sessions, outs):
        assert out.output_ids == expected(model, prompt, 5)
    assert_nothing_leaks(engine)


def test_a_cache_point_lets_the_second_session_hit_the_system_prompt(model):
    engine = small_engine(model)
    system = random_prompt(35, seed=5)
    sessions = [system + random_prompt(6 + i, seed=10 + i) for i in range(2)]
    first = engine.sequences[engine.add_request(sessions[0], SamplingParams(max_tokens=5), cache_point=35)]
    while engine.has_unfinished:
        engine.step()
    second = engine.sequences[engine.add_request(sessions[1], SamplingParams(max_tokens=5), cache_point=35)]
    while engine.has_unfinished:
        engine.step()
    # the first session snapshotted at the system prompt's last page boundary (32): the second starts there
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    assert second.output_ids == expected(model, sessions[1], 5)
    assert_nothing_leaks(engine)


def test_a_chunk_past_a_ladder_rung_snapshots_there(model):
    """Chunks of 24 tokens (pages of 8) over a 41-token prompt with a rung every 16 tokens: the first chunk snapshots
    at 16 inside its step and at 24 at its end; a request that shares only the first 20 tokens then starts at 16."""
    engine = small_engine(model, max_num_batched_tokens=24, snapshot_interval=16)
    prompt = random_prompt(41, seed=6)
    engine.generate([prompt], SamplingParams(max_tokens=2))
    other = prompt[:20] + random_prompt(9, seed=7)
    out = engine.generate([other], SamplingParams(max_tokens=4))[0]
    assert out.cached_tokens == 16
    assert out.output_ids == expected(model, other, 4)
    assert_nothing_leaks(engine)


@pytest.mark.parametrize("cache_point", [-1, 36])
def test_a_cache_point_outside_the_prompt_is_refused(model, cache_point):
    engine = small_engine(model)
    with pytest.raises(ValueError, match="cache_point"):
        engine.add_request(random_prompt(35, seed=5), cache_point=cache_point)


@padded
def test_chunked_prefill_with_a_tiny_token_budget(model, padded):
    engine = small_engine(model, page_size=4, num_pages=128, max_num_batched_tokens=6, padded=padded)
    prompts = [random_prompt(n, seed=20 + n) for n in (23, 11, 2)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=7))
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == expected(model, prompt, 7)
    assert_nothing_leaks(engine)


@padded
def test_preemption_under_a_tiny_page_pool(model, padded):
    # three requests need 6 pages each at the end; the pool has 10, so decodes run out and preempt
    engine = small_engine(model, page_size=4, num_pages=10, max_num_seqs=3, snapshot_slots=4, padded=padded)
    prompts = [random_prompt(10, seed=30 + i) for i in range(3)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == expected(model, prompt, 12)
    assert_nothing_leaks(engine)


def test_stops_on_eos_unless_ignore_eos(model):
    prompt = random_prompt(9, seed=6)
    ref = expected(model, prompt, 6)
    engine = small_engine(model, eos_token_ids=(ref[2],))
    assert engine.generate([prompt], SamplingParams(max_tokens=6))[0].output_ids == ref[:3]
    out = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert (out.output_ids, out.finish_reason) == (ref, "length")
    out = engine.generate([prompt], SamplingParams(max_tokens=6, stop_token_ids=(ref[1],)))[0]
    assert (out.output_ids, out.finish_reason) == (ref[:2], "stop")


def test_step_streams_tokens(model):
    engine = small_engine(model)
    prompt = random_prompt(12, seed=7)
    seq_id = engine.add_request(prompt, SamplingParams(max_tokens=4))
    streamed = []
    while engine.has_unfinished:
        streamed += [(o.token, o.finished) for o in engine.step() if o.seq_id == seq_id]
    ref = expected(model, prompt, 4)
    assert streamed == [(t, i == 3) for i, t in enumerate(ref)]


def test_many_random_requests_leave_no_leak(model):
    engine = small_engine(model, page_size=4, num_pages=24, max_num_seqs=3, snapshot_slots=3,
                          max_num_batched_tokens=16)
    gen = torch.Generator().manual_seed(8)
    system = random_prompt(9, seed=9)
    history = []
    for i in range(12):
        base = history[int(torch.randint(len(history), (), generator=gen))] if history and i % 2 else system
        prompt = base + random_prompt(int(torch.randint(1, 12, (), generator=gen)), seed=100 + i)
        engine.add_request(prompt[:60], SamplingParams(max_tokens=int(torch.randint(1, 8, (), generator=gen))))
        if i % 3 == 2:
            while engine.has_unfinished:
                engine.step()
            history += [s.prompt_ids + s.output_ids for s in engine.sequences.values()]
            for seq_id in list(engine.sequences):
                engine.pop_output(seq_id)
    while engine.has_unfinished:
        engine.step()
    assert_nothing_leaks(engine)


def test_rejects_a_request_that_can_never_fit(model):
    engine = small_engine(model, page_size=4, num_pages=4)
    with pytest.raises(ValueError, match="pages"):
        engine.add_request(random_prompt(10, seed=0), SamplingParams(max_tokens=7))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([VOCAB], SamplingParams(max_tokens=1))


def test_seeded_sampling_is_reproducible_and_top_k_one_is_greedy(model):
    prompts = [random_prompt(n, seed=40 + n) for n in (6, 13)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=8)
    first, second = (small_engine(model).generate(prompts, seeded) for _ in range(2))
    assert [o.output_ids for o in first] == [o.output_ids for o in second]
    top1 = small_engine(model).generate(prompts, SamplingParams(temperature=0.7, top_k=1, max_tokens=8))
    assert [o.output_ids for o in top1] == [expected(model, p, 8) for p in prompts]


def test_padded_decode_runs_at_ladder_sizes_and_splits_mixed_steps(model):
    """Five sequences decode at the padded size 8 (ladder 1, 2, 4, 8): padding rows write only the dummy page and
    slot; a late arrival's prefill runs eagerly beside the decodes (a mixed step); all equal greedy."""
    engine = small_engine(model, padded=True, max_num_seqs=8, num_pages=128)
    assert engine.runner.graph_sizes == (1, 2, 4, 8)
    assert engine.runner.padded_size(5) == 8 and engine.runner.padded_size(1) == 1
    prompts = [random_prompt(n, seed=50 + n) for n in (3, 9, 16, 5, 12)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=10)) for p in prompts]
    for _ in range(3):
        engine.step()
    late = random_prompt(20, seed=60)
    ids.append(engine.add_request(late, SamplingParams(max_tokens=6)))
    while engine.has_unfinished:
        engine.step()
    for prompt, seq_id in zip(prompts + [late], ids):
        assert engine.pop_output(seq_id).output_ids == expected(model, prompt, 10 if prompt is not late else 6)
    assert engine.runner.num_eager_decode_steps > 0
    assert_nothing_leaks(engine)


@padded
@pytest.mark.parametrize("slices,slice_tokens,most_slices", [(3, 0, 3), (4, 0, 4), (2, 4, 4), (2, 6, 3), (2, 11, 2)])
def test_interleaved_prefill_slices_equal_greedy(model, padded, slices, slice_tokens, most_slices):
    """interleave_slices: a late arrival's prefill (several chunks under a small budget) launches in slices of
    layers, and the running sequences decode between them; every output still equals greedy, the decoders gain
    tokens inside mixed steps, and nothing leaks. interleave_slice_tokens: a chunk of 16 prefill tokens (the budget
    less the 3 decode rows, in whole pages of 8) takes ceil(16 / 4) = 4 slices where interleave_slices says 2,
    ceil(16 / 6) = 3, ceil(16 / 11) = 2."""
    engine = small_engine(model, padded=padded, max_num_seqs=6, num_pages=128, max_num_batched_tokens=24,
                          interleave_slices=slices, interleave_slice_tokens=slice_tokens)
    prompts = [random_prompt(n, seed=70 + n) for n in (3, 9, 5)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=24)) for p in prompts]
    while any(engine.sequences[i].num_uncomputed_tokens > 1 for i in ids):
        engine.step()
    late = random_prompt(60, seed=80)
    ids.append(engine.add_request(late, SamplingParams(max_tokens=5)))
    most = 0
    while engine.has_unfinished:
        outs = engine.step()
        most = max([most] + [sum(o.seq_id == i for o in outs) for i in ids[:3]])
    assert most == most_slices - 1, "a decoder takes a token at each slice boundary of a mixed step"
    for prompt, seq_id in zip(prompts + [late], ids):
        assert engine.pop_output(seq_id).output_ids == expected(model, prompt, 24 if prompt is not late else 5)
    assert_nothing_leaks(engine)


def test_prefill_slices_grow_with_the_prefill_up_to_one_a_layer():
    plain = EngineConfig(interleave_slices=12)
    by_tokens = EngineConfig(interleave_slices=12, interleave_slice_tokens=256)
    assert [plain.prefill_slices(t, 24) for t in (300, 4096, 8192)] == [12, 12, 12]
    assert [by_tokens.prefill_slices(t, 24) for t in (300, 3073, 4096, 8192)] == [12, 13, 16, 24]
    assert by_tokens.prefill_slices(8192, 8) == 8
    with pytest.raises(ValueError, match="interleave_slice_tokens"):
        EngineConfig(interleave_slice_tokens=-1)


def test_a_slice_that_raises_keeps_the_decode_tokens_before_it(model):
    """The tokens of a decode step between slices are read after the next slice is launched: when that slice
    raises, they still reach their sequences (the server delivers them before it recomputes the running ones)."""
    engine = small_engine(model, max_num_seqs=6, num_pages=128, max_num_batched_tokens=24, interleave_slices=4,
                          decode_ahead=False)  # so that the step after the late arrival is the mixed one
    prompts = [random_prompt(n, seed=90 + n) for n in (3, 9, 5)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=24)) for p in prompts]
    while any(engine.sequences[i].num_uncomputed_tokens > 1 for i in ids):
        engine.step()
    engine.add_request(random_prompt(60, seed=91), SamplingParams(max_tokens=5))
    real_layers = engine.runner.eager_layers

    def failing_layers(chunks):
        layers = real_layers(chunks)
        yield next(layers)  # layer 0 of 4: the first cut follows it
        raise RuntimeError("injected fault in the second slice")
    engine.runner.eager_layers = failing_layers
    before = {i: len(engine.sequences[i].output_ids) for i in ids}
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    for prompt, seq_id in zip(prompts, ids):
        seq = engine.sequences[seq_id]
        assert len(seq.output_ids) == before[seq_id] + 1
        assert seq.output_ids == expected(model, prompt, len(seq.output_ids))


def test_max_model_len_bounds_requests(model):
    engine = small_engine(model, max_model_len=40)
    assert engine.cfg.max_model_len == 40 and engine.runner.width == 5
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(random_prompt(30, seed=0), SamplingParams(max_tokens=11))
    engine.add_request(random_prompt(30, seed=0), SamplingParams(max_tokens=10))


def test_pool_summary_reports_the_sizes(model):
    engine = small_engine(model)
    assert "KV pool 64 pages x 8 = 512 tokens" in engine.pool_summary
    assert "GDN state running_slots 4, snapshot_slots 8 (+1 padding" in engine.pool_summary
    assert engine.pools.num_slots == 13  # 4 running + 8 snapshots + 1 for padding
    assert engine.pools.num_pages == 65  # the last page is the decode padding's


def test_warm_up_runs_every_step_shape_and_leaves_nothing_behind(model):
    """LLMEngine.warm_up (a no-op on the CPU unless asked): chunks of 1..16 tokens, longer ones, a mixed step; then
    no request, page or slot is held and later requests still equal greedy."""
    engine = small_engine(model, num_pages=200, page_size=16, max_num_batched_tokens=64,
                          interleave_slices=0)  # the mixed step runs as one (interleaving splits it)
    calls = []
    run = engine.runner.execute

    def counted(chunks, *ahead):
        calls.append(sorted(c.num_tokens for c in chunks))
        return run(chunks, *ahead)
    engine.runner.execute = counted
    engine.warm_up()
    assert not calls, "warm_up compiles nothing on the CPU by default"
    engine.warm_up(on_cpu=True)
    sizes = {n for step in calls for n in step}
    assert set(range(1, 17)) <= sizes and 64 in sizes, sorted(sizes)
    assert any(len(step) == 2 and step[0] == 1 and step[1] > 1 for step in calls), "no mixed step"
    assert_nothing_leaks(engine)
    assert not engine.sequences
    prompt = random_prompt(30, seed=8)
    assert engine.generate([prompt], SamplingParams(max_tokens=5))[0].output_ids == expected(model, prompt, 5)


@pytest.mark.parametrize("fields,match", [
    (dict(num_pages=0), "pool sizes"), (dict(snapshot_slots=-1), "snapshot_slots"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"), (dict(max_model_len=1), "max_model_len"),
    (dict(max_graph_batch=0), "max_graph_batch"), (dict(interleave_slices=-1), "interleave_slices"),
])
def test_engine_config_rejects(fields, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**fields)


def _mixed_requests(model) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 1..19 tokens: greedy ones with several max_tokens, one that stops at its third greedy token (a stop
    token: it ends while a decode is launched ahead), and seeded samples."""
    prompts = [random_prompt(n, seed=200 + n) for n in (1, 2, 7, 19, 5)]
    stop_at = expected(model, prompts[2], 3)[2]
    return [(prompts[0], SamplingParams(max_tokens=9)), (prompts[1], SamplingParams(max_tokens=2)),
            (prompts[2], SamplingParams(max_tokens=12, stop_token_ids=(stop_at,))),
            (prompts[3], SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, seed=5)),
            (prompts[4], SamplingParams(max_tokens=11, temperature=1.0, top_k=20, seed=6))]


@pytest.mark.parametrize("budget", [128, 2])  # 2: one-token prompt chunks beside decodes
@padded
def test_decode_ahead_equals_plain_steps(model, budget, padded):
    """EngineConfig.decode_ahead launches the next decode before reading a step's tokens: the same tokens and
    finish reasons as without it (greedy, stop tokens, max_tokens, seeded sampling), decodes really launched ahead,
    and nothing leaks, including the rows computed for a sequence that stopped."""
    results = {}
    for ahead in (False, True):
        engine = small_engine(model, padded=padded, max_num_batched_tokens=budget, max_num_seqs=5,
                              decode_ahead=ahead)  # nobody waits: the stop comes with a decode launched ahead
        ids = [engine.add_request(p, params) for p, params in _mixed_requests(model)]
        while engine.has_unfinished:
            engine.step()
        outs = [engine.pop_output(i) for i in ids]
        results[ahead] = [(o.output_ids, o.finish_reason) for o in outs]
        assert (engine.num_ahead_steps > 0) == ahead
        assert_nothing_leaks(engine)
    assert results[True] == results[False]
    assert results[True][2][1] == "stop" and len(results[True][2][0]) == 3
    prompt, params = _mixed_requests(model)[0]
    assert results[True][0][0] == expected(model, prompt, params.max_tokens)


@pytest.mark.parametrize("budget", [128, 2])
@padded
def test_fed_decode_equals_plain_steps(model, budget, padded):
    """EngineConfig.fed_decode: the argmax of each decode step writes the next step's inputs, and a decode launched
    ahead on exactly those inputs copies nothing; with EngineConfig.token_ring the host reads the greedy tokens where
    the argmax stored them. The same tokens and finish reasons as without either (greedy requests across page
    boundaries, a stop token, seeded samples, which are never fed), steps really fed, nothing leaking."""
    requests = _mixed_requests(model) + [(random_prompt(6, seed=250), SamplingParams(max_tokens=30))]
    results = {}
    for fed, ring in ((False, False), (True, False), (True, True)):
        engine = small_engine(model, padded=padded, max_num_batched_tokens=budget, max_num_seqs=6, fed_decode=fed,
                              token_ring=ring)
        ids = [engine.add_request(p, params) for p, params in requests]
        while engine.has_unfinished:
            engine.step()
        results[fed, ring] = [(o.output_ids, o.finish_reason) for o in map(engine.pop_output, ids)]
        assert (engine.runner.num_fed_steps > 0) == fed, engine.runner.num_fed_steps
        assert (engine.runner.token_ring is not None and engine.runner.token_ring.num_read > 0) == ring
        assert_nothing_leaks(engine)
    assert results[True, True] == results[True, False] == results[False, False]
    assert results[True, True][-1][0] == expected(model, requests[-1][0], 30)  # 30 tokens over pages of 8


def test_fed_decode_is_not_fed_past_a_change(model):
    """A decode after a sequence joined, left or drew a sample is rebuilt from the host's rows, not fed."""
    engine = small_engine(model, fed_decode=True)
    a = engine.add_request(random_prompt(5, seed=260), SamplingParams(max_tokens=12))
    while engine.runner.num_fed_steps < 2:
        engine.step()
    fed = engine.runner.num_fed_steps
    b = engine.add_request(random_prompt(3, seed=261), SamplingParams(max_tokens=12))
    engine.step()  # the newcomer's prefill beside the decode
    engine.step()  # both decode: rows changed since the last decode
    assert engine.runner.num_fed_steps == fed
    while engine.has_unfinished:
        engine.step()
    assert engine.pop_output(a).output_ids == expected(model, random_prompt(5, seed=260), 12)
    assert engine.pop_output(b).output_ids == expected(model, random_prompt(3, seed=261), 12)
    assert engine.runner.num_fed_steps > fed
    assert_nothing_leaks(engine)


def test_decode_ahead_survives_an_abort_of_a_sequence_in_flight(model):
    """A sequence finished from outside (the server's abort) while its decode is launched ahead: that row is
    dropped, the others go on equal to greedy, and its pages and slot come back."""
    engine = small_engine(model)
    prompts = [random_prompt(n, seed=300 + n) for n in (4, 9, 6)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=10)) for p in prompts]
    while engine._ahead is None:
        engine.step()
    victim = engine.sequences[ids[1]]
    engine.scheduler.finish(victim, "abort")
    aborted_with = len(victim.output_ids)
    while engine.has_unfinished:
        engine.step()
    assert len(victim.output_ids) == aborted_with
    for i, p in zip(ids, prompts):
        out = engine.pop_output(i)
        want = expected(model, p, 10)
        assert out.output_ids == (want[:len(out.output_ids)] if i == ids[1] else want)
    assert engine._ahead is None
    assert_nothing_leaks(engine)


def test_device_tokens_are_only_for_decode_rows(model):
    """ModelRunner.execute with device_tokens (a decode launched ahead): every chunk one token, one token each."""
    from serving.batch import ScheduledChunk
    engine = small_engine(model)
    seq_id = engine.add_request(random_prompt(5, seed=400), SamplingParams(max_tokens=4))
    seq = engine.sequences[seq_id]
    engine.scheduler.schedule()  # admitted: a state slot and pages for its 5 prompt tokens
    with pytest.raises(ValueError, match="one token"):
        engine.runner.execute([ScheduledChunk(seq, 5)], torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="device_tokens must be"):
        engine.runner.execute([ScheduledChunk(seq, 1)], torch.zeros(2, dtype=torch.int64))
