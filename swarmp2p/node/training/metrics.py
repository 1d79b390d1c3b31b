"""A job's high-rate numbers (the loss curve, throughput, boundary traffic) on the leader.

They do not ride the replicated, fsynced table (a 500-point curve pushed to every member at
every report batch was most of its traffic): the leader folds the stages' step events into
memory here; followers ask the leader for them (``job.metrics``) when `swarm jobs show` or the
dashboard wants them. A new leader starts each running job's curve afresh from the next step.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

from swarmp2p.workers.events import Evaluated, Phase, Ready, StepDone, WorkerEvent

CURVE_POINTS = 500
"""Curve points kept per job: the newest ones, as ``[attempt, step, loss, tokens_per_s]``
(``step`` from 0, as the workers count; the dashboard draws throughput from them too)."""
COMPUTE_STEPS = 40
"""Steps of per-stage compute seconds kept per job (the re-balance trigger reads them)."""
WARMUP_STEPS = 2
"""Steps of an attempt left out of its steady tokens/s (allocations, the first snapshot)."""


def fold(
    metrics: dict[str, Any],
    *,
    attempt: int,
    stage: int,
    n_stages: int,
    event: StepDone,
    synced: bool = False,
) -> None:
    """Fold one worker ``step`` event of stage ``stage`` into ``metrics`` (in place).

    Step metrics come from the last stage (it holds the loss); boundary traffic from the stages
    on either side of it; ``synced`` (a replicated job): each stage's sync with its replicas
    too (``sync_bytes``, ``sync_s``)."""
    boundaries = metrics.setdefault("boundaries", {})
    secs = max(_float(event.step_s) or 0.0, 1e-9)
    # a stage sends activations over the boundary after it, gradients over the one before
    if stage < n_stages - 1:
        rates = boundaries.setdefault(str(stage), {"act_mb_s": 0.0, "grad_mb_s": 0.0})
        rates["act_mb_s"] = round(event.act_bytes / secs / 1e6, 3)
    if 0 < stage < n_stages:
        rates = boundaries.setdefault(str(stage - 1), {"act_mb_s": 0.0, "grad_mb_s": 0.0})
        rates["grad_mb_s"] = round(event.grad_bytes / secs / 1e6, 3)
    stages = metrics.setdefault("stages", {})
    stages[str(stage)] = {
        k: _float(getattr(event, k))
        for k in ("step_s", "forward_s", "backward_s", "optimizer_s", "wait_s")
    }
    if synced:
        stages[str(stage)].update(sync_bytes=event.sync_bytes, sync_s=_float(event.sync_s))
    _fold_compute(metrics, attempt, stage, event)
    if stage == n_stages - 1:
        _fold_steady(metrics, attempt, event)
        loss, tokens_per_s = _float(event.loss), _float(event.tokens_per_s)
        metrics.update(
            step=event.step + 1,
            loss=loss,
            tokens_per_s=tokens_per_s,
            step_s=_float(event.step_s),
        )
        losses = metrics.setdefault("losses", [])
        losses.append([attempt, event.step, loss, tokens_per_s])
        del losses[:-CURVE_POINTS]


def fold_phase(metrics: dict[str, Any], *, attempt: int, stage: int, event: WorkerEvent) -> None:
    """What stage ``stage`` does before its first step: ``metrics["phases"]`` is ``{"attempt",
    "stages": {stage: {"phase", "done", "total"}}}``, from a ``phase`` event, ``loading
    weights`` once the worker is up (``ready``), ``training`` from its first step on. A new
    attempt starts afresh."""
    phases = metrics.get("phases")
    if not isinstance(phases, dict) or phases.get("attempt") != attempt:
        phases = metrics["phases"] = {"attempt": attempt, "stages": {}}
    if isinstance(event, Phase):
        now = {"phase": event.name, "done": event.done, "total": event.total}
    elif isinstance(event, Ready):
        now = {"phase": "loading weights", "done": 0, "total": 0}
    elif isinstance(event, StepDone):
        now = {"phase": "training", "done": 0, "total": 0}
    else:
        return
    phases["stages"][str(stage)] = now


def _fold_compute(metrics: dict[str, Any], attempt: int, stage: int, event: StepDone) -> None:
    """Stage ``stage``'s compute seconds of this step (forward + backward + optimizer, its
    waits left out), kept for the newest COMPUTE_STEPS steps of the attempt."""
    parts = [_float(v) for v in (event.forward_s, event.backward_s, event.optimizer_s)]
    if any(p is None for p in parts) or event.skipped:
        return
    compute = metrics.get("compute")
    if not isinstance(compute, dict) or compute.get("attempt") != attempt:
        compute = metrics["compute"] = {"attempt": attempt, "steps": {}}
    steps = compute["steps"]
    steps.setdefault(str(event.step), {})[str(stage)] = round(sum(parts), 6)  # type: ignore[arg-type]
    for old in sorted(steps, key=int)[:-COMPUTE_STEPS]:
        del steps[old]


def _fold_steady(metrics: dict[str, Any], attempt: int, event: StepDone) -> None:
    """The pipeline's steady tokens/s: the last stage's tokens over the wall time between its
    step ends (``at``), the attempt's first WARMUP_STEPS steps left out."""
    at, tokens = _float(event.at), event.tokens
    if at is None:
        return
    steady = metrics.get("steady")
    if not isinstance(steady, dict) or steady.get("attempt") != attempt:
        steady = metrics["steady"] = {"attempt": attempt, "seen": 0, "since": None, "tokens": 0}
    steady["seen"] += 1
    if steady["seen"] == WARMUP_STEPS:
        steady["since"] = at
    elif steady["seen"] > WARMUP_STEPS and steady["since"] is not None and at > steady["since"]:
        steady["tokens"] += tokens
        metrics["steady_tokens_per_s"] = round(steady["tokens"] / (at - steady["since"]), 3)


def _fold_total(metrics: dict[str, Any], n_replicas: int) -> None:
    """A replicated job's tokens/s: its replicas' added up (once each has reported one)."""
    replicas = [metrics["replicas"].get(str(r)) or {} for r in range(n_replicas)]
    for key in ("tokens_per_s", "steady_tokens_per_s"):
        rates = [r.get(key) for r in replicas]
        if all(isinstance(v, (int, float)) for v in rates):
            metrics[key] = round(sum(rates), 3)


def _float(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


class MetricsStore:
    """The leader's metrics of every job it has heard from, by job id."""

    def __init__(self) -> None:
        self._jobs: dict[str, dict[str, Any]] = {}

    def fold(
        self,
        job_id: str,
        *,
        attempt: int,
        stage: int,
        n_stages: int,
        events: Sequence[WorkerEvent],
        replica: int = 0,
        n_replicas: int = 1,
    ) -> None:
        """Replica 0's steps make the job's metrics (as one pipeline's); with replicas each
        replica's own are under ``replicas`` (replica -> its ``stages``, ``step``, ``loss``,
        ``tokens_per_s``, ``steady_tokens_per_s``, ``phases``, and ``evaluation``: each held-out
        pass's loss, the same on every replica when they hold equal weights), and the job's
        ``tokens_per_s`` is every replica's together."""
        metrics = self._jobs.setdefault(job_id, {})
        synced = n_replicas > 1
        own = metrics.setdefault("replicas", {}).setdefault(str(replica), {}) if synced else {}
        for event in events:
            if isinstance(event, StepDone):
                if replica == 0:
                    fold(metrics, attempt=attempt, stage=stage, n_stages=n_stages, event=event,
                         synced=synced)  # fmt: skip
                if synced:
                    fold(own, attempt=attempt, stage=stage, n_stages=n_stages, event=event,
                         synced=True)  # fmt: skip
                    for k in ("losses", "compute", "boundaries"):
                        own.pop(k, None)
            if replica == 0:
                fold_phase(metrics, attempt=attempt, stage=stage, event=event)
            if synced:
                fold_phase(own, attempt=attempt, stage=stage, event=event)
                if isinstance(event, Evaluated) and stage == n_stages - 1:  # equal replicas
                    own.setdefault("evaluation", {})[event.name[:64]] = _float(event.loss)
        if synced and stage == n_stages - 1:
            _fold_total(metrics, n_replicas)

    def compute(self, job_id: str) -> dict[str, Any] | None:
        """The job's compute seconds per step and stage (read only; ``fold``'s ``compute``)."""
        return self._jobs.get(job_id, {}).get("compute")

    def get(self, job_id: str) -> dict[str, Any]:
        return copy.deepcopy(self._jobs.get(job_id, {}))

    def put(self, job_id: str, metrics: dict[str, Any]) -> None:
        """Metrics fetched from the leader (a follower's cache for its dashboard)."""
        self._jobs[job_id] = copy.deepcopy(metrics)

    def forget(self, keep: set[str]) -> None:
        for job_id in [j for j in self._jobs if j not in keep]:
            del self._jobs[job_id]


__all__ = ["COMPUTE_STEPS", "CURVE_POINTS", "WARMUP_STEPS", "MetricsStore", "fold"]
