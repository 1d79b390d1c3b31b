"""Segmented forward: chained stages equal the whole model (logits, gradients, cached decode)."""

from __future__ import annotations

import itertools

import pytest
import torch
from tiny_models import FAMILIES, load_whole
from transformers import DynamicCache

from swarmp2p.runtime.torch import build_stage, introspect

pytestmark = pytest.mark.torch

CUTS = ([2], [1, 3])
"""Cut points over the tiny models' 4 blocks: two stages, and three with a middle stage."""
TOL = 1e-5


def _stages(model, cuts):
    bounds = [0, *cuts, introspect(model).num_blocks]
    return [build_stage(model, a, b) for a, b in itertools.pairwise(bounds)]


def _chain(stages, x, caches=None):
    for i, stage in enumerate(stages):
        x = stage(x, cache=None if caches is None else caches[i])
    return x


@pytest.fixture(scope="module")
def whole(checkpoints):
    loaded = {}

    def get(family):
        if family not in loaded:
            loaded[family] = load_whole(checkpoints(family))
        return loaded[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_chained_stages_equal_the_whole_model(family, whole):
    model = whole(family)
    ids = torch.randint(
        0,
        model.config.get_text_config().vocab_size,
        (2, 10),
        generator=torch.Generator().manual_seed(1),
    )
    labels = ids.roll(-1, dims=1)

    def loss_of(logits):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    model.zero_grad()
    reference = model(ids).logits
    loss_of(reference).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert ref_grads

    for cuts in CUTS:
        stages = _stages(model, cuts)
        owned = [{id(p) for p in s.parameters()} for s in stages]
        every = {id(p) for p in model.parameters()}
        assert set().union(*owned) == every, "stages together hold every parameter"
        if not introspect(model).tied:
            assert sum(map(len, owned)) == len(every), "and no parameter twice"

        model.zero_grad()
        logits = _chain(stages, ids)
        assert (logits - reference).abs().max().item() <= TOL, (family, cuts)
        loss_of(logits).backward()
        for name, grad in ref_grads.items():
            got = dict(model.named_parameters())[name].grad
            assert got is not None, (family, cuts, name)
            assert (got - grad).abs().max().item() <= TOL, (family, cuts, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decode_equals_the_whole_models(family, whole):
    model = whole(family)
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, 7), generator=torch.Generator().manual_seed(2))
    steps = [torch.tensor([[t]]) for t in (3, 17, 42, 5)]
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        reference = [model(prompt, cache=cache, use_cache=True).logits]
        reference += [model(token, cache=cache, use_cache=True).logits for token in steps]
        for cuts in CUTS:
            stages = _stages(model, cuts)
            caches = [stage.new_cache() for stage in stages]
            got = [_chain(stages, prompt, caches)] + [_chain(stages, t, caches) for t in steps]
            for step, (a, b) in enumerate(zip(got, reference)):
                assert (a - b).abs().max().item() <= TOL, (family, cuts, step)
            assert all(c.seen_tokens == 7 + len(steps) for c in caches)
