"""Generic decoder introspection: find a causal LM's parts by structure, never by family name."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

_CACHE_KWARGS = ("cache", "layer_past", "past_key_values")
"""Names decoder blocks take their cache by, newest first (GPT-NeoX still says ``layer_past``)."""

LINEAR_ATTENTION = "linear_attention"
"""The layer type of a recurrent block (Gated DeltaNet): it takes no causal mask."""


_PEFT_PARTS = frozenset(
    {
        "base_layer",
        "lora_A",
        "lora_B",
        "lora_dropout",
        "lora_embedding_A",
        "lora_embedding_B",
        "lora_magnitude_vector",
    }
)
"""Submodule names PEFT's LoRA wrapper adds around a layer."""


def leaf_weights(blocks) -> dict[str, int]:
    """Leaf name -> weight dimensionality, for every leaf module with a weight in ``blocks``
    (meta-device ones included; a PEFT-wrapped layer counts under its own name)."""
    found: dict[str, int] = {}
    for block in blocks:
        for name, module in block.named_modules():
            if not name or _PEFT_PARTS & set(name.split(".")):
                continue  # inside an adapter wrapper: the wrapper stands for the layer
            base = getattr(module, "base_layer", None)  # a PEFT-wrapped layer: its own name
            weight = getattr(base if base is not None else module, "weight", None)
            leaf = base is not None or not list(module.children())
            if leaf and isinstance(weight, nn.Parameter):
                found.setdefault(name.rsplit(".", 1)[-1], weight.dim())
    return found


def decoder_config(config):
    """The decoder's own config: ``text_config`` of a multimodal config, else the config itself."""
    return config.get_text_config(decoder=True)


def layer_types(config) -> tuple[str, ...]:
    """Each block's layer type, by the rule transformers' own caches use (``config.layer_types``,
    else ``sliding_window`` / ``attention_chunk_size``)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(decoder_config(config))
    return tuple(types)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Topology:
    """Where a causal LM keeps its parts, and the config quirks its forward applies."""

    names: dict[str, str | None]
    """Dotted module name of each part in the whole model: blocks, embed, position_embed,
    embed_dropout, final_norm, head, rotary (``None`` when the model has no such part)."""
    blocks: nn.ModuleList
    embed: nn.Module
    position_embed: nn.Embedding | None
    """A learned absolute position embedding added to the token embedding (GPT-2's ``wpe``)."""
    embed_dropout: nn.Dropout | None
    final_norm: nn.Module
    head: nn.Module
    rotary: nn.Module | None
    rotary_takes_layer_type: bool
    """Gemma 3 keeps one rotary table per layer type: ``rotary(x, position_ids, layer_type)``."""
    layer_types: tuple[str, ...]
    tied: bool
    """The head shares its weight with the input embedding."""
    cache_kwarg: str
    """The keyword a block takes its cache by."""
    block_kwargs: frozenset[str]
    """The keywords a block's forward names (extra ones go through ``**kwargs``)."""
    embedding_multiplier: float | None
    """Granite multiplies the embeddings in the model's forward."""
    logits_divisor: float | None
    """Granite's ``logits_scaling``: logits are divided by it."""
    logit_scale: float | None
    """Cohere's ``logit_scale``: logits are multiplied by it."""
    final_logit_softcapping: float | None
    """Gemma 2/3: logits = cap * tanh(logits / cap)."""
    config: object
    """The decoder config (``text_config`` of a multimodal checkpoint)."""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(module): name for name, module in model.named_modules(remove_duplicate=False)}


def _number(config, name: str) -> float | None:
    value = getattr(config, name, None)
    if value is None or isinstance(value, bool):
        return None
    return float(value)


def introspect(model: nn.Module) -> Topology:
    """The topology of a transformers causal LM (works on a meta-device model too)."""
    config = decoder_config(model.config)
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        raise ValueError(
            f"{type(model).__name__} has no base model under a language-model head; "
            "load it with AutoModelForCausalLM"
        )
    children = list(base.named_children())
    n_layers = config.num_hidden_layers
    block_at = next(
        (
            i
            for i, (_, child) in enumerate(children)
            if isinstance(child, nn.ModuleList) and len(child) == n_layers
        ),
        None,
    )
    if block_at is None:
        raise ValueError(
            f"{type(base).__name__} has no ModuleList of {n_layers} decoder blocks "
            f"(children: {', '.join(name for name, _ in children)})"
        )
    blocks = children[block_at][1]
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output head; it is not a causal LM")

    before, after = children[:block_at], children[block_at + 1 :]
    position_embed = None
    embed_dropout = None
    for name, child in before:
        if child is embed:
            continue
        if isinstance(child, nn.Dropout):
            embed_dropout = child
        elif type(child) is nn.Embedding and child.num_embeddings == getattr(
            config, "max_position_embeddings", None
        ):
            position_embed = child
        elif any(True for _ in child.parameters()):
            raise NotImplementedError(
                f"{type(base).__name__}.{name} ({type(child).__name__}) runs before the blocks "
                "and is not an embedding this runtime knows how to apply"
            )
    rotary = next(
        (child for _, child in children if type(child).__name__.endswith("RotaryEmbedding")),
        None,
    )
    final_norm = next(
        (
            child
            for _, child in after
            if child is not rotary and any(True for _ in child.parameters())
        ),
        None,
    )
    if final_norm is None:
        raise ValueError(f"{type(base).__name__} has no final norm after its blocks")

    params = inspect.signature(blocks[0].forward).parameters
    cache_kwarg = next((name for name in _CACHE_KWARGS if name in params), "cache")
    names = _module_names(model)
    input_weight = getattr(embed, "weight", None)
    return Topology(
        names={
            "blocks": names[id(blocks)],
            "embed": names[id(embed)],
            "position_embed": names[id(position_embed)] if position_embed is not None else None,
            "embed_dropout": names[id(embed_dropout)] if embed_dropout is not None else None,
            "final_norm": names[id(final_norm)],
            "head": names[id(head)],
            "rotary": names[id(rotary)] if rotary is not None else None,
        },
        blocks=blocks,
        embed=embed,
        position_embed=position_embed,
        embed_dropout=embed_dropout,
        final_norm=final_norm,
        head=head,
        rotary=rotary,
        rotary_takes_layer_type=rotary is not None
        and "layer_type" in inspect.signature(rotary.forward).parameters,
        layer_types=layer_types(model.config),
        tied=input_weight is not None and getattr(head, "weight", None) is input_weight,
        cache_kwarg=cache_kwarg,
        block_kwargs=frozenset(params),
        embedding_multiplier=_number(config, "embedding_multiplier"),
        logits_divisor=_number(config, "logits_scaling"),
        logit_scale=_number(config, "logit_scale"),
        final_logit_softcapping=_number(config, "final_logit_softcapping"),
        config=config,
    )
