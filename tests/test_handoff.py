"""kernels/handoff.py: a batch-1 GDN decode output handed to the out-proj chain by a counter (CPU: the interpreter's
GDN kernel counts, the unchained out_proj_mlp zeroes the counter; the chain's side is compiled in test_tma_gemv)."""
import pytest
import torch
from conftest import record_launches
from test_gdn_decode import EPS, make_layer, make_token
from test_model_kernels import SMALL, decode_logits

from kernels import gdn_decode, handoff, linear
from kernels.gdn_decode import gdn_decode_step
from kernels.tma_gemv import GemvInput, TmaGemvConfig
from model import ops
from model.config import Qwen35Config
from model.model import Qwen35ForCausalLM


@pytest.fixture
def enabled(monkeypatch):
    monkeypatch.setattr(handoff, "ENABLED", True)
    monkeypatch.setattr(handoff, "_ARMED", {})
    monkeypatch.setattr(handoff, "_COUNTERS", {})


@pytest.mark.parametrize("bsz", [1, 2])
def test_gdn_kernel_counts_its_programs_at_batch_1(enabled, bsz):
    gen = torch.Generator().manual_seed(bsz)
    hk, hv, dk, dv = 2, 4, 16, 16
    conv_w, a_log, dt_bias, norm_w, conv, rec = make_layer(gen, hk, hv, dk, dv, torch.float32, 3)
    qkv, z, b, a = make_token(gen, bsz, hk, hv, dk, dv, torch.float32)
    slots = torch.arange(bsz)
    plain = gdn_decode_step(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, conv.clone(), rec.clone(), slots, hk, EPS)
    out = gdn_decode_step(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, conv, rec, slots, hk, EPS, hand_off=True)
    assert torch.equal(out, plain)
    taken = handoff.take(out)
    if bsz > 1:  # only batch-1 decode hands off
        assert taken is None and not handoff._COUNTERS
        return
    count, programs = taken
    assert programs == hk and int(count) == hk
    assert handoff.take(out) is None  # taken once


def test_other_outputs_are_not_taken(enabled):
    out = torch.zeros(1, 8)
    handoff.arm(out, 4)
    assert handoff.take(torch.zeros(1, 8)) is None and handoff.take(out) is not None


def test_unchained_out_proj_mlp_zeroes_the_counter(enabled):
    # on the CPU out_proj_mlp runs its three ops: the armed counter goes back to zero, the result is unchanged
    g = torch.Generator().manual_seed(0)
    o, residual = torch.randn(1, 32, generator=g), torch.randn(1, 16, generator=g)
    weights = (torch.randn(16, 32, generator=g), torch.randn(16, generator=g), 1e-6,
               torch.randn(48, 16, generator=g), torch.randn(16, 24, generator=g))
    with ops.use_backend("triton"):
        plain = linear.out_proj_mlp(o, residual, *weights)
        handoff.arm(o, 3)
        handoff.counter(o.device).fill_(3)
        handed = linear.out_proj_mlp(o, residual, *weights)
    assert all(torch.equal(x, y) for x, y in zip(handed, plain))
    assert int(handoff.counter(o.device)) == 0 and handoff.take(o) is None


@pytest.mark.parametrize("moe", [False, True])
def test_model_decode_hands_off_only_into_out_proj_mlp(enabled, monkeypatch, moe):
    # batch-1 decode on the triton backend (interpreter): a dense model's GDN kernels hand off (the counter is zero
    # after every step), an MoE model's do not (its mixer output goes to the experts); logits bit for bit unchanged
    cfg = Qwen35Config(**{**SMALL.__dict__, **(dict(intermediate_size=0, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, shared_expert_intermediate_size=32)
                                               if moe else {})})
    model = Qwen35ForCausalLM.random(cfg, seed=2)
    prompt = torch.randint(0, cfg.vocab_size, (1, 11))
    launches = record_launches(monkeypatch, gdn_decode, "_gdn_decode_kernel")
    handed = decode_logits(model, prompt, 2, "triton", page_size=16)
    flags = {kwargs["HANDOFF"] for _, kwargs in launches}
    monkeypatch.setattr(handoff, "ENABLED", False)
    plain = decode_logits(model, prompt, 2, "triton", page_size=16)
    assert torch.equal(handed, plain)
    assert flags == {not moe}
    assert all(int(c) == 0 for c in handoff._COUNTERS.values()) and not handoff._ARMED


def test_chain_config_needs_a_chain_for_the_counter():
    with pytest.raises(ValueError, match="after_counter"):
        TmaGemvConfig(2048, 16, 8, after_counter=True).validate()
    TmaGemvConfig(2048, 16, 8, chain=(GemvInput(2048),), after_counter=True).validate()


@pytest.mark.gpu
def test_gpu_chain_takes_the_handoff(monkeypatch):
    # bf16 on the H200 / H100: batch-1 decode steps whose out-proj chains wait on the counter give the logits of the
    # chains that wait on the GDN grid, bit for bit, and leave the counter at zero
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cfg = Qwen35Config(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                       linear_num_value_heads=32, intermediate_size=2048)
    model = Qwen35ForCausalLM.random(cfg, device="cuda", dtype=torch.bfloat16, seed=1)
    prompt = torch.randint(0, cfg.vocab_size, (1, 300), device="cuda")
    taken = []
    real_take = handoff.take
    monkeypatch.setattr(handoff, "take", lambda o: taken.append(real_take(o)) or taken[-1])
    monkeypatch.setattr(handoff, "ENABLED", True)
    handed = decode_logits(model, prompt, 6, "triton", page_size=64)
    monkeypatch.setattr(handoff, "ENABLED", False)
    plain = decode_logits(model, prompt, 6, "triton", page_size=64)
    assert torch.equal(handed, plain)
    assert sum(t is not None for t in taken) == 6 * len(cfg.linear_attention_layers)
    assert int(handoff.counter(prompt.device)) == 0
