"""What planning returns: a Plan every peer can recompute byte for byte, or Blocked(reason)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from swarmp2p import PROTOCOL_VERSION
from swarmp2p.plan.memory import StageMemory
from swarmp2p.plan.split import SplitSpec, StageSpec, parse_compression


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedStage:
    """One stage placed on one device of one node."""

    index: int
    node_id: str
    node_name: str
    devices: tuple[str, ...]
    """Torch device strings on the node, such as ("cuda:0",)."""
    device_labels: tuple[str, ...]
    """Human names, such as ("GPU 0 (RTX A5000, compute 8.6)",)."""
    device_names: tuple[str, ...] = ()
    """Model names, such as ("RTX A5000",)."""
    layer_start: int
    layer_end: int
    """End-exclusive."""
    memory: StageMemory
    device_free: int
    """Bytes the device had free when planned."""
    download: int
    """Checkpoint bytes this stage reads (its share)."""
    files: tuple[str, ...] = ()
    """Checkpoint files holding this stage's tensors, when the index names them."""
    ops: str = ""
    """This stage's schedule for one step, e.g. "F0 F1 B0 F2 B1 B2"."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "node": self.node_name,
            "node_id": self.node_id,
            "devices": list(self.devices),
            "device_labels": list(self.device_labels),
            "device_names": list(self.device_names),
            "layers": [self.layer_start, self.layer_end],
            "memory": self.memory.to_dict(),
            "device_free": self.device_free,
            "download": self.download,
            "files": list(self.files),
            "ops": self.ops,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedBoundary:
    """The link between stage `index` and stage `index + 1`."""

    index: int
    compression: str | dict[str, Any]
    """The spec as job.json writes it."""
    codec: str
    """What crosses the wire: "raw", "fp16", "intN" or "tokintN"."""
    bytes_per_token: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "compression": self.compression,
            "codec": self.codec,
            "bytes_per_token": self.bytes_per_token,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A placed job. Same inputs, same `to_json()` bytes on every peer."""

    job_name: str
    model: dict[str, Any]
    dtype: str
    finetune_mode: str
    split_mode: str
    stages: tuple[PlannedStage, ...]
    boundaries: tuple[PlannedBoundary, ...]
    schedule: str
    micro_batches: int
    bubble_fraction: float
    recompute: bool
    eval_batches: int
    weight_storage: str
    """"float16", "nf4", "int8"...: how the backbone's layer weights are held."""
    features: tuple[str, ...]
    notes: tuple[str, ...] = ()
    version: int = PROTOCOL_VERSION

    status = "planned"

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "version": self.version,
            "job": self.job_name,
            "model": dict(self.model),
            "dtype": self.dtype,
            "finetune_mode": self.finetune_mode,
            "split_mode": self.split_mode,
            "stages": [s.to_dict() for s in self.stages],
            "boundaries": [b.to_dict() for b in self.boundaries],
            "schedule": {
                "kind": self.schedule,
                "micro_batches": self.micro_batches,
                "bubble_fraction": self.bubble_fraction,
            },
            "recompute": self.recompute,
            "eval_batches": self.eval_batches,
            "weight_storage": self.weight_storage,
            "features": list(self.features),
            "notes": list(self.notes),
            "reason": None,
            "errors": [],
        }

    @property
    def split_spec(self) -> SplitSpec:
        """The plan's cut points and per-boundary compression, for the stage builder."""
        return SplitSpec(
            n_layers=self.stages[-1].layer_end,
            boundaries=tuple(s.layer_start for s in self.stages[1:]),
            compression=tuple(parse_compression(b.compression) for b in self.boundaries),
        )

    def stage_spec(self, index: int) -> StageSpec:
        """Stage `index`'s layers and the boundaries it reads from and writes to."""
        return self.split_spec.stage(index)

    def to_json(self) -> str:
        """Canonical bytes: sorted keys, no whitespace; peers compare these."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, kw_only=True, slots=True)
class Blocked:
    """A job that cannot be placed now; `placement_blocked_reason` names every rejected device."""

    placement_blocked_reason: str
    dtype: str | None = None
    required: int = 0
    placed: int = 0

    status = "blocked"

    @property
    def reason(self) -> str:
        return self.placement_blocked_reason

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "dtype": self.dtype,
            "required": self.required,
            "placed": self.placed,
            "stages": [],
            "reason": self.placement_blocked_reason,
            "errors": [],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
