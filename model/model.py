"""Qwen3.5 for causal LM (dense and MoE): embeddings, hybrid decoder layers, final norm, lm_head.

One code path serves prefill of T tokens and decode of one: `forward_step` over a flat varlen batch
(model.step.StepInput) and the cache pools (model.cache.CachePools). `forward` is the plain (batch, T)
entry that drives a SequenceCache.

Tensor parallel (model.parallel): built with a ParallelContext of world size N, the model holds one rank's
slices (ShardPlan) and forward_step runs the collectives; every rank runs it on the same inputs and gets the
same logits. At world size 1 nothing differs from the plain model.
"""
import math

import torch
from torch import nn

import reference as R
from model import ops
from model.cache import CachePools, SequenceCache
from model.config import Qwen35Config, get_preset
from model.layers import DecoderLayer, FusedLinear, Linear, RMSNorm
from model.mtp import MultiTokenPredictor
from model.parallel import SINGLE, ParallelContext, ShardPlan, gather_logits, vocab_parallel_embedding
from model.step import StepInput


class Qwen35Backbone(nn.Module):
    """transformers' `model.*`: embed_tokens, layers, norm."""

    def __init__(self, cfg: Qwen35Config, plan: ShardPlan):
        super().__init__()
        self.embed_tokens = nn.Embedding(plan.vocab.size if plan.sharded else cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t, plan) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen35Config, tp: ParallelContext | None = None):
        """tp: this process's rank in a tensor-parallel group (None: one process holds the whole model).
        Raises ValueError when cfg cannot be split over tp.world_size ranks."""
        super().__init__()
        self.config = cfg
        self.plan = ShardPlan.build(cfg, tp or SINGLE)
        self.model = Qwen35Backbone(cfg, self.plan)
        vocab_rows = self.plan.vocab.size if self.plan.sharded else cfg.vocab_size
        self.lm_head = Linear(cfg.hidden_size, vocab_rows)
        self.tie_weights()
        # registered last, so that seeded random weights of the trunk do not depend on whether it exists
        self.mtp = MultiTokenPredictor(cfg, self.plan) if cfg.mtp_num_hidden_layers else None
        # layer index -> its ordinal among layers of its kind (the index into the cache pools)
        self._pool_index = {i: cfg.full_attention_layers.index(i) if t == "full_attention"
                            else cfg.linear_attention_layers.index(i) for i, t in enumerate(cfg.layer_types)}

    @property
    def tp(self) -> ParallelContext:
        return self.plan.tp

    @property
    def cache_config(self) -> Qwen35Config:
        """The config of this rank's cache shapes (its KV heads and GDN heads); the model config at world size 1."""
        return self.plan.local

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None

    def drop_mtp(self) -> None:
        """Serve without the MTP head (a checkpoint without `mtp.*` tensors): its weights are freed. The config
        keeps what the checkpoint declared; has_mtp says whether the head is here."""
        self.mtp = None

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def empty(cls, cfg: Qwen35Config, *, device="cpu", dtype=torch.float32,
              tp: ParallelContext | None = None) -> "Qwen35ForCausalLM":
        """Uninitialised parameters of the right shapes (this rank's slices under tp), each allocated once, in
        `dtype`, on `device`: no float32 model first (its bf16 weights alone fill most of a card for 35B-A3B)."""
        with torch.device("meta"):
            model = cls(cfg, tp)
        _materialize(model, torch.device(device), dtype)
        return model

    # ---- construction ------------------------------------------------------------------------------------

    @classmethod
    def from_preset(cls, name: str, *, device="cpu", dtype=torch.float32, seed: int = 0,
                    tp: ParallelContext | None = None) -> "Qwen35ForCausalLM":
        """A preset's real shapes with seeded RANDOM weights (for speed and tests, not for text)."""
        return cls.random(get_preset(name), device=device, dtype=dtype, seed=seed, tp=tp)

    @classmethod
    def random(cls, cfg: Qwen35Config, *, device="cpu", dtype=torch.float32, seed: int = 0,
               tp: ParallelContext | None = None):
        """Seeded random weights; under tp each rank holds the slices of the world-size-1 model's weights."""
        model = cls.empty(cfg, device=device, dtype=dtype, tp=tp)
        model.init_random_weights(seed)
        return model.eval()

    @torch.no_grad()
    def init_random_weights(self, seed: int) -> None:
        """Seeded random weights with the scales of a trained model's initialisation. Tensor parallel: each full
        tensor is drawn as at world size 1 (one at a time), then this rank keeps its slice."""
        gen = torch.Generator(device=self.lm_head.weight.device).manual_seed(seed)
        full = _FullShapes(self.config) if self.plan.sharded else None
        for name, local in self.named_parameters():
            p = local if full is None else torch.empty(full.shapes[name], dtype=local.dtype, device=local.device)
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
            if full is not None:
                local.copy_(full.take(self.plan, name, p))

    def new_cache(self, batch: int, max_tokens: int, *, page_size: int = 16, shuffle_pages: bool = False,
                  seed: int = 0, mtp: bool = False) -> SequenceCache:
        """mtp: the pools also hold the MTP head's KV layer."""
        p = self.lm_head.weight
        return SequenceCache(self.cache_config, batch, max_tokens, page_size=page_size, dtype=p.dtype, device=p.device,
                             shuffle_pages=shuffle_pages, seed=seed,
                             mtp_layers=self.config.mtp_num_hidden_layers if mtp else 0)

    # ---- forward -----------------------------------------------------------------------------------------

    def check_token_ids(self, token_ids: torch.Tensor) -> None:
        if token_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be an integer tensor, got {token_ids.dtype}")
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}), "
                             f"got min {int(token_ids.min())} and max {int(token_ids.max())}")

    def prepare_rope(self, step: StepInput) -> None:
        """Fill step.cos, step.sin (every attention layer's RoPE of the step's positions) when the builder did not."""
        if step.cos is None:
            step.cos, step.sin = R.rope_cos_sin(step.positions, self.config.rotary_dim, self.config.rope_theta)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids: (N,) -> (N, hidden)
        if self.plan.sharded:
            return vocab_parallel_embedding(token_ids, self.model.embed_tokens.weight, self.plan)
        return self.model.embed_tokens(token_ids)

    def layer_caches(self, i: int, pools: CachePools) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's views of the pools: (k_pages, v_pages) for full attention, (conv, recurrent states) for GDN."""
        j = self._pool_index[i]
        if self.model.layers[i].layer_type == "full_attention":
            return pools.k_pages[j], pools.v_pages[j]
        return pools.conv_states[j], pools.recurrent_states[j]

    def forward_step(self, step: StepInput, pools: CachePools, *, all_logits: bool = False,
                     with_hidden: bool = False, logit_rows: torch.Tensor | None = None):
        """Run N new tokens of B sequences through the model, reading and extending the pools.
        Returns logits (N, vocab) when all_logits, else each sequence's last token (B, vocab), or the tokens at
        logit_rows (R,) int64 (a verify step's rows); with_hidden: also every token's hidden state after the final
        norm (N, hidden), what the MTP head reads."""
        *_, out = self.forward_step_layers(step, pools, all_logits=all_logits, with_hidden=with_hidden,
                                           logit_rows=logit_rows)
        return out

    @torch.no_grad()
    def forward_step_layers(self, step: StepInput, pools: CachePools, *, all_logits: bool = False,
                            with_hidden: bool = False, logit_rows: torch.Tensor | None = None):
        """forward_step as a generator: yields None after each decoder layer's kernels are launched, then the
        logits, or (logits, hidden) with_hidden (serving interleaves other work between a prefill's layers)."""
        self.prepare_rope(step)
        x = self.embed(step.token_ids) if step.embeddings is None else step.embeddings
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, step, *self.layer_caches(i, pools))
            yield None
        h, _ = ops.add_rms_norm(x, residual, self.model.norm.weight, self.model.norm.eps)
        rows = logit_rows if logit_rows is not None else None if all_logits else step.last_token_indices
        logits = self.logits(h if rows is None else h[rows])
        yield (logits, h) if with_hidden else logits

    def logits(self, h: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
        # h: (n, hidden) normed -> (n, vocab); vocab: only the first `vocab` token ids' (the lm_head's first rows)
        if vocab is not None and vocab < self.config.vocab_size:
            if self.plan.sharded:
                raise ValueError("a reduced vocab runs at tensor-parallel world size 1")
            return ops.linear(h, self.lm_head.weight[:vocab])
        logits = self.lm_head(h)
        return gather_logits(logits, self.plan) if self.plan.sharded else logits

    @torch.no_grad()
    def forward_mtp(self, step: StepInput, hidden: torch.Tensor, pools: CachePools, *, all_logits: bool = False,
                    logit_rows: torch.Tensor | None = None, vocab: int | None = None):
        """The MTP head over a step whose token_ids are each row's next token (row t: token t+1 at position t) and
        hidden (N, hidden) the trunk's (or the previous draft's) normed hidden state of each row. Writes the head's
        KV into its pool layer (pools from new_cache(mtp=True) or a pool with one more attention layer).
        Returns (logits (N, B or R, vocab) as forward_step's, the head's output hidden (N, hidden)); with vocab,
        the logits of the first `vocab` token ids only (a reduced draft vocabulary)."""
        if self.mtp is None:
            raise ValueError("this model has no MTP head (its checkpoint has no mtp.* tensors)")
        j = len(self.config.full_attention_layers)
        if pools.k_pages.shape[0] <= j:
            raise ValueError("the cache pools have no layer for the MTP head's KV (allocate them with mtp_layers)")
        self.prepare_rope(step)
        h = self.mtp(self.embed(step.token_ids), hidden, step, pools.k_pages[j], pools.v_pages[j])
        rows = logit_rows if logit_rows is not None else None if all_logits else step.last_token_indices
        return self.logits(h if rows is None else h[rows], vocab), h

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: SequenceCache, *, all_logits: bool = True) -> torch.Tensor:
        """input_ids: (batch, T) appended to the sequences in `cache` -> logits (batch, T, vocab),
        or only each sequence's last position (batch, 1, vocab) when not all_logits."""
        self.check_token_ids(input_ids)
        if cache.cfg != self.cache_config:
            raise ValueError("the cache was made for another model config")
        step = cache.plan(input_ids)
        logits = self.forward_step(step, cache.pools, all_logits=all_logits)
        cache.advance(step)
        return logits.view(input_ids.shape[0], -1, logits.shape[-1])


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Replace the meta parameters and buffers with uninitialised tensors on `device`: floating ones in `dtype` (what
    Module.to(dtype) would cast), the others in their own; one tensor under two names (tied embeddings) stays one."""
    made: dict[int, torch.Tensor] = {}  # id of the meta tensor -> its replacement
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for key, t in tensors.items():
                if t is None:
                    continue
                if id(t) not in made:
                    real = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
                    made[id(t)] = nn.Parameter(real, t.requires_grad) if isinstance(t, nn.Parameter) else real
                tensors[key] = made[id(t)]


class _FullShapes:
    """The world-size-1 parameter shapes and fused-projection parts of a config (a meta model: no memory)."""

    def __init__(self, cfg: Qwen35Config):
        with torch.device("meta"):
            whole = Qwen35ForCausalLM(cfg)
        self.shapes = {n: p.shape for n, p in whole.named_parameters()}
        self.parts = {f"{path}.weight": (path.rsplit(".", 1)[0], m.parts) for path, m in whole.named_modules()
                      if isinstance(m, FusedLinear)}

    def take(self, plan: ShardPlan, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full parameter `name`: a fused projection slices each of its parts."""
        if name not in self.parts:
            return plan.take(name, full)
        parent, parts = self.parts[name]
        pieces = full.split(list(parts.values()))
        return torch.cat([plan.take(f"{parent}.{part}.weight", t) for part, t in zip(parts, pieces)])
