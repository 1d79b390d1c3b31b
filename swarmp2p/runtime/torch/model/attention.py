"""``swarm_sdpa``: the attention implementation training stages run (registered in
transformers' ``AttentionInterface``, and its mask rule in ``AttentionMaskInterface``).

On CUDA where Flash Attention cannot run a grouped-query call (compute capability below 8.0,
or float32), transformers' SDPA path passes ``enable_gqa`` and CUDA runs the math kernel,
which holds seq x seq scores. There ``swarm_sdpa`` expands keys and values to the query heads
and calls SDPA without ``enable_gqa``, so the memory-efficient kernel runs. Everywhere else it
is transformers' own ``sdpa`` path, unchanged. The rule is ``plan/hardware.expands_grouped_kv``,
the one the planner prices each card by.

The mask: the layers get what ``sdpa`` would (``sdpa_mask``: none for plain causal attention,
a sliding window's where the layer has one). Unregistered, transformers builds no mask at all
for an unknown implementation, which would drop a sliding window.
"""

from __future__ import annotations

import functools

import torch

from swarmp2p.plan.hardware import expands_grouped_kv
from swarmp2p.runtime.torch.model.hf_compat import attn_implementation, set_attn_implementation

SWARM_SDPA = "swarm_sdpa"


class _Expanded:
    """The attention module as transformers' SDPA path sees it once keys and values are
    expanded: one query head per key/value head, everything else the module's own."""

    __slots__ = ("_module",)
    num_key_value_groups = 1

    def __init__(self, module) -> None:
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``; None off CUDA."""
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


def swarm_sdpa_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' ``sdpa`` attention, with grouped-query keys and values expanded where
    ``expands_grouped_kv`` says (query ``[B, H, T, D]``, key and value ``[B, H_kv, T, D]``)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    dtype = str(query.dtype).removeprefix("torch.")
    if expands_grouped_kv(device_capability(query.device), dtype, groups > 1):
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        module = _Expanded(module)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@functools.cache
def register() -> str:
    """Register ``swarm_sdpa`` with transformers (once); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SWARM_SDPA, swarm_sdpa_forward)
    AttentionMaskInterface.register(SWARM_SDPA, sdpa_mask)
    return SWARM_SDPA


def use_swarm_sdpa(stage) -> bool:
    """Switch a stage built on transformers' ``sdpa`` to ``swarm_sdpa`` (its config, which
    its blocks dispatch on); True when switched. A stage on another implementation (eager,
    a Flash Attention package) keeps it."""
    config = stage.config
    current = attn_implementation(config)
    if current == SWARM_SDPA:
        return True
    if current != "sdpa":
        return False
    register()
    set_attn_implementation(config, SWARM_SDPA)
    return True
