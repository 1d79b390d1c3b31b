"""Device and Node records, and the `cluster.json` format the daemon advertises.

`cluster.json` is a JSON list of nodes::

    {"node_id", "name", "ram", "disk_free", "capabilities": [...], "version",
     "devices": [{"kind": "cuda"|"cpu"|"mps", "index", "name", "memory_total",
                  "memory_free", "compute_capability"}]}

Sizes are bytes; `compute_capability` is a string such as "7.5", empty when unknown. An omitted
`capabilities` means every capability of this version; an omitted `version` means this version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmp2p import __version__

CAPABILITIES: frozenset[str] = frozenset(
    {
        "wire-v2",
        "microbatch",
        "pipeline-eval",
        "calibrated-bottleneck",
        "half-weights",
        "long-context",
        "serve-codec",
    }
)
"""Features this version implements; a plan enables one only when every assigned node has it."""

DEVICE_KINDS = ("cuda", "cpu", "mps")

_NODE_KEYS = {"node_id", "name", "ram", "disk_free", "capabilities", "version", "devices"}
_DEVICE_KEYS = {"kind", "index", "name", "memory_total", "memory_free", "compute_capability"}


class ClusterError(ValueError):
    """A cluster description is malformed; `errors` lists every problem with its path."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        super().__init__("invalid cluster:\n" + "\n".join(self.errors))


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """One accelerator (or the CPU) of a node."""

    kind: str
    """"cuda", "cpu" or "mps"."""
    index: int
    name: str
    memory_total: int
    """Bytes."""
    memory_free: int
    """Bytes free for a stage now."""
    compute_capability: str = ""
    """CUDA compute capability such as "8.6"; empty when unknown (or not CUDA)."""

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
        return {
            "kind": self.kind,
            "index": self.index,
            "name": self.name,
            "memory_total": self.memory_total,
            "memory_free": self.memory_free,
            "compute_capability": self.compute_capability,
        }

    @classmethod
    def from_dict(cls, data: Any, path: str = "device") -> Device:
        errors = _device_errors(data, path)
        if errors:
            raise ClusterError(errors)
        return cls(
            kind=data["kind"],
            index=data["index"],
            name=data["name"],
            memory_total=data["memory_total"],
            memory_free=data["memory_free"],
            compute_capability=data.get("compute_capability", ""),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    """One machine of the swarm as its daemon advertises it."""

    node_id: str
    name: str
    ram: int
    """Bytes of host memory."""
    disk_free: int
    """Bytes free in the node's model cache filesystem."""
    devices: tuple[Device, ...]
    capabilities: frozenset[str] = field(default=CAPABILITIES)
    version: str = __version__

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "name": self.name,
            "ram": self.ram,
            "disk_free": self.disk_free,
            "capabilities": sorted(self.capabilities),
            "version": self.version,
            "devices": [d.to_dict() for d in self.devices],
        }

    @classmethod
    def from_dict(cls, data: Any, path: str = "node") -> Node:
        errors = _node_errors(data, path)
        if errors:
            raise ClusterError(errors)
        return _node_unchecked(data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _device_errors(data: Any, path: str) -> list[str]:
    if not isinstance(data, dict):
        return [f"{path}: must be an object, got {type(data).__name__}"]
    errors = [f"{path}.{k}: unknown key" for k in sorted(set(data) - _DEVICE_KEYS)]
    for key in ("kind", "index", "name", "memory_total", "memory_free"):
        if key not in data:
            errors.append(f"{path}.{key}: required")
    if "kind" in data and data["kind"] not in DEVICE_KINDS:
        errors.append(
            f"{path}.kind: must be one of {', '.join(DEVICE_KINDS)}, got {data['kind']!r}"
        )
    if "name" in data and not isinstance(data["name"], str):
        errors.append(f"{path}.name: must be a string, got {data['name']!r}")
    for key in ("index", "memory_total", "memory_free"):
        if key in data and not (_is_int(data[key]) and data[key] >= 0):
            errors.append(f"{path}.{key}: must be an integer >= 0, got {data[key]!r}")
    cc = data.get("compute_capability", "")
    if not isinstance(cc, str) or (cc and _parse_cc(cc) is None):
        errors.append(
            f'{path}.compute_capability: must be a string such as "7.5" or empty, got {cc!r}'
        )
    return errors


def _parse_cc(text: str) -> tuple[int, int] | None:
    major, dot, minor = text.partition(".")
    if not major.isdigit() or (dot and not minor.isdigit()):
        return None
    return int(major), int(minor or 0)


def compute_capability(device: Device) -> tuple[int, int] | None:
    """The device's compute capability as (major, minor), None when unknown."""
    return _parse_cc(device.compute_capability) if device.compute_capability else None


def _node_errors(data: Any, path: str) -> list[str]:
    if not isinstance(data, dict):
        return [f"{path}: must be an object, got {type(data).__name__}"]
    errors = [f"{path}.{k}: unknown key" for k in sorted(set(data) - _NODE_KEYS)]
    for key in ("node_id", "name", "ram", "disk_free", "devices"):
        if key not in data:
            errors.append(f"{path}.{key}: required")
    for key in ("node_id", "name", "version"):
        if key in data and not (isinstance(data[key], str) and data[key]):
            errors.append(f"{path}.{key}: must be a non-empty string, got {data[key]!r}")
    for key in ("ram", "disk_free"):
        if key in data and not (_is_int(data[key]) and data[key] >= 0):
            errors.append(f"{path}.{key}: must be an integer >= 0 (bytes), got {data[key]!r}")
    caps = data.get("capabilities", [])
    if not (isinstance(caps, list) and all(isinstance(c, str) for c in caps)):
        errors.append(f"{path}.capabilities: must be a list of strings, got {caps!r}")
    devices = data.get("devices", [])
    if not isinstance(devices, list):
        errors.append(f"{path}.devices: must be a list, got {type(devices).__name__}")
    else:
        seen: set[tuple[str, int]] = set()
        for i, dev in enumerate(devices):
            dev_errors = _device_errors(dev, f"{path}.devices[{i}]")
            errors.extend(dev_errors)
            if not dev_errors:
                key = (dev["kind"], dev["index"])
                if key in seen:
                    errors.append(
                        f"{path}.devices[{i}]: duplicate {dev['kind']} index {dev['index']}"
                    )
                seen.add(key)
    return errors


def _node_unchecked(data: dict[str, Any]) -> Node:
    caps = data.get("capabilities")
    return Node(
        node_id=data["node_id"],
        name=data["name"],
        ram=data["ram"],
        disk_free=data["disk_free"],
        devices=tuple(Device.from_dict(d) for d in data["devices"]),
        capabilities=CAPABILITIES if caps is None else frozenset(caps),
        version=data.get("version", __version__),
    )


def parse_cluster(data: Any) -> tuple[Node, ...]:
    """Nodes from a decoded `cluster.json`; raises ClusterError naming every bad field."""
    if not isinstance(data, list):
        raise ClusterError([f"cluster: must be a JSON list of nodes, got {type(data).__name__}"])
    errors: list[str] = []
    for i, node in enumerate(data):
        errors.extend(_node_errors(node, f"cluster[{i}]"))
    if not data:
        errors.append("cluster: has no nodes; list at least one")
    ids = [n.get("node_id") for n in data if isinstance(n, dict)]
    for dup in sorted({i for i in ids if isinstance(i, str) and ids.count(i) > 1}):
        errors.append(f"cluster: node_id {dup!r} appears more than once")
    if errors:
        raise ClusterError(errors)
    return tuple(_node_unchecked(n) for n in data)


def load_cluster(path: str | Path) -> tuple[Node, ...]:
    """Read and parse a `cluster.json` file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ClusterError([f"{path}: cannot read: {exc.strerror or exc}"]) from exc
    except json.JSONDecodeError as exc:
        raise ClusterError([f"{path}: not valid JSON: {exc}"]) from exc
    except RecursionError:  # e.g. 200,000 nested brackets
        raise ClusterError([f"{path}: not readable JSON: nested too deeply"]) from None
    return parse_cluster(data)


def cluster_to_json(nodes: tuple[Node, ...] | list[Node]) -> str:
    """Serialise nodes as `cluster.json` text (sorted keys, stable)."""
    return json.dumps([n.to_dict() for n in nodes], indent=2, sort_keys=True) + "\n"
