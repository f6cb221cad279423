"""Prefill steps through their replayed row-wise stretches (serving/prefill_graphs.py).

CPU (fp32, the stretches run eagerly from the same static buffers, PrefillGraphs.capture(eager=True)): an engine
whose prefill steps go through the stretches gives the plain engine's tokens and logits, for single prompts,
several prompts in one step, a returning turn from the prefix cache, and steps outside the buckets (eager). The
buffers' rows past a step's tokens are filled with NaN first: a stretch that mixed rows would spread them.
GPU (bf16, triton ops, real CUDA graphs): the engine with prefill graphs equals the engine without them bit for bit
(the same products on the same row counts), and replays them under interleaved mixed steps.
"""
from dataclasses import replace

import pytest
import torch
from conftest import rel_err
from test_serving_graphs import GPU_CFG, GPU_ENGINE, prompts_of, record_sampled_logits

from kernels.row_buckets import GEMV_MAX_ROWS
from model import ops
from model.config import Qwen35Config
from model.model import Qwen35ForCausalLM
from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.prefill_graphs import PrefillGraphs, _segments, prefill_graphs_unsupported
from serving.sequence import SamplingParams

SMALL = Qwen35Config(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, intermediate_size=96, linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)


def poison_padding(graphs: PrefillGraphs) -> None:
    """NaN in every float row of the static buffers (the next step overwrites its own rows, the rest stay NaN)."""
    for t in (graphs.residual, graphs.final, graphs.cos, graphs.sin, *graphs.projected.values(),
              *graphs.mixed.values()):
        t.fill_(float("nan"))
    graphs.page_table.fill_(10**6)  # pages far outside the pool, and key counts past them
    graphs.seqused_k.fill_(10**6)


def serve(engine: LLMEngine, before_step=None):
    """Single prompts (the 120-token one first: later steps leave its rows), two prompts in one step, a returning
    turn over the first conversation, and a 200-token prompt past the buckets. Returns (outputs, logits)."""
    logits = record_sampled_logits(engine)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prompts = prompts_of((120, 65, 3, 64, 7, 40, 200), SMALL.vocab_size, seed=11)
    outs = []
    for batch in ([prompts[0]], [prompts[1]], [prompts[2]], [prompts[3]], prompts[4:6], [prompts[6]]):
        ids = [engine.add_request(p, params) for p in batch]
        while engine.has_unfinished:
            if before_step is not None:
                before_step()
            engine.step()
        outs += [engine.pop_output(i) for i in ids]
    back = prompts[0] + outs[0].output_ids + prompts_of((70,), SMALL.vocab_size, seed=12)[0]
    outs.append(engine.generate([back], params)[0])
    assert outs[-1].cached_tokens >= 112
    return [o.output_ids for o in outs], [logits[o.seq_id] for o in outs]


def test_stretches_give_the_plain_engine_cpu():
    # the reference ops: every core eager between the stretches
    model = Qwen35ForCausalLM.random(SMALL, seed=2)
    cfg = EngineConfig(num_pages=128, page_size=16, max_num_seqs=4, snapshot_slots=8, max_num_batched_tokens=256)
    plain = LLMEngine(model, cfg)
    out_p, log_p = serve(plain)
    engine = LLMEngine(model, cfg)
    graphs = engine.runner.prefill_graphs = PrefillGraphs(model, 128, cfg.max_num_seqs, engine.runner.width)
    graphs.capture(engine.pools, eager=True)
    assert graphs.buckets == (64, 128) and set(graphs.graphs) == {(64, 1), (64, 4), (128, 1), (128, 4)}
    assert len(graphs.graphs[64, 1]) == SMALL.num_hidden_layers + 1 and not graphs.grids
    out_g, log_g = serve(engine, before_step=lambda: poison_padding(graphs))
    assert out_g == out_p
    for seq, (a, b) in enumerate(zip(log_g, log_p)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.isfinite(x).all() and rel_err(x, y) < 1e-5, f"request {seq}: {rel_err(x, y):.2e}"
    # every prefill step but the 200-token prompt's (past the buckets) and the 3-token one's (the GEMV's rows)
    assert engine.runner.num_graph_prefill_steps == 5
    assert engine.runner.num_eager_steps == plain.runner.num_eager_steps == 7


def recording(replay, offsets: list):
    """replay (PrefillGraphs.forward_step_layers) that also records each step's cu_seqlens and snapshot offsets."""
    def run(step, pools):
        offsets.append((step.cu_seqlens_host, step.snapshot_offsets))
        return replay(step, pools)
    return run


def test_segments_with_device_planned_cores_give_the_plain_step_cpu():
    # the triton ops (the interpreter; each step costs ~15 s here): the GDN cores inside the segments, planned on
    # the device from the static batch (kernels.varlen.DeviceBatch), for a step of two prompts, one of which
    # snapshots its GDN state at a cache point inside the step (the batch held a larger step's slots before); then
    # a returning turn alone; both graphs hold the attention core too (head dim 64, which the split-KV kernel
    # takes: the two-prompt step's as a work list) over the static page tables with its split count on the device
    model = Qwen35ForCausalLM.random(replace(SMALL, head_dim=64), seed=2)
    # a short max_model_len: the attention grid's splits (and the interpreter's programs) are sized by it
    cfg = EngineConfig(num_pages=128, page_size=16, max_num_seqs=2, snapshot_slots=8, max_num_batched_tokens=256,
                       max_model_len=256)
    prompts = prompts_of((90, 27), SMALL.vocab_size, seed=5)
    returning = prompts_of((12,), SMALL.vocab_size, seed=6)[0]
    results = []
    with ops.use_backend("triton"):
        for graphs_on in (False, True):
            engine = LLMEngine(model, cfg)
            logits = record_sampled_logits(engine)
            if graphs_on:
                # a slice cut after layer 0: its GDN core ends the first segment
                graphs = engine.runner.prefill_graphs = PrefillGraphs(model, 128, cfg.max_num_seqs, engine.runner.width,
                                                                      frozenset({1}))
                graphs.capture(engine.pools, eager=True)
                # every graph holds every core (layer 3's attention too: a work list in the two-sequence graphs);
                # the cut ends the first segment
                assert SMALL.full_attention_layers == [3]
                assert all(graphs.segments[key] == [(0, 0, True), (1, 4, False)] for key in graphs.segments)
                assert set(graphs.grids) == {(64, 1), (128, 1), (64, 2), (128, 2)}
                assert graphs.grids[128, 1].programs is None and graphs.grids[128, 2].programs is not None
                poison_padding(graphs)
                graphs.batch.fill((0, 1, 2), torch.arange(1, 3), None, None)  # stale slots past the step
                graphs.forward_step_layers = recording(graphs.forward_step_layers, offsets := [])
            ids = [engine.add_request(prompts[0], SamplingParams(max_tokens=1), cache_point=48),
                   engine.add_request(prompts[1], SamplingParams(max_tokens=1))]
            while engine.has_unfinished:
                engine.step()
            # a returning turn over the first prompt: one sequence (the (rows, 1) graphs) over cached pages
            ids.append(engine.add_request(prompts[0] + returning, SamplingParams(max_tokens=1)))
            while engine.has_unfinished:
                engine.step()
            assert engine.pop_output(ids[-1]).cached_tokens >= 48
            pools = engine.pools
            results.append(([logits[i][0] for i in ids], [t.clone() for t in (*pools.conv_states,
                                                                              *pools.recurrent_states)]))
    # a step of both prompts with a snapshot inside it (the cache point's), then the returning turn alone
    (cu, snapshots), *_, (cu_back, _) = offsets
    assert len(cu) == 3 and snapshots is not None and snapshots[0] == 48, offsets
    assert len(cu_back) == 2 and cu_back[1] > GEMV_MAX_ROWS, offsets
    assert engine.runner.num_graph_prefill_steps == len(offsets)
    (log_e, states_e), (log_g, states_g) = results
    for x, y in zip(log_g, log_e):
        assert torch.isfinite(x).all() and rel_err(x, y) < 1e-5, f"{rel_err(x, y):.2e}"
    for x, y in zip(states_g, states_e):
        assert rel_err(x, y) < 1e-5, f"GDN pools (slots and snapshots): {rel_err(x, y):.2e}"


def test_segments_end_at_eager_cores_and_slice_cuts():
    g, a = True, False  # a GDN core in the graphs, an attention core between them
    assert _segments([g, g, g, a] * 2, frozenset()) == [(0, 3, False), (4, 7, False), (8, 8, False)]
    # 12 slices of 24 layers cut every 2 layers: a cut after a GDN core ends its segment there
    assert _segments([g, g, g, a] * 2, frozenset({2, 4, 6})) == [(0, 1, True), (2, 3, False), (4, 5, True),
                                                                 (6, 7, False), (8, 8, False)]
    assert _segments([a, g], frozenset({1})) == [(0, 0, False), (1, 2, False)]  # a cut after an eager core
    assert _segments([a, a], frozenset()) == [(0, 0, False), (1, 1, False), (2, 2, False)]  # the reference GDN
    cfg = EngineConfig(interleave_slices=12)
    assert cfg.slice_cuts(0, 24) == frozenset(range(2, 24, 2)) and EngineConfig(interleave_slices=1).slice_cuts(
        0, 24) == frozenset()


def test_prefill_graphs_are_refused_where_they_cannot_run():
    moe = Qwen35ForCausalLM.random(replace(SMALL, intermediate_size=0, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=32), seed=0)
    with ops.use_backend("reference"):  # the reference MoE syncs; the fused one does not
        assert "MoE" in prefill_graphs_unsupported(moe)
    with ops.use_backend("triton"):
        assert prefill_graphs_unsupported(moe) is None
    model = Qwen35ForCausalLM.random(SMALL, seed=0)
    assert prefill_graphs_unsupported(model) is None
    with pytest.raises(ValueError, match="max_tokens"):
        PrefillGraphs(model, 32, 4, 8)
    with pytest.raises(ValueError, match="max_seqs"):
        PrefillGraphs(model, 64, 0, 8)
    with pytest.raises(ValueError, match="max_pages"):
        PrefillGraphs(model, 64, 4, 0)
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        EngineConfig(prefill_graph_tokens=-1)
    engine = LLMEngine(model, EngineConfig(num_pages=32, max_num_seqs=2))  # the CPU: no graphs of any kind
    assert engine.runner.prefill_graphs is None and "prefill graphs" not in engine.pool_summary


@pytest.fixture(scope="module")
def gpu_model():
    return Qwen35ForCausalLM.random(GPU_CFG, device="cuda", dtype=torch.bfloat16, seed=1)


@pytest.mark.gpu
def test_prefill_graphs_equal_the_eager_steps_bit_for_bit(gpu_model):
    with ops.use_backend("triton"):
        results, engines = [], []
        for tokens in (512, 0):
            engine = LLMEngine(gpu_model, replace(GPU_ENGINE, prefill_graph_tokens=tokens))
            logits = record_sampled_logits(engine)
            params = SamplingParams(max_tokens=12, ignore_eos=True)
            outs = engine.generate(prompts_of((300,), GPU_CFG.vocab_size, seed=1), params)
            back = outs[0].prompt_ids + outs[0].output_ids + prompts_of((150,), GPU_CFG.vocab_size, seed=9)[0]
            outs += engine.generate([back], params)  # a returning turn from the prefix cache
            assert outs[-1].cached_tokens >= 300
            for lengths in ((77,), (30, 77, 128), (9,), (600,)):
                outs += engine.generate(prompts_of(lengths, GPU_CFG.vocab_size, seed=len(lengths)), params)
            results.append(([o.output_ids for o in outs], [logits[o.seq_id] for o in outs]))
            engines.append(engine)
        with_graphs, without = engines
        assert "prefill graphs up to 512 tokens" in with_graphs.pool_summary
        assert with_graphs.runner.prefill_graphs is not None and without.runner.prefill_graphs is None
        assert with_graphs.runner.num_graph_prefill_steps >= 5 and without.runner.num_graph_prefill_steps == 0
        (out_g, log_g), (out_e, log_e) = results
        assert out_g == out_e
        for seq, (a, b) in enumerate(zip(log_g, log_e)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"request {seq}"
