"""Sampling at the last stage: which tokens temperature, top-k and top-p keep."""

from __future__ import annotations

import math

import pytest

from swarmp2p.serve import SamplingParams

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from swarmp2p.runtime.torch.sampling import (  # noqa: E402
    filter_logits,
    new_generator,
    sample_token,
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
    gen = new_generator(params)
    draws = [sample_token(LOGITS, params, gen) for _ in range(4000)]
    share = draws.count(1) / len(draws)
    assert 0.46 < share < 0.54  # p = 0.5
    again = new_generator(params)
    assert [sample_token(LOGITS, params, again) for _ in range(4000)] == draws


def test_greedy_needs_no_generator_and_others_do():
    assert new_generator(SamplingParams(temperature=0)) is None
    assert sample_token(LOGITS, SamplingParams(temperature=0), None) == 1
    with pytest.raises(ValueError, match="needs a generator"):
        sample_token(LOGITS, SamplingParams(), None)
    with pytest.raises(ValueError, match=r"one \[vocab\] row"):
        sample_token(LOGITS[None], SamplingParams(temperature=0), None)
