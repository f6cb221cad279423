"""Tensor parallelism: which rank holds which slice of every weight, and the collectives that join the slices.

`ParallelContext` names a rank in a process group (world size 1 and no group: a single process, where every
helper below is a no-op). `ShardPlan` turns a Qwen35Config into this rank's slices:
- full attention: query heads split evenly; KV heads split too, or replicated (each rank keeps the one KV head
  its query heads use) when there are fewer KV heads than ranks. q_proj rows per head are [q | gate].
- Gated DeltaNet: key heads split evenly and each rank keeps the value heads of its key heads (whole key-head
  groups), so in_proj_qkv's rows and the conv1d channels become [q of my key heads | k of them | v of my value
  heads], and in_proj_z/b/a, A_log and dt_bias keep the rank's value heads.
- dense MLP and the MoE shared expert: the intermediate size split evenly; MoE experts split evenly (expert
  parallel), the router replicated.
- o_proj, out_proj and down_proj are row-parallel (their input columns split): each rank's output is a partial
  sum, and one all-reduce per block half (after the mixer, after the MLP) adds them.
- the vocabulary: each rank holds ceil(V / world) rows of the embedding / lm_head (the last rank's tail padded
  with zero rows); lookups are masked then all-reduced, logits gathered.
`ShardPlan.local` is the config of one rank's shapes (head counts, intermediate sizes): layers and cache pools are
built from it; at world size 1 it is the config itself.

All slicing rules live in `ShardPlan.pieces` (by HF tensor name), shared by the checkpoint loader and the seeded
random initialisation, so a model at world size N holds exactly the slices of the world-size-1 model.
"""
import os
import re
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from model.config import Qwen35Config


@dataclass(frozen=True)
class ParallelContext:
    """rank in world_size ranks; group: the process group of the model's collectives (None: the default group);
    cpu_group: a gloo group for host-side control messages (serving.tp_link), the default group when None."""
    rank: int = 0
    world_size: int = 1
    group: object = None
    cpu_group: object = None

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"bad tensor-parallel rank {self.rank} of world size {self.world_size}")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (no-op at world size 1). No host sync: capturable in a CUDA graph."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's x along dim (x itself at world size 1)."""
        if self.world_size == 1:
            return x
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x.contiguous(), group=self.group)  # rank r's x at rows [r * n, (r + 1) * n)
        return torch.cat(out.chunk(self.world_size), dim=dim)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (a host int; this syncs: for setup only)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t)


SINGLE = ParallelContext()
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12


CONTROL_TIMEOUT = timedelta(days=365)  # an idle server's workers wait on the control group for the next step


def init_parallel(rank: int, world_size: int, init_method: str | None = None, backend: str | None = None,
                  timeout: timedelta | None = None, store: dist.Store | None = None) -> ParallelContext:
    """Join the process group (NCCL when CUDA is available, else gloo) through init_method or an existing store,
    and make a gloo group for control messages (without a practical timeout: workers wait there while the server
    idles). Every rank must call this; NCCL's NVLink multicast (NVLS) is switched off in this process first.
    timeout: of the model's collectives (None: torch's default), e.g. short in tests, so that a dead rank fails the
    others instead of hanging them."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    if world_size == 1:
        return SINGLE
    if (init_method is None) == (store is None):
        raise ValueError("init_parallel takes one of init_method and store")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, init_method=init_method, store=store, rank=rank, world_size=world_size,
                            **({"timeout": timeout} if timeout is not None else {}))
    cpu_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return ParallelContext(rank, world_size, group=None, cpu_group=cpu_group)


@dataclass(frozen=True)
class Split:
    """This rank's [start, start + size) of `total` units (heads, channels, experts, rows)."""
    start: int
    size: int
    total: int

    @property
    def stop(self) -> int:
        return self.start + self.size


def _even(total: int, world: int, rank: int, what: str, why: str = "") -> Split:
    if total < world:
        raise ValueError(f"{what} ({total}) is fewer than the tensor-parallel size ({world}){why}")
    if total % world:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size ({world}){why}")
    size = total // world
    return Split(rank * size, size, total)


# per-layer HF tensor names (after model.layers.{i}.) -> how they are sliced
_LAYER = re.compile(r"^(?:model|mtp)\.layers\.\d+\.(.+)$")  # the trunk's layers and the MTP head's
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class ShardPlan:
    cfg: Qwen35Config
    tp: ParallelContext
    heads: Split  # query heads
    kv_heads: Split  # KV heads (size 1 and shared by several ranks when replicated)
    lin_k_heads: Split
    lin_v_heads: Split
    intermediate: Split
    experts: Split
    shared_intermediate: Split
    vocab: Split  # rows [start, start + size) of the padded vocabulary (stop may pass cfg.vocab_size)
    local: Qwen35Config  # one rank's shapes

    @classmethod
    def build(cls, cfg: Qwen35Config, tp: ParallelContext = SINGLE) -> "ShardPlan":
        """Raises ValueError naming the dimension that cannot be split over tp.world_size ranks."""
        w, r = tp.world_size, tp.rank
        heads = _even(cfg.num_attention_heads, w, r, "num_attention_heads")
        kv = cfg.num_key_value_heads
        if kv >= w:
            kv_heads = _even(kv, w, r, "num_key_value_heads")
        elif w % kv:
            raise ValueError(f"num_key_value_heads ({kv}) is fewer than the tensor-parallel size ({w}) and does "
                             f"not divide it, so KV heads cannot be replicated evenly")
        else:  # fewer KV heads than ranks: w / kv ranks share (replicate) each KV head
            kv_heads = Split(r // (w // kv), 1, kv)
        lin_k = _even(cfg.linear_num_key_heads, w, r, "linear_num_key_heads", ": each rank keeps whole key-head groups")
        lin_v = _even(cfg.linear_num_value_heads, w, r, "linear_num_value_heads")
        if cfg.is_moe:
            experts = _even(cfg.num_experts, w, r, "num_experts", ": experts are split across ranks")
            shared = _even(cfg.shared_expert_intermediate_size, w, r, "shared_expert_intermediate_size")
            inter = Split(0, cfg.intermediate_size, cfg.intermediate_size)  # unused by MoE layers
        else:
            experts = shared = Split(0, 0, 0)
            inter = _even(cfg.intermediate_size, w, r, "intermediate_size")
        v_rows = -(-cfg.vocab_size // w)
        vocab = Split(r * v_rows, v_rows, cfg.vocab_size)
        local = cfg if w == 1 else replace(
            cfg, num_attention_heads=heads.size, num_key_value_heads=kv_heads.size,
            linear_num_key_heads=lin_k.size, linear_num_value_heads=lin_v.size, intermediate_size=inter.size,
            shared_expert_intermediate_size=shared.size)
        return cls(cfg, tp, heads, kv_heads, lin_k, lin_v, inter, experts, shared, vocab, local)

    @property
    def sharded(self) -> bool:
        return self.tp.world_size > 1

    def local_expert(self, e: int) -> int | None:
        """The local index of global expert e, or None when another rank holds it (indices past the last
        expert map past the local ones, so that the loader reports them as unexpected)."""
        if e >= self.cfg.num_experts:
            return e - self.experts.start
        return e - self.experts.start if self.experts.start <= e < self.experts.stop else None

    def pieces(self, name: str) -> tuple[int, list[tuple[int, int]]] | None:
        """How the full tensor `name` (HF naming, backbone under `model.`) is sliced for this rank:
        (dim, [(start, stop), ...]) whose slices along dim are concatenated, or None when it is replicated."""
        c = self.cfg
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, [(self.vocab.start, self.vocab.stop)]  # stop may pass the vocab: zero rows (see take)
        m = _LAYER.match(name)
        if m is None:
            return None
        leaf = m.group(1)
        hd, h, kv = c.head_dim, self.heads, self.kv_heads
        dk, dv, k, v = c.linear_key_head_dim, c.linear_value_head_dim, self.lin_k_heads, self.lin_v_heads
        rows = {
            "self_attn.q_proj.weight": (0, [(h.start * 2 * hd, h.stop * 2 * hd)]),
            "self_attn.k_proj.weight": (0, [(kv.start * hd, kv.stop * hd)]),
            "self_attn.v_proj.weight": (0, [(kv.start * hd, kv.stop * hd)]),
            "self_attn.o_proj.weight": (1, [(h.start * hd, h.stop * hd)]),
            "linear_attn.in_proj_z.weight": (0, [(v.start * dv, v.stop * dv)]),
            "linear_attn.in_proj_b.weight": (0, [(v.start, v.stop)]),
            "linear_attn.in_proj_a.weight": (0, [(v.start, v.stop)]),
            "linear_attn.A_log": (0, [(v.start, v.stop)]),
            "linear_attn.dt_bias": (0, [(v.start, v.stop)]),
            "linear_attn.out_proj.weight": (1, [(v.start * dv, v.stop * dv)]),
            "mlp.experts.gate_up_proj": (0, [(self.experts.start, self.experts.stop)]),
            "mlp.experts.down_proj": (0, [(self.experts.start, self.experts.stop)]),
        }
        if leaf in rows:
            return rows[leaf]
        if leaf in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
            qk = k.total * dk  # channels q | k | v
            return 0, [(k.start * dk, k.stop * dk), (qk + k.start * dk, qk + k.stop * dk),
                       (2 * qk + v.start * dv, 2 * qk + v.stop * dv)]
        for prefix, split in (("mlp.shared_expert.", self.shared_intermediate), ("mlp.", self.intermediate)):
            if leaf in (prefix + "gate_proj.weight", prefix + "up_proj.weight"):
                return 0, [(split.start, split.stop)]
            if leaf == prefix + "down_proj.weight":
                return 1, [(split.start, split.stop)]
        return None  # norms, the router, shared_expert_gate: replicated

    def take(self, name: str, tensor) -> torch.Tensor:
        """This rank's slice of the full tensor `name`. tensor: a torch.Tensor or a safetensors slice
        (`safe_open(...).get_slice(name)`), which then reads only the rows or columns the rank needs."""
        spec = self.pieces(name) if self.sharded else None
        if spec is None:
            return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        dim, ranges = spec
        full = tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape()
        parts = []
        for start, stop in ranges:
            hi = min(stop, full[dim])
            if hi > start:
                parts.append(tensor[start:hi] if dim == 0 else tensor[:, start:hi])
            if stop > hi:  # vocabulary padding of the last rank (the loader casts to the model's dtype)
                shape = list(full)
                shape[dim] = stop - max(hi, start)
                parts.append(torch.zeros(shape, dtype=parts[0].dtype if parts else torch.float32))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def vocab_parallel_embedding(token_ids: torch.Tensor, weight: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """Embedding rows of token_ids from a vocab-sharded table: rows of other ranks give zeros, then the
    all-reduce sums in the one rank that holds each token's row. No host sync."""
    local = token_ids - plan.vocab.start
    inside = (local >= 0) & (local < plan.vocab.size)
    x = torch.nn.functional.embedding(local.clamp(0, plan.vocab.size - 1), weight)
    x = x * inside.unsqueeze(-1).to(x.dtype)
    return plan.tp.all_reduce(x)


def gather_logits(logits: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """(N, vocab rows of this rank) -> (N, vocab) on every rank."""
    return plan.tp.all_gather(logits, dim=-1)[:, :plan.cfg.vocab_size]
