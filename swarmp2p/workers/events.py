"""What a training stage worker reports, as typed records: the worker emits them, the daemon of
its node checks them, adds what only it knows and sends them on in a ``StageReport``, and the
leader folds them into its metrics and the job table. Standard library only (both sides import
it; the daemon never imports torch).

On the wire (the worker's stdout, one JSON line each; a ``StageReport``'s ``events``) an event
is its record's fields plus ``"event"`` (its kind) and ``"stage"`` (the stage that sent it, null
before the spec named one). :func:`encode` writes that map, a non-finite number as null (JSON
has none); :func:`decode` reads it back through ``schema.parse`` and raises one
:class:`~swarmp2p.schema.SchemaError` naming the kind and every bad field
(``invalid worker event "step": loss: must be a number or null, got "x"``).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from swarmp2p.schema import FieldError, SchemaError, field, parse, show, to_data


@dataclass(frozen=True, kw_only=True, slots=True)
class Ready:
    """The stage's link from the stage before is bound (before torch loads)."""

    KIND: ClassVar[str] = "ready"
    port: int | None = field(default=None, ge=0, le=65535)
    """The bound port; None on the first stage, which binds none."""
    ring_next_port: int | None = field(default=None, ge=0, le=65535)
    """The replica ring's bound link to the next replica (``WorkerSpec.ring_next`` None)."""
    ring_prev_port: int | None = field(default=None, ge=0, le=65535)
    """The replica ring's bound link from the previous replica (``WorkerSpec.ring_prev``
    None)."""


PHASES = (
    "fetching",
    "tokenizing",
    "loading weights",
    "evaluating the base model",
    "calibrating",
    "evaluating the boundary",
)
"""What a stage of a placed job does before its first step, in order (a phase may be left
out: files already here, no learned boundary, no held-out evaluation)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Phase:
    """The stage starts ``name`` (``PHASES``); ``done``/``total``: its progress so far, in
    bytes while fetching (0/0: unknown). The stage's daemon reports the first two, before the
    worker runs; the worker the rest."""

    KIND: ClassVar[str] = "phase"
    name: str = field(pattern="|".join(PHASES))
    done: int = field(default=0, ge=0)
    total: int = field(default=0, ge=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Built:
    """The stage's layers are loaded, adapters and compressors attached."""

    KIND: ClassVar[str] = "built"
    trainable_parameters: int = field(ge=0)
    finetune_mode: str
    lora_fingerprint: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Resumed:
    """The stage continues from a snapshot."""

    KIND: ClassVar[str] = "resumed"
    step: int = field(ge=0)
    snapshot: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Evaluated:
    """One held-out evaluation pass (the last stage's numbers are the job's)."""

    KIND: ClassVar[str] = "eval"
    WIRE_KEYS: ClassVar[Mapping[str, str]] = {"name": "pass"}
    """Fields written under another key: ``pass`` is a Python keyword."""
    name: str = field(min_len=1)
    """``base``, ``calibrated_boundary`` or ``trained``."""
    loss: float | None
    """Mean token cross-entropy; None when nothing was scored."""
    perplexity: float | None
    top1: float | None
    """Share of tokens whose highest logit is the next token."""
    tokens: int = field(ge=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibrated:
    """Stage 0 calibrated the learned boundaries on this many tokens."""

    KIND: ClassVar[str] = "calibrated"
    tokens: int = field(ge=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepDone:
    """What a stage reports after each step (``runtime.torch.train.steps.run_step``)."""

    KIND: ClassVar[str] = "step"
    step: int = field(ge=0)
    loss: float | None
    """The step's mean token loss, as computed by the last stage."""
    tokens: int = field(ge=0)
    tokens_per_s: float | None
    act_bytes: int = field(ge=0)
    """Bytes this stage sent forward this step."""
    grad_bytes: int = field(ge=0)
    """Bytes this stage sent backward this step."""
    step_s: float
    peak_memory_bytes: int = field(ge=0)
    """Peak accelerator memory (CUDA) or peak resident set of the process (CPU)."""
    loss_scale: float | None = None
    """The loss scale this step's backward ran under (float16 only)."""
    skipped: bool = False
    """The step was not applied: a float16 gradient overflowed on some stage."""
    forward_s: float = 0.0
    """Seconds computing its forwards (waits on the neighbours excluded)."""
    backward_s: float = 0.0
    """Seconds computing its backwards (waits on the neighbours excluded)."""
    optimizer_s: float = 0.0
    """Seconds checking the gradients and stepping the optimizer (waits excluded)."""
    wait_s: float = 0.0
    """Seconds blocked on its links: waiting for a neighbour (the pipeline's bubble and any
    imbalance show here)."""
    at: float = 0.0
    """Wall-clock time (``time.time()``) the step ended: the pipeline's pace from one step to
    the next, whatever happens between steps (data, events, snapshots)."""
    sync_bytes: int = field(default=0, ge=0)
    """Bytes this stage sent its replicas this step (``train.sync``; 0 with one replica or
    between DiLoCo syncs)."""
    sync_s: float = 0.0
    """Seconds this step spent syncing with the replicas (waits on them included)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotSaved:
    """The stage wrote its snapshot after ``step`` steps."""

    KIND: ClassVar[str] = "snapshot"
    step: int = field(ge=1)
    path: str
    """Where the worker wrote it."""
    file: str | None = None
    """The same file relative to the job's folder (the worker's daemon adds it: peers ask for
    that name)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Exported:
    """The stage wrote its shard and manifest."""

    KIND: ClassVar[str] = "exported"
    manifest: str
    """The manifest's path on the worker's node."""
    manifest_data: dict | None = None
    """The manifest itself (the worker's daemon reads it in: the leader registers the model)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Done:
    """The stage ran to its end; the worker exits 0."""

    KIND: ClassVar[str] = "done"
    steps: int = field(ge=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Failure:
    """The stage failed; the worker exits non-zero."""

    KIND: ClassVar[str] = "error"
    type: str
    """The exception's class (``WorkerSpecError``, ``NonFiniteError``, ``PipelineAborted``...)."""
    message: str
    errors: tuple[str, ...] = ()
    """Every bad field of a refused spec."""
    failed_stage: int | None = None
    """The stage that failed first (a non-finite step, or a neighbour's word)."""
    step: int | None = None
    """The step it failed in; None outside a step."""
    reason: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Exited:
    """The worker's process ended (made by its daemon, never by the worker)."""

    KIND: ClassVar[str] = "exit"
    code: int
    """Its exit code; negative: the signal that killed it."""
    stderr_tail: tuple[str, ...] = ()
    error: str | None = None
    """The message of its last ``error`` event."""


WorkerEvent = (
    Ready
    | Phase
    | Built
    | Resumed
    | Evaluated
    | Calibrated
    | StepDone
    | SnapshotSaved
    | Exported
    | Done
    | Failure
    | Exited
)
"""Every event a training stage worker (or its daemon, ``Exited``) reports."""

KINDS: dict[str, type] = {cls.KIND: cls for cls in typing.get_args(WorkerEvent)}
"""The record of each wire kind."""


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def encode(event: WorkerEvent, stage: int | None) -> dict[str, Any]:
    """``event`` as its wire map: ``{"event": kind, "stage": stage, **fields}``, a non-finite
    number as null."""
    rename = getattr(event, "WIRE_KEYS", {})
    fields = {rename.get(k, k): _finite(v) for k, v in to_data(event).items()}
    return {"event": event.KIND, "stage": stage, **fields}


def decode(data: Any) -> WorkerEvent:
    """The record of one wire map; SchemaError naming the kind and every bad field."""
    if not isinstance(data, Mapping):
        raise SchemaError(
            [FieldError(path="", message=f"must be an object, got {show(data)}")],
            title="invalid worker event",
        )
    kind = data.get("event")
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        known = ", ".join(KINDS)
        raise SchemaError(
            [FieldError(path="event", message=f"{show(kind)} is no worker event; known: {known}")],
            title="invalid worker event",
        )
    back = {wire: name for name, wire in getattr(cls, "WIRE_KEYS", {}).items()}
    fields = {back.get(k, k): v for k, v in data.items() if k not in ("event", "stage")}
    return parse(cls, fields, title=f"invalid worker event {show(kind)}")


__all__ = [
    "KINDS",
    "PHASES",
    "Built",
    "Calibrated",
    "Done",
    "Evaluated",
    "Exited",
    "Exported",
    "Failure",
    "Phase",
    "Ready",
    "Resumed",
    "SnapshotSaved",
    "StepDone",
    "WorkerEvent",
    "decode",
    "encode",
]
