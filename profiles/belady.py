"""The offline optimum of a prefix cache over a replay's page accesses (Belady's MIN), to set a measured hit rate
against.

A replay is a sequence of admissions and finishes. An admitted request looks up the longest cached prefix of its
prompt's full pages (at most (prompt - 1) // page_size of them, as the engine's hits), then holds every full page
of its prompt until it finishes; then its answer's pages are cached too and nothing of it is held. With room for
`capacity` pages, held ones included, MIN evicts the unheld page whose next lookup is furthest away (never:
first, and of a tie the deepest in its chain), or does not cache a page whose next lookup is further than every
cached page's. A page deeper in a chain is never looked up without the pages before it, so MIN drops chains from
their tails, as the engine does. It may
hit at any page, where the engine needs a GDN snapshot there too: an upper bound.
"""
import heapq

from serving.sequence import SamplingParams, Sequence

NEVER = 1 << 62


def page_keys(tokens: list[int], num_pages: int, page_size: int) -> list[bytes]:
    """The prefix cache's chain keys of tokens' first num_pages full pages (serving.sequence.Sequence's own)."""
    return Sequence(0, tokens, SamplingParams(), None).page_hashes(num_pages, page_size) if num_pages else []


class MinCache:
    """Cached page keys with their next lookups, and how many running requests hold each."""

    def __init__(self, capacity: int, next_lookups: dict[bytes, list[int]]):
        self.capacity, self.next_lookups = capacity, next_lookups  # key -> its lookups' times, latest first
        self.cached: dict[bytes, int] = {}  # key -> its next lookup as last pushed
        self.depth: dict[bytes, int] = {}  # key -> its page's index in its chain
        self.held: dict[bytes, int] = {}
        self.heap: list[tuple[int, int, bytes]] = []  # (-next lookup, -depth, key) of unheld keys; stale ones skipped

    def next_lookup(self, key: bytes, now: int) -> int:
        times = self.next_lookups.get(key, [])
        while times and times[-1] <= now:
            times.pop()
        return times[-1] if times else NEVER

    def furthest(self) -> tuple[int, bytes] | None:
        while self.heap:
            neg, _, key = self.heap[0]
            if self.cached.get(key) == -neg and key not in self.held:
                return -neg, key
            heapq.heappop(self.heap)
        return None

    def push(self, key: bytes) -> None:
        heapq.heappush(self.heap, (-self.cached[key], -self.depth[key], key))

    def put(self, key: bytes, depth: int, now: int, hold: bool) -> None:
        nxt = self.next_lookup(key, now)
        self.depth[key] = depth
        if key not in self.cached and len(self.cached) >= self.capacity:
            top = self.furthest()
            if top is not None and (hold or nxt < top[0]):
                del self.cached[top[1]], self.depth[top[1]]
            elif not hold:
                return  # caching it would only push out a page needed sooner
        self.cached[key] = nxt
        if hold:
            self.held[key] = self.held.get(key, 0) + 1
        else:
            self.push(key)

    def release(self, key: bytes, now: int) -> None:
        self.held[key] -= 1
        if not self.held[key]:
            del self.held[key]
            if key in self.cached:
                self.cached[key] = self.next_lookup(key, now)
                self.push(key)

    def fit(self) -> None:
        """Back within capacity after held pages overflowed it (a running request's pages must stay)."""
        while len(self.cached) > self.capacity and (top := self.furthest()) is not None:
            del self.cached[top[1]], self.depth[top[1]]


def belady_hits(requests: list[tuple[list[int], list[int]]], capacity: int, page_size: int,
                events: list[tuple[str, int]] | None = None) -> list[int]:
    """Tokens each request (prompt, answer) finds cached under MIN with `capacity` pages. events: the replay's
    ("admit", i) and ("finish", i) in their order (default: each request admitted and finished in turn)."""
    events = events or [(kind, i) for i in range(len(requests)) for kind in ("admit", "finish")]
    lookups = [page_keys(p, (len(p) - 1) // page_size, page_size) for p, _ in requests]
    admitted_at = {i: t for t, (kind, i) in enumerate(events) if kind == "admit"}
    next_lookups: dict[bytes, list[int]] = {}
    for i in sorted(admitted_at, key=admitted_at.get, reverse=True):
        for key in lookups[i]:
            next_lookups.setdefault(key, []).append(admitted_at[i])
    cache = MinCache(capacity, next_lookups)
    hits = [0] * len(requests)
    held: dict[int, list[bytes]] = {}
    for now, (kind, i) in enumerate(events):
        prompt, answer = requests[i]
        if kind == "admit":
            keys = lookups[i]
            n = 0
            while n < len(keys) and keys[n] in cache.cached:
                n += 1
            hits[i] = n * page_size
            held[i] = list(dict.fromkeys(page_keys(prompt, len(prompt) // page_size, page_size)))
            for depth, key in enumerate(held[i]):
                cache.put(key, depth, now, hold=True)
        else:
            for depth, key in enumerate(page_keys(prompt + answer, len(prompt + answer) // page_size, page_size)):
                cache.put(key, depth, now, hold=False)
            for key in held.pop(i):
                cache.release(key, now)
            cache.fit()
    return hits
