"""Continuous batching under a per-step token budget, with chunked prefill, a fast lane and preemption.

Each step: running decodes first; then the fast lane (waiting requests that hit the prefix cache and have
at most fast_lane_tokens left to compute, i.e. returning agent sessions); then running chunked prefills;
then cold waiting requests, in arrival order. Prefill chunks end on page boundaries, where the GDN state is
snapshotted for the prefix cache; the snapshots a chunk passes (the prompt's last page boundary, a branch point)
are written by the step itself into reserved slots (model.step snapshot_offsets), so that a returning turn is
one step. When a running sequence cannot get a page, the newest running sequence is preempted: its pages go back
(computed full pages stay cached), and it waits to be recomputed, mostly from the prefix cache. When a running
prefills' next chunks want more pages than are free, running prefills go before any admission (fast lane included),
oldest first; otherwise the fast lane may go first but must leave them those pages. Admissions would take the pages,
and newcomers admitted and preempted in turn would starve the running prefills forever (a livelock that the engine
fuzzer, tests/engine_fuzzer.py, found).
"""
from collections import deque

from model.cache import CachePools
from serving.batch import ScheduledChunk
from serving.block_manager import KVBlockManager
from serving.config import EngineConfig
from serving.page_key_memo import PageKeyMemo
from serving.sequence import PageKey, Sequence, SequenceStatus
from serving.state_cache import StateSnapshotCache


class Scheduler:
    def __init__(self, cfg: EngineConfig, block_manager: KVBlockManager, state_cache: StateSnapshotCache,
                 pools: CachePools):
        self.cfg, self.page_size = cfg, cfg.page_size
        self.block_manager, self.state_cache, self.pools = block_manager, state_cache, pools
        # pages and snapshots leave together: a snapshot with the page it is keyed by, a chain's pages past its
        # deepest snapshot before the pages that lead to one
        block_manager.snapshot_keys, block_manager.on_evict = state_cache, state_cache.drop
        state_cache.on_evict = block_manager.demote
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest admission first
        self.free_state_slots = list(range(cfg.max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self.page_keys = PageKeyMemo(cfg.page_size)  # returning turns reuse their conversation's page keys
        # the waiting requests' prefix hits as this step looked them up, and the evictions there had been by then
        self._step_hits: dict[int, tuple[list[int], PageKey | None]] = {}
        self._step_evictions = 0

    def add(self, seq: Sequence) -> None:
        self.page_keys.seed(seq)
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning a step ---------------------------------------------------------------------------------

    def schedule(self) -> list[ScheduledChunk]:
        """The chunks of the next step; preempts until something can run."""
        chunks = self._schedule_once()
        while not chunks and self.running:
            self.preempt(self.running[-1])
            chunks = self._schedule_once()
        if not chunks and self.waiting:
            raise RuntimeError("no request fits in an empty cache pool")
        return chunks

    def _schedule_once(self) -> list[ScheduledChunk]:
        budget = self.cfg.max_num_batched_tokens
        chunks = self._schedule_decodes(budget)
        budget -= sum(c.num_tokens for c in chunks)
        wanted = self._pages_wanted_by_prefills(budget, chunks)
        running_first = wanted > self.block_manager.num_available_pages
        if running_first:
            budget = self._continue_prefills(budget, chunks)
        hits = self._step_hits = {seq.id: self._prefix_hit(seq) for seq in self.waiting}
        self._step_evictions = self.block_manager.num_evictions
        fast = [s for s in self.waiting if hits[s.id][0] and s.num_tokens - self._hit_tokens(hits[s.id])
                <= self.cfg.fast_lane_tokens]
        for seq in fast:
            budget = self._try_admit(seq, budget, chunks, keep_free=0 if running_first else wanted)
        if not running_first:
            budget = self._continue_prefills(budget, chunks)
        for seq in list(self.waiting):
            if seq in fast:
                continue
            before = len(chunks)
            budget = self._try_admit(seq, budget, chunks)
            if len(chunks) == before:
                break  # cold requests keep their order: a large one is not overtaken forever
        return chunks

    def _pages_wanted_by_prefills(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        """The pages the running prefills not yet in chunks want for their next chunks (each up to budget)."""
        scheduled = {c.seq.id for c in chunks}
        wanted = 0
        for seq in self.running:
            if seq.id not in scheduled and seq.num_uncomputed_tokens:
                end = min(seq.num_tokens, seq.num_computed_tokens + max(budget, 1))
                wanted += max(0, -(-end // self.page_size) - len(seq.pages))
        return wanted

    def _continue_prefills(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        """The next chunk of each running prefill not yet in chunks, oldest first."""
        scheduled = {c.seq.id for c in chunks}
        for seq in [s for s in self.running if s.id not in scheduled]:
            budget = self._continue_prefill(seq, budget, chunks)
        return budget

    def _schedule_decodes(self, budget: int, preempt: bool = True) -> list[ScheduledChunk]:
        """A decode of each running sequence at its last token (and its drafts, speculating), up to budget; pages for
        it preempt the newest running sequences if needed, or without `preempt` the sequence waits for a later step."""
        chunks, used = [], 0
        for seq in list(self.running):
            if used >= budget:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue
            drafts = self._drafts(seq, budget - used - 1)
            n = 1 + len(drafts)
            if self._grow(seq, n) if preempt else self.block_manager.allocate(seq, seq.num_computed_tokens + n):
                chunks.append(ScheduledChunk(seq, n, drafts))
                used += n
        return chunks

    def _drafts(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """The drafts seq's verify step takes: as many as the token budget's room, its max_tokens (a verify step
        emits up to one token more than it verifies) and max_model_len allow."""
        n = min(len(seq.draft_ids), room, seq.params.max_tokens - len(seq.output_ids) - 1,
                self.cfg.max_model_len - seq.num_computed_tokens - 1)
        return tuple(seq.draft_ids[:max(n, 0)])

    def schedule_decodes_between(self) -> list[ScheduledChunk]:
        """The decode-only steps between the slices of an in-flight prefill: no preemption, as the prefill's
        sequences must stay."""
        return self._schedule_decodes(self.cfg.max_num_batched_tokens, preempt=False)

    def _grow(self, seq: Sequence, n: int = 1) -> bool:
        """Page slots for seq's next n tokens, preempting the newest running sequences if needed; False when seq
        itself was preempted."""
        while not self.block_manager.allocate(seq, seq.num_computed_tokens + n):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _continue_prefill(self, seq: Sequence, budget: int, chunks: list[ScheduledChunk]) -> int:
        """Schedule the next chunk of a running chunked prefill as far as budget and free pages allow."""
        bm = self.block_manager
        room = (len(seq.pages) + bm.num_available_pages) * self.page_size - seq.num_computed_tokens
        n, point = self.plan_chunk(seq, seq.num_computed_tokens, min(budget, room))
        if n and bm.allocate(seq, seq.num_computed_tokens + n):
            n = self._reserve_snapshot(seq, seq.num_computed_tokens, n, point)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return budget

    def plan_chunk(self, seq: Sequence, start: int, budget: int) -> tuple[int, int | None]:
        """(tokens to compute from start, a snapshot point inside them or None). Up to budget, ending at a page
        boundary unless the chunk reaches the sequence's end. The snapshot points (the end of the cached pages
        beyond the hit, where sessions branch; the prompt's last page boundary) need the GDN state there: the
        chunk takes the first one inside it in the step (model.step snapshot_offsets) and ends at the second. The
        shared prefix's end (seq.cache_point) is one too: a sparse ladder, so that a session whose deeper
        snapshot is gone, or a new one with the same system prompt, falls back there rather than to token 0."""
        end = min(seq.num_tokens, start + max(budget, 0))
        aligned = end // self.page_size * self.page_size
        if end < seq.num_tokens and aligned > start:
            end = aligned
        prompt_boundary = seq.num_prompt_tokens // self.page_size * self.page_size
        shared = seq.cache_point // self.page_size * self.page_size
        points = sorted({b for b in (seq.cached_pages_end, prompt_boundary, shared) if start < b < end})
        if len(points) > 1:
            end = points[1]
        return end - start, (points[0] if points else None)

    def _reserve_snapshot(self, seq: Sequence, start: int, n: int, point: int | None) -> int:
        """A snapshot slot for the point inside seq's chunk of n tokens from start; without a slot the chunk ends
        at the point instead (its commit snapshots there). A chunk without a point takes a rung of the ladder
        (every snapshot_interval tokens) if it passes one and a slot is free. Returns the chunk's tokens."""
        if point is None:
            rung = self._ladder_rung(start, start + n)
            if rung is not None and (slot := self.state_cache.reserve()) is not None:
                seq.pending_snapshot_slot, seq.pending_snapshot_tokens = slot, rung
            return n
        slot = self.state_cache.reserve()
        if slot is None:
            return point - start
        seq.pending_snapshot_slot, seq.pending_snapshot_tokens = slot, point
        return n

    def _ladder_rung(self, start: int, end: int) -> int | None:
        """The deepest multiple of snapshot_interval (whole pages) strictly inside (start, end), or None."""
        step = self.cfg.snapshot_interval // self.page_size * self.page_size
        if not step:
            return None
        rung = (end - 1) // step * step
        return rung if rung > start else None

    # ---- admission and the hybrid prefix cache -----------------------------------------------------------

    def _prefix_hit(self, seq: Sequence) -> tuple[list[int], int | None]:
        """The longest prefix [0, n) of seq, n <= num_tokens - 1 and page-aligned, with both its KV pages
        and a GDN snapshot cached: (its pages, the snapshot key), or ([], None). Also notes in
        seq.cached_pages_end how far cached pages alone reach: a branch point worth a snapshot."""
        hashes = seq.page_hashes((seq.num_tokens - 1) // self.page_size, self.page_size)
        pages = self.block_manager.cached_prefix(hashes)
        seq.cached_pages_end = len(pages) * self.page_size
        for j in range(len(pages), 0, -1):
            if hashes[j - 1] in self.state_cache:
                return pages[:j], hashes[j - 1]
        return [], None

    def _admission_hit(self, seq: Sequence) -> tuple[list[int], PageKey | None]:
        """seq's prefix hit as the step looked it up, or looked up again when a cached page has been evicted since
        (allocations earlier in the step may have handed one of its pages to another sequence, which seq would then
        share: a stale hit, wrong tokens) or its snapshot is gone (reserved over)."""
        hit = self._step_hits.get(seq.id)
        if (hit is None or self.block_manager.num_evictions != self._step_evictions
                or (hit[1] is not None and hit[1] not in self.state_cache)):
            hit = self._prefix_hit(seq)
        return hit

    def _hit_tokens(self, hit: tuple[list[int], int | None]) -> int:
        return len(hit[0]) * self.page_size

    def _try_admit(self, seq: Sequence, budget: int, chunks: list[ScheduledChunk], keep_free: int = 0) -> int:
        """Start a waiting seq from its prefix hit if a state slot, budget and pages allow, leaving keep_free pages
        available (for running prefills scheduled after it)."""
        if not self.free_state_slots or budget <= 0:
            return budget
        hit_pages, key = self._admission_hit(seq)
        start = len(hit_pages) * self.page_size
        n, point = self.plan_chunk(seq, start, budget)
        bm = self.block_manager
        bm.share_prefix(seq, hit_pages)  # hit pages that were only cached are taken now: no longer available
        if bm.pages_needed(seq, start + n) > bm.num_available_pages - keep_free or not bm.allocate(seq, start + n):
            bm.free(seq)
            return budget
        seq.state_slot = self.free_state_slots.pop()
        if key is None:
            self.pools.reset_slots([seq.state_slot])
        else:
            self.state_cache.restore(key, seq.state_slot)
        seq.snapshot_key = key
        seq.num_computed_tokens = start
        n = self._reserve_snapshot(seq, start, n, point)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = start
        seq.status = SequenceStatus.RUNNING
        self.waiting.remove(seq)
        self.running.append(seq)
        chunks.append(ScheduledChunk(seq, n))
        return budget - n

    # ---- after the step ----------------------------------------------------------------------------------

    def commit(self, chunks: list[ScheduledChunk], position_slots: dict[int, list[int]] | None = None) -> None:
        """The model computed the chunks: advance, publish full pages, snapshot at page boundaries. position_slots
        (a speculative step): by sequence id, the slots that hold its state after each of the chunk's first tokens,
        where a page boundary at those tokens takes its snapshot from (past them: the state slot)."""
        ps = self.page_size
        for c in chunks:
            seq, start = c.seq, c.start
            seq.num_computed_tokens = c.end  # c.start and c.end move with it
            self.block_manager.publish_computed_pages(seq)
            if seq.pending_snapshot_slot is not None:  # the step wrote the state at the point inside the chunk
                self._publish(seq, seq.pending_snapshot_slot, seq.pending_snapshot_tokens)
                seq.pending_snapshot_slot = None
            slots = position_slots.get(seq.id, ()) if position_slots else ()
            for boundary in range((start // ps + 1) * ps, seq.num_computed_tokens + 1, ps):
                j = boundary - start - 1  # the state after the chunk's first j + 1 tokens
                if j < len(slots):
                    self._snapshot(seq, boundary, slots[j])
                elif boundary == seq.num_computed_tokens:
                    self._snapshot(seq, boundary, seq.state_slot)

    def _snapshot(self, seq: Sequence, n: int, slot: int) -> None:
        """At a page boundary n, whose state is in slot: a published snapshot inside the prompt, else seq's rolling
        one."""
        key = self._key_at(seq, n)
        if n <= seq.num_prompt_tokens:
            if key in self.block_manager.page_of_hash and self.state_cache.save(key, slot, n, self._shared(seq, n)):
                self._advance(seq, key)
            return
        saved = self.state_cache.save_private(slot, seq.rolling_snapshot_slot)
        if saved is not None:
            seq.rolling_snapshot_slot, seq.rolling_snapshot_tokens = saved, n

    def _publish(self, seq: Sequence, slot: int, tokens: int) -> None:
        """Publish seq's private snapshot after tokens where its page is cached; else no hit could reach it (the
        page was computed twice and the cached copy has left): its slot goes back."""
        key = self._key_at(seq, tokens)
        if key in self.block_manager.page_of_hash:
            self.state_cache.publish_private(slot, key, tokens, self._shared(seq, tokens))
            self._advance(seq, key)
        else:
            self.state_cache.release(slot)

    def _shared(self, seq: Sequence, tokens: int) -> bool:
        """Whether a snapshot after tokens ends seq's shared prefix (its cache_point's page boundary)."""
        return tokens > 0 and tokens == seq.cache_point // self.page_size * self.page_size

    def _advance(self, seq: Sequence, key: PageKey) -> None:
        """seq published key, its deepest snapshot: its session moves there (state_cache.advance)."""
        self.state_cache.advance(seq.snapshot_key, key)
        seq.snapshot_key = key

    def _key_at(self, seq: Sequence, n: int) -> PageKey:
        """The snapshot key of seq's state after n tokens (page-aligned): the hash of the page that ends there."""
        return seq.page_key(n // self.page_size, self.page_size)

    def _release(self, seq: Sequence) -> None:
        """Give back seq's pages and slot; its rolling snapshot is published for later requests."""
        if seq.rolling_snapshot_slot is not None:
            self._publish(seq, seq.rolling_snapshot_slot, seq.rolling_snapshot_tokens)
            seq.rolling_snapshot_slot = None
        if seq.pending_snapshot_slot is not None:  # scheduled but never committed (a failed step, a preemption)
            self.state_cache.release(seq.pending_snapshot_slot)
            seq.pending_snapshot_slot = None
        self.block_manager.free(seq, self._snapshot_pages(seq))
        seq.draft_ids, seq.draft_probs = [], None  # drafts follow the state they were drafted from
        self.free_state_slots.append(seq.state_slot)
        seq.state_slot = None
        self.running.remove(seq)

    def _snapshot_pages(self, seq: Sequence) -> int:
        """How many of seq's published pages lead to its deepest published snapshot (0: none)."""
        hashes = seq.known_page_hashes()[:seq.num_published_pages]
        for j in range(len(hashes), 0, -1):
            if hashes[j - 1] in self.state_cache:
                return j
        return 0

    def finish(self, seq: Sequence, reason: str) -> None:
        self._release(seq)
        self.page_keys.remember(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def preempt(self, seq: Sequence) -> None:
        """Stop seq and queue it first, to be recomputed (from the prefix cache where it can)."""
        self._release(seq)
        self.num_preemptions += 1
        seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0
        self.waiting.appendleft(seq)
