"""StateSnapshotCache: slot copies of every linear layer's state, eviction by worth, private rolling snapshots."""
import torch

from model.cache import CachePools
from serving.state_cache import StateSnapshotCache
from tests.hf_oracle import small_config

RUNNING = 2  # slots 0, 1 belong to running sequences; snapshots use the rest


def make_cache(snapshot_slots: int) -> StateSnapshotCache:
    pools = CachePools.allocate(small_config(), num_pages=1, page_size=4, num_slots=RUNNING + snapshot_slots,
                                dtype=torch.float32, device="cpu")
    return StateSnapshotCache(pools, first_slot=RUNNING, num_slots=snapshot_slots)


def fill(cache: StateSnapshotCache, slot: int, value: float) -> None:
    cache.pools.conv_states[:, slot] = value
    cache.pools.recurrent_states[:, slot] = value


def value_of(cache: StateSnapshotCache, slot: int) -> float:
    conv, rec = cache.pools.conv_states[:, slot], cache.pools.recurrent_states[:, slot]
    assert (conv == conv.flatten()[0]).all() and (rec == conv.flatten()[0]).all()
    return float(conv.flatten()[0])


def test_save_and_restore_copy_every_linear_layer():
    cache = make_cache(2)
    fill(cache, 0, 3.0)
    assert cache.save(key=11, src_slot=0, tokens=64) and 11 in cache
    fill(cache, 0, 0.0)
    cache.restore(11, dst_slot=1)
    assert value_of(cache, 1) == 3.0 and value_of(cache, 0) == 0.0


def test_equal_worth_evicts_least_recently_used_first():
    cache = make_cache(2)
    for key in (1, 2):
        fill(cache, 0, float(key))
        cache.save(key, 0, tokens=64)
    cache.save(1, 0, tokens=64)  # key 1 is now the most recently used
    fill(cache, 0, 3.0)
    cache.save(3, 0, tokens=64)
    assert 2 not in cache and 1 in cache and 3 in cache
    cache.restore(3, 1)
    assert value_of(cache, 1) == 3.0


def test_worth_counts_the_sessions_behind_a_snapshot_and_a_point_a_session_passed_goes_first():
    cache = make_cache(3)
    cache.save("system", 0, tokens=400, shared=True)  # a shared prefix's end: one session ahead of time
    for _ in range(4):  # four sessions restored it: three branches besides the first
        cache.restore("system", 1)
    cache.save("prompt", 0, tokens=1200)
    cache.advance(None, "prompt")  # a request parked at its prompt's end...
    cache.save("end", 0, tokens=1500)
    cache.advance("prompt", "end")  # ...then moved on to its answer's: the prompt's end serves no session
    worths = {k: s.priority for k, s in cache.published.items()}
    assert worths == {"system": 400 * (1 + 3), "prompt": 0, "end": 1500}
    cache.save("other", 0, tokens=100)
    cache.advance(None, "other")
    assert set(cache.published) == {"system", "end", "other"}  # the passed point went, though deeper and newer
    for i in range(12):  # unused snapshots age: later ones outbid them once the clock has risen past their worth
        cache.save(i, 0, tokens=700)
        cache.advance(None, i)
    assert "system" not in cache and "end" not in cache and cache.clock >= 1600


def test_a_session_taken_over_moves_on_once():
    cache = make_cache(3)
    cache.save("turn1", 0, tokens=64)
    cache.advance(None, "turn1")
    cache.restore("turn1", 1)  # the session returns: a new request takes it over from turn1...
    cache.save("turn2", 0, tokens=128)
    cache.advance("turn1", "turn2")  # ...and moves it to turn2
    assert (cache.published["turn1"].live, cache.published["turn2"].live) == (0, 1)
    cache.advance("turn1", "turn2")  # again (a second request from turn1): nothing goes below zero
    assert cache.published["turn1"].live == 0 and cache.published["turn1"].priority == 0


def test_a_dropped_snapshot_frees_its_slot_and_an_evicted_one_is_reported():
    cache = make_cache(1)
    evicted = []
    cache.on_evict = evicted.append
    cache.save(1, 0, tokens=16)
    cache.drop(1)
    cache.drop(1)  # twice is harmless
    assert len(cache) == 0 and cache.free_slots == [RUNNING] and evicted == []
    cache.save(2, 0, tokens=16)
    cache.save(3, 0, tokens=16)
    assert evicted == [2] and 3 in cache


def test_saving_a_known_key_copies_nothing():
    cache = make_cache(1)
    fill(cache, 0, 1.0)
    cache.save(5, 0, tokens=16)
    fill(cache, 0, 2.0)
    assert cache.save(5, 0, tokens=16)
    cache.restore(5, 1)
    assert value_of(cache, 1) == 1.0


def test_private_snapshots_are_never_evicted_and_publish_once():
    cache = make_cache(2)
    fill(cache, 0, 1.0)
    a = cache.save_private(0, None)
    b = cache.save_private(0, None)
    assert {a, b} == {2, 3}
    assert not cache.save(7, 0, tokens=16) and cache.save_private(0, None) is None  # both slots are private
    fill(cache, 0, 4.0)
    assert cache.save_private(0, a) == a and value_of(cache, a) == 4.0  # a rolling snapshot is overwritten
    cache.publish_private(a, key=9, tokens=32)
    cache.publish_private(b, key=9, tokens=32)  # the same point again: b's slot goes back free
    assert len(cache) == 1 and cache.free_slots == [b]
    cache.restore(9, 1)
    assert value_of(cache, 1) == 4.0
