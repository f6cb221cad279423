"""The presets have the real Qwen3.5 text-model sizes (counted on the meta device, nothing allocated; the MTP head
apart, as the published sizes leave it out)."""
import pytest
import torch

from model.config import get_preset
from model.model import Qwen35ForCausalLM

# billions of text parameters (embedding counted once when tied), and of active parameters per token
SIZES = {"qwen3.5-0.8b": (0.70, 0.80), "qwen3.5-2b": (1.80, 2.00), "qwen3.5-4b": (4.0, 4.4),
         "qwen3.5-9b": (8.7, 9.2), "qwen3.5-27b": (26.5, 27.5), "qwen3.5-35b-a3b": (34.0, 35.5)}


def count_params(name):
    with torch.device("meta"):
        model = Qwen35ForCausalLM(get_preset(name))
    trunk = {n: p for n, p in model.named_parameters() if not n.startswith("mtp.")}
    total = sum(p.numel() for p in trunk.values())
    experts = sum(p.numel() for n, p in trunk.items() if ".experts." in n)
    cfg = model.config
    active = total - experts + (experts * cfg.num_experts_per_tok // cfg.num_experts if cfg.is_moe else 0)
    return total / 1e9, active / 1e9


@pytest.mark.parametrize("name", sorted(SIZES))
def test_preset_sizes(name):
    total, active = count_params(name)
    lo, hi = SIZES[name]
    assert lo <= total <= hi, f"{name}: {total:.3f}B parameters"
    if name.endswith("a3b"):
        assert 2.5 <= active <= 3.5, f"{name}: {active:.3f}B active parameters"


@pytest.mark.parametrize("name", sorted(SIZES))
def test_presets_carry_one_mtp_layer(name):
    """Every released Qwen3.5 has one MTP layer: a full-attention decoder layer with the trunk's MLP kind."""
    with torch.device("meta"):
        model = Qwen35ForCausalLM(get_preset(name))
    assert model.has_mtp and len(model.mtp.layers) == 1
    assert model.mtp.layers[0].layer_type == "full_attention"
    assert hasattr(model.mtp.layers[0].mlp, "experts") == model.config.is_moe
