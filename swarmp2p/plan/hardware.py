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
