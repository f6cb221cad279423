"""PageKeyMemo: a returning turn takes its conversation's page keys from the finished request it extends, and
only when that request's tokens begin it."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import serving.sequence as S
from serving.page_key_memo import PageKeyMemo
from serving.sequence import SamplingParams, Sequence

PAGE = 4


def new_seq(tokens: list[int], seq_id: int) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(), torch.Generator())


def finished(memo: PageKeyMemo, prompt: list[int], output: list[int], seq_id: int) -> Sequence:
    seq = new_seq(prompt, seq_id)
    seq.output_ids = list(output)
    seq.page_hashes(seq.num_tokens // PAGE, PAGE)
    memo.remember(seq)
    return seq


def counting_hashes(monkeypatch) -> list[int]:
    calls = [0]
    real = S.page_hash

    def page_hash(prev, page):
        calls[0] += 1
        return real(prev, page)

    monkeypatch.setattr(S, "page_hash", page_hash)
    return calls


def test_returning_turn_hashes_only_its_new_pages(monkeypatch):
    memo = PageKeyMemo(PAGE)
    old = finished(memo, list(range(1, 22)), [50, 51, 52], seq_id=0)  # 24 tokens: 6 keyed pages
    returning = new_seq(old.token_ids + [7] * 9, seq_id=1)  # 33 tokens: 8 full pages
    calls = counting_hashes(monkeypatch)
    assert memo.seed(returning) == 6
    keys = returning.page_hashes(8, PAGE)
    assert calls[0] == 2, "only the two new pages are hashed"
    assert keys == new_seq(returning.token_ids, seq_id=2).page_hashes(8, PAGE)


def test_a_conversation_that_differs_gets_no_keys():
    memo = PageKeyMemo(PAGE)
    old = finished(memo, list(range(1, 25)), [], seq_id=0)
    edited = old.token_ids
    edited[13] += 1
    other = new_seq(edited + [3] * 8, seq_id=1)
    assert memo.seed(other) == 0
    shorter = new_seq(old.token_ids[:20], seq_id=2)  # the remembered tokens do not fit inside it
    assert memo.seed(shorter) == 0


def test_the_longest_matching_conversation_wins_and_old_ones_are_dropped():
    memo = PageKeyMemo(PAGE, max_tokens=40)
    finished(memo, list(range(8)), [], seq_id=0)
    finished(memo, list(range(16)), [], seq_id=1)
    seq = new_seq(list(range(20)), seq_id=5)
    assert memo.seed(seq) == 4
    finished(memo, list(range(100, 124)), [], seq_id=2)  # 8 + 16 + 24 > 40: the least recently used (0) goes
    assert list(memo.entries) == [1, 2] and memo.num_tokens == 40


@settings(max_examples=40, deadline=None)
@given(history=st.lists(st.integers(0, 248_319), min_size=1, max_size=60), new=st.integers(0, 20),
       edit=st.integers(-1, 59))
def test_seeded_keys_equal_fresh_keys(history, new, edit):
    memo = PageKeyMemo(PAGE)
    finished(memo, history, [], seq_id=0)
    tokens = list(history) + [9] * new
    if 0 <= edit < len(tokens):
        tokens[edit] = (tokens[edit] + 1) % 248_320
    seq = new_seq(tokens, seq_id=1)
    memo.seed(seq)
    n = len(tokens) // PAGE
    assert seq.page_hashes(n, PAGE) == new_seq(tokens, seq_id=2).page_hashes(n, PAGE)
