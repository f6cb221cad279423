"""reference.speculative: the verify step's acceptance. Greedy against a plain loop; sampled acceptance against the
target distribution by chi-square tests (10^5 draws over a 24-token vocabulary, alpha = 0.001), with drafts that
follow another distribution, and a control showing that the test rejects the drafter's own distribution."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.speculative import greedy_accept, speculative_accept

VOCAB, K, DRAWS, ALPHA = 24, 3, 100_000, 1e-3


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(2, 5), st.integers(0, 2**31 - 1))
def test_greedy_keeps_drafts_up_to_the_first_mismatch(k, rows, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.randint(vocab, (rows, k), generator=gen)
    target = torch.randint(vocab, (rows, k + 1), generator=gen)
    target[:, :k] = torch.where(torch.rand(rows, k, generator=gen) < 0.6, drafts, target[:, :k])  # mostly agreeing
    lengths, tokens = greedy_accept(drafts, target)
    for r in range(rows):
        n = 0
        while n < k and drafts[r, n] == target[r, n]:
            n += 1
        assert lengths[r] == n + 1
        assert tokens[r, :n + 1].tolist() == target[r, :n + 1].tolist() and (tokens[r, n + 1:] == -1).all()


def distributions(gen, positions: int) -> torch.Tensor:
    """(positions, VOCAB) random distributions, peaked enough that drafts and targets often disagree."""
    return torch.softmax(1.5 * torch.randn(positions, VOCAB, generator=gen, dtype=torch.float64), 1)


def generate(target: torch.Tensor, drafter: torch.Tensor, n_tokens: int, gen, accept=speculative_accept):
    """DRAWS independent generations of n_tokens tokens by K-draft verify steps, where the token at position s is
    distributed as target[s] and drafted from drafter[s] (a model whose distribution depends on the position only).
    Returns (DRAWS, n_tokens) tokens and the mean emitted length of a step."""
    rows = torch.arange(DRAWS)
    out = torch.full((DRAWS, n_tokens), -1, dtype=torch.int64)
    pos = torch.zeros(DRAWS, dtype=torch.int64)
    lengths_seen = []
    while (pos < n_tokens).any():
        at = pos[:, None] + torch.arange(K + 1)  # (DRAWS, K+1) the verified positions
        at = at.clamp(max=target.shape[0] - 1)
        q, p = drafter[at[:, :K]], target[at]
        drafts = torch.multinomial(q.reshape(-1, VOCAB), 1, generator=gen).view(DRAWS, K)
        lengths, tokens = accept(drafts, q, p, gen)
        for i in range(K + 1):
            s = pos + i
            ok = (i < lengths) & (s < n_tokens)
            out[rows[ok], s[ok]] = tokens[ok, i]
        lengths_seen.append(lengths[pos < n_tokens].double().mean())
        pos = pos + lengths
    return out, float(torch.stack(lengths_seen).mean())


def chi_square_p(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    """The p-value of tokens (n,) drawn from `expected` (VOCAB,), Pearson's chi-square with VOCAB - 1 degrees."""
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    stat = ((counts - tokens.numel() * expected) ** 2 / (tokens.numel() * expected)).sum()
    df = torch.tensor((VOCAB - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def test_sampled_acceptance_keeps_the_target_distribution():
    gen = torch.Generator().manual_seed(7)
    target, drafter = distributions(gen, 3 + K), distributions(gen, 3 + K)
    tokens, mean_length = generate(target, drafter, 3, gen)
    assert 1.2 < mean_length < K + 1  # drafts were both kept and rejected
    for s in range(3):
        assert chi_square_p(tokens[:, s], target[s]) > ALPHA, f"token {s + 1}"
    # the test can fail: keeping every draft gives the drafter's distribution, which it rejects
    keep_all = lambda drafts, q, p, g: (torch.full((DRAWS,), K + 1), torch.cat([drafts, drafts[:, :1]], 1))
    wrong, _ = generate(target, drafter, 3, gen, accept=keep_all)
    assert chi_square_p(wrong[:, 1], target[1]) < ALPHA


def test_sampled_acceptance_keeps_every_draft_of_the_target_itself():
    gen = torch.Generator().manual_seed(3)
    p = distributions(gen, K + 1)[None].expand(64, -1, -1)
    drafts = torch.multinomial(p[:, :K].reshape(-1, VOCAB), 1, generator=gen).view(64, K)
    lengths, tokens = speculative_accept(drafts, p[:, :K], p, gen)  # q = p: min(1, p/q) = 1
    assert (lengths == K + 1).all() and torch.equal(tokens[:, :K], drafts)


def test_bad_shapes_are_refused():
    drafts = torch.zeros(2, K, dtype=torch.int64)
    with pytest.raises(ValueError, match="target must be"):
        greedy_accept(drafts, torch.zeros(2, K, dtype=torch.int64))
    p = torch.full((2, K + 1, VOCAB), 1 / VOCAB)
    with pytest.raises(ValueError, match="q must be"):
        speculative_accept(drafts, p, p)
