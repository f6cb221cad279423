"""KV pages for sequences, with a prefix cache over full pages.

A page is free, held (refcount >= 1, by one or more sequences), or cached and unreferenced (refcount 0,
evictable). A full page is published under the chain hash of its tokens (sequence.page_hash), so a later
sequence with the same prefix shares it instead of recomputing it.

A hit on the hybrid model needs a GDN snapshot at its end (serving.state_cache), so cached pages past a chain's
deepest snapshot can serve no hit: they are evicted first (`_tail`, deepest first), before the pages that lead to
a snapshot (`_lru`). Those go by `eviction`, each chain from its tail: "lru", the least recently released chain
first; "mru", the most recently released first. Agent sessions come back in about the order they left, each after
its tool call, so when the pool cannot hold them all the session that left last is the one needed last (Belady's
choice); LRU then evicts exactly the session due next. A snapshot leaves with the page it is keyed by
(`on_evict`).
"""
from collections import OrderedDict, deque
from collections.abc import Callable, Container

from serving.sequence import PageKey, Sequence

EVICTION_ORDERS = ("lru", "mru")


class KVBlockManager:
    def __init__(self, num_pages: int, page_size: int, eviction: str = "lru"):
        if eviction not in EVICTION_ORDERS:
            raise ValueError(f"eviction must be one of {EVICTION_ORDERS}, got {eviction!r}")
        self.num_pages, self.page_size = num_pages, page_size
        self.newest_first = eviction == "mru"
        self.refcount = [0] * num_pages
        self.hash_of_page: list[PageKey | None] = [None] * num_pages
        self.page_of_hash: dict[PageKey, int] = {}
        self.free_pages: deque[int] = deque(range(num_pages))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages with refcount 0, oldest first
        self._tail: OrderedDict[int, None] = OrderedDict()  # those past their chain's snapshots: evicted first
        # a cached page's predecessor in its chain (-1: the chain's first page), valid while that page's generation
        # (bumped when it leaves the cache) is the one noted: an evicted page's successors are orphans
        self.parent = [-1] * num_pages
        self.parent_generation = [0] * num_pages
        self.generation = [0] * num_pages
        self.children = [0] * num_pages  # cached pages linked to this page (2+: a branch point)
        self.num_evictions = 0  # cached pages dropped so far: a prefix hit looked up before is stale once it moves
        self.snapshot_keys: Container[PageKey] = ()  # the keys of the published GDN snapshots (serving.state_cache)
        self.on_evict: Callable[[PageKey], None] | None = None  # called with each evicted page's key

    # ---- pages -------------------------------------------------------------------------------------------

    @property
    def evictable(self) -> dict[int, None]:
        """The cached pages no sequence holds, in eviction order."""
        return {**self._tail, **dict.fromkeys(reversed(self._lru) if self.newest_first else self._lru)}

    @property
    def num_available_pages(self) -> int:
        """Pages a new allocation can take: free ones plus evictable cached ones."""
        return len(self.free_pages) + len(self._tail) + len(self._lru)

    def take_page(self) -> int:
        """A page for new tokens: a free one, else a cached one (dropped from the cache, with its snapshot): first
        those past their chain's snapshots, then by the eviction order."""
        if self.free_pages:
            page = self.free_pages.popleft()
        elif self._tail or self._lru:
            page = self._tail.popitem(last=False)[0] if self._tail else self._lru.popitem(last=self.newest_first)[0]
            self._uncache(page)
        else:
            raise MemoryError("no KV page is free or evictable")
        self.refcount[page] = 1
        return page

    def _uncache(self, page: int) -> None:
        key = self.hash_of_page[page]
        self.num_evictions += 1
        del self.page_of_hash[key]
        self.hash_of_page[page] = None
        parent = self.parent_of(page)
        if parent >= 0:
            self.children[parent] -= 1
        self.parent[page], self.children[page] = -1, 0
        self.generation[page] += 1
        if self.on_evict is not None:
            self.on_evict(key)

    def acquire(self, page: int) -> None:
        self.refcount[page] += 1
        self._lru.pop(page, None)
        self._tail.pop(page, None)

    def release(self, page: int, tail: bool = False) -> None:
        """Drop a reference; an unreferenced cached page becomes evictable (first, with tail)."""
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if self.hash_of_page[page] is None:
                self.free_pages.append(page)
            else:
                (self._tail if tail else self._lru)[page] = None

    def publish(self, page: int, key: PageKey, parent: int = -1) -> None:
        """Cache a full, computed page under its chain hash, after the chain's page `parent` (a page computed twice
        keeps the first copy)."""
        if key not in self.page_of_hash and self.hash_of_page[page] is None:
            self.page_of_hash[key] = page
            self.hash_of_page[page] = key
            self.parent[page] = parent
            if parent >= 0:
                self.parent_generation[page] = self.generation[parent]
                self.children[parent] += 1

    def parent_of(self, page: int) -> int:
        """The cached page before page in its chain, or -1 (the chain's first page, or an orphan)."""
        parent = self.parent[page]
        return parent if parent >= 0 and self.parent_generation[page] == self.generation[parent] else -1

    def demote(self, key: PageKey) -> None:
        """The snapshot under key is gone: if its page ends the chain, the chain's unreferenced pages back to the
        previous snapshot or branch point now serve no hit, so they go first."""
        page, chain_end = self.page_of_hash.get(key, -1), True
        while (page >= 0 and page in self._lru and self.children[page] == (0 if chain_end else 1)
               and (chain_end or self.hash_of_page[page] not in self.snapshot_keys)):
            del self._lru[page]
            self._tail[page] = None
            page, chain_end = self.parent_of(page), False

    def cached_prefix(self, hashes: list[PageKey]) -> list[int]:
        """The pages of the longest cached run of `hashes` (a chain, so the run starts at page 0)."""
        pages = []
        for key in hashes:
            if key not in self.page_of_hash:
                break
            pages.append(self.page_of_hash[key])
        return pages

    # ---- sequences ---------------------------------------------------------------------------------------

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages seq needs to hold its first num_tokens tokens."""
        return max(0, -(-num_tokens // self.page_size) - len(seq.pages))

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's pages to hold num_tokens tokens; False (and nothing taken) when the pool cannot."""
        need = self.pages_needed(seq, num_tokens)
        if need == 0:  # most decode steps
            return True
        if need > self.num_available_pages:
            return False
        seq.pages.extend(self.take_page() for _ in range(need))
        return True

    def share_prefix(self, seq: Sequence, pages: list[int]) -> None:
        """Give an empty seq the cached pages of a prefix hit."""
        assert not seq.pages, "a prefix hit goes to a sequence without pages"
        for page in pages:
            self.acquire(page)
        seq.pages = list(pages)
        seq.num_published_pages = len(pages)

    def publish_computed_pages(self, seq: Sequence) -> None:
        """Publish seq's pages that are now full of computed tokens."""
        full = seq.num_computed_tokens // self.page_size
        if full <= seq.num_published_pages:  # most decode steps: no page filled (and no list of hashes to copy)
            return
        hashes = seq.page_hashes(full, self.page_size)
        for i in range(seq.num_published_pages, full):
            self.publish(seq.pages[i], hashes[i], self.page_of_hash.get(hashes[i - 1], -1) if i else -1)
        seq.num_published_pages = max(seq.num_published_pages, full)

    def free(self, seq: Sequence, covered_pages: int | None = None) -> None:
        """Return seq's pages. Those from covered_pages on (past seq's deepest snapshot, up to a branch point) go
        to the tail tier, deepest first; the others in the order that evicts the chain from its tail."""
        pages = seq.pages
        covered = len(pages) if covered_pages is None else covered_pages
        for i in range(len(pages) - 1, covered - 1, -1):
            if self.children[pages[i]] > 1:  # another chain runs on from here
                covered = i + 1
                break
        for i in range(len(pages) - 1, covered - 1, -1):
            self.release(pages[i], tail=True)
        for i in range(covered) if self.newest_first else range(covered - 1, -1, -1):
            self.release(pages[i])
        seq.pages = []
        seq.num_published_pages = 0
