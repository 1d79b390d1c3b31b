"""A contiguous range of decoder blocks that runs on its own: the unit one worker holds."""

from __future__ import annotations

import torch
from torch import nn

from swarmp2p.runtime.torch.model.introspect import (
    LINEAR_ATTENTION,
    Topology,
    introspect,
    leaf_weights,
)
from swarmp2p.runtime.torch.serve.session_cache import SessionBatch


class StageCache:
    """One stage's decode state: transformers' cache laid out by block index in the WHOLE model
    (so every block finds its own layer: keys/values, a sliding window, or recurrent state),
    plus the number of tokens this stage has seen."""

    __slots__ = ("cache", "seen_tokens")

    def __init__(self, config) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=config)
        self.seen_tokens = 0


def _mask_function(layer_type: str):
    from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING

    try:
        return LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING[layer_type]
    except KeyError:
        raise NotImplementedError(
            f"layer type {layer_type!r} has no causal-mask rule in transformers; "
            "this runtime cannot run it"
        ) from None


class Stage(nn.Module):
    """Blocks ``[layer_start, layer_end)`` of a causal LM, with the embedding on the first stage
    and the final norm and head on the last. ``parameters()`` are exactly the stage's own.

    ``stage(x, position_ids=None, cache=None)``: ``x`` is input ids ``[B, T]`` on the first stage,
    hidden states ``[B, T, H]`` otherwise; returns hidden states, or logits on the last stage.
    On the last stage, ``logits_to_keep=k`` computes the head for the last ``k`` positions only
    (what ``generate`` does), and ``hidden_only=True`` returns the hidden states before the final
    norm, for a caller that applies ``logits()`` chunk by chunk (the chunked training loss).
    """

    def __init__(
        self,
        topology: Topology,
        *,
        layer_start: int,
        layer_end: int,
        is_first_stage: bool,
        is_last_stage: bool,
    ) -> None:
        super().__init__()
        n = topology.num_blocks
        if not 0 <= layer_start < layer_end <= n:
            raise ValueError(
                f"layer range [{layer_start}, {layer_end}) is not a non-empty range of the "
                f"model's {n} blocks"
            )
        if is_first_stage != (layer_start == 0) or is_last_stage != (layer_end == n):
            raise ValueError(
                f"layer range [{layer_start}, {layer_end}) of {n} blocks contradicts "
                f"is_first_stage={is_first_stage}, is_last_stage={is_last_stage}"
            )
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first_stage, self.is_last_stage = is_first_stage, is_last_stage
        self.config = topology.config
        self.loaded_files: tuple[str, ...] = ()
        """Checkpoint files this stage was read from (set by ``load_stage_shard``)."""
        self.block_indices = tuple(range(layer_start, layer_end))
        self.block_types = topology.layer_types[layer_start:layer_end]
        self.blocks = nn.ModuleList(topology.blocks[i] for i in self.block_indices)
        self.model_leaves = leaf_weights(topology.blocks)
        """Leaf name -> weight dims over every block of the WHOLE model (the ones this stage
        does not hold are on the meta device): LoRA resolves its default targets from these,
        so every stage of one model resolves the same (``lora.resolve_targets``)."""
        self.embed = topology.embed if is_first_stage else None
        self.position_embed = topology.position_embed if is_first_stage else None
        self.embed_dropout = topology.embed_dropout if is_first_stage else None
        self.final_norm = topology.final_norm if is_last_stage else None
        self.head = topology.head if is_last_stage else None
        self.rotary = topology.rotary
        self._rotary_per_type = topology.rotary_takes_layer_type
        self._cache_kwarg = topology.cache_kwarg
        self._pass_rotary = "position_embeddings" in topology.block_kwargs
        self._pass_use_cache = "use_cache" in topology.block_kwargs
        self._embedding_multiplier = topology.embedding_multiplier
        self._logits_divisor = topology.logits_divisor
        self._logit_scale = topology.logit_scale
        self._softcap = topology.final_logit_softcapping
        # the first block of each type sizes that type's mask against its own cache layer
        self._first_of_type: dict[str, int] = {}
        for index, layer_type in zip(self.block_indices, self.block_types):
            self._first_of_type.setdefault(layer_type, index)

    def new_cache(self) -> StageCache:
        """An empty decode cache for this stage (one sequence; serving uses SessionBatch)."""
        return StageCache(self.config)

    def new_batch(self, sids, *, max_context: int) -> SessionBatch:
        """Empty decode state for the sessions ``sids`` (one row each), for batched serving."""
        return SessionBatch(self.config, sids, max_context=max_context)

    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"the first stage takes input ids [B, T] as int64, got {input_ids.dtype} "
                f"{tuple(input_ids.shape)}"
            )
        hidden = self.embed(input_ids)
        if self.position_embed is not None:
            hidden = hidden + self.position_embed(position_ids).to(hidden.device)
        if self._embedding_multiplier is not None:
            hidden = hidden * self._embedding_multiplier
        if self.embed_dropout is not None:
            hidden = self.embed_dropout(hidden)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's final norm and head (with the config's scaling) over ``hidden``."""
        if not self.is_last_stage:
            raise RuntimeError(
                f"stage [{self.layer_start}, {self.layer_end}) is not the last; it has no head"
            )
        logits = self.head(self.final_norm(hidden))
        if self._logits_divisor is not None:
            logits = logits / self._logits_divisor
        if self._logit_scale is not None:
            logits = logits * self._logit_scale
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cache: StageCache | SessionBatch | None = None,
        *,
        logits_to_keep: int = 0,
        hidden_only: bool = False,
    ) -> torch.Tensor:
        batch = cache if isinstance(cache, SessionBatch) else None
        if batch is not None:  # serving: each row at its own position, masks from the batch
            batch.begin(x.shape[1], x.device)
            position_ids, past = batch.position_ids, 0
            hf_cache = batch
        else:
            past = cache.seen_tokens if cache is not None else 0
            if position_ids is None:
                position_ids = torch.arange(past, past + x.shape[1], device=x.device).unsqueeze(0)
            hf_cache = cache.cache if cache is not None else None
        hidden = self._embed(x, position_ids) if self.is_first_stage else x

        masks: dict[str, torch.Tensor | None] = {}
        rotary: dict[str, object] = {}
        shared = None
        if self.rotary is not None and self._pass_rotary and not self._rotary_per_type:
            shared = self.rotary(hidden, position_ids)
        for layer_type, first in self._first_of_type.items():
            if batch is not None:
                masks[layer_type] = batch.mask(layer_type, hidden.dtype)
            elif layer_type == LINEAR_ATTENTION:
                masks[layer_type] = None  # recurrent blocks take only a padding mask; none here
            else:
                masks[layer_type] = _mask_function(layer_type)(
                    config=self.config,
                    inputs_embeds=hidden,
                    attention_mask=None,
                    cache=hf_cache,
                    position_ids=position_ids,
                    layer_idx=first,
                )
            if self.rotary is not None and self._rotary_per_type and self._pass_rotary:
                rotary[layer_type] = self.rotary(hidden, position_ids, layer_type)
            else:
                rotary[layer_type] = shared

        kwargs: dict[str, object] = {"position_ids": position_ids, self._cache_kwarg: hf_cache}
        if self._pass_use_cache:
            kwargs["use_cache"] = cache is not None
        for block, layer_type in zip(self.blocks, self.block_types):
            if self._pass_rotary:
                kwargs["position_embeddings"] = rotary.get(layer_type)
            out = block(hidden, attention_mask=masks[layer_type], **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        if batch is not None:
            batch.commit()
        elif cache is not None:
            cache.seen_tokens = past + x.shape[1]
        if not self.is_last_stage or hidden_only:
            return hidden
        return self.logits(hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden)


def build_stage(
    model: nn.Module,
    layer_start: int,
    layer_end: int,
    *,
    is_first_stage: bool | None = None,
    is_last_stage: bool | None = None,
) -> Stage:
    """A stage over blocks ``[layer_start, layer_end)`` of a loaded model, sharing its modules."""
    topology = introspect(model)
    return Stage(
        topology,
        layer_start=layer_start,
        layer_end=layer_end,
        is_first_stage=layer_start == 0 if is_first_stage is None else is_first_stage,
        is_last_stage=layer_end == topology.num_blocks if is_last_stage is None else is_last_stage,
    )
