"""Sampling at the last stage: which tokens temperature, top-k and top-p keep."""

from __future__ import annotations

import math

import numpy as np
import pytest

from swarmp2p.serve import SamplingParams

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from swarmp2p.runtime.torch.serve.sampling import (  # noqa: E402
    SessionSampler,
    filter_logits,
    new_generator,
)

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 (as logits, shuffled)
PROBS = [0.0625, 0.5, 0.125, 0.0625, 0.25]
LOGITS = torch.tensor([math.log(p) for p in PROBS])


def _kept(params):
    return sorted(i for i, v in enumerate(filter_logits(LOGITS, params).tolist()) if v > -math.inf)


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(), [0, 1, 2, 3, 4]),
        (SamplingParams(top_k=1), [1]),
        (SamplingParams(top_k=2), [1, 4]),
        (SamplingParams(top_p=0.5), [1]),
        (SamplingParams(top_p=0.6), [1, 4]),
        (SamplingParams(top_p=0.8), [1, 2, 4]),
        (SamplingParams(top_p=1e-9), [1]),
        (SamplingParams(top_k=3, top_p=0.6), [1, 4]),
    ],
)
def test_filters_keep_the_right_tokens(params, kept):
    assert _kept(params) == kept


def test_temperature_sharpens_and_flattens():
    cold = filter_logits(LOGITS, SamplingParams(temperature=0.5)).softmax(-1)
    hot = filter_logits(LOGITS, SamplingParams(temperature=2.0)).softmax(-1)
    assert cold[1] > 0.5 > hot[1]


def test_draws_follow_the_distribution_and_repeat_with_the_seed():
    params = SamplingParams(seed=123)
    sampler = SessionSampler(params, vocab_size=5)
    draws = [sampler.next(LOGITS)[0] for _ in range(4000)]
    share = draws.count(1) / len(draws)
    assert 0.46 < share < 0.54  # p = 0.5
    again = SessionSampler(params, vocab_size=5)
    assert [again.next(LOGITS)[0] for _ in range(4000)] == draws
    # the draw belongs to the position: asking again at the same one gives the same token
    assert len({sampler.pick(LOGITS)[0] for _ in range(50)}) == 1
    other = SessionSampler(SamplingParams(seed=124), vocab_size=5)
    assert [other.next(LOGITS)[0] for _ in range(4000)] != draws


def test_a_seed_gives_plain_samplings_tokens_whatever_is_drafted_or_replayed():
    """Position-keyed draws: verifying drafts (right, wrong, of any length) keeps exactly the
    tokens plain sampling picks, and a sampler replayed from the tokens so far goes on alike."""
    rng = np.random.default_rng(0)
    rows = torch.tensor(rng.normal(size=(60, 5)) * 1.5, dtype=torch.float32)
    params = SamplingParams(temperature=0.9, seed=5)
    plain = SessionSampler(params, vocab_size=5, prompt_len=0)
    want = [plain.next(rows[t])[0] for t in range(len(rows))]

    spec = SessionSampler(params, vocab_size=5, prompt_len=0)
    got: list[int] = []
    while len(got) < len(rows) - 4:
        t = len(got)
        k = int(rng.integers(0, 4))
        # half right (the plain tokens ahead), half guessed
        draft = [want[t + i] if rng.random() < 0.6 else int(rng.integers(0, 5)) for i in range(k)]
        kept, token, _ = spec.verify(rows[t : t + k + 1], draft)
        spec.observe((token,))
        got += [*draft[:kept], token]
    assert got == want[: len(got)]

    replayed = SessionSampler(params, vocab_size=5)
    replayed.observe(want[:30])
    replayed.end_of_prompt()
    assert [replayed.next(rows[t])[0] for t in range(30, 60)] == want[30:]


def test_greedy_needs_no_generator_and_picks_one_row():
    assert new_generator(SamplingParams(temperature=0)) is None
    assert SessionSampler(SamplingParams(temperature=0), vocab_size=5).pick(LOGITS)[0] == 1
    with pytest.raises(ValueError, match=r"one \[vocab\] row"):
        SessionSampler(SamplingParams(temperature=0), vocab_size=5).pick(LOGITS[None])


def test_min_p_keeps_tokens_at_least_that_share_of_the_top_one():
    # top p = 0.5: min_p 0.3 keeps p >= 0.15 (0.5, 0.25); min_p 0.2 keeps p >= 0.1 (and 0.125)
    assert _kept(SamplingParams(min_p=0.3)) == [1, 4]
    assert _kept(SamplingParams(min_p=0.2)) == [1, 2, 4]


def _sampler(**kw):
    from swarmp2p.runtime.torch.serve.sampling import SessionSampler

    return SessionSampler(SamplingParams(temperature=0, **kw), vocab_size=5)


def test_penalties_follow_openai_and_transformers_rules():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    # prompt [1, 4], then generated 2, 2, 0: presence/frequency count the generated ones only
    sampler = _sampler(presence_penalty=0.5, frequency_penalty=0.25)
    sampler.observe([1, 4])
    sampler.end_of_prompt()
    sampler.observe([2, 2, 0])
    token, _ = sampler.pick(LOGITS)
    counts = torch.tensor([1.0, 0, 2, 0, 0])
    want = LOGITS - 0.25 * counts - 0.5 * (counts > 0).float()
    assert token == int(torch.argmax(want)) == 1
    # repetition: transformers' processor over prompt and output alike
    sampler = _sampler(repetition_penalty=8.0)
    sampler.observe([1, 4])
    sampler.end_of_prompt()
    processor = RepetitionPenaltyLogitsProcessor(penalty=8.0)
    want = processor(torch.tensor([[1, 4]]), LOGITS[None].clone())[0]
    assert sampler.pick(LOGITS)[0] == int(torch.argmax(want)) == 2


def test_logit_bias_and_logprobs():
    token, logprobs = _sampler(logit_bias=((3, 100.0),), logprobs=2).pick(LOGITS)
    assert token == 3  # forced by the bias
    # log-probabilities are the model's own (before the bias): p(3) = 0.0625
    assert logprobs.logprob == pytest.approx(math.log(0.0625), abs=1e-5)
    assert [t for t, _ in logprobs.top] == [1, 4]
    assert logprobs.top[0][1] == pytest.approx(math.log(0.5), abs=1e-5)
    assert _sampler().pick(LOGITS) == (1, None)  # greedy, no logprobs asked


def test_a_replayed_session_counts_only_its_generated_tokens():
    from swarmp2p.runtime.torch.serve.sampling import SessionSampler

    params = SamplingParams(temperature=0, frequency_penalty=2.0)
    replay = SessionSampler(params, vocab_size=5, prompt_len=2)
    replay.observe([1, 4, 1, 1])  # prompt [1, 4] and two generated 1s, in one replay
    fresh = SessionSampler(params, vocab_size=5)
    fresh.observe([1, 4])
    fresh.end_of_prompt()
    fresh.observe([1, 1])
    assert replay.pick(LOGITS) == fresh.pick(LOGITS) == (4, None)


def _mask(ids, vocab):
    bits = np.zeros(((vocab + 31) // 32) * 32, dtype=np.uint8)
    bits[list(ids)] = 1
    return np.packbits(bits, bitorder="little").tobytes()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammars_mask_limits_the_pick_to_the_ids_it_allows(temperature):
    vocab = 50
    logits = torch.arange(vocab, dtype=torch.float32)  # the argmax, 49, is not allowed
    allowed = {3, 17, 20}
    sampler = SessionSampler(SamplingParams(temperature=temperature, seed=7), vocab)
    picks = set()
    for _ in range(200):  # a position each (a sampled draw belongs to its position)
        picks.add(sampler.pick(logits, _mask(allowed, vocab))[0])
        sampler.observe((0,))
    assert picks <= allowed and (picks == {20} if temperature == 0 else len(picks) > 1)
    assert SessionSampler(SamplingParams(temperature=0.0), vocab).pick(logits)[0] == 49
    with pytest.raises(ValueError, match="allows no token"):
        sampler.pick(logits, _mask(set(), vocab))
