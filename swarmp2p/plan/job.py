"""The job.json schema (version 1): parse, defaults, and validation with field paths.

`parse(data)` returns a Job or raises one JobError listing every problem, each with its field
path (`train.steps: must be an integer >= 1, got -3`). Unknown keys are errors at every level:
a typo must never pass silently. The records' type hints and field bounds are the schema
(`swarmp2p.schema`, the one validator); defaults are defined here once. docs/job.md documents
every field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, Literal

from swarmp2p.plan.quantization import QuantSpec
from swarmp2p.plan.split import DEFAULT_CALIBRATION_TOKENS, Compression
from swarmp2p.schema import FieldError, SchemaError, field, read_json, to_data
from swarmp2p.schema import parse as parse_record

JOB_VERSION = 1
FINETUNE_MODES = ("full", "compressor_only", "lora", "none")
SPLIT_MODES = ("speed", "equal", "weighted", "cost")
LORA_EXPORTS = ("merged", "adapters")
MAX_MICRO_BATCHES = 32
DEFAULT_MICRO_BATCHES = 4
MAX_REPLICAS = 256
DILOCO_EVERY = 50
"""Inner steps between DiLoCo syncs. The paper (Douillard et al. 2023, table 4) trains with H from
50 to 1000 and loses least at the smallest; a LAN job runs hundreds of steps, not 88k."""
DILOCO_OUTER_LR = 0.7
DILOCO_OUTER_MOMENTUM = 0.9
"""The outer Nesterov step of DiLoCo's paper (section 3: SGD, lr 0.7, momentum 0.9)."""
DILOCO_BITS = 8
"""The parameter change crosses as int8 with one shared scale (INTELLECT-1's all-reduce)."""


class JobError(SchemaError):
    """A job.json is invalid; `errors` holds every problem found."""

    def __init__(self, errors: list[FieldError]) -> None:
        super().__init__(errors, title="invalid job")


class Compressions(tuple):
    """One compression per boundary, or one for all: job.json's ``split.compression`` (a spec,
    or a list of specs)."""

    __slots__ = ()

    @classmethod
    def from_data(cls, value: Any, path: str) -> Compressions:
        if not isinstance(value, list):
            return cls((Compression.from_data(value, path),))
        if not value:
            raise ValueError("must be one spec or a non-empty list with one per boundary")
        errors: list[FieldError] = []
        out = []
        for i, spec in enumerate(value):
            try:
                out.append(Compression.from_data(spec, f"{path}[{i}]"))
            except SchemaError as exc:
                errors.extend(exc.errors)
        if errors:
            raise SchemaError(errors)
        return cls(out)

    def to_data(self) -> Any:
        specs = [c.spec for c in self]
        return specs[0] if len(specs) == 1 else specs


_NO_COMPRESSION = Compressions((Compression(method="none"),))


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraConfig:
    """``model.lora``: adapters on every stage's blocks."""

    enabled: bool = False
    r: int = field(default=8, ge=1)
    alpha: float = field(default=16.0, gt=0)
    dropout: float = field(default=0.05, ge=0, lt=1)
    target_modules: tuple[str, ...] | None = field(default=None, min_len=1)
    """None: resolved from the model's own structure (the attention projections)."""
    export: Literal["merged", "adapters"] = "merged"

    def __post_init__(self) -> None:
        if self.target_modules is not None and not all(t.strip() for t in self.target_modules):
            raise SchemaError(
                [FieldError(path="target_modules", message="module names must not be empty")]
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """``model``: what is fine-tuned, in which precision."""

    pretrained: str = field(min_len=1, max_len=4096)
    """"embedded", a Hub id, or a local checkpoint folder."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Compute dtype; None picks the best every device runs."""
    weight_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Storage dtype of a frozen backbone (lora, compressor_only, none); None: the compute dtype."""
    quantization: QuantSpec | None = None
    freeze_backbone: bool = False
    lora: LoraConfig = dataclass_field(default_factory=LoraConfig)


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitConfig:
    """``split``: how many stages, how layers are shared out, what crosses each boundary."""

    stages: Literal["auto"] | int = field(default="auto", ge=1, le=4096)
    """"auto": one stage per usable device; an integer forces that many stages."""
    mode: Literal["speed", "equal", "weighted", "cost"] = "speed"
    """"speed": by each device's measured speed (``plan/speed.py``; by free memory when a
    device has no measurement); "equal" layers; "weighted" by free memory; "cost" by FLOPs."""
    compression: Compressions = _NO_COMPRESSION
    """One spec (applied to every boundary) or one per boundary."""
    replicas: Literal["auto"] | int = field(default="auto", ge=1, le=MAX_REPLICAS)
    """Copies of the pipeline that train side by side on other devices, every copy's stage i
    holding the same layers (``train.sync`` keeps them equal). "auto": as many as fit and pay
    by the measured speeds (one without measured speeds, or where a node lacks ``replicas``)."""

    def __post_init__(self) -> None:
        learned = [
            (i, c.calibration_tokens) for i, c in enumerate(self.compression) if c.is_learned
        ]
        for i, tokens in learned[1:]:
            first, want = learned[0]
            if tokens != want:
                raise SchemaError(
                    [
                        FieldError(
                            path=f"compression[{i}].calibration_tokens",
                            message=(
                                f"{tokens} differs from compression[{first}].calibration_tokens "
                                f"{want}: stage 0 runs one calibration pass for every learned "
                                "boundary; give them one value"
                            ),
                        )
                    ]
                )
        n = len(self.compression)
        if n > 1 and isinstance(self.stages, int) and n != self.stages - 1:
            raise SchemaError(
                [
                    FieldError(
                        path="compression",
                        message=(
                            f"has {n} specs but split.stages {self.stages} has {self.stages - 1} "
                            "boundaries; give one spec or one per boundary"
                        ),
                    )
                ]
            )

    @property
    def calibration_tokens(self) -> int:
        """Tokens stage 0 runs forward to calibrate the learned boundaries (one pass for all;
        ``__post_init__`` refuses learned boundaries that disagree)."""
        learned = [c.calibration_tokens for c in self.compression if c.is_learned]
        return learned[0] if learned else DEFAULT_CALIBRATION_TOKENS

    def compression_for(self, n_stages: int) -> tuple[Compression, ...]:
        """One Compression per boundary of an `n_stages` pipeline."""
        n = max(n_stages - 1, 0)
        if len(self.compression) == 1:
            return tuple(self.compression) * n
        if len(self.compression) != n:
            raise ValueError(
                f"split.compression: {len(self.compression)} specs for {n} boundaries; "
                f"give one spec or exactly one per boundary"
            )
        return tuple(self.compression)


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """``data``: the corpus the first stage reads."""

    source: str = field(default="embedded", min_len=1, max_len=4096)
    text_field: str = field(default="text", min_len=1, max_len=256)


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncConfig:
    """``train.sync``: how the replicas of a job (``split.replicas`` above 1) stay equal.

    "step": every optimizer step averages each stage's gradients over its replicas (float32),
    so N replicas train like one pipeline with N times the batch. "diloco" (Douillard et al.
    2023): each replica takes ``every`` inner steps alone, then the replicas average their
    parameter change (``bits`` wide, one shared scale) and apply one outer Nesterov step.
    """

    mode: Literal["step", "diloco"] = "step"
    every: int | None = field(default=None, ge=1)
    """Inner steps between syncs (diloco only; default DILOCO_EVERY)."""
    outer_lr: float | None = field(default=None, gt=0, le=10)
    """The outer step's learning rate (diloco only; default DILOCO_OUTER_LR)."""
    outer_momentum: float | None = field(default=None, ge=0, lt=1)
    """The outer Nesterov momentum (diloco only; default DILOCO_OUTER_MOMENTUM)."""
    bits: Literal[8, 16, 32] | None = None
    """Width of what crosses between replicas: 32 (float32), 16 (bfloat16) or 8 (int8, one
    shared scale). Default: 32 in step mode, DILOCO_BITS in diloco."""

    def __post_init__(self) -> None:
        errors = []
        if self.mode == "step":
            for name in ("every", "outer_lr", "outer_momentum"):
                if getattr(self, name) is not None:
                    errors.append(
                        FieldError(
                            path=name,
                            message="is a diloco setting; step mode syncs every step (drop it or "
                            'set mode "diloco")',
                        )
                    )
            if self.bits not in (None, 32):
                errors.append(
                    FieldError(
                        path="bits",
                        message=f"step mode averages float32 gradients; {self.bits}-bit "
                        "gradients (with error feedback) are not built yet: drop bits or use "
                        'mode "diloco"',
                    )
                )
        if errors:
            raise SchemaError(errors)

    @property
    def inner_steps(self) -> int:
        """Steps between syncs: 1 in step mode."""
        return 1 if self.mode == "step" else (self.every or DILOCO_EVERY)

    @property
    def lr(self) -> float:
        return DILOCO_OUTER_LR if self.outer_lr is None else self.outer_lr

    @property
    def momentum(self) -> float:
        return DILOCO_OUTER_MOMENTUM if self.outer_momentum is None else self.outer_momentum

    @property
    def wire_bits(self) -> int:
        if self.bits is not None:
            return self.bits
        return 32 if self.mode == "step" else DILOCO_BITS


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """``train``: the schedule and optimiser every stage of the job shares."""

    steps: int = field(default=100, ge=1)
    batch_size: int = field(default=4, ge=1)
    seq_len: int = field(default=128, ge=1)
    lr: float = field(default=2e-4, gt=0)
    micro_batches: int = field(default=DEFAULT_MICRO_BATCHES, ge=1, le=MAX_MICRO_BATCHES)
    """The default adapts to a small batch (the largest divisor of batch_size up to 4)."""
    schedule: Literal["auto", "gpipe", "1f1b", "zb-h1", "zb-h2"] = "auto"
    """"auto": the planner prices every schedule the nodes run at their measured speeds and
    picks the fastest that fits (``plan.schedule``); a name forces that schedule."""
    recompute: Literal[True, False, "auto"] = "auto"
    """True, False, or "auto": on only when the job fits only with it."""
    eval_batches: int = field(default=16, ge=0)
    seed: int = field(default=0, ge=0)
    checkpoint_every: int = field(default=25, ge=0)
    """Snapshot every this many steps; 0 switches snapshots off."""
    sync: SyncConfig = dataclass_field(default_factory=SyncConfig)
    """How replicas (``split.replicas``) stay equal; one pipeline ignores it."""

    @staticmethod
    def __schema_prepare__(data: dict[str, Any]) -> dict[str, Any]:
        batch = data.get("batch_size", 4)
        if "micro_batches" not in data and type(batch) is int and batch >= 1:
            data["micro_batches"] = math.gcd(batch, DEFAULT_MICRO_BATCHES)
        return data

    def __post_init__(self) -> None:
        if self.batch_size % self.micro_batches:
            raise SchemaError(
                [
                    FieldError(
                        path="micro_batches",
                        message=(
                            f"must divide train.batch_size {self.batch_size} (each micro-batch gets an "
                            f"equal share), got {self.micro_batches}"
                        ),
                    )
                ]
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """A training job (job.json version 1): the record the CLI submits and every peer plans."""

    name: str = field(default="job", min_len=1, max_len=200)
    model: ModelConfig
    split: SplitConfig = dataclass_field(default_factory=SplitConfig)
    data: DataConfig = dataclass_field(default_factory=DataConfig)
    train: TrainConfig = dataclass_field(default_factory=TrainConfig)
    version: Literal[1] = JOB_VERSION

    def __post_init__(self) -> None:
        errors = []
        m = self.model
        if m.weight_dtype is not None and m.quantization is not None:
            errors.append(
                FieldError(
                    path="model.weight_dtype",
                    message="cannot be combined "
                    "with model.quantization (quantized weights are already stored narrow); drop "
                    "one of them",
                )
            )
        if m.quantization is not None and not (m.lora.enabled or m.freeze_backbone):
            errors.append(
                FieldError(
                    path="model.quantization",
                    message="a quantized backbone "
                    "cannot be fully fine-tuned; enable model.lora (QLoRA) or set "
                    "model.freeze_backbone",
                )
            )
        if errors:
            raise SchemaError(errors)

    def to_dict(self) -> dict[str, Any]:
        """Canonical job.json with every field explicit; `parse(job.to_dict()) == job`."""
        return to_data(self)

    @property
    def finetune_mode(self) -> str:
        """What trains, by the reference's precedence.

        lora wins over freeze_backbone; freeze_backbone trains only a learned bottleneck
        (compressor_only) and with fixed_intN or no compressor trains nothing (none);
        otherwise full.
        """
        if self.model.lora.enabled:
            return "lora"
        if self.model.freeze_backbone:
            if any(c.is_learned for c in self.split.compression):
                return "compressor_only"
            return "none"
        return "full"


def _version_message(errors: list[FieldError]) -> list[FieldError]:
    return [
        FieldError(
            path=e.path,
            message=f"must be {JOB_VERSION} (this swarmp2p reads job.json "
            f"version {JOB_VERSION}), got {e.message.rsplit(', got ', 1)[-1]}",
        )
        if e.path == "version"
        else e
        for e in errors
    ]


def parse(data: Any) -> Job:
    """A Job from decoded job.json; raises JobError listing every problem with its path."""
    if not isinstance(data, dict):
        raise JobError([FieldError(path="(job)", message="must be a JSON object")])
    if "model" not in data:
        data = {**data, "model": None}
    try:
        return parse_record(Job, data)
    except SchemaError as exc:
        errors = [
            FieldError(path="model", message='required: an object with at least "pretrained"')
            if e.path == "model" and data["model"] is None
            else e
            for e in exc.errors
        ]
        raise JobError(_version_message(errors)) from None


def load(path: str | Path) -> Job:
    """Read and parse a job.json file; unreadable or non-JSON files raise JobError too."""
    return parse(read_json(path, JobError))
