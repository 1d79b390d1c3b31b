"""The stage worker: ``python -m swarmp2p.runtime.worker`` runs one pipeline stage.

It reads a worker spec (one JSON object) on stdin, validates it (a bad field exits with code 2
and an ``error`` event naming it), binds the link to the stage before it (port 0: any free
port) and dials the stage after it, then writes JSON-lines events on stdout:

- ``{"event": "ready", "stage": i, "port": p}`` once its link is bound (``port`` null on stage 0)
- ``{"event": "eval", "stage": i, "pass": name, "loss": ..., "perplexity": ..., "top1": ..., "tokens": n}``
- ``{"event": "step", "stage": i, "step": s, "loss": ..., "tokens_per_s": ..., "act_bytes": ...,
  "grad_bytes": ..., "step_s": ..., "peak_memory_bytes": ..., "loss_scale": ..., "skipped": ...}``
  (``loss_scale`` null unless float16; ``skipped``: a float16 overflow dropped the step)
- ``{"event": "done", "stage": i, "steps": n}`` and exit code 0
- ``{"event": "error", "stage": i, "type": ..., "message": ...}`` and exit code 1; a non-finite
  step (``NonFiniteError``) and a stage stopped by another's failure (``PipelineAborted``) add
  ``failed_stage``, ``step`` (null when not in a step) and ``reason``

Parsing the spec imports no torch (the daemon validates specs with it); running a stage does.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

SCHEDULES = ("gpipe", "1f1b")
FINETUNE_MODES = ("full", "compressor_only", "lora", "none")
DATA_SOURCES = ("random", "tokens")
EXIT_BAD_SPEC = 2
EXIT_FAILED = 1


class WorkerSpecError(ValueError):
    """A worker spec is invalid; ``errors`` lists every problem with its field path."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        super().__init__("invalid worker spec: " + "; ".join(self.errors))


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    """``train``: the schedule and optimiser every stage of the job shares."""

    steps: int = 1
    batch_size: int = 4
    seq_len: int = 32
    micro_batches: int = 1
    schedule: str = "1f1b"
    lr: float = 1e-4
    weight_decay: float = 0.0
    recompute: bool = False
    loss_chunk_tokens: int = 2048
    eval_batches: int = 0
    """Held-out batches per evaluation pass (0: no evaluation)."""
    calibration_tokens: int = 16384
    checkpoint_every: int = 0
    """Write a snapshot every this many steps (0: never)."""
    loss_scale: float | None = None
    """A float16 job's first loss scale (None: 2**16, torch.amp.GradScaler's default)."""
    inject_nan_step: int | None = None
    """Test knob: from this step on, this stage's gradients hold a NaN."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSpec:
    """``data``: where the first stage's tokens come from."""

    source: str = "random"
    """``random`` (seeded uniform tokens, for tests and benchmarks) or ``tokens`` (a .npy file
    of token ids, cut into windows of seq_len + 1)."""
    path: str | None = None
    seed: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSpec:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    target_modules: tuple[str, ...] | None = None
    export: str = "merged"


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSpec:
    """One stage's assignment."""

    stage: int
    n_stages: int
    model: str
    """A local checkpoint folder (or what ``load_stage_shard`` accepts)."""
    layers: tuple[int, int]
    """This stage's blocks ``[start, end)``."""
    n_layers: int
    """Blocks in the whole model."""
    token: str
    """The swarm token: links are CURVE-authenticated with keys derived from it."""
    compression: tuple[Any, ...] = ()
    """One compression spec per boundary (n_stages - 1)."""
    finetune_mode: str = "full"
    lora: LoraSpec | None = None
    dtype: str = "float32"
    device: str = "cpu"
    host: str = "127.0.0.1"
    """Where the link to the stage before binds."""
    port: int = 0
    next: str | None = None
    """The endpoint of the next stage's bound link (``tcp://host:port``); None on the last."""
    link_timeout_s: float = 60.0
    seed: int = 0
    wire_v2: bool = True
    train: TrainSpec = field(default_factory=TrainSpec)
    data: DataSpec = field(default_factory=DataSpec)
    snapshot_dir: str | None = None
    resume: bool = False
    """Continue from the newest snapshot in ``snapshot_dir``."""
    quantization: dict | None = None
    """Weight quantization of the stage as it loads (``{"bits": 4}``: NF4); LoRA then exports
    adapters only."""
    export_dir: str | None = None
    """Write this stage's shard to ``export_dir/stage-<i>`` after the last step."""
    weight_dtype: str | None = None
    """Store the frozen backbone's Linear/Embedding weights in this 16-bit dtype (``float16`` or
    ``bfloat16``; lora, compressor_only and none modes; a full fine-tune ignores it)."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1


_TOP_KEYS = {f for f in WorkerSpec.__dataclass_fields__}


class _Checker:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def fail(self, path: str, message: str) -> None:
        self.errors.append(f"{path}: {message}")

    def obj(self, data: Any, path: str, keys: set[str]) -> dict[str, Any]:
        if not isinstance(data, dict):
            self.fail(path, f"must be an object, got {type(data).__name__}")
            return {}
        for key in sorted(set(data) - keys):
            self.fail(f"{path}.{key}" if path else key, "unknown field")
        return data

    def integer(self, d, key, path, default, lo, hi=None, required=False):
        if key not in d:
            if required:
                self.fail(path + key, "is required")
            return default
        v = d[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            bound = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            self.fail(path + key, f"must be an integer {bound}, got {v!r}")
            return default
        return v

    def number(self, d, key, path, default, lo, lo_open=False):
        v = d.get(key, default)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or v < lo or (lo_open and v == lo):
            self.fail(path + key, f"must be a number {'>' if lo_open else '>='} {lo}, got {v!r}")
            return default
        return float(v)

    def string(self, d, key, path, default, required=False, choices=None):
        if key not in d:
            if required:
                self.fail(path + key, "is required")
            return default
        v = d[key]
        if not isinstance(v, str) or not v:
            self.fail(path + key, f"must be a non-empty string, got {v!r}")
            return default
        if choices is not None and v not in choices:
            self.fail(path + key, f"must be one of {', '.join(choices)}, got {v!r}")
            return default
        return v

    def boolean(self, d, key, path, default):
        v = d.get(key, default)
        if not isinstance(v, bool):
            self.fail(path + key, f"must be true or false, got {v!r}")
            return default
        return v


def _parse_train(c: _Checker, data: Any) -> TrainSpec:
    d = c.obj(data, "train", set(TrainSpec.__dataclass_fields__))
    p = "train."
    spec = TrainSpec(
        steps=c.integer(d, "steps", p, 1, 0),
        batch_size=c.integer(d, "batch_size", p, 4, 1),
        seq_len=c.integer(d, "seq_len", p, 32, 1),
        micro_batches=c.integer(d, "micro_batches", p, 1, 1, 32),
        schedule=c.string(d, "schedule", p, "1f1b", choices=SCHEDULES),
        lr=c.number(d, "lr", p, 1e-4, 0.0, lo_open=True),
        weight_decay=c.number(d, "weight_decay", p, 0.0, 0.0),
        recompute=c.boolean(d, "recompute", p, False),
        loss_chunk_tokens=c.integer(d, "loss_chunk_tokens", p, 2048, 1),
        eval_batches=c.integer(d, "eval_batches", p, 0, 0),
        calibration_tokens=c.integer(d, "calibration_tokens", p, 16384, 1),
        checkpoint_every=c.integer(d, "checkpoint_every", p, 0, 0),
        loss_scale=c.number(d, "loss_scale", p, None, 0.0, lo_open=True)
        if d.get("loss_scale") is not None
        else None,
        inject_nan_step=c.integer(d, "inject_nan_step", p, None, 0)
        if d.get("inject_nan_step") is not None
        else None,
    )
    if spec.batch_size % spec.micro_batches:
        c.fail(
            "train.micro_batches",
            f"must divide train.batch_size {spec.batch_size}, got {spec.micro_batches}",
        )
    return spec


def _parse_data(c: _Checker, data: Any) -> DataSpec:
    d = c.obj(data, "data", set(DataSpec.__dataclass_fields__))
    source = c.string(d, "source", "data.", "random", choices=DATA_SOURCES)
    path = c.string(d, "path", "data.", None, required=source == "tokens")
    return DataSpec(source=source, path=path, seed=c.integer(d, "seed", "data.", 0, 0))


def _parse_lora(c: _Checker, data: Any) -> LoraSpec:
    d = c.obj(data, "lora", set(LoraSpec.__dataclass_fields__))
    targets = d.get("target_modules")
    if targets is not None and (
        not isinstance(targets, list)
        or not targets
        or not all(isinstance(t, str) and t for t in targets)
    ):
        c.fail("lora.target_modules", f"must be a non-empty list of module names, got {targets!r}")
        targets = None
    return LoraSpec(
        r=c.integer(d, "r", "lora.", 8, 1),
        alpha=c.number(d, "alpha", "lora.", 16.0, 0.0, lo_open=True),
        dropout=c.number(d, "dropout", "lora.", 0.05, 0.0),
        target_modules=tuple(targets) if targets else None,
        export=c.string(d, "export", "lora.", "merged", choices=("merged", "adapters")),
    )


def _parse_quantization(c: _Checker, data: Any) -> dict | None:
    if data is None:
        return None
    from swarmp2p.plan.quantization import quantization_errors

    c.errors.extend(quantization_errors(data, "quantization"))
    return data if isinstance(data, dict) else None


def parse_worker_spec(data: Any) -> WorkerSpec:
    """A validated WorkerSpec, or WorkerSpecError listing every bad field."""
    c = _Checker()
    d = c.obj(data, "", _TOP_KEYS)
    n = c.integer(d, "n_stages", "", 2, 1, required=True)
    stage = c.integer(d, "stage", "", 0, 0, required=True)
    if "stage" in d and "n_stages" in d and isinstance(stage, int) and stage >= n:
        c.fail("stage", f"must be < n_stages ({n}), got {stage}")
    n_layers = c.integer(d, "n_layers", "", 1, 1, required=True)
    layers = d.get("layers")
    if not (
        isinstance(layers, list)
        and len(layers) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in layers)
        and 0 <= layers[0] < layers[1] <= n_layers
    ):
        c.fail("layers", f"must be [start, end) with 0 <= start < end <= n_layers, got {layers!r}")
        layers = [0, 1]
    compression = d.get("compression", ["none"] * (n - 1))
    if not isinstance(compression, list) or len(compression) != n - 1:
        c.fail("compression", f"must list one spec per boundary ({n - 1}), got {compression!r}")
        compression = ["none"] * (n - 1)
    else:
        from swarmp2p.plan.split import compression_errors

        for i, spec in enumerate(compression):
            c.errors.extend(compression_errors(spec, f"compression[{i}]"))
    mode = c.string(d, "finetune_mode", "", "full", choices=FINETUNE_MODES)
    lora = _parse_lora(c, d["lora"]) if d.get("lora") is not None else None
    if mode == "lora" and lora is None:
        c.fail("lora", 'is required when finetune_mode is "lora"')
    nxt = c.string(d, "next", "", None)
    if isinstance(stage, int) and isinstance(n, int) and stage < n - 1 and nxt is None:
        c.fail("next", "is required on every stage but the last (the next stage's endpoint)")
    if nxt is not None and not nxt.startswith("tcp://"):
        c.fail("next", f"must be a tcp://host:port endpoint, got {nxt!r}")
    spec = dict(
        stage=stage,
        n_stages=n,
        model=c.string(d, "model", "", "", required=True),
        layers=tuple(layers),
        n_layers=n_layers,
        token=c.string(d, "token", "", "", required=True),
        compression=tuple(compression),
        finetune_mode=mode,
        lora=lora,
        dtype=c.string(d, "dtype", "", "float32", choices=("float32", "float16", "bfloat16")),
        device=c.string(d, "device", "", "cpu"),
        host=c.string(d, "host", "", "127.0.0.1"),
        port=c.integer(d, "port", "", 0, 0, 65535),
        next=nxt,
        link_timeout_s=c.number(d, "link_timeout_s", "", 60.0, 0.0, lo_open=True),
        seed=c.integer(d, "seed", "", 0, 0),
        wire_v2=c.boolean(d, "wire_v2", "", True),
        train=_parse_train(c, d.get("train", {})),
        data=_parse_data(c, d.get("data", {})),
        snapshot_dir=c.string(d, "snapshot_dir", "", None),
        resume=c.boolean(d, "resume", "", False),
        quantization=_parse_quantization(c, d.get("quantization")),
        export_dir=c.string(d, "export_dir", "", None),
        weight_dtype=c.string(d, "weight_dtype", "", None, choices=("float16", "bfloat16"))
        if d.get("weight_dtype") is not None
        else None,
    )
    if spec["resume"] and spec["snapshot_dir"] is None:
        c.fail("resume", "needs snapshot_dir")
    if spec["train"].loss_scale is not None and spec["dtype"] != "float16":
        c.fail("train.loss_scale", f"applies only to float16 jobs, dtype is {spec['dtype']}")
    if c.errors:
        raise WorkerSpecError(c.errors)
    return WorkerSpec(**spec)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _emitter(out: TextIO, stage: int | None) -> Callable[..., None]:
    def emit(event: str, **fields: Any) -> None:
        record = {"event": event, "stage": stage, **{k: _clean(v) for k, v in fields.items()}}
        out.write(json.dumps(record) + "\n")
        out.flush()

    return emit


def main(stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Run one stage from the spec on stdin; return the exit code."""
    import faulthandler

    faulthandler.enable()
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    try:
        raw = json.loads(stdin.read())
    except ValueError as exc:
        _emitter(stdout, None)("error", type="WorkerSpecError", message=f"spec is not JSON: {exc}")
        return EXIT_BAD_SPEC
    stage = raw.get("stage") if isinstance(raw, dict) else None
    emit = _emitter(stdout, stage if isinstance(stage, int) else None)
    try:
        spec = parse_worker_spec(raw)
    except WorkerSpecError as exc:
        emit("error", type="WorkerSpecError", message=str(exc), errors=exc.errors)
        return EXIT_BAD_SPEC
    try:
        from swarmp2p.runtime.torch.stage_runner import run_stage

        run_stage(spec, emit)
    except Exception as exc:
        import traceback

        traceback.print_exc(file=sys.stderr)
        extra = getattr(exc, "event_fields", None)
        emit("error", type=type(exc).__name__, message=str(exc), **(extra or {}))
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
