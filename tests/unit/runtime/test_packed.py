"""Linear layers on oneDNN: packed for a CPU serve worker's stages (the same logits, rows alike
alone and batched) and run by oneDNN's products for a CPU training stage (the same loss and
gradients); the layers either must leave alone left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import build_model
from torch import nn

from swarmp2p.runtime.torch import build_stage
from swarmp2p.runtime.torch.model.packed import (
    OneDnnLinear,
    PackedLinear,
    pack_linears,
    packing_available,
    use_onednn,
)

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


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "qwen3_moe"])
def test_onednn_layers_train_as_plain_ones(family):
    """A float32 CPU training stage's products on oneDNN: the same loss and gradients (within
    float32 rounding), the same parameters and state dict names."""
    plain = build_model(family).train()
    fast = copy.deepcopy(plain)
    linears = _plain_linears(plain)
    assert use_onednn(fast) == linears > 0
    assert _plain_linears(fast) == 0
    assert list(fast.state_dict()) == list(plain.state_dict())
    ids = torch.randint(3, plain.get_output_embeddings().out_features, (2, 9))
    losses = []
    for model in (plain, fast):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, a), b in zip(plain.named_parameters(), fast.parameters()):
        if a.grad is not None:
            assert torch.allclose(b.grad, a.grad, rtol=1e-4, atol=1e-6 * a.grad.abs().max()), name


def test_a_lora_stage_runs_its_base_layers_on_onednn_and_its_adapters_plain():
    from peft import LoraConfig, get_peft_model

    model = build_model("llama").train()
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    reference = copy.deepcopy(adapted)
    use_onednn(adapted)
    bases = [m.base_layer for m in adapted.modules() if hasattr(m, "lora_A")]
    assert bases and all(type(b) is OneDnnLinear for b in bases)
    lora = [m for n, m in adapted.named_modules() if ".lora_" in n and isinstance(m, nn.Linear)]
    assert lora and all(type(m) is nn.Linear for m in lora)
    ids = torch.tensor([[5, 9, 11, 7]])
    for m in (reference, adapted):
        m(ids, labels=ids).loss.backward()
    grads = [(a.grad, b.grad) for a, b in zip(reference.parameters(), adapted.parameters())]
    trained = [(a, b) for a, b in grads if a is not None]
    assert trained and all(torch.allclose(b, a, rtol=1e-4, atol=1e-7) for a, b in trained)


def test_the_training_build_of_a_cpu_float32_stage_uses_onednn(tmp_path):
    import transformers as tf

    from swarmp2p.plan import load_model_shape, parse_job
    from swarmp2p.plan.worker_spec import local_plan, worker_spec
    from swarmp2p.runtime.torch.train.stage_runner import build_from_spec

    build_model("llama").save_pretrained(tmp_path)
    assert tf.AutoConfig.from_pretrained(tmp_path).model_type == "llama"
    job = parse_job(
        {
            "model": {"pretrained": str(tmp_path)},
            "data": {"source": "random"},
            "split": {"stages": 1},
            "train": {"steps": 1, "batch_size": 1, "seq_len": 8},
        }
    )
    spec = worker_spec(job, local_plan(job, load_model_shape(str(tmp_path))), 0, token="t")
    assert (spec.device, spec.dtype) == ("cpu", "float32")
    bundle, _, _ = build_from_spec(spec)
    layers = [m for m in bundle.stage.modules() if isinstance(m, nn.Linear)]
    assert layers and all(type(m) is OneDnnLinear for m in layers)
