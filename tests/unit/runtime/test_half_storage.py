"""Half-storage of a frozen backbone: the loss and adapter gradients of a float32 model with the
same rounded weights, without keeping a float32 copy of any weight for backward."""

from __future__ import annotations

import pytest
import torch
from tiny_models import load_whole

from swarmp2p.runtime.torch import build_stage
from swarmp2p.runtime.torch.model.half_storage import apply_half_storage

pytestmark = pytest.mark.torch


def _lora(model):
    from peft import LoraConfig, get_peft_model

    targets = ["c_attn"] if model.config.model_type == "gpt2" else ["q_proj", "v_proj"]
    torch.manual_seed(0)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    for name, param in peft.named_parameters():
        if "lora_B" in name:  # non-zero so the adapters' gradients all depend on the backbone
            torch.nn.init.normal_(param, std=0.1)
    return peft


def _rounded(folder, dtype):
    model = load_whole(folder)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(dtype).float())
    return model


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "weight_dtype"), [("qwen3", "float16"), ("gpt2", "bfloat16"), ("llama", "float16")]
)
def test_half_storage_matches_float32_with_rounded_weights(family, weight_dtype, checkpoints):
    folder = checkpoints(family)
    dtype = getattr(torch, weight_dtype)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    labels = ids.roll(-1, dims=1)
    results = []
    for half in (False, True):
        model = _lora(_rounded(folder, dtype))
        n = model.config.get_text_config().num_hidden_layers
        if half:
            count = apply_half_storage(model, weight_dtype, chunk_rows=48)
            assert count > 0
            base = model.get_base_model()
            assert base.get_output_embeddings().weight.dtype == dtype
            assert all(
                p.dtype == torch.float32 for n_, p in model.named_parameters() if "lora" in n_
            )
        stages = [
            build_stage(model.get_base_model(), 0, 2),
            build_stage(model.get_base_model(), 2, n),
        ]
        saved = []

        def pack(tensor, saved=saved):
            saved.append((tensor.dtype, tuple(tensor.shape)))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = stages[1](stages[0](ids))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
        assert grads and all(g.abs().sum() > 0 for g in grads.values())
        head_shape = tuple(model.get_base_model().get_output_embeddings().weight.shape)
        results.append((loss.detach(), grads, saved, head_shape))

    (loss32, grads32, _, _), (loss16, grads16, saved16, head_shape) = results
    assert torch.allclose(loss16, loss32, rtol=0, atol=1e-6)
    assert grads16.keys() == grads32.keys()
    for name in grads32:
        assert torch.allclose(grads16[name], grads32[name], rtol=1e-5, atol=1e-7), name
    assert (torch.float32, head_shape) not in saved16, "no float32 copy of the head kept"
    assert (dtype, head_shape) in saved16, "the head's 16-bit weight is what backward keeps"


def test_only_frozen_weights_change_and_bad_dtypes_are_refused(checkpoints):
    model = load_whole(checkpoints("llama"))
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    assert apply_half_storage(model.model.layers[0].self_attn, "bfloat16") == 1
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.k_proj.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="weight_dtype 'int8' must be 'float16' or 'bfloat16'"):
        apply_half_storage(model, "int8")
