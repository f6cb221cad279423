"""KVBlockManager: refcounts, sharing, eviction of cached pages (past the snapshots first, then LRU), and no leaks
under random traffic."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.block_manager import KVBlockManager
from serving.sequence import SamplingParams, Sequence

PAGE = 4


def new_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(), torch.Generator())


def computed(bm: KVBlockManager, seq: Sequence, n: int) -> Sequence:
    """Pretend the model computed seq's first n tokens: pages allocated and full ones published."""
    assert bm.allocate(seq, n)
    seq.num_computed_tokens = n
    bm.publish_computed_pages(seq)
    return seq


@settings(max_examples=30, deadline=None)
@given(tokens=st.lists(st.integers(0, 248_319), min_size=1, max_size=40), split=st.integers(0, 40),
       grow=st.integers(0, 12), change=st.integers(0, 39))
def test_page_keys_are_a_hash_chain_over_prompt_and_output(tokens, split, grow, change):
    # a page's key (32 bytes) is the same however its tokens were split between prompt and output and however often
    # it was asked for, and changes with any earlier token
    split = min(split, len(tokens) - 1)
    grown = new_seq(tokens[:split + 1])
    grown.page_hashes((split + 1) // PAGE, PAGE)  # memoised part-way, then the outputs arrive
    grown.output_ids = tokens[split + 1:]
    whole = new_seq(tokens)
    n = len(tokens) // PAGE
    assert grown.page_hashes(n, PAGE) == whole.page_hashes(n, PAGE)
    assert all(isinstance(k, bytes) and len(k) == 32 for k in whole.page_hashes(n, PAGE))
    assert len(set(whole.page_hashes(n, PAGE))) == n
    # one page's key alone (a snapshot key) is the chain's entry, asked for first or after the list
    assert [new_seq(tokens).page_key(i, PAGE) for i in range(1, n + 1)] == whole.page_hashes(n, PAGE)
    with pytest.raises(ValueError, match="num_pages"):
        whole.page_key(0, PAGE)
    with pytest.raises(ValueError, match="exceed"):
        whole.page_key(n + 1, PAGE)
    if change < n * PAGE:
        edited = list(tokens)
        edited[change] = (edited[change] + 1 + grow) % 248_320
        keys, edited_keys = whole.page_hashes(n, PAGE), new_seq(edited).page_hashes(n, PAGE)
        first = change // PAGE
        assert keys[:first] == edited_keys[:first]
        assert all(a != b for a, b in zip(keys[first:], edited_keys[first:]))


def test_allocate_is_all_or_nothing():
    bm = KVBlockManager(num_pages=3, page_size=PAGE)
    seq = new_seq(list(range(20)))
    assert not bm.allocate(seq, 13)  # needs 4 pages
    assert seq.pages == [] and bm.num_available_pages == 3
    assert bm.allocate(seq, 12) and len(seq.pages) == 3 and bm.num_available_pages == 0


def test_shared_prefix_pages_are_refcounted():
    bm = KVBlockManager(num_pages=8, page_size=PAGE)
    a = computed(bm, new_seq(list(range(10))), 10)  # pages 0, 1 full and published; page 2 partial
    b = new_seq(list(range(9)) + [99], seq_id=1)
    hit = bm.cached_prefix(b.page_hashes(2, PAGE))
    assert hit == a.pages[:2]
    bm.share_prefix(b, hit)
    assert [bm.refcount[p] for p in a.pages] == [2, 2, 1]
    bm.free(a)
    assert [bm.refcount[p] for p in b.pages] == [1, 1]
    assert a.pages == [] and bm.num_available_pages == 8 - 2  # a's partial page went back to the free list


def test_freed_cached_pages_stay_cached_and_evict_in_lru_order():
    bm = KVBlockManager(num_pages=4, page_size=PAGE)
    a = computed(bm, new_seq(list(range(8))), 8)
    b = computed(bm, new_seq(list(range(100, 108)), seq_id=1), 8)
    a_pages, b_pages = list(a.pages), list(b.pages)
    bm.free(a)
    bm.free(b)
    assert bm.num_available_pages == 4 and not bm.free_pages
    # a was freed first and a sequence's tail before its head: a[1], a[0], b[1], b[0]
    assert [bm.take_page() for _ in range(2)] == [a_pages[1], a_pages[0]]
    assert bm.cached_prefix(new_seq(list(range(8))).page_hashes(2, PAGE)) == []
    assert bm.cached_prefix(new_seq(list(range(100, 108))).page_hashes(2, PAGE)) == b_pages


def test_mru_evicts_the_chain_released_last_from_its_tail():
    bm = KVBlockManager(num_pages=4, page_size=PAGE, eviction="mru")
    a = computed(bm, new_seq(list(range(8))), 8)
    b = computed(bm, new_seq(list(range(100, 108)), seq_id=1), 8)
    a_pages, b_pages = list(a.pages), list(b.pages)
    bm.free(a)
    bm.free(b)
    assert list(bm.evictable) == [b_pages[1], b_pages[0], a_pages[1], a_pages[0]]
    assert bm.take_page() == b_pages[1]  # b left last: its tail goes first, a stays whole
    assert bm.cached_prefix(new_seq(list(range(8))).page_hashes(2, PAGE)) == a_pages


def test_an_unknown_eviction_order_is_refused():
    with pytest.raises(ValueError, match="eviction"):
        KVBlockManager(num_pages=4, page_size=PAGE, eviction="fifo")


def test_a_hit_refreshes_lru_position():
    bm = KVBlockManager(num_pages=2, page_size=PAGE)
    a = computed(bm, new_seq([1, 2, 3, 4]), 4)
    b = computed(bm, new_seq([5, 6, 7, 8], seq_id=1), 4)
    a_page, b_page = a.pages[0], b.pages[0]
    bm.free(a)
    bm.free(b)
    c = new_seq([1, 2, 3, 4, 9], seq_id=2)
    bm.share_prefix(c, bm.cached_prefix(c.page_hashes(1, PAGE)))
    assert c.pages == [a_page] and bm.refcount[a_page] == 1 and a_page not in bm.evictable
    bm.free(c)  # a's page is now the most recently used
    assert bm.take_page() == b_page


def test_a_page_computed_twice_keeps_the_first_copy():
    bm = KVBlockManager(num_pages=4, page_size=PAGE)
    a = computed(bm, new_seq([1, 2, 3, 4, 5]), 5)
    b = computed(bm, new_seq([1, 2, 3, 4, 6], seq_id=1), 5)
    assert bm.cached_prefix(b.page_hashes(1, PAGE)) == [a.pages[0]]
    bm.free(b)
    assert len(bm.free_pages) == 2 and not bm.evictable  # b's copy was never published: it went back free


def test_pages_past_the_deepest_snapshot_are_evicted_first_and_take_their_snapshot():
    bm = KVBlockManager(num_pages=5, page_size=PAGE)
    evicted = []
    bm.on_evict = evicted.append
    a = computed(bm, new_seq(list(range(12))), 12)
    b = computed(bm, new_seq(list(range(100, 108)), seq_id=1), 8)
    a_pages, b_pages, a_keys = list(a.pages), list(b.pages), a.page_hashes(3, PAGE)
    bm.free(a, covered_pages=1)  # a's snapshot is at its first page: pages 1 and 2 serve no hit
    bm.free(b)
    assert list(bm.evictable) == [a_pages[2], a_pages[1], a_pages[0], b_pages[1], b_pages[0]]
    assert [bm.take_page() for _ in range(3)] == [a_pages[2], a_pages[1], a_pages[0]]
    assert evicted == [a_keys[2], a_keys[1], a_keys[0]]
    assert bm.cached_prefix(b.page_hashes(2, PAGE)) == b_pages


def test_a_gone_snapshot_demotes_its_chain_back_to_the_previous_snapshot():
    bm = KVBlockManager(num_pages=8, page_size=PAGE)
    a = computed(bm, new_seq(list(range(16))), 16)
    b = computed(bm, new_seq(list(range(100, 104)) + [0], seq_id=1), 4)
    a_pages, keys = list(a.pages), a.page_hashes(4, PAGE)
    bm.snapshot_keys = {keys[1], keys[3]}
    bm.free(a)
    bm.free(b)
    bm.demote(keys[1])  # not the chain's end: page 2 runs on to the snapshot at page 3, nothing moves
    assert list(bm.evictable)[0] == a_pages[3]
    bm.snapshot_keys = {keys[1]}
    bm.demote(keys[3])  # pages 3 and 2 now lead nowhere; page 1 ends on a snapshot
    assert list(bm.evictable)[:2] == [a_pages[3], a_pages[2]] and bm._tail.keys() == {a_pages[3], a_pages[2]}


def test_release_past_the_snapshots_stops_at_a_branch_point():
    bm = KVBlockManager(num_pages=8, page_size=PAGE)
    a = computed(bm, new_seq([1] * 8 + [2] * 4), 12)
    a_pages = list(a.pages)
    b = new_seq([1] * 8 + [3] * 4 + [0], seq_id=1)
    bm.share_prefix(b, bm.cached_prefix(b.page_hashes(2, PAGE)))
    computed(bm, b, 12)
    b_last = b.pages[2]
    assert b.pages[:2] == a_pages[:2] and bm.children[a_pages[1]] == 2  # a branch point after page 1
    bm.free(a)
    bm.free(b, covered_pages=0)  # b has no snapshot: its own page goes first, not the chain a branches from
    assert list(bm._tail) == [b_last]
    assert list(bm.evictable) == [b_last, a_pages[2], a_pages[1], a_pages[0]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=14), st.integers(0, 14),
                          st.booleans()), min_size=1, max_size=25))
def test_random_traffic_leaves_every_page_free_or_cached(requests):
    """Sequences with shared prefixes (a 3-token vocabulary) hit, allocate, compute and free in random order."""
    bm = KVBlockManager(num_pages=10, page_size=PAGE)
    live = []
    for i, (tokens, extra, free_oldest) in enumerate(requests):
        seq = new_seq(tokens + [0] * extra, seq_id=i)
        hit = bm.cached_prefix(seq.page_hashes((seq.num_tokens - 1) // PAGE, PAGE))
        bm.share_prefix(seq, hit)
        seq.num_computed_tokens = len(hit) * PAGE
        while not bm.allocate(seq, seq.num_tokens) and live:
            bm.free(live.pop(0 if free_oldest else -1))
        if len(seq.pages) * PAGE < seq.num_tokens:
            bm.free(seq)
            continue
        seq.num_computed_tokens = seq.num_tokens
        bm.publish_computed_pages(seq)
        live.append(seq)
        held = [p for s in live for p in s.pages]
        assert all(bm.refcount[p] == held.count(p) for p in range(bm.num_pages))
    for seq in live:
        bm.free(seq)
    assert all(r == 0 for r in bm.refcount)
    assert sorted(list(bm.free_pages) + list(bm.evictable)) == list(range(bm.num_pages))
    assert set(bm.evictable) == {p for p, h in enumerate(bm.hash_of_page) if h is not None}
    assert all(bm.hash_of_page[p] == h for h, p in bm.page_of_hash.items())


@settings(max_examples=200, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 4, 16, 128]), num_pages=st.integers(1, 40))
def test_kv_slots_of_a_span_are_the_slots_of_its_tokens(data, page_size, num_pages):
    # Sequence.kv_slots (a page at a time) against kv_slot of each position, on scattered pages
    s = new_seq([1])
    s.pages = data.draw(st.permutations(range(3 * num_pages)))[:num_pages]
    start = data.draw(st.integers(0, num_pages * page_size))
    end = data.draw(st.integers(start, num_pages * page_size))
    assert s.kv_slots(start, end, page_size) == [s.kv_slot(p, page_size) for p in range(start, end)]
