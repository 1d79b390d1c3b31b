"""Training jobs as data: the table record, planning inputs, worker specs, progress. Pure.

A training job lives in the replicated job table as ``{"kind": "train", "job": <job.json,
canonical>, ...}``; the leader adds ``plan``, ``cluster`` (the exact planner inputs),
``attempt``, ``history``, ``metrics``, ``evaluation``, ``reason``, ``error`` and ``model`` by
``update`` events. Every function here takes and returns plain data, so the leader, the peers
that check a plan and the CLI all compute the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from swarmp2p.plan import Blocked, Job, Node, Plan, parse_job, plan_job
from swarmp2p.plan.hardware import CAPABILITIES

JOB_KIND = "train"
ACTIVE_STATES = ("placed", "running", "resuming")
"""States in which workers may run."""
WAITING_STATES = ("submitted", "pending")
FINAL_STATES = ("completed", "failed", "cancelled")
LINK_TIMEOUT_S = 30.0
"""How long a stage waits on a silent neighbour before it fails (the leader stops it sooner)."""
STDERR_TAIL_LINES = 40


class PlanMismatch(ValueError):
    """A peer recomputed a different plan from the same inputs (version skew)."""


OVERRIDES: dict[str, tuple[str, ...]] = {
    "pretrained": ("model", "pretrained"),
    "steps": ("train", "steps"),
    "stages": ("split", "stages"),
    "compression": ("split", "compression"),
    "freeze_backbone": ("model", "freeze_backbone"),
    "lora": ("model", "lora", "enabled"),
    "lora_export": ("model", "lora", "export"),
    "dtype": ("model", "dtype"),
    "weight_dtype": ("model", "weight_dtype"),
    "quantization": ("model", "quantization"),
}
"""`swarm train` flag -> the job.json field it sets."""


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (decoded job.json) with the flags in ``overrides`` (None: not given) set."""
    out = _copy(data) if isinstance(data, Mapping) else data
    if not isinstance(out, dict):
        return out
    for flag, value in overrides.items():
        if value is None:
            continue
        if flag not in OVERRIDES:
            raise ValueError(f"unknown override {flag!r}; one of {sorted(OVERRIDES)}")
        *parents, leaf = OVERRIDES[flag]
        node = out
        for key in parents:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[leaf] = value
    return out


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


def job_record(job: Job, *, submitted_by: str, submitted_at: float) -> dict[str, Any]:
    """The opaque record `submit` puts in the table for a training job."""
    return {
        "kind": JOB_KIND,
        "name": job.name,
        "job": job.to_dict(),
        "submitted_by": submitted_by,
        "history": [{"state": "pending", "at": submitted_at}],
        "attempt": 0,
    }


def is_training(entry: Mapping[str, Any]) -> bool:
    record = entry.get("record", {})
    return isinstance(record, Mapping) and record.get("kind") == JOB_KIND


def without_runtime(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Names of the nodes that declare no runtime capability (torch is not importable there):
    they cannot run a stage, so they are left out of planning."""
    return sorted(r["name"] for r in records if not r.get("capabilities"))


def blocked_note(reason: str, records: Sequence[Mapping[str, Any]]) -> str:
    """A blocked reason, naming the live nodes left out for lack of the runtime."""
    missing = without_runtime(records)
    if not missing:
        return reason
    return (
        f"{reason}\nnot placed (no torch runtime): {', '.join(missing)}; install swarmp2p "
        "with its runtime there (install.sh)"
    )


def cluster_records(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Planner inputs from live nodes' hardware records, sorted by node id (order-free); nodes
    without the runtime are left out."""
    out = []
    for r in sorted(records, key=lambda r: r["node_id"]):
        if not r.get("capabilities"):
            continue
        rec = _copy(r)
        rec["devices"] = [{k: v for k, v in d.items() if k != "fake"} for d in r["devices"]]
        out.append(rec)
    return out


def compute_plan(
    job_data: Mapping[str, Any],
    cluster: Sequence[Mapping[str, Any]],
    capabilities: frozenset[str] | None = None,
) -> Plan | Blocked:
    """``plan_job`` over plain records; what the leader and every assigned peer run."""
    job = parse_job(_copy(job_data))
    nodes = [Node.from_dict(_copy(r), f"cluster[{i}]") for i, r in enumerate(cluster)]
    return plan_job(job, nodes, CAPABILITIES if capabilities is None else capabilities)


def check_plan(
    job_data: Mapping[str, Any],
    cluster: Sequence[Mapping[str, Any]],
    plan_json: str,
    *,
    node_id: str,
    capabilities: frozenset[str] | None = None,
) -> Plan:
    """Recompute the plan on this peer; PlanMismatch unless it is byte-identical."""
    mine = compute_plan(job_data, cluster, capabilities)
    if not isinstance(mine, Plan):
        raise PlanMismatch(
            f"node {node_id} cannot place this job from the same inputs: {mine.reason}; "
            "run the same swarmp2p version on every node"
        )
    if mine.to_json() != plan_json:
        raise PlanMismatch(
            f"node {node_id} computes a different plan from the same job and cluster "
            f"(first difference at byte {_first_diff(mine.to_json(), plan_json)}); run the "
            "same swarmp2p version on every node"
        )
    return mine


def _first_diff(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def device_for(stage: Mapping[str, Any], record: Mapping[str, Any]) -> tuple[str, str | None]:
    """(torch device inside the worker, CUDA_VISIBLE_DEVICES or None) for a planned stage.

    A fake GPU (``SWARM_FAKE_DEVICES``, tests and demos) runs its stage on the CPU.
    """
    device = stage["devices"][0]
    if device == "cpu" or ":" not in device:
        return "cpu", None
    kind, index = device.split(":", 1)
    for d in record.get("devices", []):
        if d.get("kind") == kind and str(d.get("index")) == index and d.get("fake"):
            return "cpu", None
    return f"{kind}:0", index


# --- progress: worker events folded into the record -------------------------------------------


def fold_event(record: Mapping[str, Any], event: Mapping[str, Any]) -> dict[str, Any]:
    """The record fields to update for one worker event (``{}``: nothing to record).

    Step metrics come from the last stage (it holds the loss); boundary traffic from the
    stages on either side of it; evaluation from the last stage (every stage reports the same numbers).
    """
    kind = event.get("event")
    stage = event.get("stage")
    n = len(record.get("plan", {}).get("stages", [])) or 1
    last = stage == n - 1
    if kind == "step":
        metrics = _copy(record.get("metrics", {}))
        boundaries = metrics.setdefault("boundaries", {})
        secs = max(float(event.get("step_s") or 0.0), 1e-9)
        # a stage sends activations over the boundary after it, gradients over the one before
        if stage is not None and stage < n - 1:
            rates = boundaries.setdefault(str(stage), {"act_mb_s": 0.0, "grad_mb_s": 0.0})
            rates["act_mb_s"] = round((event.get("act_bytes") or 0) / secs / 1e6, 3)
        if stage is not None and 0 < stage < n:
            rates = boundaries.setdefault(str(stage - 1), {"act_mb_s": 0.0, "grad_mb_s": 0.0})
            rates["grad_mb_s"] = round((event.get("grad_bytes") or 0) / secs / 1e6, 3)
        out: dict[str, Any] = {"metrics": metrics}
        if last:
            metrics.update(
                step=event["step"] + 1,
                loss=event.get("loss"),
                tokens_per_s=event.get("tokens_per_s"),
                step_s=event.get("step_s"),
            )
            attempt = int(record.get("attempt", 0))
            losses = list(metrics.get("losses", []))[-499:]
            losses.append([attempt, event["step"], event.get("loss")])
            metrics["losses"] = losses
            out["step"] = event["step"] + 1
        return out
    if kind == "eval" and last:
        evaluation = _copy(record.get("evaluation", {}))
        evaluation[event["pass"]] = {
            k: event.get(k) for k in ("loss", "perplexity", "top1", "tokens")
        }
        return {"evaluation": evaluation}
    return {}


SNAPSHOTS_KEPT = 4
"""Snapshot steps remembered per stage (a copy may land after the next snapshot is taken)."""


def add_snapshot(snapshots: Mapping[str, Any], stage: int, step: int, node: str) -> dict[str, Any]:
    """``snapshots`` with ``node`` holding stage ``stage``'s snapshot after ``step`` steps.

    Shape: ``{stage: {"steps": {step: [node, ...]}}}`` (string keys: the table is JSON).
    """
    out = _copy(snapshots)
    steps = out.setdefault(str(stage), {}).setdefault("steps", {})
    holders = steps.setdefault(str(step), [])
    if node not in holders:
        holders.append(node)
    for old in sorted(steps, key=int)[:-SNAPSHOTS_KEPT]:
        del steps[old]
    return out


def snapshot_holders(record: Mapping[str, Any], stage: int, step: int) -> list[str]:
    entry = record.get("snapshots", {}).get(str(stage), {})
    return list(entry.get("steps", {}).get(str(step), []))


def resume_step(
    record: Mapping[str, Any], alive: frozenset[str] | set[str] | None = None, copies: int = 1
) -> int:
    """The newest step every stage has a snapshot of, held by at least ``copies`` nodes (live
    ones, when ``alive`` is given); 0 when there is none."""
    n = len(record.get("plan", {}).get("stages", []))
    snaps = record.get("snapshots", {})
    if not n:
        return 0
    common: set[str] | None = None
    for i in range(n):
        steps = {
            step
            for step, holders in snaps.get(str(i), {}).get("steps", {}).items()
            if len([h for h in holders if alive is None or h in alive]) >= copies
        }
        common = steps if common is None else common & steps
    return max((int(s) for s in common or ()), default=0)


def failure(
    *, stage: int, node: str, message: str, stderr_tail: Sequence[str] = ()
) -> dict[str, Any]:
    """The ``error`` of a FAILED job: the first error, where it happened."""
    return {
        "stage": stage,
        "node": node,
        "message": message,
        "stderr_tail": list(stderr_tail)[-STDERR_TAIL_LINES:],
    }


def exit_message(code: int | None) -> str:
    """What a worker's exit code says (a negative code is the signal it died of)."""
    import signal

    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exited with code {code}"


# --- views for the CLI ---------------------------------------------------------------------------


def job_view(entry: Mapping[str, Any]) -> dict[str, Any]:
    """`swarm jobs show ID --json`: one job's public shape."""
    record = entry.get("record", {})
    job = record.get("job", {})
    plan = record.get("plan") or {}
    return {
        "id": entry.get("job_id"),
        "name": record.get("name", job.get("name")),
        "state": "PENDING" if entry.get("state") == "submitted" else str(entry["state"]).upper(),
        "step": record.get("step", 0),
        "steps": job.get("train", {}).get("steps"),
        "attempt": record.get("attempt", 0),
        "plan": {
            "stages": [
                {
                    "node": s.get("node_id"),
                    "node_name": s.get("node"),
                    "devices": s.get("devices"),
                    "layers": s.get("layers"),
                }
                for s in plan.get("stages", [])
            ],
            "dtype": plan.get("dtype"),
            "finetune_mode": plan.get("finetune_mode"),
            "features": plan.get("features", []),
        },
        "history": record.get("history", []),
        "metrics": record.get("metrics", {}),
        "evaluation": record.get("evaluation", {}),
        "reason": record.get("reason"),
        "error": record.get("error"),
        "model": record.get("model"),
        "snapshots": record.get("snapshots", {}),
        "job": job,
    }


def eta_s(step: int, steps: int, step_s: float | None) -> float | None:
    if not step_s or step >= steps or not math.isfinite(step_s):
        return None
    return (steps - step) * step_s
