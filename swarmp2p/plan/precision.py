"""Which dtype each device can train in, and the one dtype a job runs in.

Rules from the reference (predecessor-torch-runtime.md, "Compute capability and dtype"):
compute capability >= 8.0 trains bfloat16, float16 and float32; 7.x float16 and float32; below
7.0 float32 only. An empty capability means the node could not read one, so it is not
excluded. A CPU runs float32, and bfloat16 only when the job asks for it explicitly (most CPUs
compute bfloat16 far slower than float32). An explicit `model.dtype` wins and excludes the
devices that cannot run it; otherwise the best dtype every ready device supports is used.

And which attention kernel a training stage's card runs, so whether it holds seq x seq scores:
one rule for the runtime's ``swarm_sdpa`` dispatch and the planner's memory price.

CUDA's SDPA takes grouped-query heads (``enable_gqa``) only in its Flash and math kernels, and
Flash only runs on compute capability 8.0 and up in float16 or bfloat16. Where Flash cannot run
a grouped-query call, transformers' own SDPA path (which passes ``enable_gqa`` when there is no
mask) lands in the math kernel, which materialises the scores. ``swarm_sdpa``
(``runtime/torch/model/attention.py``) expands keys and values to the query heads there and
calls SDPA without ``enable_gqa``, so the memory-efficient kernel runs instead. Pure, standard
library only.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmp2p.plan.hardware import Device, Node, compute_capability

DTYPES = ("bfloat16", "float16", "float32")
"""Compute dtypes, best first."""

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def supported_dtypes(device: Device, *, explicit: str | None = None) -> tuple[str, ...]:
    """Dtypes `device` trains in, best first; `explicit` is the job's `model.dtype`, if any."""
    if device.kind == "cpu":
        return ("bfloat16", "float32") if explicit == "bfloat16" else ("float32",)
    if device.kind == "mps":
        return ("float16", "float32")
    cc = compute_capability(device)
    if cc is None or cc >= (8, 0):
        return DTYPES
    if cc >= (7, 0):
        return ("float16", "float32")
    return ("float32",)


def can_run(device: Device, dtype: str, *, explicit: bool = False) -> bool:
    """Whether `device` can train in `dtype` (`explicit`: the job asked for it by name)."""
    return dtype in supported_dtypes(device, explicit=dtype if explicit else None)


@dataclass(frozen=True, kw_only=True, slots=True)
class DtypeChoice:
    """The job's dtype and the devices it excludes."""

    dtype: str
    excluded: tuple[tuple[Node, Device], ...] = ()
    """(node, device) pairs that cannot run `dtype`; only an explicit dtype excludes any."""

    @property
    def reason_lines(self) -> tuple[str, ...]:
        return tuple(f"{n.name} {d.label} cannot run {self.dtype}" for n, d in self.excluded)


def resolve_dtype(devices: list[tuple[Node, Device]], requested: str | None) -> DtypeChoice:
    """One dtype for the whole job over the ready `devices`.

    An explicit `requested` dtype wins and excludes the devices that cannot run it; otherwise
    the best dtype in DTYPES that every device supports (float32 runs everywhere).
    """
    if requested is not None:
        if requested not in DTYPES:
            raise ValueError(f"model.dtype: must be one of {', '.join(DTYPES)}, got {requested!r}")
        excluded = tuple((n, d) for n, d in devices if not can_run(d, requested, explicit=True))
        return DtypeChoice(dtype=requested, excluded=excluded)
    for dtype in DTYPES:
        if all(can_run(d, dtype) for _, d in devices):
            return DtypeChoice(dtype=dtype)
    return DtypeChoice(dtype="float32")  # unreachable: every device runs float32


# --- attention kernels -----------------------------------------------------------------------

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
