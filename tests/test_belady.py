"""profiles.belady: the offline optimum of the prefix cache bounds what an LRU cache of the same size gets, and with
room for everything it is every page seen before."""
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from profiles.belady import belady_hits, page_keys

PAGE = 2


def lru_hits(requests, capacity: int) -> list[int]:
    cache: OrderedDict[bytes, None] = OrderedDict()
    hits = []
    for prompt, answer in requests:
        keys = page_keys(prompt, (len(prompt) - 1) // PAGE, PAGE)
        n = 0
        while n < len(keys) and keys[n] in cache:
            n += 1
        hits.append(n * PAGE)
        for key in dict.fromkeys(keys + page_keys(prompt + answer, len(prompt + answer) // PAGE, PAGE)):
            cache[key] = None
            cache.move_to_end(key)
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def sessions(draw_turns: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """Agent-like requests: each session resends its history plus new tokens, sessions interleaved."""
    requests, history = [], {}
    for turn in draw_turns:
        s, new = turn[0] % 3, turn[1:]
        prompt = history.get(s, [9, 9, 9, 9]) + new  # a shared two-page system prompt
        answer = [t + 1 for t in new[:3]]
        requests.append((prompt, answer))
        history[s] = prompt + answer
    return requests


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=2, max_size=8), min_size=1, max_size=14),
       st.integers(1, 12))
def test_the_optimum_is_at_least_lru_and_unbounded_it_hits_every_page_seen(turns, capacity):
    requests = sessions(turns)
    assert sum(belady_hits(requests, capacity, PAGE)) >= sum(lru_hits(requests, capacity))
    assert belady_hits(requests, 10**6, PAGE) == lru_hits(requests, 10**6)


def test_the_optimum_keeps_what_returns_and_drops_chains_from_their_tails():
    a, b = [1] * 6, [2] * 3
    requests = [(a, []), (b, []), (a + [5], [])]  # room for 3 pages: b's one page takes a's last, not a's first
    assert belady_hits(requests, 3, PAGE) == [0, 0, 4]
    assert lru_hits(requests, 3) == [0, 0, 0]


def test_held_pages_stay_while_their_request_runs():
    a, b = [1] * 6, [2] * 6
    requests = [(a, []), (b, []), (a + [5], [])]
    # a and b run at once: a's three pages are held while b's are cached, so b's cannot stay for long
    overlapped = [("admit", 0), ("admit", 1), ("finish", 0), ("finish", 1), ("admit", 2), ("finish", 2)]
    assert belady_hits(requests, 6, PAGE, overlapped) == [0, 0, 6]
    assert belady_hits(requests, 5, PAGE, overlapped) == [0, 0, 4]
