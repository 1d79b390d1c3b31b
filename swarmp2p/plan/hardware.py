"""Device and Node records, and the `cluster.json` format the daemon advertises.

`cluster.json` is a JSON list of nodes::

    {"node_id", "name", "ram", "disk_free", "capabilities": [...], "version", "link_speed",
     "devices": [{"kind": "cuda"|"cpu"|"mps", "index", "name", "memory_total",
                  "memory_free", "compute_capability", "speed": {"float32": 2.1e10}}]}

Sizes are bytes; `compute_capability` is a string such as "7.5", empty when unknown. An omitted
`capabilities` means every capability of this version; an omitted `version` means this version.
`speed` is the training FLOP/s measured per dtype (`swarmp2p.runtime.probe`; omitted: never
measured); `link_speed` the bytes/s of the node's network link (omitted or 0: unknown).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from swarmp2p import __version__
from swarmp2p.schema import (
    FieldError,
    SchemaError,
    field,
    parse,
    read_json,
    replace_errors,
    show,
    to_data,
)

CAPABILITIES: frozenset[str] = frozenset(
    {
        "wire-v2",
        "microbatch",
        "pipeline-eval",
        "calibrated-bottleneck",
        "half-weights",
        "long-context",
        "serve-codec",
        "swarm-sdpa",
        "zero-bubble",
        "replicas",
    }
)
"""Features this version implements; a plan enables one only when every assigned node has it."""

DEVICE_KINDS = ("cuda", "cpu", "mps")
_SPEED_DTYPES = ("bfloat16", "float16", "float32")


class Speeds(tuple):
    """A device's measured training speed: ``(dtype, FLOP/s)`` pairs sorted by dtype, written as
    the object ``{"float32": 2.1e10}`` (``speed`` in cluster.json)."""

    __slots__ = ()

    @classmethod
    def from_data(cls, value: Any, path: str) -> Speeds:
        if not isinstance(value, dict):
            raise ValueError(f"must be an object of FLOP/s per dtype, got {show(value)}")
        errors = []
        for dtype, flops in value.items():
            if dtype not in _SPEED_DTYPES:
                errors.append(
                    FieldError(
                        path=f"{path}.{dtype}",
                        message=f"is not a dtype; use {', '.join(_SPEED_DTYPES)}",
                    )
                )
            elif type(flops) not in (int, float) or not 0 < flops < 1e21:
                errors.append(
                    FieldError(
                        path=f"{path}.{dtype}",
                        message=f"must be FLOP/s, a number in (0, 1e21), got {show(flops)}",
                    )
                )
        if errors:
            raise SchemaError(errors)
        return cls(sorted((k, float(v)) for k, v in value.items()))

    def to_data(self) -> dict[str, float]:
        return dict(self)

    def get(self, dtype: str) -> float | None:
        """FLOP/s in ``dtype``; None when not measured."""
        return dict(self).get(dtype)


NO_SPEEDS = Speeds()


class ClusterError(SchemaError):
    """A cluster description is malformed; `errors` lists every problem with its path."""

    def __init__(self, errors: list[FieldError] | list[str]) -> None:
        errors = [
            e if isinstance(e, FieldError) else FieldError(path="", message=e) for e in errors
        ]
        super().__init__(errors, title="invalid cluster")


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """One accelerator (or the CPU) of a node."""

    kind: Literal["cuda", "cpu", "mps"]
    index: int = field(ge=0)
    name: str
    memory_total: int = field(ge=0)
    """Bytes."""
    memory_free: int = field(ge=0)
    """Bytes free for a stage now."""
    compute_capability: str = field(default="", pattern=r"(\d+(\.\d+)?)?")
    """CUDA compute capability such as "8.6"; empty when unknown (or not CUDA)."""
    speed: Speeds = NO_SPEEDS
    """Measured training FLOP/s per dtype; empty: never measured."""

    @property
    def is_gpu(self) -> bool:
        return self.kind != "cpu"

    @property
    def label(self) -> str:
        """How messages name the device: `GPU 0 (GTX 1660 SUPER, compute 7.5)`."""
        if self.kind == "cpu":
            return f"CPU {self.index} ({self.name})"
        detail = self.name
        if self.compute_capability:
            detail += f", compute {self.compute_capability}"
        return f"GPU {self.index} ({detail})"

    def to_dict(self) -> dict[str, Any]:
        return to_data(self)

    @classmethod
    def from_dict(cls, data: Any, path: str = "device") -> Device:
        return _parsed(cls, data, path)


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    """One machine of the swarm as its daemon advertises it."""

    node_id: str = field(min_len=1, max_len=64)
    name: str = field(min_len=1, max_len=256)
    ram: int = field(ge=0)
    """Bytes of host memory."""
    disk_free: int = field(ge=0)
    """Bytes free in the node's model cache filesystem."""
    devices: tuple[Device, ...]
    capabilities: frozenset[str] = CAPABILITIES
    """Omitted: every capability of this version."""
    version: str = field(default=__version__, min_len=1, max_len=128)
    link_speed: int = field(default=0, ge=0)
    """Bytes/s of the node's network link; 0: unknown."""

    def __post_init__(self) -> None:
        seen: set[tuple[str, int]] = set()
        for i, dev in enumerate(self.devices):
            key = (dev.kind, dev.index)
            if key in seen:
                raise SchemaError(
                    [
                        FieldError(
                            path=f"devices[{i}]", message=f"duplicate {dev.kind} index {dev.index}"
                        )
                    ]
                )
            seen.add(key)

    def to_dict(self) -> dict[str, Any]:
        return to_data(self)

    @classmethod
    def from_dict(cls, data: Any, path: str = "node") -> Node:
        return _parsed(cls, data, path)


def _parsed(cls: type, data: Any, path: str) -> Any:
    try:
        return parse(cls, data)
    except SchemaError as exc:
        raise ClusterError(replace_errors(exc, path)) from None


def _parse_cc(text: str) -> tuple[int, int] | None:
    major, dot, minor = text.partition(".")
    if not major.isdigit() or (dot and not minor.isdigit()):
        return None
    return int(major), int(minor or 0)


def compute_capability(device: Device) -> tuple[int, int] | None:
    """The device's compute capability as (major, minor), None when unknown."""
    return _parse_cc(device.compute_capability) if device.compute_capability else None


def parse_cluster(data: Any) -> tuple[Node, ...]:
    """Nodes from a decoded `cluster.json`; raises ClusterError naming every bad field."""
    if not isinstance(data, list):
        raise ClusterError(
            [FieldError(path="cluster", message=f"must be a JSON list of nodes, got {show(data)}")]
        )
    errors: list[FieldError] = []
    nodes = []
    for i, node in enumerate(data):
        try:
            nodes.append(parse(Node, node))
        except SchemaError as exc:
            errors.extend(replace_errors(exc, f"cluster[{i}]"))
    if not data:
        errors.append(FieldError(path="cluster", message="has no nodes; list at least one"))
    ids = [n.get("node_id") for n in data if isinstance(n, dict)]
    for dup in sorted({i for i in ids if isinstance(i, str) and ids.count(i) > 1}):
        errors.append(FieldError(path="cluster", message=f"node_id {dup!r} appears more than once"))
    if errors:
        raise ClusterError(errors)
    return tuple(nodes)


def load_cluster(path: str | Path) -> tuple[Node, ...]:
    """Read and parse a `cluster.json` file."""
    return parse_cluster(read_json(path, ClusterError))


def cluster_to_json(nodes: tuple[Node, ...] | list[Node]) -> str:
    """Serialise nodes as `cluster.json` text (sorted keys, stable)."""
    return json.dumps([n.to_dict() for n in nodes], indent=2, sort_keys=True) + "\n"


# --- precision: compute capability -> dtypes, one dtype per job, the training kernel -------
# Which dtype each device can train in, and the one dtype a job runs in.
#
# Rules from the reference (predecessor-torch-runtime.md, "Compute capability and dtype"):
# compute capability >= 8.0 trains bfloat16, float16 and float32; 7.x float16 and float32; below
# 7.0 float32 only. An empty capability means the node could not read one, so it is not
# excluded. A CPU runs float32, and bfloat16 only when the job asks for it explicitly (most CPUs
# compute bfloat16 far slower than float32). An explicit `model.dtype` wins and excludes the
# devices that cannot run it; otherwise the best dtype every ready device supports is used.
#
# And which attention kernel a training stage's card runs, so whether it holds seq x seq scores:
# one rule for the runtime's ``swarm_sdpa`` dispatch and the planner's memory price.
#
# CUDA's SDPA takes grouped-query heads (``enable_gqa``) only in its Flash and math kernels, and
# Flash only runs on compute capability 8.0 and up in float16 or bfloat16. Where Flash cannot run
# a grouped-query call, transformers' own SDPA path (which passes ``enable_gqa`` when there is no
# mask) lands in the math kernel, which materialises the scores. ``swarm_sdpa``
# (``runtime/torch/model/attention.py``) expands keys and values to the query heads there and
# calls SDPA without ``enable_gqa``, so the memory-efficient kernel runs instead. Pure, standard
# library only.
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
