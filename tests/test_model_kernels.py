"""The model on the Triton kernels equals the model on the references (decode steps after a prefill)."""
import pytest
import torch
from conftest import rel_err

from model import ops
from model.config import Qwen35Config
from model.model import Qwen35ForCausalLM

# the smallest shapes the kernels take (head_dim 64), for the CPU interpreter
SMALL = Qwen35Config(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=16, linear_value_head_dim=16)


def decode_logits(model, prompt, steps, backend, page_size):
    """Prefill on the references, then `steps` decode steps on `backend`: logits (steps, B, V). The decoded tokens
    are fixed (drawn from the prompt's generator state), not each backend's argmax: rounding that flips a near-tied
    argmax would send the two runs down different sequences and compare unrelated logits."""
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + steps, page_size=page_size, shuffle_pages=True)
    model(prompt, cache, all_logits=False)
    tokens = torch.randint(0, model.config.vocab_size, (steps, prompt.shape[0], 1),
                           generator=torch.Generator().manual_seed(int(prompt.sum()))).to(prompt.device)
    with ops.use_backend(backend):
        return torch.stack([model(tokens[i], cache, all_logits=False)[:, -1].float() for i in range(steps)])


def test_triton_backend_covers_decode_ops():
    with ops.use_backend("triton"):
        table = ops.backend_table()
    for op in ("rms_norm", "add_rms_norm", "silu_and_mul", "attention_prep", "paged_attention", "gated_deltanet"):
        assert table[op] == "triton", table


def test_final_norm_stays_apart_from_lm_head(monkeypatch):
    # the final norm runs as add_rms_norm, then lm_head's plain projection: lm_head's weight never reaches the
    # pre-norm projection (its norm inside the GEMV lost), whose other callers (the layers') still do
    model = Qwen35ForCausalLM.random(SMALL, seed=6)
    prompt = torch.randint(0, SMALL.vocab_size, (1, 19))
    calls = []
    real = ops.add_rms_norm_linear
    monkeypatch.setattr(ops, "add_rms_norm_linear", lambda *a: calls.append(a[-1].shape) or real(*a))
    decode_logits(model, prompt, 1, "triton", page_size=16)
    assert calls and model.lm_head.weight.shape not in calls


def test_model_decode_triton_equals_reference_cpu():
    cfg = SMALL
    model = Qwen35ForCausalLM.random(cfg, seed=3)
    prompt = torch.randint(0, cfg.vocab_size, (2, 19))
    ref = decode_logits(model, prompt, 2, "reference", page_size=16)
    out = decode_logits(model, prompt, 2, "triton", page_size=16)
    assert rel_err(out, ref) < 1e-4, rel_err(out, ref)


def test_model_prefill_triton_equals_reference_cpu():
    """A prompt prefilled in two chunks (65 tokens, then 5 over the cached 65) through the triton ops."""
    cfg = SMALL
    model = Qwen35ForCausalLM.random(cfg, seed=4)
    prompt = torch.randint(0, cfg.vocab_size, (2, 70))

    def run(backend):
        cache = model.new_cache(2, 80, page_size=16, shuffle_pages=True)
        with ops.use_backend(backend):
            first = model(prompt[:, :65], cache)
            second = model(prompt[:, 65:], cache)
        return torch.cat([first, second], dim=1)

    assert rel_err(run("triton"), run("reference")) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True])
def test_model_decode_triton_equals_reference_gpu(moe):
    """bf16: the kernels (GEMV, PDL, fused decode ops) are compared with the reference ops against the same model in
    fp32 (weights cast exactly): their error must stay within 1.5x the reference ops' own bf16 error (plus 5e-3).
    Two bf16 runs differ by their rounding (a measured 2.7e-2 between them), so neither is the oracle of the other.
    MoE runs in fp32 against the reference directly: routing is discrete, and bf16 rounding flips near-tied top-k
    choices."""
    extra = dict(intermediate_size=0, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                 shared_expert_intermediate_size=256) if moe else dict(intermediate_size=2048)
    cfg = Qwen35Config(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                       linear_num_value_heads=32, **extra)
    model = Qwen35ForCausalLM.random(cfg, device="cuda", dtype=torch.bfloat16, seed=1)
    # 3 x 700 tokens: the prefill chunk fills the SMs, so it takes the long-chunk path (the CuTe forward in bf16)
    prompt = torch.randint(0, cfg.vocab_size, (3, 700), device="cuda")
    exact = decode_logits(model.float(), prompt, 6, "reference", page_size=64)  # the same weights in fp32
    if moe:  # model is the fp32 model now (.float() converts in place)
        out = decode_logits(model, prompt, 6, "triton", page_size=64)
        assert rel_err(out, exact) < 1e-3, rel_err(out, exact)
        return
    model.bfloat16()
    ref = rel_err(decode_logits(model, prompt, 6, "reference", page_size=64), exact)
    ours = rel_err(decode_logits(model, prompt, 6, "triton", page_size=64), exact)
    assert ours < 1.5 * ref + 5e-3, f"triton ops' error {ours:.3e} against fp32, reference ops' {ref:.3e}"
