"""Decode steps as the CUDA graphs run them (serving/model_runner.py).

CPU: padded decode batches on the Triton ops (interpreter) follow the reference ops; graphs are refused where the
ops or the model would sync with the host.
CPU: padding rows change nothing in the real rows: padded and unpadded decode batches on the Triton ops agree to
fp32 rounding (a padding row writing into real KV pages or GDN slots, or leaking through a shared workspace,
would show here exactly).
GPU (bf16, triton ops): at batch 1 the engine's greedy output with graphs equals it without graphs and equals
model.generate.greedy token for token (same kernels on the same shapes: the engine's page tables have the width
of a SequenceCache of max_model_len tokens, and a page-aligned prompt is prefilled in one chunk); with the prefix
cache, graphs and eager agree exactly. Batched, graphs equal eager decoding padded to the same ladder sizes
exactly (the same kernels on the same shapes). Against unpadded eager decoding (other GEMM shapes, and mixed
steps whose decode rows run the prefill kernels) only BATCHED_TOL holds: this random bf16 model amplifies any
difference to its own rounding noise (see BATCHED_TOL).
"""
import gc
from collections import defaultdict
from dataclasses import replace

import pytest
import torch
from conftest import HAS_CUDA, rel_err

from model import ops
from model.config import Qwen35Config
from model.generate import greedy
from model.model import Qwen35ForCausalLM
from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.model_runner import graphs_unsupported
from serving.sequence import SamplingParams

# the smallest shapes the kernels take (head_dim 64), for the CPU interpreter
KERNEL_SMALL = Qwen35Config(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, intermediate_size=96, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
# real head shapes, 8 layers (2 full attention), the real vocabulary
GPU_CFG = Qwen35Config(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                       linear_num_value_heads=32, intermediate_size=2048)
# bf16, 8 layers: relative logit error between padded-graph and unpadded eager batches along the common path.
# Why 1e-1: any bf16 difference, even one ulp in a few GEMM outputs a step, grows to the model's rounding noise,
# which reaches up to ~6e-2 along this test's decode steps (measured on the CPU: profiles/FINDINGS.md, serving).
BATCHED_TOL = 1e-1


def record_logits(engine: LLMEngine) -> dict[int, list[torch.Tensor]]:
    """seq id -> the fp32 logits of each of its sampled rows, in order (wraps the runner; a decode launched ahead
    computes a row one token past the sequence's appended ones)."""
    rows = defaultdict(list)
    execute = engine.runner.execute

    def wrapped(chunks, *ahead):
        logits, greedy, order = execute(chunks, *ahead)
        for c, row in zip(order, logits):
            if c.end >= c.seq.num_tokens:
                rows[c.seq.id].append(row.float().cpu())
        return logits, greedy, order
    engine.runner.execute = wrapped
    return rows


def run(engine: LLMEngine, prompts, max_tokens: int, **params) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)) for p in prompts]
    while engine.has_unfinished:
        engine.step()
    return [engine.pop_output(i).output_ids for i in ids]


def assert_logits_close_until_divergence(a_out, a_logits, b_out, b_logits, tol: float) -> int:
    """Along each sequence's common token path, logits agree within tol; returns the tokens in common."""
    common = 0
    for seq, (ta, tb) in enumerate(zip(a_out, b_out)):
        for i, (x, y) in enumerate(zip(ta, tb)):
            err = rel_err(a_logits[seq][i], b_logits[seq][i])
            assert err < tol, f"sequence {seq} token {i}: relative logit error {err:.2e}"
            if x != y:
                break
            common += 1
    return common


# the CPU tests run the Triton ops on CPU tensors, which only the interpreter (the CPU tests' conftest) takes
interpreter_only = pytest.mark.skipif(HAS_CUDA, reason="Triton ops on CPU tensors need the interpreter")


def prompts_of(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def test_graphs_are_refused_where_they_would_sync():
    model = Qwen35ForCausalLM.random(KERNEL_SMALL, seed=0)
    with ops.use_backend("reference"):
        assert "reference" in graphs_unsupported(model)
    with ops.use_backend("triton"):
        assert graphs_unsupported(model) is None
        moe = Qwen35ForCausalLM.random(replace(KERNEL_SMALL, intermediate_size=0, num_experts=4,
                                               num_experts_per_tok=2, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=32), seed=0)
        assert graphs_unsupported(moe) is None  # the fused MoE (kernels.moe) syncs with nothing
    with ops.use_backend("reference"):
        assert "moe" in graphs_unsupported(moe)
    engine = LLMEngine(model, EngineConfig(num_pages=32, max_num_seqs=2))
    assert "eager decode (not a CUDA device)" in engine.pool_summary


@interpreter_only
def test_padded_decode_on_triton_ops_follows_the_reference_cpu():
    """Three sequences (prefilled on the reference ops) decode padded to batch 4 (one dummy row) on the Triton
    kernels in the interpreter."""
    model = Qwen35ForCausalLM.random(KERNEL_SMALL, seed=3)
    prompts = prompts_of((5, 16, 11), KERNEL_SMALL.vocab_size)
    cfg = EngineConfig(num_pages=32, page_size=16, max_num_seqs=4, snapshot_slots=4)
    results = {}
    for backend in ("reference", "triton"):
        engine = LLMEngine(model, cfg, pad_decode=True)
        logits = record_logits(engine)
        ids = [engine.add_request(p, SamplingParams(max_tokens=3)) for p in prompts]
        engine.step()  # the three prefills
        with ops.use_backend(backend):
            while engine.has_unfinished:
                engine.step()
        results[backend] = [engine.pop_output(i).output_ids for i in ids], [logits[i] for i in sorted(logits)]
        assert engine.runner.num_eager_decode_steps == 2  # padded 3 -> 4
    common = assert_logits_close_until_divergence(*results["triton"], *results["reference"], tol=1e-4)
    assert common >= 3


@interpreter_only
def test_moe_engine_on_triton_ops_follows_the_reference_cpu():
    """An MoE model (top-2 of 6 experts, a shared expert) through the engine on the Triton kernels in the
    interpreter (kernels.moe among them): prefill and padded decode follow the reference ops' logits."""
    cfg = replace(KERNEL_SMALL, intermediate_size=0, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                  shared_expert_intermediate_size=40)
    model = Qwen35ForCausalLM.random(cfg, seed=4)
    prompts = prompts_of((5, 9), cfg.vocab_size, seed=5)
    results = {}
    for backend in ("reference", "triton"):
        engine = LLMEngine(model, EngineConfig(num_pages=32, page_size=16, max_num_seqs=4, snapshot_slots=4),
                           pad_decode=True)
        logits = record_logits(engine)
        with ops.use_backend(backend):
            ids = [engine.add_request(p, SamplingParams(max_tokens=3)) for p in prompts]
            while engine.has_unfinished:
                engine.step()
        results[backend] = [engine.pop_output(i).output_ids for i in ids], [logits[i] for i in sorted(logits)]
    assert assert_logits_close_until_divergence(*results["triton"], *results["reference"], tol=1e-4) >= 3


@interpreter_only
def test_fed_decode_on_triton_ops_equals_unfed_cpu():
    """EngineConfig.fed_decode on the Triton kernels (interpreter): the argmax kernel writes each next decode step's
    inputs, across a page boundary (pages of 16: the 14-token prompt's fourth token opens its second page) and with
    a padding row (batch 3 -> 4); the tokens and logits equal an unfed run's bit for bit, and steps were fed."""
    model = Qwen35ForCausalLM.random(KERNEL_SMALL, seed=3)
    prompts = prompts_of((5, 14, 12), KERNEL_SMALL.vocab_size, seed=2)
    results = {}
    for fed in (False, True):
        cfg = EngineConfig(num_pages=32, page_size=16, max_num_seqs=4, snapshot_slots=4, fed_decode=fed)
        engine = LLMEngine(model, cfg, pad_decode=True)
        logits = record_logits(engine)
        ids = [engine.add_request(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p in prompts]
        engine.step()  # the prefills, on the reference ops
        with ops.use_backend("triton"):
            while engine.has_unfinished:
                engine.step()
        results[fed] = [engine.pop_output(i).output_ids for i in ids], [logits[i] for i in sorted(logits)]
        assert (engine.runner.num_fed_steps >= 2) == fed, engine.runner.num_fed_steps
    assert results[True][0] == results[False][0]
    for fed_rows, rows in zip(results[True][1], results[False][1]):
        assert len(fed_rows) == len(rows) and all(torch.equal(a, b) for a, b in zip(fed_rows, rows))


@interpreter_only
def test_padded_decode_equals_unpadded_cpu():
    """Five sequences decode on the Triton kernels (interpreter, fp32) padded to batch 8 (three dummy rows) and
    unpadded: the real rows agree to fp32 rounding. The paged attention takes two KV splits at both batch sizes,
    as on the GPU; the 20-token prompt is prefilled in two chunks, so one step mixes decodes with a prefill
    chunk. The padding rows' state slot (zeroed once, at the warm-up before capture, never by a step) stays
    finite."""
    model = Qwen35ForCausalLM.random(replace(KERNEL_SMALL, linear_value_head_dim=32), seed=3)
    prompts = prompts_of((5, 16, 11, 20, 3), KERNEL_SMALL.vocab_size, seed=1)
    cfg = EngineConfig(num_pages=64, page_size=16, max_num_seqs=8, snapshot_slots=4, max_model_len=128)
    results, engines = {}, {}
    for pad in (True, False):
        engine = engines[pad] = LLMEngine(model, cfg, pad_decode=pad)
        logits = record_logits(engine)
        ids = [engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in prompts]
        engine.step()  # the prefills (the 20-token one up to its page boundary), on the reference ops
        with ops.use_backend("triton"):
            while engine.has_unfinished:
                engine.step()
        results[pad] = [engine.pop_output(i).output_ids for i in ids], [logits[i] for i in sorted(logits)]
    assert engines[True].runner.graph_sizes == (1, 2, 4, 8) and not engines[False].runner.graph_sizes
    common = assert_logits_close_until_divergence(*results[True], *results[False], tol=1e-5)
    assert common == 4 * len(prompts)
    pools, dummy = engines[True].pools, engines[True].runner.dummy_slot
    padding_state = (pools.conv_states[:, dummy], pools.recurrent_states[:, dummy])
    assert all(t.isfinite().all() for t in padding_state)


@pytest.fixture(scope="module")
def gpu_model():
    return Qwen35ForCausalLM.random(GPU_CFG, device="cuda", dtype=torch.bfloat16, seed=1)


GPU_ENGINE = EngineConfig(num_pages=512, page_size=16, max_num_seqs=8, snapshot_slots=8, max_model_len=1024)


@pytest.mark.gpu
def test_batch1_greedy_graphs_equal_eager_and_model_greedy(gpu_model):
    with ops.use_backend("triton"):
        graphs = LLMEngine(gpu_model, GPU_ENGINE)
        eager = LLMEngine(gpu_model, replace(GPU_ENGINE, cuda_graphs=False))
        assert graphs.runner.graphs and not eager.runner.graphs, (graphs.pool_summary, eager.pool_summary)
        prompt = prompts_of((128,), GPU_CFG.vocab_size, seed=1)  # page-aligned: one prefill chunk
        n = 48  # crosses three page boundaries while decoding
        out_g, out_e = run(graphs, prompt, n)[0], run(eager, prompt, n)[0]
        ref = greedy(gpu_model, torch.tensor(prompt, device="cuda"), n,
                     cache=gpu_model.new_cache(1, GPU_ENGINE.max_model_len, page_size=GPU_ENGINE.page_size))
        assert graphs.runner.num_graph_steps >= n - 1 and eager.runner.num_graph_steps == 0
        assert out_g == out_e
        assert out_g == ref[0].tolist()
        # the returning turn: the conversation back unchanged plus new tokens, served from the prefix cache
        second = prompt[0] + out_g + prompts_of((37,), GPU_CFG.vocab_size, seed=2)[0]
        ids = [e.add_request(second, SamplingParams(max_tokens=32, ignore_eos=True)) for e in (graphs, eager)]
        for e in (graphs, eager):
            while e.has_unfinished:
                e.step()
        res_g, res_e = graphs.pop_output(ids[0]), eager.pop_output(ids[1])
        assert res_g.cached_tokens == res_e.cached_tokens >= 128
        assert res_g.output_ids == res_e.output_ids


@pytest.mark.gpu
def test_batched_graphs_equal_padded_eager_and_follow_unpadded(gpu_model):
    """Batch 5 replays the batch-8 graph (three padded rows). Eager decoding padded to the same sizes runs the same
    kernels on the same shapes: the same tokens and bit-identical logits. Unpadded eager decoding: within
    BATCHED_TOL along the common path (a padding row leaking into real rows would be O(1))."""
    with ops.use_backend("triton"):
        prompts = prompts_of((30, 77, 128, 200, 9), GPU_CFG.vocab_size, seed=3)
        eager_cfg = replace(GPU_ENGINE, cuda_graphs=False)
        results, engines = [], []
        for cfg, pad in ((GPU_ENGINE, False), (eager_cfg, True), (eager_cfg, False)):
            engine = LLMEngine(gpu_model, cfg, pad_decode=pad)
            logits = record_logits(engine)
            out = run(engine, prompts, 24)
            results.append((out, [logits[i] for i in sorted(logits)]))
            engines.append(engine)
            assert all(torch.isfinite(x).all() for rows in logits.values() for x in rows)
        graphs, padded, unpadded = engines
        assert graphs.runner.graphs and graphs.runner.num_graph_steps >= 23
        assert padded.runner.num_graph_steps == unpadded.runner.num_graph_steps == 0
        assert padded.runner.num_eager_decode_steps == graphs.runner.num_graph_steps
        (out_g, log_g), (out_p, log_p), (out_u, log_u) = results
        assert out_g == out_p
        for seq, (a, b) in enumerate(zip(log_g, log_p)):
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), f"sequence {seq}"
        common = assert_logits_close_until_divergence(out_g, log_g, out_u, log_u, tol=BATCHED_TOL)
        assert common >= len(prompts)  # at least the prefill tokens


@pytest.mark.gpu
def test_graphs_through_preemption_and_slot_reuse(gpu_model):
    """A pool too small for all: decodes preempt and recompute, slots and pages are reused, graph batch sizes
    change as sequences finish; everything finishes and nothing leaks."""
    cfg = replace(GPU_ENGINE, num_pages=24, max_model_len=256, snapshot_slots=4)
    with ops.use_backend("triton"):
        engine = LLMEngine(gpu_model, cfg)
        prompts = prompts_of((40, 60, 33, 70, 20, 50), GPU_CFG.vocab_size, seed=4)
        ids = [engine.add_request(p, SamplingParams(max_tokens=40 + 7 * i, ignore_eos=True))
               for i, p in enumerate(prompts)]
        while engine.has_unfinished:
            engine.step()
        outs = [engine.pop_output(i) for i in ids]
    assert [len(o.output_ids) for o in outs] == [40 + 7 * i for i in range(len(prompts))]
    assert engine.scheduler.num_preemptions > 0 and engine.runner.num_graph_steps > 0
    bm = engine.block_manager
    assert all(r == 0 for r in bm.refcount) and len(engine.scheduler.free_state_slots) == cfg.max_num_seqs


@pytest.mark.gpu
def test_seeded_sampling_with_graphs_is_reproducible(gpu_model):
    with ops.use_backend("triton"):
        prompts = prompts_of((20, 45, 64), GPU_CFG.vocab_size, seed=5)
        params = dict(temperature=0.8, top_p=0.9, top_k=50, seed=7)
        a = run(LLMEngine(gpu_model, GPU_ENGINE), prompts, 16, **params)
        b = run(LLMEngine(gpu_model, GPU_ENGINE), prompts, 16, **params)
        assert a == b


@pytest.mark.gpu
def test_pools_sized_from_gpu_memory(gpu_model):
    gc.collect()  # the engines of earlier tests (record_logits makes reference cycles)
    torch.cuda.empty_cache()
    # utilization counts the whole card, as vLLM's does: what other processes hold (pytest-xdist workers on one GPU)
    # comes off this engine's share, so ask for what is in use now plus 25% of the card
    free, total = torch.cuda.mem_get_info()
    share = 0.25
    util = min(0.95, (total - free) / total + share)
    before = torch.cuda.memory_allocated()
    with ops.use_backend("triton"):
        engine = LLMEngine(gpu_model, EngineConfig.for_gpu_memory(util, max_num_seqs=4, max_model_len=4096))
    assert engine.cfg.num_pages * engine.cfg.page_size >= 4096 and engine.cfg.max_model_len == 4096
    assert engine.sizing["peak_GiB"] > 0 and "KV pool" in engine.pool_summary
    # the pools fit the card's utilization as the engine saw it: other xdist workers may free memory between the
    # reading above and the engine's own, and the engine then takes more than `share` (once 37 GiB of an H100),
    # rightly
    room = engine.sizing["free_GiB"] * 2**30 - (1 - util) * total
    assert torch.cuda.memory_allocated() - before <= room, (engine.pool_summary, engine.sizing)


def record_sampled_logits(engine: LLMEngine) -> dict[int, list[torch.Tensor]]:
    """seq id -> the fp32 logits of each of its sampled rows, in order (wraps the engine's sampling, which every
    step, every decode step between prefill slices and every decode launched ahead goes through)."""
    rows = defaultdict(list)
    sample = engine._sample

    def wrapped(chunks, ready, logits, greedy):
        for c, r, row in zip(chunks, ready, logits):
            if r:
                rows[c.seq.id].append(row.float().cpu())
        return sample(chunks, ready, logits, greedy)
    engine._sample = wrapped
    return rows


@pytest.mark.gpu
def test_interleaved_prefill_with_graphs_follows_the_plain_engine(gpu_model):
    """EngineConfig.interleave_slices on the GPU: a late 300-token prefill launches in slices, the three running
    sequences replay their decode graph between them. Against the same arrivals without slices: the same tokens
    along the common path, logits within BATCHED_TOL (batches differ), and decode graphs ran between slices."""
    with ops.use_backend("triton"):
        results = []
        for slices in (0, 4):
            engine = LLMEngine(gpu_model, replace(GPU_ENGINE, max_num_batched_tokens=64, interleave_slices=slices))
            logits = record_sampled_logits(engine)
            ids = [engine.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True))
                   for p in prompts_of((30, 77, 9), GPU_CFG.vocab_size, seed=6)]
            while any(engine.sequences[i].num_uncomputed_tokens > 1 for i in ids):
                engine.step()
            late = prompts_of((300,), GPU_CFG.vocab_size, seed=7)[0]
            ids.append(engine.add_request(late, SamplingParams(max_tokens=8, ignore_eos=True)))
            most = 0  # tokens of one sequence in one step: 3 with 4 slices (a decode step at each slice boundary)
            while engine.has_unfinished:
                outs = engine.step()
                most = max([most] + [sum(o.seq_id == i for o in outs) for i in ids[:3]])
            results.append(([engine.pop_output(i).output_ids for i in ids], [logits[i] for i in ids]))
            assert engine.runner.num_graph_steps > 0 and most == (3 if slices else 1)
        (out_a, log_a), (out_b, log_b) = results
        assert [len(o) for o in out_a] == [len(o) for o in out_b] == [24, 24, 24, 8]
        assert assert_logits_close_until_divergence(out_a, log_a, out_b, log_b, tol=BATCHED_TOL) >= 4


@pytest.mark.gpu
@pytest.mark.parametrize("fed", [False, True], ids=["copied", "fed"])
def test_decode_ahead_with_graphs_equals_plain_steps(gpu_model, fed):
    """EngineConfig.decode_ahead on the GPU: the graph of the next decode is replayed with its tokens copied on the
    device before the host reads them (fed: written by the last step's argmax, with the rest of its inputs, and
    nothing copied, the host reading the tokens from the argmax's stores into pinned memory: EngineConfig.token_ring).
    Same kernels on the same shapes as without it: the same tokens and bit-identical logits,
    batched, with a sequence that ends early (max_tokens) while a decode is launched ahead."""
    with ops.use_backend("triton"):
        prompts = prompts_of((30, 77, 128, 9), GPU_CFG.vocab_size, seed=8)
        results = []
        for ahead in (False, True):
            engine = LLMEngine(gpu_model, replace(GPU_ENGINE, decode_ahead=ahead, fed_decode=fed and ahead))
            logits = record_sampled_logits(engine)
            ids = [engine.add_request(p, SamplingParams(max_tokens=12 + 5 * i, ignore_eos=True))
                   for i, p in enumerate(prompts)]
            while engine.has_unfinished:
                engine.step()
            results.append(([engine.pop_output(i).output_ids for i in ids], [logits[i] for i in ids]))
            assert (engine.num_ahead_steps > 0) == ahead and engine.runner.num_graph_steps > 0
            assert (engine.runner.num_fed_steps > 0) == (fed and ahead)
            ring = engine.runner.token_ring  # fed: the host read the tokens where the argmax stored them
            assert (ring is not None and ring.num_read > 0) == (fed and ahead)
        (out_a, log_a), (out_b, log_b) = results
        assert out_a == out_b and [len(o) for o in out_a] == [12, 17, 22, 27]
        for seq, (a, b) in enumerate(zip(log_a, log_b)):
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), f"sequence {seq}"
