"""LLMEngine: requests in, tokens out, one model.forward_step per step over a mixed prefill/decode batch."""
from dataclasses import dataclass

import torch

from model.cache import CachePools
from model.model import Qwen35ForCausalLM
from serving.batch import build_step_input
from serving.block_manager import KVBlockManager
from serving.config import EngineConfig
from serving.sampler import sample
from serving.scheduler import Scheduler
from serving.sequence import SamplingParams, Sequence
from serving.state_cache import StateSnapshotCache


@dataclass
class StepOutput:
    seq_id: int
    token: int
    finished: bool


@dataclass
class RequestOutput:
    """A finished request; cached_tokens of the prompt came from the prefix cache (KV pages + GDN snapshot)."""
    seq_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str


class LLMEngine:
    def __init__(self, model: Qwen35ForCausalLM, cfg: EngineConfig | None = None):
        cfg = cfg or EngineConfig()
        self.model, self.cfg = model, cfg
        weight = model.lm_head.weight
        self.device = weight.device
        self.pools = CachePools.allocate(model.config, cfg.num_pages, cfg.page_size,
                                         cfg.max_num_seqs + cfg.snapshot_slots, weight.dtype, weight.device)
        self.block_manager = KVBlockManager(cfg.num_pages, cfg.page_size)
        self.state_cache = StateSnapshotCache(self.pools, cfg.max_num_seqs, cfg.snapshot_slots)
        self.scheduler = Scheduler(cfg, self.block_manager, self.state_cache, self.pools)
        self.sequences: dict[int, Sequence] = {}
        self._next_id = 0
        self._seeds = torch.Generator().manual_seed(cfg.seed)

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Raises if it could never fit in the KV pool."""
        params = params or SamplingParams()
        pages = -(-(len(prompt_ids) + params.max_tokens) // self.cfg.page_size)
        if pages > self.cfg.num_pages:
            raise ValueError(f"{len(prompt_ids)} prompt + {params.max_tokens} new tokens need {pages} pages; "
                             f"the pool has {self.cfg.num_pages}")
        if any(not 0 <= t < self.model.config.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.model.config.vocab_size})")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (), generator=self._seeds))
        seq = Sequence(self._next_id, prompt_ids, params, torch.Generator(self.device).manual_seed(seed))
        self._next_id += 1
        self.sequences[seq.id] = seq
        self.scheduler.add(seq)
        return seq.id

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[StepOutput]:
        """Schedule, run the model once, commit the cache, sample the sequences whose chunk reached their end."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        logits = self.model.forward_step(build_step_input(chunks, self.cfg.page_size, self.device), self.pools)
        self.scheduler.commit(chunks)
        ready = [i for i, c in enumerate(chunks) if c.seq.num_uncomputed_tokens == 0]  # prefill tails, decodes
        if not ready:
            return []
        seqs = [chunks[i].seq for i in ready]
        tokens = sample(logits[ready], [s.params for s in seqs], [s.generator for s in seqs]).tolist()
        return [self._append(seq, token) for seq, token in zip(seqs, tokens)]

    def _append(self, seq: Sequence, token: int) -> StepOutput:
        seq.output_ids.append(token)
        p = seq.params
        if token in p.stop_token_ids or (token in self.cfg.eos_token_ids and not p.ignore_eos):
            self.scheduler.finish(seq, "stop")
        elif len(seq.output_ids) >= p.max_tokens:
            self.scheduler.finish(seq, "length")
        return StepOutput(seq.id, token, seq.is_finished)

    def pop_output(self, seq_id: int) -> RequestOutput:
        """The result of a finished request, which the engine then forgets."""
        seq = self.sequences[seq_id]
        if not seq.is_finished:
            raise ValueError(f"request {seq_id} has not finished")
        del self.sequences[seq_id]
        return RequestOutput(seq.id, seq.prompt_ids, seq.output_ids, seq.num_prompt_tokens,
                             seq.num_cached_tokens or 0, seq.finish_reason)

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run the prompts to completion, batched together; outputs in prompt order."""
        ids = [self.add_request(p, params) for p in prompts]
        while self.has_unfinished:
            self.step()
        return [self.pop_output(i) for i in ids]
