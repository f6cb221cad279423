"""Builders of small transformers Qwen3.5 models (the oracle) and their counterparts here, shared by tests."""
import torch

from model.config import Qwen35Config

SMALL = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, rope_theta=1e6)
SMALL_MOE = dict(SMALL, intermediate_size=0, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
                 shared_expert_intermediate_size=48)


def small_config(moe: bool = False, **overrides) -> Qwen35Config:
    return Qwen35Config(**{**(SMALL_MOE if moe else SMALL), **overrides})


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Random values everywhere, norms included, so that no weight hides behind an identity."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=gen) * 2.0)
        elif "conv1d" in name:
            p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
        elif "norm" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if "linear_attn.norm" in name else 0.0))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.08)


def hf_text_model(cfg: Qwen35Config, seed: int = 0):
    """transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM for cfg, fp32, random weights."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig
    hf = cfg.to_hf()
    hf.pop("model_type")
    if cfg.is_moe:
        hf.pop("intermediate_size", None)
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**hf))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**hf))
    model = model.float().eval()
    randomize_(model, seed)
    return model


def hf_state_dict(model, per_expert: bool = False) -> dict[str, torch.Tensor]:
    """Our model's weights named and split as in an HF checkpoint (fused projections into their parts, the tied
    lm_head left out); MoE experts packed (`mlp.experts.gate_up_proj`) or per_expert (`mlp.experts.{e}.*_proj`)."""
    from model.loader import fused_parts
    params = dict(model.named_parameters())
    out = {hf: params[target][rows].clone() for hf, (target, rows, _) in fused_parts(model).items()}
    fused = {target for target, _, _ in fused_parts(model).values()}
    for name, p in params.items():
        if name in fused:
            continue
        if per_expert and name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name[:-len(".gate_up_proj")], p.shape[1] // 2
            for e in range(p.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = p[e, :inter].clone()
                out[f"{base}.{e}.up_proj.weight"] = p[e, inter:].clone()
        elif per_expert and name.endswith("mlp.experts.down_proj"):
            for e in range(p.shape[0]):
                out[f"{name[:-len('.down_proj')]}.{e}.down_proj.weight"] = p[e].clone()
        else:
            out[name] = p.detach().clone()
    return out
