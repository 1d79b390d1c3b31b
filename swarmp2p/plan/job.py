"""The job.json schema (version 1): parse, defaults, and validation with field paths.

`parse(data)` returns a Job or raises one JobError listing every problem, each with its field
path (`train.steps: must be an integer >= 1, got -3`). Unknown keys are errors at every level:
a typo must never pass silently. docs/job.md documents every field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmp2p.plan.precision import DTYPES
from swarmp2p.plan.quantization import QuantSpec, normalize, quantization_errors
from swarmp2p.plan.schedule import SCHEDULES
from swarmp2p.plan.split import Compression, compression_errors, parse_compression

JOB_VERSION = 1
FINETUNE_MODES = ("full", "compressor_only", "lora", "none")
SPLIT_MODES = ("equal", "weighted", "cost")
LORA_EXPORTS = ("merged", "adapters")
MAX_MICRO_BATCHES = 32


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldError:
    """One problem in a job: where (`model.lora.r`) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class JobError(ValueError):
    """A job.json is invalid; `errors` holds every problem found."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = list(errors)
        super().__init__("invalid job:\n" + "\n".join(str(e) for e in self.errors))


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraConfig:
    enabled: bool = False
    r: int = 8
    alpha: float = 16
    dropout: float = 0.05
    target_modules: tuple[str, ...] | None = None
    """None: resolved from the model's own structure (the attention projections)."""
    export: str = "merged"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    pretrained: str
    """"embedded", a Hub id, or a local checkpoint folder."""
    dtype: str | None = None
    """Compute dtype; None picks the best every device runs."""
    weight_dtype: str | None = None
    """Storage dtype of a frozen backbone (lora, compressor_only, none); None: the compute dtype."""
    quantization: QuantSpec | None = None
    freeze_backbone: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitConfig:
    stages: int | str = "auto"
    """"auto": one stage per usable device; an integer forces that many stages."""
    mode: str = "weighted"
    compression: tuple[Compression, ...] = (Compression(method="none"),)
    """One spec (applied to every boundary) or one per boundary."""

    def compression_for(self, n_stages: int) -> tuple[Compression, ...]:
        """One Compression per boundary of an `n_stages` pipeline."""
        n = max(n_stages - 1, 0)
        if len(self.compression) == 1:
            return self.compression * n
        if len(self.compression) != n:
            raise ValueError(
                f"split.compression: {len(self.compression)} specs for {n} boundaries; "
                f"give one spec or exactly one per boundary"
            )
        return self.compression


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    source: str = "embedded"
    text_field: str = "text"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    steps: int = 100
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 2e-4
    micro_batches: int = 4
    schedule: str = "1f1b"
    recompute: bool | str = "auto"
    """True, False, or "auto": on only when the job fits only with it."""
    eval_batches: int = 16
    seed: int = 0
    checkpoint_every: int = 25
    """Snapshot every this many steps; 0 switches snapshots off."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    name: str
    model: ModelConfig
    split: SplitConfig = field(default_factory=SplitConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    version: int = JOB_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Canonical job.json with every field explicit; `parse(job.to_dict()) == job`."""
        m, lora, t = self.model, self.model.lora, self.train
        comp = [c.spec for c in self.split.compression]
        return {
            "version": self.version,
            "name": self.name,
            "model": {
                "pretrained": m.pretrained,
                "dtype": m.dtype,
                "weight_dtype": m.weight_dtype,
                "quantization": None if m.quantization is None else m.quantization.to_dict(),
                "freeze_backbone": m.freeze_backbone,
                "lora": {
                    "enabled": lora.enabled,
                    "r": lora.r,
                    "alpha": lora.alpha,
                    "dropout": lora.dropout,
                    "target_modules": None
                    if lora.target_modules is None
                    else list(lora.target_modules),
                    "export": lora.export,
                },
            },
            "split": {
                "stages": self.split.stages,
                "mode": self.split.mode,
                "compression": comp[0] if len(comp) == 1 else comp,
            },
            "data": {"source": self.data.source, "text_field": self.data.text_field},
            "train": {
                "steps": t.steps,
                "batch_size": t.batch_size,
                "seq_len": t.seq_len,
                "lr": t.lr,
                "micro_batches": t.micro_batches,
                "schedule": t.schedule,
                "recompute": t.recompute,
                "eval_batches": t.eval_batches,
                "seed": t.seed,
                "checkpoint_every": t.checkpoint_every,
            },
        }

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


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class _Collector:
    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def add(self, path: str, message: str) -> None:
        self.errors.append(FieldError(path=path, message=message))

    def section(self, data: Any, path: str, keys: tuple[str, ...]) -> dict[str, Any]:
        if data is None:
            return {}
        if not isinstance(data, dict):
            self.add(path, f"must be an object, got {json.dumps(data)}")
            return {}
        for key in data:
            if key not in keys:
                self.add(
                    _join(path, key) if path else key, f"unknown key; known: {', '.join(keys)}"
                )
        return data

    def integer(self, d: dict, key: str, path: str, default: int, lo: int, hi: int | None = None):
        value = d.get(key, default)
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo
        if ok and hi is not None and value > hi:
            ok = False
        if not ok:
            bound = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            self.add(_join(path, key), f"must be an integer {bound}, got {json.dumps(value)}")
            return default
        return value

    def number(self, d: dict, key: str, path: str, default: float, lo: float, lo_open: bool):
        value = d.get(key, default)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value) and (value > lo if lo_open else value >= lo)
        if not ok:
            self.add(
                _join(path, key),
                f"must be a number {'>' if lo_open else '>='} {lo:g}, got {json.dumps(value)}",
            )
            return default
        return float(value)

    def boolean(self, d: dict, key: str, path: str, default: bool) -> bool:
        value = d.get(key, default)
        if not isinstance(value, bool):
            self.add(_join(path, key), f"must be true or false, got {json.dumps(value)}")
            return default
        return value

    def choice(self, d: dict, key: str, path: str, default: Any, options: tuple) -> Any:
        value = d.get(key, default)
        if value not in options or isinstance(value, bool):
            shown = ", ".join("null" if o is None else str(o) for o in options)
            self.add(_join(path, key), f"must be one of {shown}, got {json.dumps(value)}")
            return default
        return value

    def string(self, d: dict, key: str, path: str, default: str | None) -> str:
        value = d.get(key, default)
        if not (isinstance(value, str) and value.strip()):
            self.add(
                _join(path, key),
                "required: a non-empty string"
                if value is None
                else f"must be a non-empty string, got {json.dumps(value)}",
            )
            return default or ""
        return value


_TOP_KEYS = ("version", "name", "model", "split", "data", "train")
_MODEL_KEYS = ("pretrained", "dtype", "weight_dtype", "quantization", "freeze_backbone", "lora")
_LORA_KEYS = ("enabled", "r", "alpha", "dropout", "target_modules", "export")
_SPLIT_KEYS = ("stages", "mode", "compression")
_DATA_KEYS = ("source", "text_field")
_TRAIN_KEYS = (
    "steps", "batch_size", "seq_len", "lr", "micro_batches", "schedule", "recompute",
    "eval_batches", "seed", "checkpoint_every",
)  # fmt: skip


def _parse_lora(c: _Collector, data: Any) -> LoraConfig:
    p = "model.lora"
    d = c.section(data, p, _LORA_KEYS)
    targets = d.get("target_modules")
    if targets is not None and not (
        isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)
    ):
        c.add(f"{p}.target_modules", f"must be null or a non-empty list of module names, "
              f"got {json.dumps(targets)}")  # fmt: skip
        targets = None
    dropout = c.number(d, "dropout", p, 0.05, 0.0, False)
    if dropout >= 1:
        c.add(f"{p}.dropout", f"must be below 1, got {json.dumps(d.get('dropout'))}")
    return LoraConfig(
        enabled=c.boolean(d, "enabled", p, False),
        r=c.integer(d, "r", p, 8, 1),
        alpha=c.number(d, "alpha", p, 16.0, 0.0, True),
        dropout=dropout,
        target_modules=None if targets is None else tuple(targets),
        export=c.choice(d, "export", p, "merged", LORA_EXPORTS),
    )


def _parse_model(c: _Collector, data: Any) -> ModelConfig:
    p = "model"
    if data is None:
        c.add("model", 'required: an object with at least "pretrained"')
    d = c.section(data, p, _MODEL_KEYS)
    for err in quantization_errors(d.get("quantization"), f"{p}.quantization"):
        path, _, message = err.partition(": ")
        c.add(path, message)
    quant = (
        None
        if any(e.path.startswith(f"{p}.quantization") for e in c.errors)
        else normalize(d.get("quantization"))
    )
    return ModelConfig(
        pretrained=c.string(d, "pretrained", p, None) if data is not None else "",
        dtype=c.choice(d, "dtype", p, None, (None, *DTYPES)),
        weight_dtype=c.choice(d, "weight_dtype", p, None, (None, *DTYPES)),
        quantization=quant,
        freeze_backbone=c.boolean(d, "freeze_backbone", p, False),
        lora=_parse_lora(c, d.get("lora")),
    )


def _parse_split(c: _Collector, data: Any) -> SplitConfig:
    p = "split"
    d = c.section(data, p, _SPLIT_KEYS)
    stages = d.get("stages", "auto")
    if stages != "auto" and not (isinstance(stages, int) and not isinstance(stages, bool)
                                 and stages >= 1):  # fmt: skip
        c.add(f"{p}.stages", f'must be "auto" or an integer >= 1, got {json.dumps(stages)}')
        stages = "auto"
    raw = d.get("compression", "none")
    specs = raw if isinstance(raw, list) else [raw]
    if isinstance(raw, list) and not raw:
        c.add(f"{p}.compression", "must be one spec or a non-empty list with one per boundary")
    compression: list[Compression] = []
    for i, spec in enumerate(specs):
        path = f"{p}.compression[{i}]" if isinstance(raw, list) else f"{p}.compression"
        errs = compression_errors(spec, path)
        for err in errs:
            where, _, message = err.partition(": ")
            c.add(where, message)
        if not errs:
            compression.append(parse_compression(spec, path))
    if isinstance(raw, list) and isinstance(stages, int) and raw and len(raw) != stages - 1:
        c.add(
            f"{p}.compression",
            f"has {len(raw)} specs but split.stages {stages} has {stages - 1} boundaries; "
            f"give one spec or one per boundary",
        )
    return SplitConfig(
        stages=stages,
        mode=c.choice(d, "mode", p, "weighted", SPLIT_MODES),
        compression=tuple(compression) or (Compression(method="none"),),
    )


def _parse_train(c: _Collector, data: Any) -> TrainConfig:
    p = "train"
    d = c.section(data, p, _TRAIN_KEYS)
    recompute = d.get("recompute", "auto")
    if recompute != "auto" and not isinstance(recompute, bool):
        c.add(f"{p}.recompute", f'must be true, false or "auto", got {json.dumps(recompute)}')
        recompute = "auto"
    batch = c.integer(d, "batch_size", p, 4, 1)
    micro = c.integer(d, "micro_batches", p, 4, 1, MAX_MICRO_BATCHES)
    if "micro_batches" not in d and batch % micro:
        micro = math.gcd(batch, micro)  # the default adapts to a small batch
    elif batch % micro:
        c.add(
            f"{p}.micro_batches",
            f"must divide train.batch_size {batch} (each micro-batch gets an equal share), "
            f"got {micro}",
        )
    return TrainConfig(
        steps=c.integer(d, "steps", p, 100, 1),
        batch_size=batch,
        seq_len=c.integer(d, "seq_len", p, 128, 1),
        lr=c.number(d, "lr", p, 2e-4, 0.0, True),
        micro_batches=micro,
        schedule=c.choice(d, "schedule", p, "1f1b", SCHEDULES),
        recompute=recompute,
        eval_batches=c.integer(d, "eval_batches", p, 16, 0),
        seed=c.integer(d, "seed", p, 0, 0),
        checkpoint_every=c.integer(d, "checkpoint_every", p, 25, 0),
    )


def parse(data: Any) -> Job:
    """A Job from decoded job.json; raises JobError listing every problem with its path."""
    c = _Collector()
    if not isinstance(data, dict):
        raise JobError([FieldError(path="(job)", message="must be a JSON object")])
    d = c.section(data, "", _TOP_KEYS)
    version = d.get("version", JOB_VERSION)
    if version != JOB_VERSION or isinstance(version, bool):
        c.add("version", f"must be {JOB_VERSION} (this swarmp2p reads job.json version "
              f"{JOB_VERSION}), got {json.dumps(version)}")  # fmt: skip
    name = c.string(d, "name", "", "job") if "name" in d else "job"
    model = _parse_model(c, d.get("model"))
    split = _parse_split(c, d.get("split"))
    data_cfg = c.section(d.get("data"), "data", _DATA_KEYS)
    data_section = DataConfig(
        source=c.string(data_cfg, "source", "data", "embedded"),
        text_field=c.string(data_cfg, "text_field", "data", "text"),
    )
    train = _parse_train(c, d.get("train"))
    if model.weight_dtype is not None and model.quantization is not None:
        c.add("model.weight_dtype", "cannot be combined with model.quantization (quantized "
              "weights are already stored narrow); drop one of them")  # fmt: skip
    frozen = model.lora.enabled or model.freeze_backbone
    if model.quantization is not None and not frozen:
        c.add("model.quantization", "a quantized backbone cannot be fully fine-tuned; enable "
              "model.lora (QLoRA) or set model.freeze_backbone")  # fmt: skip
    if c.errors:
        raise JobError(c.errors)
    return Job(name=name, model=model, split=split, data=data_section, train=train)


def load(path: str | Path) -> Job:
    """Read and parse a job.json file; unreadable or non-JSON files raise JobError too."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise JobError(
            [FieldError(path=str(path), message=f"cannot read: {exc.strerror}")]
        ) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JobError([FieldError(path=str(path), message=f"not valid JSON: {exc}")]) from exc
    except RecursionError:  # e.g. 200,000 nested brackets
        raise JobError(
            [FieldError(path=str(path), message="not readable JSON: nested too deeply")]
        ) from None
    return parse(data)
