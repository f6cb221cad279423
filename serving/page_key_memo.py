"""Prefix-cache keys of recently finished requests, so that a returning agent turn hashes only its new pages.

A returning turn resends its whole conversation: the finished request's prompt and output, then the new tokens.
Its page keys (serving.sequence.page_hash, a BLAKE2b chain) over that old part are the finished request's, so the
memo hands them over once the old tokens are checked equal (one list comparison in C). At 50k cached tokens this
replaces ~3,200 hashes (a few ms of the returning turn's admission) with that comparison.
"""
from collections import OrderedDict

from serving.sequence import PageKey, Sequence


class PageKeyMemo:
    def __init__(self, page_size: int, max_tokens: int = 1 << 20, max_entries: int = 256):
        self.page_size, self.max_tokens, self.max_entries = page_size, max_tokens, max_entries
        # finished request id -> (its tokens over its keyed pages, those keys); least recently used first
        self.entries: OrderedDict[int, tuple[list[int], list[PageKey]]] = OrderedDict()
        self.num_tokens = 0

    def remember(self, seq: Sequence) -> None:
        """Keep the keys seq has computed (a finished request), dropping the least recently used beyond
        max_tokens or max_entries."""
        keys = seq.known_page_hashes()
        if not keys or seq.id in self.entries:
            return
        tokens = seq.token_slice(0, len(keys) * self.page_size)
        self.entries[seq.id] = (tokens, keys)
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens or len(self.entries) > self.max_entries:
            _, (old, _) = self.entries.popitem(last=False)
            self.num_tokens -= len(old)

    def seed(self, seq: Sequence) -> int:
        """Give a new seq the keys of the longest remembered request whose tokens begin it; returns the pages
        seeded. Candidates are screened on their last token before the full comparison."""
        best = None
        for entry_id, (tokens, keys) in reversed(self.entries.items()):
            n = len(tokens)
            if (n <= seq.num_tokens and (best is None or n > len(best[1][0]))
                    and seq.token_slice(n - 1, n)[0] == tokens[-1] and seq.token_slice(0, n) == tokens):
                best = entry_id, (tokens, keys)
        if best is None:
            return 0
        self.entries.move_to_end(best[0])
        seq.adopt_page_hashes(best[1][1], self.page_size)
        return len(best[1][1])
