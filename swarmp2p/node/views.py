"""What `swarm status`, `swarm jobs` and the dashboard show: pure functions of the table, the
live view and the leader's metrics. No torch, no I/O."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from swarmp2p.node.cluster.membership import Peer
from swarmp2p.node.records import NodeRecord
from swarmp2p.node.table.jobtable import JobEntry, JobTable
from swarmp2p.plan.result import PlannedTiming
from swarmp2p.schema import Data, to_data


def entry_json(entry: JobEntry, metrics: Mapping[str, Data] | None = None) -> dict[str, Data]:
    """One job as `swarm status --json` lists it: ``{"job_id", "state", "version", "record"}``."""
    data = to_data(entry)
    record = {k: v for k, v in data.items() if k not in ("job_id", "state", "version")}
    record["kind"] = "train"
    record["name"] = entry.name
    record["metrics"] = dict(metrics or {})
    if entry.plan is not None:
        record["plan"] = entry.plan.to_dict()
    return {
        "job_id": entry.job_id,
        "state": entry.state,
        "version": entry.version,
        "record": record,
    }


def job_view(entry: JobEntry, metrics: Mapping[str, Data] | None = None) -> dict[str, Data]:
    """`swarm jobs show ID --json`: one job's public shape."""
    plan = entry.plan
    timing = plan.timing if plan is not None else None
    metrics = dict(metrics or {})
    metrics.setdefault("step", entry.step)
    if entry.loss is not None:
        metrics.setdefault("loss", entry.loss)
    view = {
        "id": entry.job_id,
        "name": entry.name,
        "state": entry.state.upper(),
        "step": max(entry.step, metrics.get("step") or 0),
        "steps": entry.job.train.steps,
        "attempt": entry.attempt,
        "plan": {
            "stages": [
                {
                    "node": s.node_id,
                    "node_name": s.node,
                    "devices": list(s.devices),
                    "layers": list(s.layers),
                    **_predicted_vs_measured(timing, metrics, i),
                }
                for i, s in enumerate(plan.stages if plan is not None else ())
            ],
            "predicted_step_s": timing.step_s if timing is not None else None,
            "bottleneck": timing.bottleneck if timing is not None else None,
            "dtype": plan.dtype if plan is not None else None,
            "schedule": plan.schedule.kind if plan is not None else None,
            "finetune_mode": plan.finetune_mode if plan is not None else None,
            "features": list(plan.features) if plan is not None else [],
        },
        "history": [to_data(h) for h in entry.history],
        "metrics": metrics,
        "evaluation": dict(entry.evaluation),
        "reason": entry.reason,
        "error": to_data(entry.error) if entry.error is not None else None,
        "model": entry.model,
        "snapshots": to_data(entry.snapshots),
        "job": entry.job.to_dict(),
        "rebalances": entry.rebalances,
    }
    if plan is not None and plan.n_replicas > 1:
        view["plan"]["replicas"] = replicas_view(entry, metrics)  # type: ignore[index]
        view["plan"]["sync"] = to_data(entry.job.train.sync)  # type: ignore[index]
    return view


def replicas_view(entry: JobEntry, metrics: Mapping[str, Data]) -> list[dict[str, Data]]:
    """A replicated job's replicas (`swarm jobs show`): each one's stages (node, devices,
    layers, compute and sync per step, done), its own step, loss and tokens/s, and its
    held-out losses (equal replicas score the same)."""
    plan = entry.plan
    assert plan is not None
    out: list[dict[str, Data]] = []
    for r in range(plan.n_replicas):
        got = ((metrics.get("replicas") or {}).get(str(r))) or {}
        timing = plan.timing if r == 0 else plan.replicas[r - 1].timing
        stages = []
        for i, s in enumerate(plan.replica_stages(r)):
            measured = (got.get("stages") or {}).get(str(i)) or {}
            stages.append(
                {
                    "node": s.node_id,
                    "node_name": s.node,
                    "devices": list(s.devices),
                    "layers": list(s.layers),
                    **_predicted_vs_measured(timing, got, i),
                    "sync_bytes": measured.get("sync_bytes"),
                    "sync_s": measured.get("sync_s"),
                    "done": r * entry.n_stages + i in entry.done_stages,
                }
            )
        out.append(
            {
                "replica": r,
                "stages": stages,
                **{k: got.get(k) for k in ("step", "loss", "tokens_per_s", "steady_tokens_per_s")},
                "evaluation": dict(got.get("evaluation") or {}),
            }
        )
    return out


def _predicted_vs_measured(
    timing: PlannedTiming | None, metrics: Mapping[str, Data], i: int
) -> dict[str, Data]:
    """Stage i's predicted compute seconds per step (the plan's; None without a measured
    speed) beside the newest measured ones (forward + backward + optimizer) and its waits."""
    predicted = None
    if timing is not None and i < len(timing.stages):
        predicted = timing.stages[i].compute_s
    got = (metrics.get("stages") or {}).get(str(i)) or {}
    parts = [got.get(k) for k in ("forward_s", "backward_s", "optimizer_s")]
    measured = round(sum(parts), 6) if all(isinstance(p, (int, float)) for p in parts) else None
    return {"predicted_s": predicted, "measured_s": measured, "wait_s": got.get("wait_s")}


def jobs_list(table: JobTable, metrics: Mapping[str, Mapping[str, Data]]) -> list[dict[str, Data]]:
    """`swarm jobs --json`: every job, oldest first."""
    entries = sorted(
        table.jobs.values(), key=lambda e: (e.history[0].at if e.history else 0, e.job_id)
    )
    return [job_view(e, metrics.get(e.job_id)) for e in entries]


def find_entry(table: JobTable, key: str) -> JobEntry | None:
    """A job by id, or by name when exactly one job has it."""
    if key in table.jobs:
        return table.jobs[key]
    named = [e for e in table.jobs.values() if e.name == key]
    return named[0] if len(named) == 1 else None


def devices(record: NodeRecord) -> list[dict[str, Data]]:
    """A node's devices as `swarm peers --json` lists them (``speed`` None: never measured)."""
    return [
        {
            "kind": d.kind,
            "index": d.index,
            "name": d.name,
            "memory_total": d.memory_total,
            "memory_free": d.memory_free,
            "compute_capability": d.compute_capability,
            "speed": d.speed.to_data() or None,
            "fake": record.is_fake(d),
        }
        for d in record.node.devices
    ]


def peer_rows(
    *,
    me: dict[str, Data],
    peers: Sequence[Peer],
    leader: str,
    now: float,
    skews: Mapping[str, float],
) -> list[dict[str, Data]]:
    """This node first, then every peer in its view, as `swarm peers --json` lists them."""
    rows = [me]
    for peer in sorted(peers, key=lambda p: p.node_id):
        skew = skews.get(peer.node_id)
        rows.append(
            {
                "node_id": peer.node_id,
                "name": peer.name,
                "address": peer.endpoint.removeprefix("tcp://"),
                "alive": peer.alive,
                "is_leader": peer.alive and peer.node_id == leader,
                "last_seen_s": round(now - peer.last_seen, 3),
                "clock_skew_s": None if skew is None or not math.isfinite(skew) else round(skew, 4),
                "host": to_data(peer.host),
                "devices": devices(peer.record),
                "version": peer.record.node.version or peer.software,
                "capabilities": sorted(peer.record.node.capabilities),
            }
        )
    return rows


def eta_s(step: int, steps: int, step_s: float | None) -> float | None:
    """Seconds left at ``step_s`` per step; None when unknown or done."""
    if not step_s or step >= steps or not math.isfinite(step_s):
        return None
    return (steps - step) * step_s


__all__ = [
    "devices",
    "entry_json",
    "eta_s",
    "find_entry",
    "job_view",
    "jobs_list",
    "peer_rows",
    "replicas_view",
]
