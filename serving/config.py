"""How big the engine's caches are, how much one step may compute, and how decode steps run."""
from dataclasses import dataclass

GRAPH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MAX_SPECULATIVE_TOKENS = 4  # a verify step's K+1 <= 5 tokens a sequence: the paged decode attention's q_len range


@dataclass(frozen=True)
class EngineConfig:
    """num_pages * page_size tokens of KV; max_num_seqs running sequences, each with a GDN state slot, plus
    snapshot_slots more slots for the prefix cache's GDN snapshots. A step computes at most
    max_num_batched_tokens tokens; a prefill of at most fast_lane_tokens uncached tokens after a prefix hit
    (a returning session) goes before cold prefills. Generation stops at eos_token_ids unless ignore_eos.

    gpu_memory_utilization: on a CUDA device, when set, num_pages is ignored and the KV pool takes what is
    left of that fraction of the card after the weights, a profiled worst-case step (one chunk of
    max_num_batched_tokens at the end of a max_model_len context) and a fixed reserve (see serving.engine).
    state_cache_fraction, state_cache_gb: with gpu_memory_utilization on a CUDA device, snapshot_slots is ignored and
    the snapshot pool takes state_cache_gb GiB, else state_cache_fraction of what the KV pool would have taken (the
    budget left after the weights, the peak step, the reserve and the running slots), the KV pool the rest
    (serving.model_runner.pages_for_memory). 0.1: a snapshot (19 MiB at 0.8B/2B, 49 at 9B) costs what ~1.6k tokens
    of KV do, so 0.1 keeps one snapshot per ~14k KV tokens: a returning session needs one (its last turn's end).
    max_model_len: the longest sequence (prompt + output); None: the pool's tokens when num_pages sizes it,
    else DEFAULT_MAX_MODEL_LEN, and never beyond the model's max_position_embeddings. Decode steps size their
    page tables by it.
    cuda_graphs: capture decode steps (every sequence one token) in CUDA graphs at the batch sizes of
    GRAPH_LADDER up to max_graph_batch (None: max_num_seqs), on CUDA devices; False is --enforce-eager.
    interleave_slices: a step that mixes decodes with prefill chunks launches the prefill in this many slices of
    layers and runs a decode-only step of the running sequences after each slice but the last, so decoders get
    a token per slice instead of per (host-bound) prefill step; 0 or 1: off. Not under tensor parallelism.
    8192 tokens a step and 12 slices were the fastest at 16 users (FINDINGS, serving): a decode step's tokens are
    read only after the next slice is launched (serving.engine), so the GPU runs that decode step while the host
    launches the slice. The price is the returning turn's TTFT under load (p50 ~38 ms at 12 slices, ~21 at 4).
    interleave_slice_tokens: with it, a mixed step whose prefill chunks hold T tokens takes max(interleave_slices,
    ceil(T / interleave_slice_tokens)) slices (at most one a layer), so that a cold 4-8k-token prefill stalls the
    decoders about as long a slice as a returning turn's does; 0: always interleave_slices. Why: at 16 users the
    slowest user's decode rate is set by its first turn, decoded while the other users' 4096-token first turns
    prefill in 12 slices of ~8 ms each. Off until timed (`profiles.bench_serving
    --concurrency 16 --sweep interleave_slice_tokens=0,256`).
    decode_ahead: after a step in which every running sequence sampled (decodes, prompt tails), launch the next
    decode step before reading this one's tokens (its input tokens copied on the device from the samples), so
    the host's bookkeeping
    between two decode steps (reading tokens, stop checks, scheduling, inputs: ~0.1-0.2 ms on the H200) overlaps
    the GPU instead of idling it. Not when a request waits, when a sequence ends by length at this step, when a
    page is short, or under tensor parallelism. A sequence that stops (eos) at this step wasted its row of the
    step ahead, whose writes land past its tokens.
    fed_decode: a decode step's greedy argmax (inside its graph) also writes the next step's inputs (token, position,
    KV slot through the page table, cached tokens: reference.advance_decode_inputs), and a decode launched ahead
    whose rows moved on exactly so, every row greedy, replays its graph with no copy before it (serving.model_runner).
    Pages are then allocated a token ahead. Faster at 0.8B, equal at 2B (FINDINGS, decode step). On by default;
    profiles.bench_serving --sweep fed_decode=0,1 compares.
    token_ring: a fed decode's argmax also stores its tokens in pinned host memory (serving.token_ring), so that
    no copy to the host sits between two decode graphs. On by default; profiles.bench_serving --sweep token_ring=0,1.
    snapshot_interval: a chunk that passes a multiple of this many tokens (whole pages) and has no other snapshot
    point inside snapshots there too, when a slot is free: a sparse ladder along long prompts, so that a chain whose
    deepest snapshot went with its tail pages still has a hit part-way; 0: off.
    kv_eviction: which cached KV pages go first when the pool is full (serving.block_manager), each chain from its
    tail: "mru", the chain released last (agent sessions return in about the order they left, so it is needed last:
    0.90 of the eligible prefix tokens hit against LRU's 0.66, with 75% of the working set; FINDINGS, prefix cache
    under many sessions), or "lru", the chain released first (when the latest sessions come back first).
    prefill_graph_tokens: eager steps of GEMV_MAX_ROWS + 1 up to this many tokens replay CUDA graphs
    (serving.prefill_graphs: every op but the attention cores the router sends to a forward), captured at every
    row bucket up to it (kernels.row_buckets), when CUDA graphs are on and the model allows (not tensor parallel,
    not the reference MoE); None: every prefill step (max_num_batched_tokens + max_num_seqs); 0: off.
    speculative_tokens: K in 0..4, the drafts of the model's MTP head that each decode step verifies (serving.
    speculative); 0: off. Needs a model with its MTP head, at world size 1. Greedy decode steps replay CUDA graphs
    of their own, each launched before the one before it is read (with decode_ahead), steps without drafts the
    prefill graphs; the others run eagerly, with no decode-ahead or interleaved slices.
    draft_vocab_size: with speculative_tokens, the MTP head drafts among the first N token ids only, 0: all of them.
    The full lm_head is most of a draft's bytes (2B: 248k x 2048, 1 GB); Qwen's byte-level BPE numbers tokens in
    merge order, so the first ids are the common ones. Output stays exact (the target verifies every draft); only
    acceptance can drop, at tokens past N."""
    num_pages: int = 256
    page_size: int = 16
    max_num_seqs: int = 8
    snapshot_slots: int = 32
    max_num_batched_tokens: int = 8192
    fast_lane_tokens: int = 512
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    state_cache_fraction: float = 0.1
    state_cache_gb: float | None = None
    cuda_graphs: bool = True
    max_graph_batch: int | None = None
    interleave_slices: int = 12
    interleave_slice_tokens: int = 0
    decode_ahead: bool = True
    fed_decode: bool = True
    token_ring: bool = True
    prefill_graph_tokens: int | None = None
    snapshot_interval: int = 4096
    kv_eviction: str = "mru"
    speculative_tokens: int = 0
    draft_vocab_size: int = 0

    def __post_init__(self):
        if min(self.num_pages, self.page_size, self.max_num_seqs, self.max_num_batched_tokens) < 1:
            raise ValueError(f"pool sizes and the token budget must be positive: {self}")
        if self.snapshot_slots < 0 or self.fast_lane_tokens < 0:
            raise ValueError(f"snapshot_slots and fast_lane_tokens must be >= 0: {self}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization < 1:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1), got {self.gpu_memory_utilization}")
        if not 0 <= self.state_cache_fraction <= 1:  # also refuses NaN
            raise ValueError(f"state_cache_fraction must lie in [0, 1], got {self.state_cache_fraction}")
        if self.state_cache_gb is not None and not 0 <= self.state_cache_gb < float("inf"):
            raise ValueError(f"state_cache_gb must be a finite number >= 0, got {self.state_cache_gb}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.interleave_slices < 0 or self.interleave_slice_tokens < 0:
            raise ValueError(f"interleave_slices and interleave_slice_tokens must be >= 0, got "
                             f"{self.interleave_slices} and {self.interleave_slice_tokens}")
        if self.prefill_graph_tokens is not None and self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0, got {self.prefill_graph_tokens}")
        if self.snapshot_interval < 0:
            raise ValueError(f"snapshot_interval must be >= 0, got {self.snapshot_interval}")
        if self.kv_eviction not in ("lru", "mru"):
            raise ValueError(f"kv_eviction must be 'lru' or 'mru', got {self.kv_eviction!r}")
        if not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_tokens must lie in [0, {MAX_SPECULATIVE_TOKENS}], got "
                             f"{self.speculative_tokens}")
        if self.draft_vocab_size < 0 or (self.draft_vocab_size and not self.speculative_tokens):
            raise ValueError(f"draft_vocab_size must be >= 0, and is set only with speculative_tokens, got "
                             f"{self.draft_vocab_size} with speculative_tokens {self.speculative_tokens}")
        if self.max_graph_batch is not None and self.max_graph_batch < 1:
            raise ValueError(f"max_graph_batch must be positive, got {self.max_graph_batch}")

    @classmethod
    def for_token_budget(cls, kv_tokens: int, page_size: int = 16, **fields) -> "EngineConfig":
        """A config whose KV pool holds kv_tokens tokens (rounded up to whole pages)."""
        return cls(num_pages=-(-kv_tokens // page_size), page_size=page_size, **fields)

    @classmethod
    def for_gpu_memory(cls, utilization: float = 0.9, **fields) -> "EngineConfig":
        """A config whose KV pool is sized on a CUDA device from its free memory (num_pages on the CPU)."""
        return cls(gpu_memory_utilization=utilization, **fields)

    @property
    def position_sets(self) -> int:
        """Sets of K+1 GDN position slots a speculating sequence holds: two where greedy steps are launched ahead
        (decode_ahead: the step ahead writes the other set), else one (serving.speculative)."""
        return 2 if self.decode_ahead else 1

    def graph_batch_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes captured in CUDA graphs: the ladder up to max_graph_batch, which is included."""
        top = min(self.max_graph_batch or self.max_num_seqs, self.max_num_seqs)
        return tuple(sorted({b for b in GRAPH_LADDER if b < top} | {top}))

    def prefill_graph_rows(self) -> int:
        """The most tokens a step replays prefill graphs for (prefill_graph_tokens; 0: none)."""
        every_step = self.max_num_batched_tokens + self.max_num_seqs
        return every_step if self.prefill_graph_tokens is None else min(self.prefill_graph_tokens, every_step)

    def prefill_slices(self, prefill_tokens: int, num_layers: int) -> int:
        """The layer slices of a mixed step whose prefill chunks hold prefill_tokens tokens: interleave_slices, more
        for long prefills with interleave_slice_tokens, at most one a layer."""
        slices = self.interleave_slices
        if self.interleave_slice_tokens:
            slices = max(slices, -(-prefill_tokens // self.interleave_slice_tokens))
        return min(slices, num_layers)

    def slice_cuts(self, prefill_tokens: int, num_layers: int) -> frozenset[int]:
        """The layers before which a mixed step's decodes run (prefill_slices' cuts; 0 tokens: the fewest slices)."""
        slices = self.prefill_slices(prefill_tokens, num_layers)
        return frozenset(num_layers * k // slices for k in range(1, slices))


DEFAULT_MAX_MODEL_LEN = 65536
