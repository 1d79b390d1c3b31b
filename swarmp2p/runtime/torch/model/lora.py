"""LoRA across pipeline stages: targets resolved from the model's own module names, adapters
injected in place (PEFT), each stage optimising only the adapters inside its blocks.

``target_modules`` omitted is resolved by ``default_target_modules`` from the leaf names inside
the decoder blocks against the reference's family table ("Which parameters train"); an
unrecognised architecture falls back to every module in the blocks with a 2-D weight (GPT-2's
Conv1D is matched on the weight's shape, not on ``nn.Linear``).

A stage resolves them from the blocks of the WHOLE model (``Stage.model_leaves``, read from the
meta-device model it was cut from), never from its own: a hybrid model's stage of linear-attention
blocks only would otherwise fall back to a different set than its neighbour, train under another
``lora_fingerprint``, and have its shards refused at the merge.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence

from torch import nn

from swarmp2p.plan.job import LoraConfig
from swarmp2p.runtime.torch.model.introspect import introspect, leaf_weights

ATTENTION_GROUPS: tuple[tuple[str, ...], ...] = (
    # Qwen3-Next (hybrid): the attention group plus its linear-attention projections
    ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "out_proj"),
    # Qwen3.5 (hybrid): the attention group plus the Gated DeltaNet projections
    ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"),
    ("q_proj", "k_proj", "v_proj", "o_proj"),  # Llama, Qwen, Mistral, Gemma
    ("query_key_value",),  # GPT-NeoX, Falcon
    ("c_attn",),  # GPT-2 (c_proj is skipped: the MLP reuses the name)
    ("Wqkv",),  # MPT
    ("qkv_proj",),  # Phi-3
)
"""Known attention-projection groups, most specific first (reference's family table)."""


def default_target_modules(blocks: Sequence[nn.Module]) -> tuple[str, ...]:
    """The leaf names LoRA adapts in these blocks (all of them are read: a hybrid model's first
    block may be linear attention only)."""
    return targets_of_leaves(leaf_weights(blocks))


def targets_of_leaves(leaves: dict[str, int]) -> tuple[str, ...]:
    """The family table's group that ``leaves`` (leaf name -> weight dims) hold, else every
    2-D weight's name."""
    for group in ATTENTION_GROUPS:
        if all(name in leaves for name in group):
            return group
    fallback = tuple(sorted(name for name, dim in leaves.items() if dim == 2))
    if not fallback:
        raise ValueError("the decoder blocks hold no 2-D weight for LoRA to adapt")
    return fallback


def _blocks(module: nn.Module) -> tuple[str, list[nn.Module]]:
    """(dotted name of the block list, the blocks) of a whole model or of a runtime Stage."""
    if hasattr(module, "block_indices") and hasattr(module, "blocks"):  # a runtime Stage
        return "blocks", list(module.blocks)
    topology = introspect(module)
    return topology.names["blocks"], list(topology.blocks)


def resolve_targets(model: nn.Module, settings: LoraConfig) -> tuple[str, ...]:
    """The settings' targets, or the defaults of the whole architecture: of every block of the
    model, for a runtime Stage too (its ``model_leaves``), so all stages of a job agree."""
    if settings.target_modules is not None:
        return tuple(settings.target_modules)
    leaves = getattr(model, "model_leaves", None)  # a runtime Stage: the whole model's leaves
    if leaves is None:
        return default_target_modules(introspect(model).blocks)
    return targets_of_leaves(leaves)


def lora_fingerprint(settings: LoraConfig, targets: Sequence[str]) -> str:
    """A hash of the effective rank, scaling, dropout and resolved targets; stages of one job
    agree on it, halves trained differently do not."""
    canonical = json.dumps(
        {
            "r": settings.r,
            "scaling": float(settings.alpha / settings.r),
            "dropout": float(settings.dropout),
            "targets": sorted(targets),
        },
        sort_keys=True,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _target_regex(blocks_name: str, targets: Sequence[str]) -> str:
    names = "|".join(re.escape(t) for t in sorted(targets))
    return rf"^{re.escape(blocks_name)}\.\d+\.(?:.*\.)?(?:{names})$"


def lora_config(model: nn.Module, settings: LoraConfig):
    """The PEFT ``LoraConfig`` of these settings, matching only modules inside the blocks."""
    from peft import LoraConfig as PeftConfig
    from transformers.pytorch_utils import Conv1D

    targets = resolve_targets(model, settings)
    blocks_name, blocks = _blocks(model)
    # GPT-2's Conv1D stores its weight transposed (in, out): PEFT must be told
    transposed = any(
        isinstance(m, Conv1D) and name.rsplit(".", 1)[-1] in targets
        for block in blocks
        for name, m in block.named_modules()
    )
    return PeftConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=_target_regex(blocks_name, targets),
        fan_in_fan_out=transposed,
        bias="none",
    )


def apply_lora(model: nn.Module, settings: LoraConfig) -> str:
    """Inject adapters into the decoder blocks of ``model`` (a whole model or a runtime
    ``Stage``) in place; return the fingerprint.

    Stages built from a model (before or after) see the adapted blocks. ``lora_B`` starts at
    zero, so an untrained adapter is the identity.
    """
    from peft import inject_adapter_in_model

    targets = resolve_targets(model, settings)
    config = lora_config(model, settings)
    try:
        inject_adapter_in_model(config, model)
    except ValueError as exc:
        raise ValueError(
            f"LoRA target_modules {list(targets)} matched nothing in the decoder blocks: {exc}"
        ) from None
    return lora_fingerprint(settings, targets)
