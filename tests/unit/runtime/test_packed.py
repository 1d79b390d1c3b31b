"""Linear layers packed for oneDNN (a CPU serve worker's stages): the same logits, rows alike
alone and batched, and the layers it must leave alone left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import build_model
from torch import nn

from swarmp2p.runtime.torch import build_stage
from swarmp2p.runtime.torch.packed import PackedLinear, pack_linears, packing_available

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN packing"),
]


def _plain_linears(module: nn.Module) -> int:
    return sum(type(m) is nn.Linear for m in module.modules())


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "qwen3_moe"])
def test_a_packed_model_gives_the_plain_models_logits_batched_or_alone(family):
    plain = build_model(family).eval()
    packed = copy.deepcopy(plain)
    linears = _plain_linears(plain)
    assert pack_linears(packed) == linears > 0
    assert _plain_linears(packed) == 0
    ids = torch.randint(3, plain.get_output_embeddings().out_features, (8, 6))
    with torch.inference_mode():
        want = plain(ids).logits
        got = packed(ids).logits
        alone = torch.cat([packed(ids[r : r + 1]).logits for r in range(ids.shape[0])])
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert torch.allclose(alone, got, atol=1e-5, rtol=1e-5)
    assert got.argmax(-1).equal(want.argmax(-1))


def test_a_tied_head_packs_once_and_the_embedding_keeps_its_weight():
    model = build_model("llama").eval()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's are
    stage = build_stage(copy.deepcopy(model), 0, model.config.num_hidden_layers)
    assert stage.head.weight is stage.embed.weight
    linears = _plain_linears(stage)
    assert pack_linears(stage) == linears
    assert isinstance(stage.head, PackedLinear)
    assert isinstance(stage.embed, nn.Embedding)
    ids = torch.tensor([[5, 9, 11]])
    with torch.inference_mode():
        want = model(ids).logits
        got = stage(ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_half_weights_and_adapter_layers_stay_as_they_are():
    from peft import LoraConfig, get_peft_model

    model = build_model("llama").eval()
    half = nn.Linear(4, 4).to(torch.float16)
    assert pack_linears(half) == 0
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    inside = sum(
        type(m) is nn.Linear
        for owner in adapted.modules()
        if hasattr(owner, "lora_A")
        for m in owner.modules()
    )
    before = _plain_linears(adapted)
    packed = pack_linears(adapted)
    assert packed == before - inside > 0
    assert _plain_linears(adapted) == inside > 0
    with torch.inference_mode():
        assert torch.isfinite(adapted(torch.tensor([[5, 9, 11]])).logits).all()
