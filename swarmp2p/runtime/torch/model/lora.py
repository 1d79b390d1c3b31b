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
from dataclasses import dataclass

from torch import nn

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

LORA_EXPORTS = ("merged", "adapters")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSettings:
    """A job's LoRA settings (``model.lora``)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    target_modules: tuple[str, ...] | None = None
    """Leaf module names to adapt; ``None`` resolves them from the model."""
    export: str = "merged"
    """``merged`` (adapters folded into the weights) or ``adapters`` (the delta only)."""

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"model.lora.r must be an integer >= 1, got {self.r!r}")
        if self.alpha <= 0:
            raise ValueError(f"model.lora.alpha must be > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.lora.dropout must be in [0, 1), got {self.dropout!r}")
        if self.export not in LORA_EXPORTS:
            raise ValueError(f"model.lora.export must be merged or adapters, got {self.export!r}")
        if self.target_modules is not None and (
            not self.target_modules
            or not all(isinstance(t, str) and t for t in self.target_modules)
        ):
            raise ValueError(
                f"model.lora.target_modules must be a non-empty list of module names, "
                f"got {self.target_modules!r}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


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


def resolve_targets(model: nn.Module, settings: LoraSettings) -> tuple[str, ...]:
    """The settings' targets, or the defaults of the whole architecture: of every block of the
    model, for a runtime Stage too (its ``model_leaves``), so all stages of a job agree."""
    if settings.target_modules is not None:
        return tuple(settings.target_modules)
    leaves = getattr(model, "model_leaves", None)  # a runtime Stage: the whole model's leaves
    if leaves is None:
        return default_target_modules(introspect(model).blocks)
    return targets_of_leaves(leaves)


def lora_fingerprint(settings: LoraSettings, targets: Sequence[str]) -> str:
    """A hash of the effective rank, scaling, dropout and resolved targets; stages of one job
    agree on it, halves trained differently do not."""
    canonical = json.dumps(
        {
            "r": settings.r,
            "scaling": float(settings.scaling),
            "dropout": float(settings.dropout),
            "targets": sorted(targets),
        },
        sort_keys=True,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _target_regex(blocks_name: str, targets: Sequence[str]) -> str:
    names = "|".join(re.escape(t) for t in sorted(targets))
    return rf"^{re.escape(blocks_name)}\.\d+\.(?:.*\.)?(?:{names})$"


def lora_config(model: nn.Module, settings: LoraSettings):
    """The PEFT ``LoraConfig`` of these settings, matching only modules inside the blocks."""
    from peft import LoraConfig
    from transformers.pytorch_utils import Conv1D

    targets = resolve_targets(model, settings)
    blocks_name, blocks = _blocks(model)
    # GPT-2's Conv1D stores its weight transposed (in, out): PEFT must be told
    transposed = any(
        isinstance(m, Conv1D) and name.rsplit(".", 1)[-1] in targets
        for block in blocks
        for name, m in block.named_modules()
    )
    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=_target_regex(blocks_name, targets),
        fan_in_fan_out=transposed,
        bias="none",
    )


def apply_lora(model: nn.Module, settings: LoraSettings) -> str:
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
