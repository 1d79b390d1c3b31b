"""Speculative decoding's pure parts: prompt-lookup drafts, the draft length, verification."""

from __future__ import annotations

import random

import pytest

from swarmp2p.serve.decoding.speculate import (
    DraftLength,
    NgramIndex,
    accepted_prefix,
    best_k,
    expected_accepted,
)


def _naive_draft(tokens, k, max_n=4, min_n=2):
    """The definition: the longest suffix (max_n..min_n) with an earlier occurrence; what
    followed its latest earlier occurrence."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_a_draft_is_what_followed_the_suffix_last_time():
    index = NgramIndex([5, 6, 7, 8, 9, 1, 5, 6, 7])
    assert index.draft(3) == [8, 9, 1]
    index.extend([8])  # 6 7 8 recurs: what followed it
    assert index.draft(2) == [9, 1]
    assert NgramIndex([1, 2, 3]).draft(4) == []  # nothing recurs
    assert index.draft(0) == []


@pytest.mark.parametrize("seed", range(20))
def test_the_incremental_index_drafts_what_the_definition_says(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 80))]
    index = NgramIndex()
    for i, token in enumerate(tokens):
        index.extend([token])
        k = rng.randrange(1, 6)
        assert index.draft(k) == _naive_draft(tokens[: i + 1], k), (tokens[: i + 1], k)
    cut = rng.randrange(len(tokens) + 1)
    index.truncate(cut)
    assert index.tokens == tokens[:cut] and index.draft(3) == _naive_draft(tokens[:cut], 3)


def test_bad_ngram_sizes_are_refused():
    with pytest.raises(ValueError, match="need 1 <= min_n <= max_n"):
        NgramIndex(min_n=3, max_n=2)


def test_the_draft_length_follows_the_acceptance_and_stops_where_it_does_not_pay():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert best_k(0.0, 0.05, 10) == 0  # nothing is ever accepted: plain laps
    assert best_k(0.95, 0.05, 10) == 10  # almost everything: draft the most
    assert 0 < best_k(0.6, 0.05, 10) < 10
    good = DraftLength(lap_cost=0.05)
    for _ in range(10):
        good.record(good.next_k() or 1, good.next_k() or 1)  # all accepted
    assert good.rate > 0.9 and good.next_k() == good.max_k and good.acceptance == 1.0
    bad = DraftLength(lap_cost=0.2, retry_after=4)
    for _ in range(10):
        bad.record(4, 0)
    assert bad.next_k() == 0 and bad.acceptance == 0.0
    ks = [bad.next_k() for _ in range(8)]
    assert ks.count(1) == 2 and ks.count(0) == 6  # a probe draft every retry_after laps
    assert good.next_k(available=3) == 3  # never more than the proposer has
    with pytest.raises(ValueError, match="accepted 3 of 2"):
        good.record(2, 3)


def test_greedy_verification_keeps_the_confirmed_prefix():
    assert accepted_prefix([4, 5, 6], [4, 5, 7, 9]) == 2
    assert accepted_prefix([4], [3, 1]) == 0
    assert accepted_prefix([], [3]) == 0


torch = pytest.importorskip("torch")


def test_verify_greedy_returns_the_plain_decodings_next_token():
    from swarmp2p.runtime.torch.serve.verify import verify_greedy

    scores = torch.zeros(4, 10)
    for row, best in enumerate([3, 5, 2, 8]):
        scores[row, best] = 1.0
    assert verify_greedy(scores, [3, 5, 1]) == (2, 2)  # 3, 5 kept; the model says 2 next
    assert verify_greedy(scores, [3, 5, 2]) == (3, 8)  # all kept, then the bonus token
    assert verify_greedy(scores[:1], []) == (0, 3)
    with pytest.raises(ValueError, match="needs 3 rows"):
        verify_greedy(scores, [1, 2])


CHI2_99_DF5 = 15.09
"""The chi-square statistic 5 degrees of freedom exceed with probability 1%."""


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_sampled_tokens_keep_the_models_distribution(drafter):
    """The first token out of a verified lap, over many seeds, is distributed as plain
    sampling from the model's first row: a chi-square test with a fixed threshold."""
    from swarmp2p.runtime.torch.serve.verify import verify_sampled

    vocab, runs = 6, 6000
    gen = torch.Generator().manual_seed(1234)
    probs = torch.softmax(torch.randn(3, vocab, generator=gen), dim=-1)
    q = torch.softmax(torch.randn(2, vocab, generator=gen), dim=-1)
    counts = torch.zeros(vocab)
    for seed in range(runs):
        g = torch.Generator().manual_seed(seed)
        if drafter == "ngram":
            draft = [1, 4]  # fixed, as a prompt lookup's
            kept, token = verify_sampled(probs, draft, g)
        else:
            draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
            kept, token = verify_sampled(probs, draft, g, draft_probs=q)
        first = draft[0] if kept > 0 else token
        counts[first] += 1
    expected = probs[0] * runs
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_99_DF5, (chi2, counts.tolist(), expected.tolist())


def test_a_seed_reproduces_a_sampled_verification():
    from swarmp2p.runtime.torch.serve.verify import verify_sampled

    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), -1)
    runs = [verify_sampled(probs, [7, 8, 9], torch.Generator().manual_seed(42)) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_a_drafted_tokens_cost_grows_with_the_draft_models_share_of_the_compute():
    from swarmp2p.serve.decoding.speculate import (
        DRAFT_FORWARD_LAPS,
        VERIFY_ROW_LAPS,
        best_k,
        draft_lap_cost,
    )

    assert draft_lap_cost(0.0) == VERIFY_ROW_LAPS
    assert draft_lap_cost(1.0) == pytest.approx(VERIFY_ROW_LAPS + DRAFT_FORWARD_LAPS)
    # a drafter as costly as the model pays only where nearly every draft is kept
    assert best_k(0.6, draft_lap_cost(1.0), 10) == 0 < best_k(0.6, draft_lap_cost(0.05), 10)
    with pytest.raises(ValueError, match="compute share"):
        draft_lap_cost(float("nan"))
