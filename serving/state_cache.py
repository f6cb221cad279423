"""GDN state snapshots for the hybrid prefix cache.

A prefix hit at n tokens needs the KV pages of [0, n) AND the conv window and recurrent state of every linear
layer after exactly n tokens. Snapshots live in extra slots of CachePools, after the running sequences'
slots, and are keyed by the chain hash of the page that ends at n (n is page-aligned). A snapshot slot is
free, private (one running sequence's rolling snapshot, not evictable) or published (keyed, evictable).

Published snapshots are evicted by worth, not by age alone (GreedyDual): a snapshot's worth is the tokens a hit
on it saves times the sessions behind it, and its priority is the clock at its last use plus its worth; the
lowest priority goes first and sets the clock, so unused snapshots still age out. The sessions behind a snapshot:
- the requests parked there (`live`): a request's deepest published snapshot is where its session would come back;
  a request that restores it takes the session over, and moves it on when it publishes a deeper one (`advance`);
- the sessions that branched from it: every restore after the first (`hits` - 1);
- one more at a shared prefix's end (a request's cache_point: the server's system and tools message).
So the point a session has moved past (its earlier turns' ends, its prompt's last page) is worth nothing and goes
first, a system prompt that ten sessions restored stays, and each session keeps its latest end. Copies between
slots are tensor copies on the pools' device.
"""
import heapq
from collections.abc import Callable
from dataclasses import dataclass

from model.cache import CachePools
from serving.sequence import PageKey


@dataclass
class Snapshot:
    slot: int
    tokens: int  # the hit's length: what restoring this snapshot saves
    hits: int = 0
    live: int = 0
    shared: bool = False
    priority: float = 0.0
    entry: int = 0  # its live heap entry's tie-breaker: older entries of it are stale


class StateSnapshotCache:
    def __init__(self, pools: CachePools, first_slot: int, num_slots: int):
        if first_slot + num_slots > pools.num_slots:
            raise ValueError(f"snapshot slots [{first_slot}, {first_slot + num_slots}) exceed the pools' "
                             f"{pools.num_slots} slots")
        self.pools = pools
        self.num_slots = num_slots
        self.free_slots = list(range(first_slot + num_slots - 1, first_slot - 1, -1))  # pop() takes the lowest
        self.published: dict[PageKey, Snapshot] = {}
        self._heap: list[tuple[float, int, PageKey]] = []  # (priority, tie, key); entries go stale on each use
        self._tie = 0
        self.clock = 0.0  # GreedyDual's: the priority of the last snapshot evicted
        self.num_evictions = 0
        # called with the key of each snapshot evicted for room (serving.block_manager: its chain's pages go first)
        self.on_evict: Callable[[PageKey], None] | None = None

    def __contains__(self, key: PageKey) -> bool:
        return key in self.published

    def __len__(self) -> int:
        return len(self.published)

    @property
    def slot_of_key(self) -> dict[PageKey, int]:
        return {key: snap.slot for key, snap in self.published.items()}

    def copy_state(self, src: int, dst: int) -> None:
        """conv_states[:, dst] = conv_states[:, src], recurrent likewise: every linear layer at once."""
        self.pools.copy_slot(src, dst)

    def _touch(self, key: PageKey, snap: Snapshot) -> None:
        snap.priority = self.clock + snap.tokens * (snap.live + max(snap.hits - 1, 0) + snap.shared)
        self._tie += 1
        snap.entry = self._tie
        heapq.heappush(self._heap, (snap.priority, self._tie, key))
        if len(self._heap) > 4 * len(self.published) + 64:  # drop stale entries now and then
            self._heap = [(s.priority, s.entry, k) for k, s in self.published.items()]
            heapq.heapify(self._heap)

    def _evict_one(self) -> int:
        """Evict the published snapshot of lowest priority; returns its slot."""
        while True:
            priority, entry, key = heapq.heappop(self._heap)
            snap = self.published.get(key)
            if snap is not None and snap.entry == entry:
                break
        del self.published[key]
        self.clock = priority
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(key)
        return snap.slot

    def _take_slot(self) -> int | None:
        """A free slot, else the published one of least worth; None when all are private."""
        if self.free_slots:
            return self.free_slots.pop()
        return self._evict_one() if self.published else None

    def _publish(self, key: PageKey, slot: int, tokens: int, shared: bool) -> None:
        snap = self.published[key] = Snapshot(slot, tokens, shared=shared)
        self._touch(key, snap)

    def save(self, key: PageKey, src_slot: int, tokens: int, shared: bool = False) -> bool:
        """Publish a copy of src_slot's state (after `tokens` tokens; at a shared prefix's end with shared) under
        key; False when no slot can be had (snapshots are optional)."""
        if key in self.published:
            self._touch(key, self.published[key])
            return True
        slot = self._take_slot()
        if slot is None:
            return False
        self.copy_state(src_slot, slot)
        self._publish(key, slot, tokens, shared)
        return True

    def restore(self, key: PageKey, dst_slot: int) -> None:
        """Copy the snapshot under key into a running sequence's slot (which takes over a session parked there)."""
        snap = self.published[key]
        snap.hits += 1
        self._touch(key, snap)
        self.copy_state(snap.slot, dst_slot)

    def advance(self, old: PageKey | None, new: PageKey) -> None:
        """A request whose deepest snapshot was old (None: none) published new, deeper: its session moves there."""
        if old == new or new not in self.published:
            return
        if old in self.published and self.published[old].live > 0:
            self.published[old].live -= 1
            self._touch(old, self.published[old])
        self.published[new].live += 1
        self._touch(new, self.published[new])

    def drop(self, key: PageKey) -> None:
        """Free the snapshot under key, if any (its page left the KV cache: no hit can reach it)."""
        snap = self.published.pop(key, None)
        if snap is not None:
            self.free_slots.append(snap.slot)

    # ---- private (rolling) snapshots ---------------------------------------------------------------------

    def reserve(self) -> int | None:
        """A private slot for a snapshot that a step will write (model.step snapshot_slots); None when none can be
        had. publish_private or release it after the step."""
        return self._take_slot()

    def release(self, slot: int) -> None:
        """Give back a private slot unpublished."""
        self.free_slots.append(slot)

    def save_private(self, src_slot: int, slot: int | None) -> int | None:
        """Copy src_slot into the private snapshot `slot` (a new one when None); None when none can be had."""
        slot = self._take_slot() if slot is None else slot
        if slot is not None:
            self.copy_state(src_slot, slot)
        return slot

    def publish_private(self, slot: int, key: PageKey, tokens: int, shared: bool = False) -> None:
        """Turn a private snapshot (after `tokens` tokens) into a published one (or drop it when key is already
        published)."""
        if key in self.published:
            self._touch(key, self.published[key])
            self.free_slots.append(slot)
        else:
            self._publish(key, slot, tokens, shared)
