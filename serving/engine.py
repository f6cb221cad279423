"""LLMEngine: requests in, tokens out. Each step the scheduler picks chunks, the ModelRunner runs them (decodes
from CUDA graphs), the scheduler commits the cache, and the sampler draws the tokens of the rows that finished
their prompt or decoded. When every running sequence sampled, the next decode step is launched before the tokens
are read (EngineConfig.decode_ahead), and the next call to step() completes it."""
import gc
import logging
import time
from dataclasses import dataclass, replace

import torch

from kernels.row_buckets import MATMUL_ROW_BUCKET
from model import ops
from model.cache import CachePools
from model.layers import Linear
from model.model import Qwen35ForCausalLM
from serving.batch import ScheduledChunk
from serving.block_manager import KVBlockManager
from serving.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from serving.model_runner import ModelRunner, describe_pools, graphs_unsupported, pages_for_memory
from serving.prefill_graphs import PrefillGraphs, prefill_graphs_unsupported
from serving.sampler import TokensInFlight, sample
from serving.scheduler import Scheduler
from serving.sequence import SamplingParams, Sequence, SequenceStatus
from serving.speculative import DeviceStep, Speculator, is_verify, position_slots_each
from serving.state_cache import StateSnapshotCache
from serving.token_ring import GreedyTokens
from serving.tp_link import leader_link

log = logging.getLogger("serving")


@dataclass
class StepOutput:
    seq_id: int
    token: int
    finished: bool


@dataclass
class StepPhases:
    """Host milliseconds of an engine step's phases. `sample` ends with the step's one host sync, so it includes
    waiting for the GPU: a long sample beside a short dispatch is a GPU-bound step, the reverse a host-bound one."""
    schedule_ms: float = 0.0  # admission (prefix-cache lookup) and the chunk plan
    dispatch_ms: float = 0.0  # the model step's host side: building its inputs and launching its kernels
    commit_ms: float = 0.0  # publishing computed pages and state snapshots
    sample_ms: float = 0.0  # sampling, and the wait for the step's results
    prefill_tokens: int = 0  # the step's prefill chunks' tokens
    decode_rows: int = 0  # sequences decoding at the step's start
    decode_steps: int = 0  # decode steps run (a mixed step runs one after each prefill slice but the last)
    ahead: bool = False  # the step completed a decode step launched ahead by the step before
    wait_ms: float = 0.0  # of the above, the host blocked on the GPU reading sampled tokens (host-bound steps: ~0)


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
    def __init__(self, model: Qwen35ForCausalLM, cfg: EngineConfig | None = None, *, pad_decode: bool = False):
        """cfg.gpu_memory_utilization sizes the KV pool from the card's free memory (CUDA only); decode steps run
        from CUDA graphs unless cfg.cuda_graphs is False or the ops cannot be captured. pad_decode (tests) pads
        decode batches to the graph ladder without capturing."""
        cfg = cfg or EngineConfig()
        self.model = model
        weight = model.lm_head.weight
        self.device = weight.device
        if cfg.speculative_tokens and not model.has_mtp:
            raise ValueError("speculative_tokens needs the model's MTP head; this model has none (a checkpoint "
                             "without mtp.* tensors)")
        cfg, self.sizing = self._size(model, cfg)
        self.cfg = cfg
        k = cfg.speculative_tokens
        mtp_layers = model.config.mtp_num_hidden_layers if k else 0
        each = position_slots_each(k, cfg.position_sets) if k else 0
        # slots: the running sequences', the snapshots', position slots for each running sequence and the padding
        # (speculating), and the last one, which is padding's (as is the last page)
        num_slots = cfg.max_num_seqs * (1 + each) + cfg.snapshot_slots + each + 1
        # tensor parallel: rank 0 sends each step to the workers (serving.tp_link), whose engines only hold the
        # pools and the runner; every rank's pools hold its own heads (model.cache_config). None at TP=1.
        self.link = leader_link(model)
        pools = CachePools.allocate(model.cache_config, cfg.num_pages + 1, cfg.page_size, num_slots, weight.dtype,
                                    weight.device, mtp_layers)
        self.pools = pools if self.link is None else self.link.recording(pools)
        self.block_manager = KVBlockManager(cfg.num_pages, cfg.page_size, cfg.kv_eviction)
        self.state_cache = StateSnapshotCache(self.pools, cfg.max_num_seqs, cfg.snapshot_slots)
        self.scheduler = Scheduler(cfg, self.block_manager, self.state_cache, self.pools)
        why_not = None
        if self.device.type != "cuda":
            why_not = "not a CUDA device"
        elif not cfg.cuda_graphs:
            why_not = "cuda_graphs off (enforce eager)"
        else:
            why_not = graphs_unsupported(model)
        spec_graphs = why_not is None
        if k and why_not is None:  # the speculative steps' own graphs replace the decode graphs
            why_not = "speculative decoding: greedy decode steps replay graphs of their own"
        use_graphs = why_not is None
        prefill_graphs = None
        prefill_rows = cfg.prefill_graph_rows()
        # speculation's trunk steps without drafts (prefills, returning turns) replay them too
        if spec_graphs and prefill_rows >= MATMUL_ROW_BUCKET and prefill_graphs_unsupported(model) is None:
            max_pages = -(-cfg.max_model_len // cfg.page_size)
            prefill_graphs = PrefillGraphs(model, prefill_rows, cfg.max_num_seqs, max_pages,
                                           cfg.slice_cuts(0, model.config.num_hidden_layers))
        self.runner = ModelRunner(model, self.pools, page_size=cfg.page_size, max_model_len=cfg.max_model_len,
                                  max_num_seqs=cfg.max_num_seqs, dummy_page=cfg.num_pages, dummy_slot=num_slots - 1,
                                  graph_sizes=cfg.graph_batch_sizes() if use_graphs or pad_decode else (),
                                  use_graphs=use_graphs, link=self.link, prefill_graphs=prefill_graphs,
                                  fed_decode=cfg.fed_decode, token_ring=cfg.token_ring)
        self.runner.capture()
        self.speculator = None
        if k:
            self.speculator = Speculator(model, self.pools, self.runner, self.block_manager, num_drafts=k,
                                         first_position_slot=cfg.max_num_seqs + cfg.snapshot_slots,
                                         page_size=cfg.page_size, max_model_len=cfg.max_model_len,
                                         max_num_seqs=cfg.max_num_seqs,
                                         graph_sizes=cfg.graph_batch_sizes() if spec_graphs or pad_decode else (),
                                         use_graphs=spec_graphs, draft_vocab=cfg.draft_vocab_size,
                                         position_sets=cfg.position_sets)
            self.speculator.capture()
        sizes = list(self.runner.graph_sizes)
        self.graphs = f"decode CUDA graphs at batch {sizes}" if use_graphs else f"eager decode ({why_not})"
        if prefill_graphs is not None:
            self.graphs += f"; prefill graphs up to {prefill_graphs.buckets[-1]} tokens"
        self.pool_summary = (describe_pools(model, cfg.num_pages, cfg.page_size, cfg.max_num_seqs, cfg.snapshot_slots,
                                            each, mtp_layers)
                             + f"; max_model_len {cfg.max_model_len}; {self.graphs}")
        if k:
            graphs = f"graphs at batch {list(self.speculator.graphs)}" if self.speculator.graphs else "eager"
            vocab = f"first {cfg.draft_vocab_size} token ids" if self.speculator.draft_vocab else "full vocab"
            self.pool_summary += (f"; MTP speculative decoding, {k} drafts a step from the {vocab} (greedy decode "
                                  f"steps: {graphs})")
        log.info("engine: %s", self.pool_summary)
        self.sequences: dict[int, Sequence] = {}
        self._next_id = 0
        self.last_step = StepPhases()  # the phases of the last step that ran
        self._wait_ms = 0.0  # the running step's StepPhases.wait_ms
        self._seeds = torch.Generator().manual_seed(cfg.seed)
        # a decode step launched ahead (EngineConfig.decode_ahead), unread: what _take_tokens reads (speculating, a
        # DeviceStep)
        self._ahead: tuple | DeviceStep | None = None
        self.num_ahead_steps = 0

    def close(self) -> None:
        """Tensor parallel rank 0: stop the workers' loops (nothing to do at TP=1)."""
        if self.link is not None:
            self.link.stop()

    @staticmethod
    def _size(model: Qwen35ForCausalLM, cfg: EngineConfig) -> tuple[EngineConfig, dict | None]:
        """Resolve max_model_len and, on a CUDA device with gpu_memory_utilization, num_pages and snapshot_slots from
        free memory (state_cache_gb, else state_cache_fraction); elsewhere num_pages and snapshot_slots as given."""
        max_pos = model.config.max_position_embeddings
        by_memory = cfg.gpu_memory_utilization is not None and model.lm_head.weight.device.type == "cuda"
        if cfg.max_model_len is not None:
            max_len = cfg.max_model_len
        else:
            max_len = DEFAULT_MAX_MODEL_LEN if by_memory else cfg.num_pages * cfg.page_size
        max_len = min(max_len, max_pos)
        sizing = None
        if by_memory:
            k = cfg.speculative_tokens
            each = position_slots_each(k, cfg.position_sets) if k else 0
            num_pages, snapshot_slots, sizing = pages_for_memory(
                model, utilization=cfg.gpu_memory_utilization, page_size=cfg.page_size,
                num_slots=cfg.max_num_seqs * (1 + each) + each + 1, max_model_len=max_len,
                max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
                state_cache_fraction=cfg.state_cache_fraction, state_cache_gb=cfg.state_cache_gb,
                graph_rows=cfg.prefill_graph_rows() if cfg.cuda_graphs else 0,
                mtp_layers=model.config.mtp_num_hidden_layers if k else 0)
            cfg = replace(cfg, num_pages=num_pages, snapshot_slots=snapshot_slots)
        return replace(cfg, max_model_len=min(max_len, cfg.num_pages * cfg.page_size)), sizing

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, cache_point: int = 0) -> int:
        """Queue a request; returns its id. Raises if it could never fit in the KV pool. cache_point: where a prefix
        that other requests share ends (the system and tools message of a chat), so that the prefix cache keeps a
        GDN snapshot there (at its page boundary); 0: none."""
        params = params or SamplingParams()
        if not 0 <= cache_point <= len(prompt_ids):
            raise ValueError(f"cache_point must lie in [0, {len(prompt_ids)}] (the prompt's tokens), got {cache_point}")
        pages = -(-(len(prompt_ids) + params.max_tokens) // self.cfg.page_size)
        if pages > self.cfg.num_pages:
            raise ValueError(f"{len(prompt_ids)} prompt + {params.max_tokens} new tokens need {pages} pages; "
                             f"the pool has {self.cfg.num_pages}")
        if len(prompt_ids) + params.max_tokens > self.cfg.max_model_len:
            raise ValueError(f"{len(prompt_ids)} prompt + {params.max_tokens} new tokens exceed max_model_len "
                             f"{self.cfg.max_model_len}")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (), generator=self._seeds))
        # a CPU generator: the sampler draws each row's uniform on the host, so sampling adds no per-row sync
        seq = Sequence(self._next_id, prompt_ids, params, torch.Generator().manual_seed(seed))
        seq.cache_point = cache_point
        self._next_id += 1
        self.sequences[seq.id] = seq
        self.scheduler.add(seq)
        return seq.id

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[StepOutput]:
        """Schedule, run the model once, commit the cache, sample the sequences whose chunk reached their end. With
        EngineConfig.interleave_slices, a step of decodes and prefill chunks also runs decode-only steps between
        the prefill's layer slices (its outputs then hold several tokens of a sequence, in order). With
        EngineConfig.decode_ahead, a decode step of every running sequence launches the next before its tokens
        are read, and the next call completes that one (`_step_ahead`)."""
        try:
            if self.speculator is not None:
                return self._step_speculative()
            return self._step_ahead() if self._ahead is not None else self._step()
        except BaseException:
            self._ahead = None  # a failed step's work in flight is not trusted
            raise

    def _step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        self._wait_ms = 0.0
        chunks = self.scheduler.schedule()
        if not chunks:
            self.last_step = StepPhases()
            return []
        t1 = time.perf_counter()
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefill_tokens = sum(c.num_tokens for c in chunks) - len(decodes)
        outputs, decode_steps, greedy = [], int(bool(decodes)), None
        if self.cfg.interleave_slices > 1 and decodes and len(decodes) < len(chunks) and self.link is None:
            chunks = [c for c in chunks if c.num_tokens > 1]
            logits, outputs, decode_steps = self._prefill_between_decodes(chunks, decodes)
        else:
            logits, greedy, chunks = self.runner.execute(chunks)  # rows of logits follow the returned chunks
        t2 = time.perf_counter()
        finished, commit_ms = self._finish_step(chunks, logits, greedy)
        t3 = time.perf_counter()
        self.last_step = StepPhases(1e3 * (t1 - t0), 1e3 * (t2 - t1), commit_ms, 1e3 * (t3 - t2) - commit_ms,
                                    prefill_tokens, len(decodes), decode_steps, wait_ms=self._wait_ms)
        return outputs + finished

    def _step_speculative(self) -> list[StepOutput]:
        """A step with MTP speculation (serving.speculative): the trunk over the chunks (verify chunks: a sequence's
        last token and its drafts), acceptance, the MTP head's rows and the rollback, the commit of the kept tokens,
        then the next drafts of the sequences still running. A greedy step of every running sequence on the device
        launches the next one before its results are read (EngineConfig.decode_ahead); the next call completes it."""
        if self._ahead is not None and not any(s.status is SequenceStatus.RUNNING for s in self._ahead.seqs):
            self._ahead = None  # its sequences were aborted since: nothing of it is read
        if self._ahead is not None:
            return self._device_step_ahead()
        t0 = time.perf_counter()
        self._wait_ms = 0.0
        chunks = self.scheduler.schedule()
        if not chunks:
            self.last_step = StepPhases()
            return []
        t1 = time.perf_counter()
        spec = self.speculator
        if spec.on_device(chunks):  # greedy decodes: the whole step on the device, one read
            launched = spec.launch(chunks)
            self._ahead = self._launch_device_ahead(launched)
            t2 = time.perf_counter()
            outputs, commit_ms = self._take_device_step(launched)
            self.last_step = StepPhases(1e3 * (t1 - t0), 1e3 * (t2 - t1), commit_ms,
                                        1e3 * (time.perf_counter() - t2) - commit_ms, 0, len(chunks), 1,
                                        wait_ms=self._wait_ms)
            return outputs
        decodes = sum(is_verify(c) for c in chunks)  # before the commit moves the chunks' starts
        prefill_tokens = sum(c.num_tokens for c in chunks if not is_verify(c))
        verified = spec.verify(chunks)
        t2 = time.perf_counter()
        emitted = [self._until_stop(c.seq, tokens) for c, tokens in zip(chunks, spec.accept(chunks, verified))]
        kept = [len(e) if is_verify(c) else c.num_tokens for c, e in zip(chunks, emitted)]
        heads = spec.advance(chunks, kept, emitted, verified)
        t3 = time.perf_counter()
        for c, tokens in zip(chunks, emitted):
            c.seq.output_ids.extend(tokens)
        self.scheduler.commit([ScheduledChunk(c.seq, n) for c, n in zip(chunks, kept)],
                              {c.seq.id: spec.position_slots(c.seq.state_slot)[:len(c.drafts)] for c in chunks})
        t4 = time.perf_counter()
        outputs = self._emit([c.seq for c in chunks], emitted)
        spec.draft([h for h in heads if h.seq.status is SequenceStatus.RUNNING])
        t5 = time.perf_counter()
        self.last_step = StepPhases(1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t4 - t3), 1e3 * (t3 - t2 + t5 - t4),
                                    prefill_tokens, decodes, int(bool(decodes)))
        return outputs

    def _launch_device_ahead(self, step: DeviceStep) -> DeviceStep | None:
        """The greedy step after `step`, launched before step is read, where every running sequence is in it and none
        waits to be admitted (EngineConfig.decode_ahead; not with the replace_drafts test hook, which changes drafts
        on the host). A sequence that stops at `step` wasted its rows of it."""
        sched, spec = self.scheduler, self.speculator
        if (not self.cfg.decode_ahead or spec.replace_drafts is not None or sched.waiting
                or len(step.seqs) != len(sched.running)
                or any(s.status is not SequenceStatus.RUNNING for s in step.seqs)):
            return None
        ahead = spec.launch_ahead(step)
        self.num_ahead_steps += ahead is not None
        return ahead

    def _device_step_ahead(self) -> list[StepOutput]:
        """Complete the greedy step launched ahead: launch the next one ahead of it (its sequences all still
        running), then read it."""
        t0 = time.perf_counter()
        self._wait_ms = 0.0
        step, self._ahead = self._ahead, None
        self._ahead = self._launch_device_ahead(step)
        t1 = time.perf_counter()
        outputs, commit_ms = self._take_device_step(step)
        self.last_step = StepPhases(0.0, 1e3 * (t1 - t0), commit_ms, 1e3 * (time.perf_counter() - t1) - commit_ms,
                                    0, len(step.seqs), 1, ahead=True, wait_ms=self._wait_ms)
        return outputs

    def _take_device_step(self, step: DeviceStep) -> tuple[list[StepOutput], float]:
        """Read a greedy step and apply it to its sequences still running: the tokens they keep (up to a stop), the
        commit (page-boundary snapshots from the step's position slots: a step launched ahead writes the other set
        and the state slot), the outputs and the next drafts. Returns the outputs and the commit's milliseconds."""
        spec = self.speculator
        t0 = time.perf_counter()
        targets, lengths, drafts = spec.read(step)
        self._wait_ms += 1e3 * (time.perf_counter() - t0)
        live = [i for i, s in enumerate(step.seqs) if s.status is SequenceStatus.RUNNING]
        seqs = [step.seqs[i] for i in live]
        emitted = [self._until_stop(step.seqs[i], targets[i][:lengths[i]]) for i in live]
        for seq, tokens in zip(seqs, emitted):
            seq.output_ids.extend(tokens)
            spec.count_verified(spec.k, len(tokens))  # rows of sequences that stopped before are not counted
        t1 = time.perf_counter()
        self.scheduler.commit([ScheduledChunk(seq, len(e)) for seq, e in zip(seqs, emitted)],
                              {seq.id: spec.position_slots(seq.state_slot, step.half) for seq in seqs})
        commit_ms = 1e3 * (time.perf_counter() - t1)
        outputs = self._emit(seqs, emitted)
        running = [(seq, drafts[i]) for seq, i in zip(seqs, live) if seq.status is SequenceStatus.RUNNING]
        spec.set_drafts([seq for seq, _ in running], [d for _, d in running])
        if self._ahead is not None and not any(s.status is SequenceStatus.RUNNING for s in self._ahead.seqs):
            self._ahead = None  # every sequence of the step ahead stopped: nothing of it is read
        return outputs, commit_ms

    def _emit(self, seqs: list[Sequence], emitted: list[list[int]]) -> list[StepOutput]:
        """The step's outputs, each sequence's tokens in order; a sequence whose last token ends it finishes."""
        outputs = []
        for seq, tokens in zip(seqs, emitted):
            for i, token in enumerate(tokens):
                reason = self._stop_reason(seq, token) if i == len(tokens) - 1 else None
                if reason is not None:
                    self.scheduler.finish(seq, reason)
                outputs.append(StepOutput(seq.id, token, reason is not None))
        return outputs

    def _until_stop(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """tokens up to the first that ends seq (a stop or eos token, or max_tokens), which is kept."""
        for i, token in enumerate(tokens):
            if self._stop_reason(seq, token, len(seq.output_ids) + i + 1) is not None:
                return tokens[:i + 1]
        return tokens

    def _stop_reason(self, seq: Sequence, token: int, num_outputs: int | None = None) -> str | None:
        """Why seq ends with token as its num_outputs-th output token (default: its last one now), or None."""
        p = seq.params
        if token in p.stop_token_ids or (token in self.cfg.eos_token_ids and not p.ignore_eos):
            return "stop"
        if (len(seq.output_ids) if num_outputs is None else num_outputs) >= p.max_tokens:
            return "length"
        return None

    def _finish_step(self, chunks: list[ScheduledChunk], logits: torch.Tensor,
                     greedy: GreedyTokens | None) -> tuple[list[StepOutput], float]:
        """Commit the chunks the model computed and sample those that reached their sequence's end (launching the
        next decode step ahead when it may); returns their outputs and the commit's milliseconds."""
        sampled, commit_ms = self._commit_and_sample(chunks, logits, greedy)
        self._ahead = self._launch_ahead(sampled)
        return self._take_tokens(sampled), commit_ms

    def _commit_and_sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor,
                           greedy: GreedyTokens | None) -> tuple[tuple, float]:
        """Commit the chunks and launch the sampling of those that reached their sequence's end, without waiting
        for it (greedy: the logits' argmax where the step computed it): returns (what _take_tokens reads, the
        commit's milliseconds)."""
        t0 = time.perf_counter()
        self.scheduler.commit(chunks)
        t1 = time.perf_counter()
        ready = [c.seq.num_uncomputed_tokens == 0 for c in chunks]  # prefill tails and decodes
        return self._sample(chunks, ready, logits, greedy), 1e3 * (t1 - t0)

    @staticmethod
    def _sample(chunks: list[ScheduledChunk], ready: list[bool], logits: torch.Tensor,
                greedy: GreedyTokens | None) -> tuple:
        """Launch the sampling of the ready rows: (chunks, ready, their TokensInFlight or None). Where every row is
        greedy, the tokens are the step's argmax, and the host reads them where they land (if they do)."""
        tokens = None
        if any(ready):
            params = [c.seq.params if r else None for c, r in zip(chunks, ready)]
            gens = [c.seq.generator if r else None for c, r in zip(chunks, ready)]
            on_device = greedy.on_device if greedy is not None else None
            sampled = sample(logits, params, gens, on_device)
            tokens = TokensInFlight(sampled, greedy.landed if sampled is on_device else None)
        return chunks, ready, tokens

    def _take_tokens(self, sampled: tuple) -> list[StepOutput]:
        """Wait for a sampling's tokens (the step's one host sync) and append them to their sequences, except to
        sequences that are no longer running (a row of a decode launched ahead whose sequence stopped, or was
        aborted, since)."""
        chunks, ready, tokens = sampled
        t0 = time.perf_counter()
        values = tokens.tolist() if tokens is not None else []
        self._wait_ms += 1e3 * (time.perf_counter() - t0)
        outputs = [self._append(c.seq, t) for c, t, r in zip(chunks, values, ready)
                   if r and c.seq.status is SequenceStatus.RUNNING]
        if self._ahead is not None and not any(c.seq.status is SequenceStatus.RUNNING for c in self._ahead[0]):
            self._ahead = None  # every sequence of the step ahead stopped: nothing of it is read
        return outputs

    def _launch_ahead(self, sampled: tuple) -> tuple | None:
        """After a step in which every running sequence sampled its next token (decodes, prompt tails; sampled, not
        read): launch the next decode of the same sequences now, each input token copied on the device from this
        step's samples, and its sampling; returns what _step_ahead completes, or None where it may not run
        (EngineConfig.decode_ahead)."""
        chunks, ready, tokens = sampled
        sched = self.scheduler
        if (not self.cfg.decode_ahead or self.link is not None or not all(ready) or sched.waiting
                or len(chunks) != len(sched.running) or len(chunks) > self.runner.max_decode
                or any(c.seq.status is not SequenceStatus.RUNNING for c in chunks)):
            return None  # every running sequence must have sampled its next token this step
        if any(len(c.seq.output_ids) + 2 > c.seq.params.max_tokens for c in chunks):  # one ends by length now
            return None
        if not all(self.block_manager.allocate(c.seq, c.seq.num_computed_tokens + 1) for c in chunks):
            return None  # pages allocated so far stay: the next step needs them anyway
        if self.runner.fed_decode:  # the page after this step's, where it opens one, for the argmax's next inputs
            for c in chunks:
                if c.seq.num_computed_tokens + 2 <= self.cfg.max_model_len:
                    self.block_manager.allocate(c.seq, c.seq.num_computed_tokens + 2)
        ahead = [ScheduledChunk(c.seq, 1) for c in chunks]
        logits, greedy, _ = self.runner.execute(ahead, tokens.on_device)
        self.num_ahead_steps += 1
        return self._sample(ahead, [True] * len(ahead), logits, greedy)

    def _step_ahead(self) -> list[StepOutput]:
        """Complete the decode step launched ahead: commit it for the sequences still running (the tokens it took
        as input are appended by now), launch the next one ahead, then read its tokens."""
        t0 = time.perf_counter()
        self._wait_ms = 0.0
        sampled, self._ahead = self._ahead, None
        self.scheduler.commit([c for c in sampled[0] if c.seq.status is SequenceStatus.RUNNING])
        t1 = time.perf_counter()
        self._ahead = self._launch_ahead(sampled)
        t2 = time.perf_counter()
        outputs = self._take_tokens(sampled)
        t3 = time.perf_counter()
        self.last_step = StepPhases(0.0, 1e3 * (t2 - t1), 1e3 * (t1 - t0), 1e3 * (t3 - t2), 0, len(sampled[0]), 1,
                                    ahead=True, wait_ms=self._wait_ms)
        return outputs

    def _prefill_between_decodes(self, prefills: list[ScheduledChunk], decodes: list[ScheduledChunk]):
        """A mixed step with EngineConfig.interleave_slices: the prefill chunks' layers launch in slices, and after
        each slice but the last the running decodes take a step (the scheduled ones first, then whoever is at
        its last token and gets a page). A decode step's tokens are read only after the next slice is launched:
        the host, the bottleneck of an eager prefill, launches that slice while the GPU runs the decode step.
        Returns (the prefill rows' logits, the decode steps' outputs, how many decode steps ran)."""
        cuts = self.cfg.slice_cuts(sum(c.num_tokens for c in prefills), self.model.config.num_hidden_layers)
        outputs, layer, sampled, steps = [], 0, None, 0
        try:
            for out in self.runner.eager_layers(prefills):
                layer += out is None
                if sampled is not None and (out is not None or layer in cuts):
                    outputs += self._take_tokens(sampled)  # the decode step of the cut before this slice
                    sampled, decodes = None, self.scheduler.schedule_decodes_between()
                if out is not None:
                    return out, outputs, steps
                if layer in cuts and decodes:
                    sampled = self._commit_and_sample(decodes, *self.runner.decode_rows(decodes))[0]
                    steps += 1
        finally:
            if sampled is not None:  # a slice raised: the decode step before it still appends its tokens
                self._take_tokens(sampled)
        raise RuntimeError("the model's layer generator ended without logits")

    def _append(self, seq: Sequence, token: int) -> StepOutput:
        seq.output_ids.append(token)
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return StepOutput(seq.id, token, seq.is_finished)

    def pop_output(self, seq_id: int) -> RequestOutput:
        """The result of a finished request, which the engine then forgets."""
        seq = self.sequences[seq_id]
        if not seq.is_finished:
            raise ValueError(f"request {seq_id} has not finished")
        del self.sequences[seq_id]
        return RequestOutput(seq.id, seq.prompt_ids, seq.output_ids, seq.num_prompt_tokens,
                             seq.num_cached_tokens or 0, seq.finish_reason)

    def warm_up(self, on_cpu: bool = False) -> None:
        """Run one request of each step shape whose kernels compile separately, so that no live request pays for a
        compile (seconds each): the attention kernels' variants for every split count class, which short prompts
        never reach (kernels.paged_decode_attention.compile_variants), the GDN state pass's for every dv split with
        and without snapshots (kernels.gdn_prefill.compile_variants); prefill chunks of 1..16 tokens (the tails
        after a page boundary), a few longer chunks (one past ALWAYS_Q_LEN, one of the full token budget), prefills
        of several sequences at once and a mixed step (a chunk beside a decode row), for every other kernel; and
        cuBLAS's choice for every padded row count of every projection (kernels.linear.MATMUL_ROW_BUCKET).
        Random tokens; their pages stay in the prefix cache as evictable entries. On CUDA only unless on_cpu
        (Triton's interpreter on the CPU compiles nothing; tests)."""
        if self.device.type != "cuda" and not on_cpu:
            return
        if ops.backend_table()["paged_attention"] == "triton" and self.device.type == "cuda":
            # the split counts real contexts pick, which short warm-up prompts never reach
            from kernels.paged_decode_attention import compile_variants
            compile_variants(self.model.cache_config.num_attention_heads, self.pools.k_pages[0],
                             self.pools.v_pages[0], self.runner.width)
        if ops.backend_table()["gated_deltanet"] == "triton" and self.model.config.linear_attention_layers:
            from kernels import gdn_prefill  # the state pass at each dv split, with and without snapshots
            gdn_prefill.compile_variants(self.model.cache_config.linear_num_key_heads,
                                         self.pools.recurrent_states[0], self.model.lm_head.weight.dtype)
        if ops.backend_table()["linear"] == "triton" and self.device.type == "cuda":  # every padded row count
            from kernels.linear import warm_up_row_buckets
            warm_up_row_buckets((m.weight for m in self.model.model.modules() if isinstance(m, Linear)),
                                self.cfg.max_num_batched_tokens + self.cfg.max_num_seqs)
            warm_up_row_buckets([self.model.lm_head.weight], self.cfg.max_num_seqs)  # a row per sampled chunk
        gen = torch.Generator().manual_seed(12345)
        vocab = self.model.config.vocab_size
        lens = [*range(1, 17), 40, 100, 600, self.cfg.max_num_batched_tokens + 20]
        lens = [n for n in lens if n + 2 <= self.cfg.max_model_len]
        prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in lens]
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        for p in prompts:
            self.generate([p], params)
        for k in (2, 3, 5, 9, 17, 33):  # prefills of k sequences in one step (the GDN state pass tiles by k)
            if k <= self.cfg.max_num_seqs:
                self.generate([torch.randint(vocab, (40,), generator=gen).tolist() for _ in range(k)], params)
        if self.cfg.max_num_seqs > 1:  # a mixed step: the second prompt's prefill beside the first's decodes
            first = self.add_request(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))
            self.step()
            second = self.add_request(prompts[-3], params)
            while self.has_unfinished:
                self.step()
            for seq_id in (first, second):
                self.pop_output(seq_id)
        # what exists now (weights, compiled kernels, graphs, the caller's data) lives as long as the engine: keep it
        # out of the collector's full passes, each of which stops a live step for 0.1-0.2 s on millions of objects.
        # A process that drops this engine to build another calls gc.unfreeze() first, or its cycles stay
        gc.collect()
        gc.freeze()

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run the prompts to completion, batched together; outputs in prompt order."""
        ids = [self.add_request(p, params) for p in prompts]
        while self.has_unfinished:
            self.step()
        return [self.pop_output(i) for i in ids]
