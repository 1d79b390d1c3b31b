"""Which attention kernel a training stage's card runs, and so whether it holds seq x seq
scores: one rule for the runtime's ``swarm_sdpa`` dispatch and the planner's memory price.

CUDA's SDPA takes grouped-query heads (``enable_gqa``) only in its Flash and math kernels, and
Flash only runs on compute capability 8.0 and up in float16 or bfloat16. Where Flash cannot run
a grouped-query call, transformers' own SDPA path (which passes ``enable_gqa`` when there is no
mask) lands in the math kernel, which materialises the scores. ``swarm_sdpa``
(``runtime/torch/model/attention.py``) expands keys and values to the query heads there and
calls SDPA without ``enable_gqa``, so the memory-efficient kernel runs instead. Pure, standard
library only.
"""

from __future__ import annotations

from swarmp2p.plan.hardware import Device, Node

FLASH_MIN_CAPABILITY = (8, 0)
"""The first compute capability CUDA's Flash Attention kernel runs on (Ampere)."""
FLASH_DTYPES = ("float16", "bfloat16")
"""The dtypes CUDA's Flash Attention kernel takes."""
SWARM_SDPA_CAPABILITY = "swarm-sdpa"
"""What a node declares when its training stages run ``swarm_sdpa``."""


def parse_capability(text: str) -> tuple[int, int] | None:
    """``"7.5" -> (7, 5)``; None for an empty (unknown) one."""
    if not text:
        return None
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


def expands_grouped_kv(capability: tuple[int, int] | None, dtype: str, grouped: bool) -> bool:
    """Whether ``swarm_sdpa`` expands keys and values to the query heads: a grouped-query call
    on CUDA (``capability`` not None) that Flash cannot run (below 8.0, or float32)."""
    if not grouped or capability is None:
        return False
    return tuple(capability) < FLASH_MIN_CAPABILITY or dtype not in FLASH_DTYPES


def training_kernel(
    node: Node, device: Device, dtype: str, grouped: bool, own: frozenset[str]
) -> str:
    """The SDPA kernel a training stage of a model (``grouped``: fewer key/value heads than
    query heads) runs on ``device``: ``"flash"``, ``"memory-efficient"`` (the expanded call),
    ``"math"`` (seq x seq scores: a node without ``swarm_sdpa`` where Flash cannot run), or the
    device's kind off CUDA (transformers' own path). An unknown capability counts as below 8.0.
    """
    if device.kind != "cuda":
        return device.kind
    capability = parse_capability(device.compute_capability) or (0, 0)
    if not expands_grouped_kv(capability, dtype, grouped):
        return "flash" if tuple(capability) >= FLASH_MIN_CAPABILITY else "memory-efficient"
    expands = SWARM_SDPA_CAPABILITY in node.capabilities and SWARM_SDPA_CAPABILITY in own
    return "memory-efficient" if expands else "math"
