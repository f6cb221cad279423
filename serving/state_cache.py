"""GDN state snapshots for the hybrid prefix cache.

A prefix hit at n tokens needs the KV pages of [0, n) AND the conv window and recurrent state of every linear
layer after exactly n tokens. Snapshots live in extra slots of CachePools, after the running sequences'
slots, and are keyed by the chain hash of the page that ends at n (n is page-aligned). A snapshot slot is
free, private (one running sequence's rolling snapshot, not evictable) or published (keyed, evictable in
LRU order). Copies between slots are tensor copies on the pools' device.
"""
from collections import OrderedDict

from model.cache import CachePools
from serving.sequence import PageKey


class StateSnapshotCache:
    def __init__(self, pools: CachePools, first_slot: int, num_slots: int):
        if first_slot + num_slots > pools.num_slots:
            raise ValueError(f"snapshot slots [{first_slot}, {first_slot + num_slots}) exceed the pools' "
                             f"{pools.num_slots} slots")
        self.pools = pools
        self.free_slots = list(range(first_slot + num_slots - 1, first_slot - 1, -1))  # pop() takes the lowest
        self.slot_of_key: OrderedDict[PageKey, int] = OrderedDict()  # published snapshots, least recently used first

    def __contains__(self, key: PageKey) -> bool:
        return key in self.slot_of_key

    def __len__(self) -> int:
        return len(self.slot_of_key)

    def copy_state(self, src: int, dst: int) -> None:
        """conv_states[:, dst] = conv_states[:, src], recurrent likewise: every linear layer at once."""
        self.pools.copy_slot(src, dst)

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used published one; None when all are private."""
        if self.free_slots:
            return self.free_slots.pop()
        if self.slot_of_key:
            return self.slot_of_key.popitem(last=False)[1]
        return None

    def save(self, key: PageKey, src_slot: int) -> bool:
        """Publish a copy of src_slot's state under key; False when no slot can be had (snapshots are optional)."""
        if key in self.slot_of_key:
            self.slot_of_key.move_to_end(key)
            return True
        slot = self._take_slot()
        if slot is None:
            return False
        self.copy_state(src_slot, slot)
        self.slot_of_key[key] = slot
        return True

    def restore(self, key: PageKey, dst_slot: int) -> None:
        """Copy the snapshot under key into a running sequence's slot."""
        self.slot_of_key.move_to_end(key)
        self.copy_state(self.slot_of_key[key], dst_slot)

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

    def publish_private(self, slot: int, key: PageKey) -> None:
        """Turn a private snapshot into a published one (or drop it when key is already published)."""
        if key in self.slot_of_key:
            self.slot_of_key.move_to_end(key)
            self.free_slots.append(slot)
        else:
            self.slot_of_key[key] = slot
