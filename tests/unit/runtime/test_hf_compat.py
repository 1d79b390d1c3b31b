"""Each transformers hook of ``hf_compat`` on the installed transformers: the member is where the
hook reaches for it and the hook has its effect on a tiny model built here; a hook whose member
moved raises naming itself and the version."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from swarmp2p.runtime.torch.model import hf_compat
from swarmp2p.runtime.torch.model.hf_compat import TransformersHookMoved

pytestmark = pytest.mark.torch

IDS = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))


def _common(**extra):
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    base.update(extra)
    return base


def _llama(**kwargs):
    import transformers as tf

    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**_common()), **kwargs).eval()


def _glm4_moe():
    """An MoE whose router keeps float32 under bfloat16 (``_keep_in_fp32_modules_strict``)."""
    import transformers as tf

    config = tf.Glm4MoeConfig(
        **_common(moe_intermediate_size=16, first_k_dense_replace=1),
        n_routed_experts=2,
        num_experts_per_tok=1,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
    )
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).eval()


def _mixtral():
    import transformers as tf

    config = tf.MixtralConfig(**_common(num_local_experts=2, num_experts_per_tok=1))
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).eval()


def _assert_names(error: pytest.ExceptionInfo, hook: str) -> None:
    import transformers

    assert error.value.hook == hook
    assert f"transformers hook {hook}:" in str(error.value)
    assert f"in transformers {transformers.__version__}" in str(error.value)


# --- dtype_plan: PreTrainedModel._get_dtype_plan ------------------------------------------------


def test_dtype_plan_is_the_plan_from_pretrained_casts_by(tmp_path):
    from transformers import AutoModelForCausalLM, PreTrainedModel

    from swarmp2p.runtime.torch.model.loader import _dtype_for

    assert callable(getattr(PreTrainedModel, "_get_dtype_plan", None))
    model = _glm4_moe()
    plan = hf_compat.dtype_plan(model, torch.bfloat16)
    assert plan  # 5.8: e_score_correction_bias; 5.24: gate.weight as well
    assert plan == dict.fromkeys(type(model)._keep_in_fp32_modules_strict, torch.float32)
    assert hf_compat.dtype_plan(model, torch.float32) == {}
    assert hf_compat.dtype_plan(_llama(), torch.bfloat16) == {}

    # the loader's rule built on the plan casts every tensor as from_pretrained does
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    pick = _dtype_for(loaded, torch.bfloat16)
    kept = {key for key, value in loaded.state_dict().items() if value.dtype == torch.float32}
    assert kept
    for key, value in loaded.state_dict().items():
        if value.is_floating_point():
            assert pick(key, torch.bfloat16) == value.dtype, key


def test_dtype_plan_moved_is_loud(monkeypatch):
    from transformers import PreTrainedModel

    model = _llama()
    monkeypatch.delattr(PreTrainedModel, "_get_dtype_plan")
    with pytest.raises(TransformersHookMoved, match="_get_dtype_plan") as error:
        hf_compat.dtype_plan(model, torch.bfloat16)
    _assert_names(error, "dtype_plan")


# --- set_block_checkpointing: GradientCheckpointingLayer._gradient_checkpointing_func -----------


def test_block_checkpointing_recomputes_each_block_with_the_same_gradients():
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    model = _llama(attn_implementation="eager").train()
    plain = copy.deepcopy(model)
    blocks = list(model.model.layers)
    assert all(isinstance(block, GradientCheckpointingLayer) for block in blocks)
    calls = []

    def counted(forward, *args, **kwargs):
        calls.append(forward)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    for block in blocks:
        hf_compat.set_block_checkpointing(block, True, counted)
        assert block._gradient_checkpointing_func is counted
    model(IDS).logits.square().mean().backward()
    plain(IDS).logits.square().mean().backward()
    assert len(calls) == len(blocks)
    for (name, got), expected in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.allclose(got.grad, expected.grad, rtol=0, atol=1e-6), name

    for block in blocks:
        hf_compat.set_block_checkpointing(block, False, counted)
    model(IDS).logits.sum().backward()
    assert len(calls) == len(blocks)


def test_block_checkpointing_moved_is_loud(monkeypatch):
    import transformers.modeling_layers

    class Ignores(nn.Module):
        """A checkpointing layer that no longer calls ``_gradient_checkpointing_func``."""

        gradient_checkpointing = False

    monkeypatch.setattr(transformers.modeling_layers, "GradientCheckpointingLayer", Ignores)
    hf_compat._checkpointing_contract.cache_clear()
    try:
        with pytest.raises(TransformersHookMoved, match="_gradient_checkpointing_func") as error:
            hf_compat.set_block_checkpointing(nn.Linear(1, 1), True, lambda f, *a: f(*a))
        _assert_names(error, "set_block_checkpointing")
        hf_compat.set_block_checkpointing(
            nn.Linear(1, 1), False, lambda f, *a: f(*a)
        )  # off: no check
    finally:
        hf_compat._checkpointing_contract.cache_clear()


# --- is_fused_experts / set_eager_experts: use_experts_implementation, _experts_implementation --


class _PerExpert(nn.Module):
    """A fused expert weight served one expert at a time (what a quantized ExpertStack does)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight.detach().clone()
        self.read: list[int] = []

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __getitem__(self, index) -> torch.Tensor:
        self.read.append(int(index))
        return self.weight[int(index)]


def test_fused_experts_are_found_and_run_eager_one_expert_at_a_time():
    model = _mixtral()
    found = [name for name, module in model.named_modules() if hf_compat.is_fused_experts(module)]
    assert found == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    with torch.no_grad():
        expected = model(IDS).logits

    hf_compat.set_eager_experts(model.config)
    assert model.config._experts_implementation == "eager"
    stacks = []
    for name in found:
        experts = model.get_submodule(name)
        assert experts.config._experts_implementation == "eager"
        for weight in ("gate_up_proj", "down_proj"):
            stack = _PerExpert(getattr(experts, weight))
            del experts._parameters[weight]
            experts.add_module(weight, stack)
            stacks.append(stack)
    with torch.no_grad():
        got = model(IDS).logits
    assert all(stack.read for stack in stacks)
    assert torch.allclose(got, expected, rtol=0, atol=1e-5)


def test_eager_experts_moved_is_loud():
    with pytest.raises(TransformersHookMoved, match="_experts_implementation") as error:
        hf_compat.set_eager_experts(SimpleNamespace())
    _assert_names(error, "set_eager_experts")


def test_fused_experts_marks_moved_is_loud(monkeypatch):
    import transformers.integrations.moe

    monkeypatch.setattr(
        transformers.integrations.moe, "use_experts_implementation", lambda cls: cls
    )
    hf_compat._experts_contract.cache_clear()
    try:
        assert not hf_compat.is_fused_experts(nn.Linear(1, 1))  # 2-D: no check
        experts = _mixtral().model.layers[0].mlp.experts
        with pytest.raises(TransformersHookMoved, match="is_transposed") as error:
            hf_compat.is_fused_experts(experts)
        _assert_names(error, "is_fused_experts")
    finally:
        hf_compat._experts_contract.cache_clear()


# --- attn_implementation: PretrainedConfig._attn_implementation ---------------------------------


def test_attn_implementation_is_what_the_attention_dispatches_on():
    from transformers import LlamaConfig

    assert hf_compat.attn_implementation(LlamaConfig(**_common())) == "sdpa"  # unset
    assert hf_compat.attn_implementation(_llama().config) == "sdpa"
    model = _llama(attn_implementation="eager")
    assert hf_compat.attn_implementation(model.config) == "eager"
    model.set_attn_implementation("sdpa")  # the public setter writes where the hook reads
    attention = model.model.layers[0].self_attn
    assert hf_compat.attn_implementation(attention.config) == "sdpa"

    # eager and sdpa agree; an unknown name reaches the dispatch and is refused there
    with torch.no_grad():
        expected = model(IDS).logits
        model.set_attn_implementation("eager")
        assert torch.allclose(model(IDS).logits, expected, rtol=0, atol=1e-5)
        attention.config._attn_implementation = "no_such_attention"
        assert hf_compat.attn_implementation(attention.config) == "no_such_attention"
        with pytest.raises(KeyError, match="no_such_attention"):
            model(IDS)


def test_attn_implementation_moved_is_loud():
    with pytest.raises(TransformersHookMoved, match="_attn_implementation") as error:
        hf_compat.attn_implementation(SimpleNamespace())
    _assert_names(error, "attn_implementation")


# --- set_attn_implementation: PretrainedConfig._attn_implementation, written ---------------------


def test_set_attn_implementation_switches_what_a_built_model_dispatches_on():
    model = _llama(attn_implementation="sdpa")
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        expected = model(IDS).logits
        hf_compat.set_attn_implementation(attention.config, "eager")
        assert hf_compat.attn_implementation(attention.config) == "eager"
        assert torch.allclose(model(IDS).logits, expected, rtol=0, atol=1e-5)
        hf_compat.set_attn_implementation(attention.config, "no_such_attention")
        with pytest.raises(KeyError, match="no_such_attention"):  # the blocks read the write
            model(IDS)


def test_set_attn_implementation_moved_is_loud():
    class Computed:  # a config whose implementation is derived, not stored
        @property
        def _attn_implementation(self):
            return "sdpa"

        @_attn_implementation.setter
        def _attn_implementation(self, value):
            pass

    with pytest.raises(TransformersHookMoved, match="does not change") as error:
        hf_compat.set_attn_implementation(Computed(), "eager")
    _assert_names(error, "set_attn_implementation")
