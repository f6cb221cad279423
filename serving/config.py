"""How big the engine's caches are and how much one step may compute."""
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """num_pages * page_size tokens of KV; max_num_seqs running sequences, each with a GDN state slot, plus
    snapshot_slots more slots for the prefix cache's GDN snapshots. A step computes at most
    max_num_batched_tokens tokens; a prefill of at most fast_lane_tokens uncached tokens after a prefix hit
    (a returning session) goes before cold prefills. Generation stops at eos_token_ids unless ignore_eos."""
    num_pages: int = 256
    page_size: int = 16
    max_num_seqs: int = 8
    snapshot_slots: int = 32
    max_num_batched_tokens: int = 2048
    fast_lane_tokens: int = 512
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self):
        if min(self.num_pages, self.page_size, self.max_num_seqs, self.max_num_batched_tokens) < 1:
            raise ValueError(f"pool sizes and the token budget must be positive: {self}")
        if self.snapshot_slots < 0 or self.fast_lane_tokens < 0:
            raise ValueError(f"snapshot_slots and fast_lane_tokens must be >= 0: {self}")

    @classmethod
    def for_token_budget(cls, kv_tokens: int, page_size: int = 16, **fields) -> "EngineConfig":
        """A config whose KV pool holds kv_tokens tokens (rounded up to whole pages)."""
        return cls(num_pages=-(-kv_tokens // page_size), page_size=page_size, **fields)
