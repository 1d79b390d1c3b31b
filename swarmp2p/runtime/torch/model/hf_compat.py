"""Every reach into a private (underscore) member of transformers, one function per hook.

A stage is a slice of a transformers model run outside its ``PreTrainedModel``: loading it the
way ``from_pretrained`` would, checkpointing its blocks and quantizing its MoE experts needs a
few members transformers keeps private. Each is reached here and nowhere else (with the
undocumented marks that tell a fused experts module, which stand in for a private one). Each
function says what it reaches, why, and the transformers versions it was checked on
(:data:`CHECKED_ON`); where the member has moved it raises :class:`TransformersHookMoved`,
naming the hook and the installed version, rather than carrying on without it (a stage that
silently stops checkpointing, or loads its experts unquantized, is worse than one that stops).
None of the hooks has a public fallback that does the same job; each docstring names the
nearest public API where there is one, and why it does not fit.

Not here: public names of transformers' internal modules the loader and the stage import
(``core_model_loading``, ``cache_utils.get_layer_types_and_kwargs``, ``masking_utils``, the
bitsandbytes integration); those fail at import when they move.

tests/unit/runtime/test_hf_compat.py runs each hook on the installed transformers: a version
that moves a member fails there first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn

CHECKED_ON = ("5.8.0", "5.24.0")
"""The transformers releases these hooks were read against and their tests run on. Only the
hooks: pyproject.toml pins ``transformers>=5.8``, but 5.8.0 has no
``cache_utils.get_layer_types_and_kwargs``, which ``introspect`` imports."""


class TransformersHookMoved(RuntimeError):
    """A transformers member a hook of this module reaches is not where it was."""

    def __init__(self, hook: str, detail: str) -> None:
        import transformers

        super().__init__(
            f"transformers hook {hook}: {detail} in transformers {transformers.__version__} "
            f"(swarmp2p checked it on {', '.join(CHECKED_ON)}); "
            "see swarmp2p/runtime/torch/model/hf_compat.py"
        )
        self.hook = hook


def dtype_plan(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``PreTrainedModel._get_dtype_plan(dtype)``: the glob patterns of the tensors that
    ``from_pretrained`` keeps in float32 when loading in ``dtype`` (the model class's
    ``_keep_in_fp32_modules`` under float16, ``_keep_in_fp32_modules_strict`` under float16 and
    bfloat16), each mapped to its dtype.

    Why: a stage reads its tensors itself rather than through ``from_pretrained``, and must
    cast each the way ``from_pretrained`` would (a bfloat16 Glm4Moe keeps its router's
    ``e_score_correction_bias`` in float32, and in 5.24 its ``gate.weight`` too). No public API
    returns the plan; the two class attributes it is built from are private as well, so this
    asks for the plan ``from_pretrained`` itself builds (``modeling_utils``, checked on 5.8.0
    and 5.24.0)."""
    method = getattr(type(model), "_get_dtype_plan", None)
    if not callable(method):
        raise TransformersHookMoved(
            "dtype_plan", f"{type(model).__name__} has no _get_dtype_plan(dtype)"
        )
    plan = method(model, dtype)
    if not isinstance(plan, dict):
        raise TransformersHookMoved(
            "dtype_plan", f"_get_dtype_plan returned {type(plan).__name__}, not a dict"
        )
    return plan


def set_block_checkpointing(block: nn.Module, enabled: bool, checkpoint: Callable) -> None:
    """Turn activation checkpointing of one decoder block on or off: ``gradient_checkpointing``
    and ``_gradient_checkpointing_func`` of a ``GradientCheckpointingLayer``
    (``transformers.modeling_layers``), the flag and the function its wrapped forward calls
    (``checkpoint(forward, *args)``) when the flag is set and the block trains.

    Why: a stage holds a range of blocks, not a ``PreTrainedModel``; the public
    ``PreTrainedModel.gradient_checkpointing_enable`` (``activation_checkpointing_enable`` in
    5.24) sets the same two attributes, but on every layer of a whole model. Setting a private
    name that transformers stopped reading would raise nothing and checkpoint nothing, so a
    probe layer checks, once a process, that the function is still the one called before
    checkpointing is turned on (turning it off, as every run without recompute does, needs no
    check). Checked on 5.8.0, where ``__call__`` calls it, and 5.24.0, where ``forward`` does."""
    if enabled:
        _checkpointing_contract()
    block.gradient_checkpointing = enabled
    block._gradient_checkpointing_func = checkpoint


@functools.cache
def _checkpointing_contract() -> None:
    """Raises unless a ``GradientCheckpointingLayer`` that trains with the flag set calls its
    ``_gradient_checkpointing_func``."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError as error:
        raise TransformersHookMoved(
            "set_block_checkpointing",
            f"no transformers.modeling_layers.GradientCheckpointingLayer ({error})",
        ) from error

    class Probe(GradientCheckpointingLayer):
        def forward(self, x):
            return x * 2

    calls = []

    def spy(forward, *args):
        calls.append(len(args))
        return forward(*args)

    probe = Probe().train()
    probe.gradient_checkpointing = True
    probe._gradient_checkpointing_func = spy
    with torch.enable_grad():
        out = probe(torch.ones(1, requires_grad=True))
    if calls != [1] or out.item() != 2:
        raise TransformersHookMoved(
            "set_block_checkpointing",
            "a GradientCheckpointingLayer with gradient_checkpointing set does not call its "
            "_gradient_checkpointing_func",
        )


def set_eager_experts(config) -> None:
    """Run the fused MoE experts of every model built on ``config`` the eager way: sets
    ``PretrainedConfig._experts_implementation`` (a property whose setter passes the value on to
    the sub-configs), which the forward that ``use_experts_implementation``
    (``transformers.integrations.moe``) wraps around an experts class reads on every call.

    Why: the eager forward (the class's own) takes ``gate_up_proj[e]`` one expert at a time,
    which a quantized ``ExpertStack`` serves; the batched and grouped ones read the whole 3-D
    tensor. The public ``PreTrainedModel.set_experts_implementation`` works on a whole model and
    decides whether it may by reading the model class's source for the decorator; the stage
    quantizer holds the decoder config the stage runs with, and sets it there (checked on 5.8.0
    and 5.24.0)."""
    _experts_contract("set_eager_experts")
    if not hasattr(config, "_experts_implementation"):
        raise TransformersHookMoved(
            "set_eager_experts", f"{type(config).__name__} has no _experts_implementation"
        )
    config._experts_implementation = "eager"
    if config._experts_implementation != "eager":
        raise TransformersHookMoved(
            "set_eager_experts",
            f"setting {type(config).__name__}._experts_implementation does not keep 'eager'",
        )


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a fused MoE experts module (3-D ``gate_up_proj``/``down_proj``, one
    slice per expert): an instance of a class ``use_experts_implementation`` decorated, which
    marks each instance with ``is_transposed`` (the weight layout), ``is_concatenated``,
    ``has_gate`` and ``has_bias``.

    Why: the stage quantizer stores those weights expert by expert, and there is no public
    registry of experts classes. The marks are undocumented; a probe class checks, once a
    process, that the decorator still sets them, before the first module with a 3-D parameter
    of its own is asked about (no other can be fused experts, so a dense model needs no check).
    Checked on 5.8.0 and 5.24.0; 5.24.0 also sets the private ``_is_expert_parallel``, which
    5.8.0 does not, so it is not read."""
    if not any(p.dim() == 3 for p in module.parameters(recurse=False)):
        return False
    _experts_contract("is_fused_experts")
    return all(hasattr(module, mark) for mark in _EXPERTS_MARKS)


_EXPERTS_MARKS = ("is_transposed", "is_concatenated", "has_gate", "has_bias")


@functools.cache
def _experts_contract(hook: str) -> None:
    """Raises unless ``use_experts_implementation`` marks an instance of the class it decorates
    and its forward runs the class's own forward when the config's
    ``_experts_implementation`` is ``"eager"``."""
    try:
        from transformers.integrations.moe import use_experts_implementation
    except ImportError as error:
        raise TransformersHookMoved(
            hook, f"no transformers.integrations.moe.use_experts_implementation ({error})"
        ) from error

    class Probe(nn.Module):
        def __init__(self, config) -> None:
            super().__init__()

        def forward(self, x):
            return x + 1

    probe = use_experts_implementation(Probe)(SimpleNamespace(_experts_implementation="eager"))
    missing = [mark for mark in _EXPERTS_MARKS if not hasattr(probe, mark)]
    if missing:
        raise TransformersHookMoved(
            hook, f"use_experts_implementation no longer sets {', '.join(missing)}"
        )
    try:
        out = probe(torch.zeros(1))
    except (AttributeError, KeyError) as error:
        raise TransformersHookMoved(
            hook,
            "the experts forward does not dispatch on config._experts_implementation "
            f"({type(error).__name__}: {error})",
        ) from error
    if out.item() != 1:
        raise TransformersHookMoved(
            hook, "experts_implementation 'eager' does not run the experts class's own forward"
        )


def attn_implementation(config) -> str:
    """The attention implementation blocks built on ``config`` dispatch on:
    ``PretrainedConfig._attn_implementation`` (``from_config``/``from_pretrained``'s
    ``attn_implementation`` and the public ``PreTrainedModel.set_attn_implementation`` write
    it), ``"sdpa"`` where it is unset, as transformers resolves an unset one.

    Why: batched serving builds the attention mask itself, in the form that implementation
    takes (a boolean mask for sdpa, an additive one for eager). There is no public getter
    (checked on 5.8.0 and 5.24.0)."""
    if not hasattr(config, "_attn_implementation"):
        raise TransformersHookMoved(
            "attn_implementation", f"{type(config).__name__} has no _attn_implementation"
        )
    return config._attn_implementation or "sdpa"


def set_attn_implementation(config, name: str) -> None:
    """Make the blocks built on ``config`` dispatch on ``name`` (one registered with
    ``AttentionInterface``): ``PretrainedConfig._attn_implementation`` written in place.

    Why: a stage's blocks read the config they were built with at every forward, so switching
    a built stage to ``swarm_sdpa`` is one write there. The public
    ``PreTrainedModel.set_attn_implementation`` needs the whole model (a stage is a slice of
    one) and checks the name against the implementations it knows, which a registered one is
    not on 5.8.0 (checked on 5.8.0 and 5.24.0)."""
    attn_implementation(config)  # the member is where it was
    config._attn_implementation = name
    if attn_implementation(config) != name:
        raise TransformersHookMoved(
            "set_attn_implementation",
            "setting _attn_implementation on the config does not change what it reads",
        )
