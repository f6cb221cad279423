"""Qwen3.5 for causal LM (dense and MoE): embeddings, hybrid decoder layers, final norm, lm_head.

One code path serves prefill of T tokens and decode of one: `forward_step` over a flat varlen batch
(model.step.StepInput) and the cache pools (model.cache.CachePools). `forward` is the plain (batch, T)
entry that drives a SequenceCache.
"""
import math

import torch
from torch import nn

import reference as R
from model import ops
from model.cache import CachePools, SequenceCache
from model.config import Qwen35Config, get_preset
from model.layers import DecoderLayer, RMSNorm
from model.step import StepInput


class Qwen35Backbone(nn.Module):
    """transformers' `model.*`: embed_tokens, layers, norm."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.config = cfg
        self.model = Qwen35Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # layer index -> its ordinal among layers of its kind (the index into the cache pools)
        self._pool_index = {i: cfg.full_attention_layers.index(i) if t == "full_attention"
                            else cfg.linear_attention_layers.index(i) for i, t in enumerate(cfg.layer_types)}

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config says so (again after to_empty, which unties)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def empty(cls, cfg: Qwen35Config, *, device="cpu", dtype=torch.float32) -> "Qwen35ForCausalLM":
        """Uninitialised parameters of the right shapes, allocated once on `device` in `dtype`."""
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device=device).to(dtype)
        model.tie_weights()
        return model

    # ---- construction ------------------------------------------------------------------------------------

    @classmethod
    def from_preset(cls, name: str, *, device="cpu", dtype=torch.float32, seed: int = 0) -> "Qwen35ForCausalLM":
        """A preset's real shapes with seeded RANDOM weights (for speed and tests, not for text)."""
        return cls.random(get_preset(name), device=device, dtype=dtype, seed=seed)

    @classmethod
    def random(cls, cfg: Qwen35Config, *, device="cpu", dtype=torch.float32, seed: int = 0):
        model = cls.empty(cfg, device=device, dtype=dtype)
        model.init_random_weights(seed)
        return model.eval()

    @torch.no_grad()
    def init_random_weights(self, seed: int) -> None:
        """Seeded random weights with the scales of a trained model's initialisation."""
        gen = torch.Generator(device=self.lm_head.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, 0.05, generator=gen)
            elif "norm" in name:
                p.normal_(0.0, 0.05, generator=gen)
            elif leaf == "A_log":
                p.uniform_(0.0, math.log(16.0), generator=gen)
            elif leaf == "dt_bias":
                p.normal_(1.0, 0.1, generator=gen)
            elif "conv1d" in name:
                p.uniform_(-0.5, 0.5, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)

    def new_cache(self, batch: int, max_tokens: int, *, page_size: int = 16, shuffle_pages: bool = False,
                  seed: int = 0) -> SequenceCache:
        p = self.lm_head.weight
        return SequenceCache(self.config, batch, max_tokens, page_size=page_size, dtype=p.dtype, device=p.device,
                             shuffle_pages=shuffle_pages, seed=seed)

    # ---- forward -----------------------------------------------------------------------------------------

    def check_token_ids(self, token_ids: torch.Tensor) -> None:
        if token_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be an integer tensor, got {token_ids.dtype}")
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}), "
                             f"got min {int(token_ids.min())} and max {int(token_ids.max())}")

    @torch.no_grad()
    def forward_step(self, step: StepInput, pools: CachePools, *, all_logits: bool = False) -> torch.Tensor:
        """Run N new tokens of B sequences through the model, reading and extending the pools.
        Returns logits (N, vocab) when all_logits, else each sequence's last token (B, vocab)."""
        if step.cos is None:
            step.cos, step.sin = R.rope_cos_sin(step.positions, self.config.rotary_dim, self.config.rope_theta)
        x, residual = self.model.embed_tokens(step.token_ids), None
        for i, layer in enumerate(self.model.layers):
            j = self._pool_index[i]
            if layer.layer_type == "full_attention":
                x, residual = layer(x, residual, step, pools.k_pages[j], pools.v_pages[j])
            else:
                x, residual = layer(x, residual, step, pools.conv_states[j], pools.recurrent_states[j])
        h, _ = ops.add_rms_norm(x, residual, self.model.norm.weight, self.model.norm.eps)
        if not all_logits:
            h = h[step.last_token_indices]
        return self.lm_head(h)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: SequenceCache, *, all_logits: bool = True) -> torch.Tensor:
        """input_ids: (batch, T) appended to the sequences in `cache` -> logits (batch, T, vocab),
        or only each sequence's last position (batch, 1, vocab) when not all_logits."""
        self.check_token_ids(input_ids)
        if cache.cfg != self.config:
            raise ValueError("the cache was made for another model config")
        step = cache.plan(input_ids)
        logits = self.forward_step(step, cache.pools, all_logits=all_logits)
        cache.advance(step)
        return logits.view(input_ids.shape[0], -1, logits.shape[-1])
