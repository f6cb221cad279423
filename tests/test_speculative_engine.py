"""MTP speculative decoding in the engine (CPU, fp32, reference ops): greedy output equals plain greedy token for token
for K = 1..4, alone and batched, with and without the prefix cache, under preemption, with drafts forced to be all
kept, all rejected or kept to a random length; the verify step's per-token GDN states; the head's KV and hidden state
across a prefix hit; and sampled output distributed as without speculation (chi-square, alpha = 0.001)."""
import random

import pytest
import torch
from hf_oracle import randomize_

from model import ops
from model.config import get_preset
from model.generate import greedy
from model.model import Qwen35ForCausalLM
from model.step import StepInput
from serving import speculative
from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.prefill_graphs import PrefillGraphs
from serving.sequence import SamplingParams

VOCAB = 1024


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def model(request):
    m = Qwen35ForCausalLM.random(get_preset(request.param, vocab_size=VOCAB), seed=0)
    randomize_(m, 0)  # varied outputs (the preset's init repeats one token)
    return m.eval()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(length),), generator=gen).tolist()
            for length in torch.randint(3, 40, (n,), generator=gen)]


def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    return greedy(model, torch.tensor([prompt]), n)[0].tolist()


def engine(model, k: int, **cfg) -> LLMEngine:
    fields = dict(num_pages=128, page_size=4, max_num_seqs=4, speculative_tokens=k)
    return LLMEngine(model, EngineConfig(**{**fields, **cfg}))


def forcing(model, mode: str, seed: int = 0):
    """A replace_drafts hook: drafts set to greedy's next tokens ("all"), to wrong ones ("none"), or right up to a
    random length ("random")."""
    rng = random.Random(seed)

    def replace(seq, drafts):
        truth = plain_greedy(model, seq.prompt_ids, len(seq.output_ids) + len(drafts))[len(seq.output_ids):]
        n = {"all": len(drafts), "none": 0}.get(mode, rng.randint(0, len(drafts)))
        return truth[:n] + [(t + 1) % VOCAB for t in truth[n:]]
    return replace


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["drafted", "all", "none", "random"])
def test_speculative_greedy_equals_plain_greedy(model, k, mode):
    batch = prompts(3, seed=k)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    spec = engine(model, k)
    if mode != "drafted":
        spec.speculator.replace_drafts = forcing(model, mode, seed=k)
    outputs = spec.generate(batch, params)  # batched
    alone = engine(model, k).generate(batch[:1], params)
    for prompt, out in zip(batch, outputs):
        assert out.output_ids == plain_greedy(model, prompt, 14), f"K={k}, {mode}"
    assert alone[0].output_ids == outputs[0].output_ids
    assert spec.speculator.num_verified > 0 and spec.speculator.num_device_steps > 0
    if mode == "all":
        assert spec.speculator.num_accepted == spec.speculator.num_verified
    if mode == "none":
        assert spec.speculator.num_accepted == 0


@pytest.mark.parametrize("k", [1, 3])
def test_a_reduced_draft_vocab_keeps_greedy_exact(model, k):
    """Drafts from the first VOCAB // 8 token ids only: every draft lies there, and the output is plain greedy's
    (greedy's tokens past them are never drafted, so fewer drafts are kept)."""
    batch = prompts(3, seed=50 + k)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    spec = engine(model, k, draft_vocab_size=VOCAB // 8)
    seen = []
    spec.speculator.replace_drafts = lambda seq, drafts: seen.extend(drafts) or drafts
    for prompt, out in zip(batch, spec.generate(batch, params)):
        assert out.output_ids == plain_greedy(model, prompt, 14)
    assert seen and max(seen) < VOCAB // 8 and spec.speculator.num_verified > 0


def test_draft_vocab_size_is_checked():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        EngineConfig(draft_vocab_size=64)  # without speculative_tokens
    with pytest.raises(ValueError, match="draft_vocab_size"):
        EngineConfig(speculative_tokens=2, draft_vocab_size=-1)
    model = Qwen35ForCausalLM.random(get_preset("tiny", vocab_size=VOCAB), seed=0)
    with pytest.raises(ValueError, match="draft_vocab_size must lie in"):
        LLMEngine(model, EngineConfig(num_pages=16, speculative_tokens=2, draft_vocab_size=VOCAB + 1))


def test_forced_lengths_keep_that_many_tokens_a_step(model):
    """force_lengths (a benchmark mode): every greedy step keeps the drawn length (here always K+1 or 2), whatever
    the target says; the requests still end at max_tokens, and nothing leaks."""
    for mean, expected in ((4.0, 4), (2.0, 2)):
        eng = engine(model, 3)
        eng.speculator.force_lengths(mean, seed=1)
        eng.add_request(prompts(1, seed=60)[0], SamplingParams(max_tokens=21, ignore_eos=True))
        emitted = []
        while eng.has_unfinished:
            before = eng.speculator.num_device_steps
            outs = eng.step()
            if eng.speculator.num_device_steps > before:
                emitted.append(len(outs))
        assert emitted and all(n == expected for n in emitted[:-1]) and emitted[-1] <= expected, emitted
        out = eng.pop_output(0)
        assert len(out.output_ids) == 21
        assert not any(eng.block_manager.refcount) and len(eng.scheduler.free_state_slots) == eng.cfg.max_num_seqs
    with pytest.raises(ValueError, match="mean_length"):
        eng.speculator.force_lengths(5.0)


def test_forced_lengths_at_a_padded_batch(model):
    """force_lengths with three sequences padded to batch 4: each keeps 40 tokens in steps of 3 (the last shorter),
    and every slot and page comes back."""
    eng = LLMEngine(model, EngineConfig(num_pages=128, page_size=4, max_num_seqs=4, speculative_tokens=3),
                    pad_decode=True)
    eng.speculator.force_lengths(3.0)
    outs = eng.generate(prompts(3, seed=71), SamplingParams(max_tokens=40, ignore_eos=True))
    spec = eng.speculator
    assert all(len(o.output_ids) == 40 for o in outs) and spec.num_device_steps > 0
    assert 2.5 < 1 + spec.num_accepted / spec.num_verify_steps <= 3.0
    assert not any(eng.block_manager.refcount) and len(eng.scheduler.free_state_slots) == eng.cfg.max_num_seqs


def test_padded_device_steps_equal_unpadded(model):
    """Greedy decode steps padded to the graph ladder (3 sequences run at batch 4: one padding row on the padding
    slot, its position slots and the padding page) decode greedy's tokens; what graphs replay on a GPU."""
    batch = prompts(3, seed=41)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    eng = LLMEngine(model, EngineConfig(num_pages=128, page_size=4, max_num_seqs=4, speculative_tokens=3),
                    pad_decode=True)
    eng.speculator.replace_drafts = forcing(model, "random", seed=5)
    assert eng.speculator.graph_sizes == (1, 2, 4) and not eng.speculator.graphs
    outputs = eng.generate(batch, params)
    for prompt, out in zip(batch, outputs):
        assert out.output_ids == plain_greedy(model, prompt, 12)
    assert eng.speculator.num_device_steps > 0


@pytest.mark.parametrize("k", [1, 3])
def test_steps_launched_ahead_keep_greedy_and_the_prefix_cache_exact(model, k):
    """Greedy steps launched before the step before them is read (EngineConfig.decode_ahead), with pages of 4 tokens
    so that page boundaries fall inside and at the end of verify steps, and sequences that end at different steps,
    one at a stop token (their rows of the step ahead are wasted): plain greedy's tokens. Each returning turn hits
    the snapshot its first turn published from a step's position slots while the step ahead ran, and decodes plain
    greedy's tokens too."""
    batch = prompts(3, seed=80 + k)
    truth = plain_greedy(model, batch[2], 17)
    stop = truth[6]
    params = [SamplingParams(max_tokens=9, ignore_eos=True), SamplingParams(max_tokens=14, ignore_eos=True),
              SamplingParams(max_tokens=17, stop_token_ids=(stop,))]
    eng = engine(model, k, snapshot_slots=16)
    ids = [eng.add_request(p, q) for p, q in zip(batch, params)]
    while eng.has_unfinished:
        eng.step()
    outs = [eng.pop_output(i) for i in ids]
    assert eng.num_ahead_steps > 0
    assert outs[0].output_ids == plain_greedy(model, batch[0], 9)
    assert outs[1].output_ids == plain_greedy(model, batch[1], 14)
    assert outs[2].output_ids == truth[:truth.index(stop) + 1] and outs[2].finish_reason == "stop"
    turns = [p + o.output_ids + prompts(1, seed=90 + i)[0] for i, (p, o) in enumerate(zip(batch, outs))]
    again = eng.generate(turns, SamplingParams(max_tokens=8, ignore_eos=True))
    for turn, first, out in zip(turns, batch, again):
        assert out.output_ids == plain_greedy(model, turn, 8)
        assert out.cached_tokens > len(first)  # the hit reaches into the first turn's decoded tokens
    assert not any(eng.block_manager.refcount) and len(eng.scheduler.free_state_slots) == eng.cfg.max_num_seqs


def test_forced_lengths_are_the_same_launched_ahead(model):
    """force_lengths drawing 2 or 3 tokens a step: one sequence keeps the same tokens with decode_ahead on (each
    step's next inputs written on the device: the last kept token, the drafts after it, the start moved by L) and
    off (the host writes them), up to where the engine without steps ahead drafts fewer than K (max_tokens near) and
    leaves the device (whose steps alone force L)."""
    outs = []
    for ahead in (True, False):
        eng = engine(model, 3, decode_ahead=ahead)
        eng.speculator.force_lengths(2.5, seed=3)
        outs.append(eng.generate(prompts(1, seed=85), SamplingParams(max_tokens=40, ignore_eos=True))[0].output_ids)
        assert (eng.num_ahead_steps > 0) == ahead
        each = (2 if ahead else 1) * 4  # sets of K+1 position slots: a second only to launch steps ahead
        assert eng.pools.num_slots == eng.cfg.max_num_seqs * (1 + each) + eng.cfg.snapshot_slots + each + 1
    assert outs[0][:36] == outs[1][:36] and len(outs[0]) == 40


def test_a_step_ahead_of_aborted_sequences_is_dropped(model):
    """Every running sequence aborted while a greedy step runs ahead: the next request is scheduled at the next call
    (the dead step is not read), decodes plain greedy's tokens, and the drafts counts take no row of the dead step."""
    batch = prompts(3, seed=95)
    eng = engine(model, 3)
    for p in batch[:2]:
        eng.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True))
    while eng._ahead is None:
        eng.step()
    verified = eng.speculator.num_verified
    for seq in list(eng.scheduler.running):
        eng.scheduler.finish(seq, "abort")
    new = eng.add_request(batch[2], SamplingParams(max_tokens=8, ignore_eos=True))
    assert eng.step() and eng.speculator.num_verified == verified  # the new request's prompt step, no dead rows
    while eng.has_unfinished:
        eng.step()
    assert eng.pop_output(new).output_ids == plain_greedy(model, batch[2], 8)


def test_drafts_counts_follow_the_emitted_tokens(model):
    """One sequence whose greedy steps all run on the device (launched ahead), L forced to 2, max_tokens even so that
    the last step is cut to one token: every output token but the prompt step's is a verify row's, so outputs = 1 +
    verify rows + kept drafts; the step launched past the end counts nothing."""
    eng = engine(model, 3)
    eng.speculator.force_lengths(2.0)
    out = eng.generate(prompts(1, seed=96), SamplingParams(max_tokens=30, ignore_eos=True))[0]
    spec = eng.speculator
    assert eng.num_ahead_steps > 0 and spec.num_verified == 3 * spec.num_verify_steps
    assert len(out.output_ids) == 30 == 1 + spec.num_verify_steps + spec.num_accepted


def test_verify_steps_emit_several_tokens_a_step(model):
    """All drafts kept: a sequence of 13 new tokens takes its prefill and ceil(12 / (K+1)) verify steps."""
    spec = engine(model, 3)
    spec.speculator.replace_drafts = forcing(model, "all")
    spec.add_request(prompts(1)[0], SamplingParams(max_tokens=13, ignore_eos=True))
    steps = 0
    while spec.has_unfinished:
        spec.step()
        steps += 1
    assert steps == 1 + 3


def test_prefix_cache_hits_and_drafts_are_the_same_with_speculation(model):
    """A returning turn hits as many cached tokens with speculation as without, decodes the same tokens, and its
    first drafts (the head over row n-1 of the hit, its snapshot's hidden state and the head's cached KV) equal a
    cold prefill's."""
    first = prompts(1, seed=5)[0] + prompts(1, seed=6)[0]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cached = {}
    for k in (0, 3):
        eng = engine(model, k, snapshot_slots=8)
        out = eng.generate([first], params)[0]
        turn = first + out.output_ids + prompts(1, seed=7)[0]
        again = eng.generate([turn], params)[0]
        assert again.output_ids == plain_greedy(model, turn, 8)
        cached[k] = again.cached_tokens
    assert cached[3] == cached[0] > 0
    drafts = []
    for warm in (False, True):
        eng = engine(model, 3, snapshot_slots=8)
        if warm:
            eng.generate([first], params)
        seq_id = eng.add_request(turn, params)
        eng.step()  # the prefill (from the hit when warm) and the first drafts
        drafts.append(list(eng.sequences[seq_id].draft_ids))
    assert len(drafts[0]) == 3 and drafts[0] == drafts[1]


def test_steps_without_drafts_replay_the_prefill_graphs(model):
    """With speculation, a trunk step without drafts (a prompt, a returning turn) goes through the prefill graphs'
    segments (run eagerly here) and hands the head their hidden states: the same tokens, and the same first drafts
    after the returning turn, as the eager trunk."""
    first = prompts(1, seed=5)[0] + prompts(1, seed=6)[0]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    runs = []
    for graphs_on in (False, True):
        eng = engine(model, 3, snapshot_slots=8)
        if graphs_on:
            graphs = eng.runner.prefill_graphs = PrefillGraphs(model, 128, 4, eng.runner.width)
            graphs.capture(eng.pools, eager=True)
        out = eng.generate([first], params)[0]
        turn = first + out.output_ids + prompts(1, seed=7)[0]
        seq_id = eng.add_request(turn, params)
        eng.step()  # the returning turn's prefill and its first drafts
        drafts = list(eng.sequences[seq_id].draft_ids)
        while eng.has_unfinished:
            eng.step()
        runs.append((out.output_ids, eng.pop_output(seq_id).output_ids, drafts, eng.runner.num_graph_prefill_steps))
    (*eager, none), (*replayed, steps) = runs
    assert replayed == eager and len(eager[2]) == 3 and none == 0 and steps == 2
    assert eager[1] == plain_greedy(model, turn, 8)


def test_a_snapshot_inside_a_prefill_beside_verify_steps(model):
    """A cold prompt prefills (its last page boundary snapshotted inside the chunk) in the same step as another
    sequence's verify chunk; a later prompt that hits that snapshot still decodes greedy's tokens."""
    short, long = prompts(1, seed=21)[0][:6], prompts(1, seed=22)[0] + prompts(1, seed=23)[0]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    eng = engine(model, 2, snapshot_slots=8, max_num_seqs=2)
    eng.speculator.replace_drafts = forcing(model, "none")
    first = eng.add_request(short, params)
    eng.step()  # short's prefill: from now on it brings drafts
    second = eng.add_request(long, params)
    eng.step()  # short's verify chunk beside long's prefill chunk with a snapshot point
    while eng.has_unfinished:
        eng.step()
    for seq_id, prompt in ((first, short), (second, long)):
        assert eng.pop_output(seq_id).output_ids == plain_greedy(model, prompt, 10)
    turn = long + [7, 8, 9]
    out = eng.generate([turn], params)[0]
    assert out.cached_tokens == len(long) // 4 * 4 and out.output_ids == plain_greedy(model, turn, 10)


def test_speculation_under_preemption(model):
    """A pool too small for every sequence at once: sequences are preempted and recomputed, and still decode
    greedy's tokens."""
    batch = prompts(4, seed=11)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    eng = engine(model, 2, num_pages=30, max_num_seqs=4, snapshot_slots=2)
    eng.speculator.replace_drafts = forcing(model, "random", seed=3)
    outputs = eng.generate(batch, params)
    assert eng.scheduler.num_preemptions > 0
    for prompt, out in zip(batch, outputs):
        assert out.output_ids == plain_greedy(model, prompt, 16)
    assert len(eng.scheduler.free_state_slots) == eng.cfg.max_num_seqs and not any(eng.block_manager.refcount)


def test_stop_token_inside_a_verify_step_ends_there(model):
    prompt = prompts(1, seed=2)[0]
    truth = plain_greedy(model, prompt, 12)
    stop = truth[5]
    cut = truth.index(stop) + 1
    eng = engine(model, 4)
    eng.speculator.replace_drafts = forcing(model, "all")
    out = eng.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(stop,)))[0]
    assert out.output_ids == truth[:cut] and out.finish_reason == "stop"


def test_speculation_needs_the_mtp_head():
    model = Qwen35ForCausalLM.random(get_preset("tiny", mtp_num_hidden_layers=0), seed=0)
    with pytest.raises(ValueError, match="MTP head"):
        LLMEngine(model, EngineConfig(num_pages=16, speculative_tokens=2))
    with pytest.raises(ValueError, match="speculative_tokens must lie in"):
        EngineConfig(speculative_tokens=5)


def test_verify_step_keeps_the_state_after_every_token(model):
    """The GDN layers of a verify step write the state after each token to its position slot: equal to plain
    one-token steps' states; the last token's goes to the sequence's slot where it has no position slot."""
    cfg = model.config
    torch.manual_seed(0)
    n, slots = 5, 8
    qkv_w = cfg.conv_dim
    layer = model.model.layers[0].linear_attn
    x = torch.randn(n, cfg.hidden_size)
    proj = layer.project_in(x)
    conv0 = torch.randn(slots, qkv_w, cfg.linear_conv_kernel_dim - 1)
    rec0 = torch.randn(slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim) * 0.1

    def step(rows, position_slots=None):
        m = len(rows)
        return StepInput(token_ids=torch.zeros(m, dtype=torch.int64), positions=torch.arange(m),
                         cu_seqlens=torch.tensor([0, m], dtype=torch.int32), max_seqlen_q=m, cu_seqlens_host=(0, m),
                         seqused_k=torch.tensor([m], dtype=torch.int32),
                         page_table=torch.zeros(1, 1, dtype=torch.int32), slot_mapping=torch.arange(m),
                         state_slots=torch.tensor([0]), position_slots=position_slots)

    for last in (-1, 7):  # the last token's state: to the sequence's slot, or to a position slot of its own
        conv, rec = conv0.clone(), rec0.clone()
        out = layer.core(proj, step(range(n), torch.tensor([3, 4, 5, 6, last])), conv, rec)
        conv_ref, rec_ref = conv0.clone(), rec0.clone()
        for i in range(n):
            ref_out = layer.core(proj[i:i + 1], step([i]), conv_ref, rec_ref)
            assert torch.allclose(out[i], ref_out[0], atol=1e-6)
            where = 3 + i if i < n - 1 else max(last, 0)
            assert torch.allclose(rec[where], rec_ref[0], atol=1e-6) and torch.equal(conv[where], conv_ref[0])
        if last >= 0:
            assert torch.equal(rec[0], rec0[0]) and torch.equal(conv[0], conv0[0])
    assert ops.backend_table()["gated_deltanet"] == "reference"


# ---- sampling -----------------------------------------------------------------------------------------------

SMALL_VOCAB, DRAWS, ALPHA = 12, 2000, 1e-3


def joint_of_tokens_2_and_3(model, prompt: list[int]) -> torch.Tensor:
    """The exact distribution of (token 2, token 3) after prompt at temperature 1: (V, V), from the model's
    probabilities over every token 1 and 2."""
    v = SMALL_VOCAB
    p1 = torch.softmax(model(torch.tensor([prompt]), model.new_cache(1, 64))[0, -1].double(), -1)  # (V,)
    ids = torch.tensor([prompt + [a, b] for a in range(v) for b in range(v)])
    logits = model(ids, model.new_cache(v * v, 64))[:, -2:].double()  # (V*V, 2, V)
    p2 = torch.softmax(logits[::v, 0], -1)  # (V, V): token 2 given token 1
    p3 = torch.softmax(logits[:, 1], -1).view(v, v, v)  # token 3 given tokens 1, 2
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


def chi_square_p(pairs: list[tuple[int, int]], expected: torch.Tensor) -> float:
    """Pearson's chi-square p-value of the pairs against expected (V, V), cells of expected count < 5 pooled."""
    counts = torch.zeros_like(expected)
    for a, b in pairs:
        counts[a, b] += 1
    exp = expected.flatten() * len(pairs)
    obs = counts.flatten()
    small = exp < 5
    if small.any():
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor((exp.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def sampled_pairs(model, prompt, k: int, draws: int, draft_vocab: int = 0) -> tuple[list[tuple[int, int]], LLMEngine]:
    eng = LLMEngine(model, EngineConfig(num_pages=1024, page_size=4, max_num_seqs=64, speculative_tokens=k,
                                        draft_vocab_size=draft_vocab))
    # max_tokens 4: the verify step after token 1 checks two drafts; the same prompt each time, so that all but the
    # first requests start from the prefix cache
    outs = eng.generate([prompt] * draws, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
    return [tuple(o.output_ids[1:3]) for o in outs], eng


def keep_every_draft(drafts, q, p, generator=None):
    """A wrong acceptance (the control): every draft kept, then a draw from the target."""
    k = drafts.shape[1]
    own = torch.multinomial(p[:, k], 1, generator=generator)
    return torch.full((drafts.shape[0],), k + 1), torch.cat([drafts, own], 1)


def test_sampled_tokens_2_and_3_keep_their_distribution(monkeypatch):
    model = Qwen35ForCausalLM.random(get_preset("tiny", vocab_size=SMALL_VOCAB), seed=0)
    randomize_(model, 4)
    prompt = [3, 1, 4, 1, 5]
    expected = joint_of_tokens_2_and_3(model, prompt)
    plain, _ = sampled_pairs(model, prompt, 0, DRAWS)
    drafted, eng = sampled_pairs(model, prompt, 2, DRAWS)
    # a draft vocab of half the ids: q is zero past it, so the residual there is all of p
    reduced, eng_reduced = sampled_pairs(model, prompt, 2, DRAWS, draft_vocab=SMALL_VOCAB // 2)
    for e in (eng, eng_reduced):
        kept = e.speculator.num_accepted / e.speculator.num_verified
        assert 0.05 < kept < 0.95, f"drafts kept {kept:.2f}: the test would not see both paths"
    found = chi_square_p(plain, expected), chi_square_p(drafted, expected), chi_square_p(reduced, expected)
    assert min(found) > ALPHA, found
    # the test can fail: keeping every draft gives the drafter's distribution, which it rejects
    monkeypatch.setattr(speculative.R, "speculative_accept", keep_every_draft)
    wrong, _ = sampled_pairs(model, prompt, 2, DRAWS // 4)
    assert chi_square_p(wrong, expected) < ALPHA


# ---- the GPU: bf16, the Triton kernels (the verify step's GDN kernel, the paged attention at q_len 2..5) ----------

GPU_TIE = 0.25  # a top-2 logit gap below this in bf16 (|logits| ~10: 3 bits of mantissa apart) is a near-tie


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["drafted", "random"])
def test_gpu_batch1_speculative_greedy_follows_plain_greedy(mode):
    """Batch 1 on the GPU: speculative greedy output equals the plain engine's (decode graphs) until a position
    where plain greedy's top-2 logits are within GPU_TIE of each other, if it diverges at all."""
    model = Qwen35ForCausalLM.random(get_preset("tiny", vocab_size=VOCAB), device="cuda", dtype=torch.bfloat16,
                                     seed=0)
    randomize_(model, 0)
    prompt = prompts(1, seed=31)[0] * 4
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    cfg = dict(num_pages=256, page_size=16, max_num_seqs=2, max_model_len=512)
    with ops.use_backend("triton"):
        plain = LLMEngine(model, EngineConfig(**cfg)).generate([prompt], params)[0].output_ids
        spec = LLMEngine(model, EngineConfig(**cfg, speculative_tokens=3))
        if mode == "random":  # greedy's next tokens up to a random length, then wrong ones
            def forced(seq, drafts):
                truth = (plain[len(seq.output_ids):] + [0] * len(drafts))[:len(drafts)]
                n = random.Random(len(seq.output_ids)).randint(0, len(drafts))
                return truth[:n] + [(t + 1) % VOCAB for t in truth[n:]]
            spec.speculator.replace_drafts = forced
        got = spec.generate([prompt], params)[0].output_ids
        logits = model(torch.tensor([prompt + plain], device="cuda"),
                       model.new_cache(1, 512, page_size=16))[0, len(prompt) - 1:-1].float()
    assert spec.speculator.num_verified > 0 and spec.speculator.graphs  # greedy decode steps from CUDA graphs
    assert mode == "random" or spec.num_ahead_steps > 0  # replace_drafts (random) keeps steps from running ahead
    same = next((i for i, (a, b) in enumerate(zip(got, plain)) if a != b), len(plain))
    if same < len(plain):
        top2 = logits[same].topk(2).values
        assert top2[0] - top2[1] < GPU_TIE, f"diverged at token {same} with a top-2 gap of {top2[0] - top2[1]:.3f}"


@pytest.mark.gpu
def test_gpu_forced_lengths_replay_from_graphs():
    """force_lengths on the GPU: the greedy steps are captured again with the forced length inside, and replayed;
    three sequences at batch 4 (one padding row) keep 3 tokens a step on average."""
    model = Qwen35ForCausalLM.random(get_preset("tiny", vocab_size=VOCAB), device="cuda", dtype=torch.bfloat16,
                                     seed=0)
    cfg = EngineConfig(num_pages=256, page_size=16, max_num_seqs=4, max_model_len=512, speculative_tokens=3)
    with ops.use_backend("triton"):
        eng = LLMEngine(model, cfg)
        eng.speculator.force_lengths(3.0, seed=2)
        outs = eng.generate(prompts(3, seed=70), SamplingParams(max_tokens=40, ignore_eos=True))
    spec = eng.speculator
    assert spec.graphs and spec.num_device_steps > 0 and all(len(o.output_ids) == 40 for o in outs)
    assert 2.5 < 1 + spec.num_accepted / spec.num_verify_steps <= 3.0


def test_metrics_count_drafts_and_kept_drafts():
    from serving.metrics import EngineStats, ServingMetrics
    text = ServingMetrics().render(EngineStats(draft_tokens=30, accepted_draft_tokens=12))
    assert "fa4_spec_decode_draft_tokens_total 30" in text and "fa4_spec_decode_accepted_tokens_total 12" in text
    assert "# TYPE fa4_spec_decode_accepted_tokens_total counter" in text


def test_step_phases_count_a_prompt_as_prefill(model):
    """A speculative engine's prompt step reports its tokens as prefill, not as a decode row (the commit moves the
    chunk's start to the sequence's last token): what the trace bench's breakdown by kind of step reads."""
    eng = engine(model, 3)
    prompt = prompts(1, seed=9)[0]
    eng.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()
    assert (eng.last_step.prefill_tokens, eng.last_step.decode_rows) == (len(prompt), 0)
