"""What planning returns: a Plan every peer can recompute byte for byte, or Blocked(reason)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from swarmp2p import PROTOCOL_VERSION
from swarmp2p.plan.memory import StageMemory
from swarmp2p.plan.speed import PlannedTiming
from swarmp2p.plan.split import Compression, SplitSpec
from swarmp2p.schema import SchemaError, field, parse, to_data


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedStage:
    """One stage placed on one device of one node."""

    index: int = field(ge=0)
    node_id: str = field(max_len=64)
    node: str = field(max_len=256)
    """The node's human name."""
    devices: tuple[str, ...] = field(min_len=1)
    """Torch device strings on the node, such as ("cuda:0",)."""
    device_labels: tuple[str, ...]
    """Human names, such as ("GPU 0 (RTX A5000, compute 8.6)",)."""
    device_names: tuple[str, ...] = ()
    """Model names, such as ("RTX A5000",)."""
    layers: tuple[int, int]
    """``[start, end)`` of the model's decoder blocks."""
    memory: StageMemory
    device_free: int = field(ge=0)
    """Bytes the device had free when planned."""
    download: int = field(ge=0)
    """Checkpoint bytes this stage reads (its share)."""
    files: tuple[str, ...] = ()
    """Checkpoint files holding this stage's tensors, when the index names them."""
    ops: str = ""
    """This stage's schedule for one step, e.g. "F0 F1 B0 F2 B1 B2"."""

    def __post_init__(self) -> None:
        if not 0 <= self.layers[0] < self.layers[1]:
            raise ValueError(
                f"layers must be [start, end) with 0 <= start < end, got {list(self.layers)}"
            )

    @property
    def layer_start(self) -> int:
        return self.layers[0]

    @property
    def layer_end(self) -> int:
        """End-exclusive."""
        return self.layers[1]

    @property
    def node_name(self) -> str:
        return self.node

    def to_dict(self) -> dict[str, Any]:
        return to_data(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedBoundary:
    """The link between stage `index` and stage `index + 1`."""

    index: int = field(ge=0)
    compression: Compression
    """The spec as job.json writes it."""
    codec: str
    """What crosses the wire: "raw", "fp16", "intN" or "tokintN"."""
    bytes_per_token: int = field(ge=0)

    def to_dict(self) -> dict[str, Any]:
        return to_data(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulePrediction:
    """One schedule as the planner priced it for this placement."""

    kind: str = field(max_len=16)
    step_s: float | None = None
    """The predicted step (seconds, optimizer excluded; None without measured speeds)."""
    bubble: float = field(ge=0, le=1)
    """The predicted idle share of the step, at the stages' predicted op costs."""
    fits: bool = True
    """Whether its memory fits every device (a schedule that does not is never chosen)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedSchedule:
    """The pipeline schedule every stage runs."""

    kind: Literal["gpipe", "1f1b", "zb-h1", "zb-h2"]
    micro_batches: int = field(ge=1)
    bubble_fraction: float = field(ge=0, le=1)
    """The idle share at equal op costs on every stage (``(N-1)/(M+N-1)`` for GPipe, 1F1B)."""
    requested: str = field(default="auto", max_len=16)
    """``train.schedule``: "auto" (the planner chose) or the name the job forced."""
    predicted: tuple[SchedulePrediction, ...] = ()
    """Every schedule priced, the chosen one among them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedReplica:
    """Another copy of the pipeline (``split.replicas``): its own devices, the same layers on
    every stage as the plan's ``stages`` (replica 0), the same schedule."""

    index: int = field(ge=1)
    stages: tuple[PlannedStage, ...] = field(min_len=1)
    timing: PlannedTiming | None = None
    """This replica's predicted step on its devices (``plan/speed.py``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A placed job. Same inputs, same `to_json()` bytes on every peer; `Plan.from_json` reads
    them back (a peer's, the job table's) through the one validator."""

    status: Literal["planned"] = "planned"
    version: int = PROTOCOL_VERSION
    job: str
    """The job's name."""
    model: dict[str, Any]
    """The model's shape (``ModelShape.to_dict()``)."""
    dtype: Literal["float32", "bfloat16", "float16"]
    finetune_mode: Literal["full", "compressor_only", "lora", "none"]
    split_mode: str
    stages: tuple[PlannedStage, ...] = field(min_len=1)
    boundaries: tuple[PlannedBoundary, ...]
    schedule: PlannedSchedule
    recompute: bool
    eval_batches: int = field(ge=0)
    weight_storage: str
    """"float16", "nf4", "int8"...: how the backbone's layer weights are held."""
    features: tuple[str, ...]
    notes: tuple[str, ...] = ()
    reason: Literal[None] = None
    """Always null: a Plan is not Blocked (the JSON shape both share)."""
    errors: tuple[str, ...] = field(default=(), max_len=0)
    timing: PlannedTiming | None = None
    """Each stage's predicted time per step and the bottleneck (``plan/speed.py``); None in a
    plan made before speeds were priced."""
    replicas: tuple[PlannedReplica, ...] = ()
    """The pipeline's other copies (replica 0 is ``stages``); empty for one pipeline, whose
    JSON then has no ``replicas`` key at all (a one-replica plan is byte for byte the plan of a
    version without replicas)."""

    def __post_init__(self) -> None:
        self._check_stages()
        for r, replica in enumerate(self.replicas, start=1):
            if replica.index != r:
                raise ValueError(f"replicas[{r - 1}].index is {replica.index}, not {r}")
            layers = [s.layers for s in replica.stages]
            if layers != [s.layers for s in self.stages]:
                raise ValueError(
                    f"replica {r}'s stages hold layers {layers}, replica 0's "
                    f"{[list(s.layers) for s in self.stages]}: every replica's stage i must hold "
                    "the same layers"
                )
            for i, stage in enumerate(replica.stages):
                if stage.index != i:
                    raise ValueError(f"replicas[{r - 1}].stages[{i}].index is {stage.index}")

    @property
    def n_replicas(self) -> int:
        return 1 + len(self.replicas)

    def replica_stages(self, replica: int) -> tuple[PlannedStage, ...]:
        """Replica ``replica``'s stages (0: ``stages``)."""
        return self.stages if replica == 0 else self.replicas[replica - 1].stages

    def _check_stages(self) -> None:
        if len(self.boundaries) != len(self.stages) - 1:
            raise ValueError(
                f"{len(self.stages)} stages need {len(self.stages) - 1} boundaries, got {len(self.boundaries)}"
            )
        for i, stage in enumerate(self.stages):
            if stage.index != i:
                raise ValueError(f"stages[{i}].index is {stage.index}")
            if i and stage.layer_start != self.stages[i - 1].layer_end:
                raise ValueError(
                    f"stages[{i}] starts at block {stage.layer_start}, not where stage {i - 1} ends"
                )
        if self.stages[0].layer_start != 0:
            raise ValueError("stages[0] must start at block 0")

    @property
    def n_layers(self) -> int:
        return self.stages[-1].layer_end

    def to_dict(self) -> dict[str, Any]:
        data = to_data(self)
        if not self.replicas:
            del data["replicas"]
        return data

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """A plan from its JSON form; SchemaError naming every bad field."""
        return parse(cls, data, title="invalid plan")

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        """A plan from ``to_json()`` bytes; ValueError when they are not a plan."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise SchemaError(f"a plan must be JSON: {exc}", title="invalid plan") from None
        return cls.from_dict(data)

    @property
    def split_spec(self) -> SplitSpec:
        """The plan's cut points and per-boundary compression, for the stage builder."""
        return SplitSpec(
            n_layers=self.stages[-1].layer_end,
            boundaries=tuple(s.layer_start for s in self.stages[1:]),
            compression=tuple(b.compression for b in self.boundaries),
        )

    def to_json(self) -> str:
        """Canonical bytes: sorted keys, no whitespace; peers compare these."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, kw_only=True, slots=True)
class Blocked:
    """A job that cannot be placed now; `reason` names every rejected device or node."""

    status: Literal["blocked"] = "blocked"
    reason: str
    dtype: str | None = None
    required: int = field(default=0, ge=0)
    placed: int = field(default=0, ge=0)
    stages: tuple[str, ...] = field(default=(), max_len=0)
    errors: tuple[str, ...] = field(default=(), max_len=0)

    @property
    def placement_blocked_reason(self) -> str:
        return self.reason

    def to_dict(self) -> dict[str, Any]:
        return to_data(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
