"""KV pages for sequences, with a prefix cache over full pages.

A page is free, held (refcount >= 1, by one or more sequences), or cached and unreferenced (refcount 0,
evictable in LRU order). A full page is published under the chain hash of its tokens (sequence.page_hash),
so a later sequence with the same prefix shares it instead of recomputing it.
"""
from collections import OrderedDict, deque

from serving.sequence import PageKey, Sequence


class KVBlockManager:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.refcount = [0] * num_pages
        self.hash_of_page: list[PageKey | None] = [None] * num_pages
        self.page_of_hash: dict[PageKey, int] = {}
        self.free_pages: deque[int] = deque(range(num_pages))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached pages with refcount 0, oldest first
        self.num_evictions = 0  # cached pages dropped so far: a prefix hit looked up before is stale once it moves

    # ---- pages -------------------------------------------------------------------------------------------

    @property
    def num_available_pages(self) -> int:
        """Pages a new allocation can take: free ones plus evictable cached ones."""
        return len(self.free_pages) + len(self.evictable)

    def take_page(self) -> int:
        """A page for new tokens: a free one, else the least recently used cached one (dropped from the cache)."""
        if self.free_pages:
            page = self.free_pages.popleft()
        elif self.evictable:
            page, _ = self.evictable.popitem(last=False)
            self.num_evictions += 1
            del self.page_of_hash[self.hash_of_page[page]]
            self.hash_of_page[page] = None
        else:
            raise MemoryError("no KV page is free or evictable")
        self.refcount[page] = 1
        return page

    def acquire(self, page: int) -> None:
        self.refcount[page] += 1
        self.evictable.pop(page, None)

    def release(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if self.hash_of_page[page] is None:
                self.free_pages.append(page)
            else:
                self.evictable[page] = None

    def publish(self, page: int, key: PageKey) -> None:
        """Cache a full, computed page under its chain hash (a page computed twice keeps the first copy)."""
        if key not in self.page_of_hash and self.hash_of_page[page] is None:
            self.page_of_hash[key] = page
            self.hash_of_page[page] = key

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
            self.publish(seq.pages[i], hashes[i])
        seq.num_published_pages = max(seq.num_published_pages, full)

    def free(self, seq: Sequence) -> None:
        """Return seq's pages, last first, so that a prefix's tail is evicted before its head."""
        for page in reversed(seq.pages):
            self.release(page)
        seq.pages = []
        seq.num_published_pages = 0
