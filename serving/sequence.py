"""One request as the engine sees it: its sampling parameters, its tokens and where its cache lives."""
import hashlib
import math
from array import array
from dataclasses import dataclass
from enum import Enum

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (below serving.sampler.GREEDY_BELOW) is greedy; top_k 0 and top_p 1.0 switch those filters
    off; seed None draws from the engine.

    Generation ends at max_tokens, at a token of stop_token_ids, at the engine's eos ids unless ignore_eos, or
    at the first stop string in the decoded text. The engine sees token ids only: stop strings are matched by
    whoever detokenizes (serving.server, with serving.openai_protocol.Detokenizer), which then aborts the
    request with reason "stop" and returns the text before the stop string."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if (not math.isfinite(self.temperature) or self.temperature < 0 or self.top_k < 0
                or not 0 < self.top_p <= 1 or self.max_tokens < 1):
            raise ValueError(f"bad sampling parameters: {self}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must lie in [0, 2**63): {self.seed}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings: {self.stop}")


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


PageKey = bytes  # a prefix-cache key: 32 bytes of BLAKE2b


def page_hash(prev_key: PageKey, page_tokens: bytes) -> PageKey:
    """The hash chain of the prefix cache: a page's key is a cryptographic hash of the previous page's key and
    this page's token ids (int32 bytes), so it depends on every token before it, and a crafted prompt cannot
    collide with another user's prefix to be served its KV (Python's hash() of ints and tuples can be steered)."""
    return hashlib.blake2b(prev_key + page_tokens, digest_size=32).digest()


class Sequence:
    """Tokens [0, num_computed_tokens) are in the cache: KV in `pages` (page i holds positions
    [i*page_size, (i+1)*page_size)), GDN state in `state_slot`. The last output token is never computed
    while running: it is the next step's input."""

    def __init__(self, seq_id: int, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator):
        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        self.id = seq_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.pages: list[int] = []
        self.num_published_pages = 0  # pages[:num_published_pages] are in the prefix cache (or were hits)
        self.state_slot: int | None = None
        self.rolling_snapshot_slot: int | None = None  # a private copy of the state at rolling_snapshot_tokens
        self.rolling_snapshot_tokens = 0
        self.pending_snapshot_slot: int | None = None  # reserved for the state at pending_snapshot_tokens, which
        self.pending_snapshot_tokens = 0  # the scheduled chunk passes; published when the step commits
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hit of the first admission
        self.cached_pages_end = 0  # tokens that cached KV pages covered at the last lookup (hit or not)
        self.cache_point = 0  # where a prefix shared with other requests ends (LLMEngine.add_request)
        self.snapshot_key: PageKey | None = None  # its deepest published snapshot, or the one it started from
        self.finish_reason: str | None = None
        # speculative decoding: the MTP head's drafts of the tokens after the last one, and (sampled requests) the
        # distributions they were drawn from, (len(draft_ids), vocab); the next verify step checks them
        self.draft_ids: list[int] = []
        self.draft_probs: torch.Tensor | None = None
        self._page_hashes: list[PageKey] = []

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """token_ids[start:stop] without building token_ids."""
        n = len(self.prompt_ids)
        return self.prompt_ids[start:min(stop, n)] + self.output_ids[max(start - n, 0):max(stop - n, 0)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def kv_slot(self, position: int, page_size: int) -> int:
        """The flat KV-pool slot of the token at position (page * page_size + offset)."""
        return self.pages[position // page_size] * page_size + position % page_size

    def kv_slots(self, start: int, end: int, page_size: int) -> list[int]:
        """kv_slot of positions start .. end - 1, a page at a time: 8000 slots of 16-token pages in 0.39 ms against
        1.09 for a call a token (the 2-core CPU)."""
        slots = []
        for page in range(start // page_size, -(-end // page_size)):
            base = self.pages[page] * page_size - page * page_size  # position p of this page: base + p
            slots.extend(range(base + max(start, page * page_size), base + min(end, (page + 1) * page_size)))
        return slots

    def page_hashes(self, num_pages: int, page_size: int) -> list[PageKey]:
        """The chain hashes of the first num_pages full pages (tokens only grow, so they are memoised)."""
        self._hash_pages(num_pages, page_size)
        return self._page_hashes[:num_pages]

    def page_key(self, num_pages: int, page_size: int) -> PageKey:
        """The chain hash of the first num_pages (>= 1) full pages: page_hashes(...)[-1] without the list copy."""
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self._hash_pages(num_pages, page_size)
        return self._page_hashes[num_pages - 1]

    def _hash_pages(self, num_pages: int, page_size: int) -> None:
        if num_pages * page_size > self.num_tokens:
            raise ValueError(f"{num_pages} pages of {page_size} exceed the {self.num_tokens} tokens")
        done = len(self._page_hashes)
        if done < num_pages:
            new = array("i", self.token_slice(done * page_size, num_pages * page_size)).tobytes()
            width = 4 * page_size
            prev = self._page_hashes[-1] if done else b""
            for offset in range(0, len(new), width):
                prev = page_hash(prev, new[offset:offset + width])
                self._page_hashes.append(prev)

    def known_page_hashes(self) -> list[PageKey]:
        """The chain hashes computed so far (of the first len(...) full pages)."""
        return list(self._page_hashes)

    def adopt_page_hashes(self, keys: list[PageKey], page_size: int) -> None:
        """Take the chain hashes of another sequence whose tokens begin this one's (checked by the caller:
        serving.page_key_memo), where they reach further than this sequence's own."""
        if len(keys) * page_size > self.num_tokens:
            raise ValueError(f"{len(keys)} pages of {page_size} exceed the {self.num_tokens} tokens")
        if len(keys) > len(self._page_hashes):
            self._page_hashes = list(keys)
