"""Segmented forward: chained stages equal the whole model (logits, gradients, cached decode)."""

from __future__ import annotations

import itertools

import pytest
import torch
from tiny_models import FAMILIES, load_whole
from transformers import DynamicCache

from swarmp2p.runtime.torch import build_stage
from swarmp2p.runtime.torch.model.hf_compat import attn_implementation
from swarmp2p.runtime.torch.model.introspect import introspect

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
            for stage, cache in zip(stages, caches):
                filled = [i for i, layer in enumerate(cache.cache.layers) if _filled(layer)]
                assert filled == list(stage.block_indices), "laid out by whole-model index"


def _filled(layer) -> bool:
    """A cache layer holds state: keys/values, or a linear-attention block's recurrent state."""
    recurrent = getattr(layer, "is_recurrent_states_initialized", {})
    return bool(getattr(layer, "is_initialized", False) or any(recurrent.values()))


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5"])
def test_eager_attention_is_handed_its_causal_mask(family, checkpoints):
    """Eager attention given no mask attends to future tokens silently (DESIGN pitfall)."""
    from swarmp2p.runtime.torch import load_stage_shard

    folder = checkpoints(family)
    sdpa = load_whole(folder)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(7))
    stages = [
        load_stage_shard(folder, 0, 1, True, False, attn_implementation="eager"),
        load_stage_shard(folder, 1, 4, False, True, attn_implementation="eager"),
    ]
    assert attn_implementation(stages[0].config) == "eager"
    with torch.no_grad():
        got = _chain(stages, ids)
        expected = sdpa(ids).logits
    assert (got - expected).abs().max().item() <= TOL


S, F, L = "sliding_attention", "full_attention", "linear_attention"


@pytest.mark.parametrize(
    ("family", "blocks", "head", "types", "tied", "cache_kwarg", "position_embed"),
    [
        ("gpt2", "transformer.h", "lm_head", (F,) * 4, True, "cache", "transformer.wpe"),
        ("llama", "model.layers", "lm_head", (F,) * 4, False, "cache", None),
        ("mistral", "model.layers", "lm_head", (S,) * 4, False, "cache", None),
        ("qwen2", "model.layers", "lm_head", (F, F, S, S), False, "cache", None),
        ("gemma3", "model.layers", "lm_head", (S, F, S, F), True, "cache", None),
        ("gpt_neox", "gpt_neox.layers", "lm_head", (F,) * 4, False, "layer_past", None),
        ("qwen3_5", "model.layers", "lm_head", (L, F, L, F), False, "cache", None),
    ],
)
def test_introspection_finds_each_part(
    family, blocks, head, types, tied, cache_kwarg, position_embed, whole
):
    topology = introspect(whole(family))
    assert topology.names["blocks"] == blocks
    assert topology.names["head"] == head
    assert topology.layer_types == types
    assert topology.tied is tied
    assert topology.cache_kwarg == cache_kwarg
    assert topology.names["position_embed"] == position_embed


def test_introspection_refuses_a_model_without_a_head(checkpoints):
    from transformers import AutoModel

    bare = AutoModel.from_pretrained(checkpoints("llama"))
    with pytest.raises(
        ValueError, match="LlamaModel has no base model under a language-model head"
    ):
        introspect(bare)
