"""What the dashboard shows, as plain data: a pure function of the daemon's status.

The browser polls :func:`dashboard_view` as JSON. Jobs come from the replicated job table;
their records are opaque to the daemon, so this reads them defensively:

- ``record["plan"]``: a ``Plan.to_dict()`` (stages with ``node_id``, ``node``, ``devices``,
  ``layers``) -- drawn as stages over nodes;
- ``record["metrics"]``: a list of ``{"step", "loss", "tokens_per_s"}`` points (either value
  may be null; ``step`` as "step N of M" counts, 1 the first), or the training dispatcher's
  map (``losses`` as ``[attempt, step, loss(, tokens_per_s)]`` rows with ``step`` from 0 as
  the workers count, the newest ``step`` (steps done)/``loss``/``tokens_per_s``, and
  per-boundary ``boundaries`` traffic) -- drawn as loss and throughput curves over the step
  numbers "step N of M" shows (a row's step + 1); bad points are counted;
- ``record["evaluation"]`` (or ``"eval"``): a map of name -> number, a list of such maps, or
  a map of pass name -> such a map;
- ``record["step"]``, ``record["job"]["train"]["steps"]``, ``record["attempt"]`` and
  ``record["error"]["message"]`` when present;
- served models: ``status["served"]`` (a list of ``{"model", "url", "state", "reason",
  "stages", "sessions"}``, ``sessions`` as ``{"active", "max", "queued", "speculation",
  "prefix_cache"}`` or null: the last two as ``speculation_view``/``prefix_cache_view``) and jobs
  whose record has ``"kind": "serve"``.

Stages name their node by the name the peers list gives it (``status["peers"]``), so served
models and jobs say ``host-a`` alike; the node id only where no name is known.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

VIEW_FORMAT = 1
MAX_POINTS = 2000
"""Most metric points sent per job (the newest are kept)."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _fraction_used(total: Any, free: Any) -> float | None:
    total, free = _number(total), _number(free)
    if total is None or free is None or total <= 0:
        return None
    return round(min(max((total - free) / total, 0.0), 1.0), 4)


def device_view(device: Mapping[str, Any]) -> dict[str, Any]:
    """One device with its memory use as a fraction in [0, 1] (None when unknown)."""
    kind, index = device.get("kind") or "?", device.get("index")
    return {
        "label": f"{kind}:{index}" if index is not None else str(kind),
        "kind": kind,
        "name": device.get("name") or "",
        "memory_total": device.get("memory_total"),
        "memory_free": device.get("memory_free"),
        "memory_used_fraction": _fraction_used(
            device.get("memory_total"), device.get("memory_free")
        ),
        "compute_capability": device.get("compute_capability") or "",
        "fake": bool(device.get("fake", False)),
    }


def node_view(peer: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "node_id": peer.get("node_id", ""),
        "name": peer.get("name", ""),
        "address": peer.get("address", ""),
        "alive": bool(peer.get("alive", False)),
        "is_leader": bool(peer.get("is_leader", False)),
        "last_seen_s": _number(peer.get("last_seen_s")),
        "clock_skew_s": _number(peer.get("clock_skew_s")),
        "devices": [device_view(d) for d in peer.get("devices") or [] if isinstance(d, Mapping)],
    }


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _dispatcher_points(raw: Mapping[str, Any]) -> list[Any]:
    """The dispatcher's metrics map as a list of point dicts (later attempts last), each
    row's 0-based step as the step number it completes (row step 0 is "step 1")."""
    items: list[Any] = []
    for row in raw.get("losses") or []:
        if isinstance(row, (list, tuple)) and len(row) in (3, 4) and _count(row[1]) is not None:
            items.append(
                {
                    "step": row[1] + 1,
                    "loss": row[2],
                    "tokens_per_s": row[3] if len(row) == 4 else None,
                }
            )
        else:
            items.append(row)  # counted as bad
    step = raw.get("step")
    if (_count(step) or 0) > 0:
        newest = {"step": step, "loss": raw.get("loss"), "tokens_per_s": raw.get("tokens_per_s")}
        same = [p for p in items if isinstance(p, dict) and p.get("step") == step]
        if same:  # the newest row lacks throughput: take it from the newest step's fields
            if same[-1]["tokens_per_s"] is None:
                same[-1]["tokens_per_s"] = newest["tokens_per_s"]
        elif _number(newest["loss"]) is not None or _number(newest["tokens_per_s"]) is not None:
            items.append(newest)
    return items


def metric_points(raw: Any) -> tuple[list[dict[str, Any]], int]:
    """Valid ``{"step", "loss", "tokens_per_s"}`` points sorted by step (newest
    ``MAX_POINTS``), and how many entries were not valid points."""
    if isinstance(raw, Mapping):
        raw = _dispatcher_points(raw)
    if not isinstance(raw, list):
        return [], 0 if raw is None else 1
    points, bad = {}, 0
    for item in raw:
        step = item.get("step") if isinstance(item, Mapping) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            bad += 1
            continue
        loss, tps = _number(item.get("loss")), _number(item.get("tokens_per_s"))
        if loss is None and tps is None:
            bad += 1
            continue
        points[step] = {"step": step, "loss": loss, "tokens_per_s": tps}  # a repeat step: last wins
    ordered = [points[s] for s in sorted(points)]
    return ordered[-MAX_POINTS:], bad


def stage_views(plan: Any, names: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """A plan's stages as ``{"index", "node_id", "node", "devices", "layers"}``, ``node`` the
    node's name: from ``names`` (node id -> name, the peers'), else the stage's ``node_name``
    or ``node``, else its node id."""
    if not isinstance(plan, Mapping) or not isinstance(plan.get("stages"), list):
        return []
    stages = []
    for i, stage in enumerate(plan["stages"]):
        if not isinstance(stage, Mapping):
            continue
        layers = stage.get("layers")
        if not (
            isinstance(layers, list)
            and len(layers) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
        ):
            layers = None
        node_id = str(stage.get("node_id", ""))
        known = (names or {}).get(node_id) or stage.get("node_name") or stage.get("node")
        stages.append(
            {
                "index": stage.get("index", i),
                "node_id": node_id,
                "node": str(known or node_id),
                "devices": [str(d) for d in stage.get("devices") or []],
                "layers": layers,
            }
        )
    return stages


def evaluation_rows(raw: Any) -> list[dict[str, Any]]:
    """Evaluation results as a list of flat rows of scalars (a map becomes one row; a map of
    pass name -> map becomes one row per pass, its name under ``"pass"``)."""
    if isinstance(raw, Mapping) and raw and all(isinstance(v, Mapping) for v in raw.values()):
        raw = [{"pass": str(k), **v} for k, v in raw.items()]
    items = [raw] if isinstance(raw, Mapping) else raw if isinstance(raw, list) else []
    rows = []
    for item in items:
        if isinstance(item, Mapping):
            row = {
                str(k): v
                for k, v in item.items()
                if isinstance(v, (str, int, float, bool)) or v is None
            }
            if row:
                rows.append(row)
    return rows


def job_view(job: Mapping[str, Any], names: Mapping[str, str] | None = None) -> dict[str, Any]:
    record = job.get("record") if isinstance(job.get("record"), Mapping) else {}
    points, bad = metric_points(record.get("metrics"))
    plan = record.get("plan")
    name = record.get("name")
    if not isinstance(name, str):
        inner = record.get("job")
        name = inner.get("name", "") if isinstance(inner, Mapping) else ""
    reason = record.get("reason") or ""
    error = record.get("error")
    if isinstance(error, Mapping):
        where = f"stage {error.get('stage')} on {error.get('node')}: " if "stage" in error else ""
        error = f"{where}{error.get('message', '')}"
    inner = record.get("job") if isinstance(record.get("job"), Mapping) else {}
    steps = inner.get("train", {}).get("steps") if isinstance(inner.get("train"), Mapping) else None
    metrics = record.get("metrics")
    raw_boundaries = metrics.get("boundaries") if isinstance(metrics, Mapping) else None
    boundaries = [
        {
            "stage": str(k),
            "act_mb_s": _number(v.get("act_mb_s")),
            "grad_mb_s": _number(v.get("grad_mb_s")),
        }
        for k, v in sorted((raw_boundaries or {}).items())
        if isinstance(v, Mapping)
    ]
    return {
        "job_id": job.get("job_id", ""),
        "state": job.get("state", ""),
        "version": job.get("version"),
        "name": name if isinstance(name, str) else "",
        "kind": str(record.get("kind") or ""),
        "reason": reason if isinstance(reason, str) else "",
        "error": error if isinstance(error, str) else "",
        "step": record.get("step") if isinstance(record.get("step"), int) else None,
        "steps": steps if isinstance(steps, int) else None,
        "attempt": record.get("attempt") if isinstance(record.get("attempt"), int) else None,
        "boundaries": boundaries,
        "dtype": plan.get("dtype") if isinstance(plan, Mapping) else None,
        "stages": stage_views(plan, names),
        "metrics": points,
        "bad_metrics": bad,
        "evaluation": evaluation_rows(record.get("evaluation", record.get("eval"))),
    }


def sessions_view(raw: Any) -> dict[str, int] | None:
    """A served model's sessions now, ``{"active", "max", "queued"}`` (None when unknown:
    before its ring runs, or malformed)."""
    if not isinstance(raw, Mapping):
        return None
    view = {k: _count(raw.get(k)) for k in ("active", "max", "queued")}
    if any(v is None for v in view.values()):
        return None
    return {
        **view,
        "speculation": speculation_view(raw),
        "prefix_cache": prefix_cache_view(raw.get("prefix_cache")),
    }


def speculation_view(raw: Mapping[str, Any]) -> dict[str, Any] | None:
    """A served model's speculative decoding: ``{"mode", "off", "laps", "drafted",
    "acceptance", "tokens_per_lap"}`` (``off``: why a stage declined; None: not asked)."""
    mode = raw.get("speculate")
    if not isinstance(mode, str) or not mode or mode == "none":
        return None
    stats = raw.get("speculation") if isinstance(raw.get("speculation"), Mapping) else {}
    return {
        "mode": mode,
        "off": str(raw.get("speculate_off") or ""),
        "laps": _count(stats.get("laps")) or 0,
        "drafted": _count(stats.get("drafted")) or 0,
        "acceptance": _rate(stats.get("acceptance")),
        "tokens_per_lap": _rate(stats.get("tokens_per_lap"), top=1e6),
    }


def prefix_cache_view(raw: Any) -> dict[str, Any] | None:
    """A served model's prefix cache: ``{"blocks", "capacity", "lookups", "hits", "hit_rate",
    "reused_tokens"}`` (None: off)."""
    if not isinstance(raw, Mapping):
        return None
    view = {
        k: _count(raw.get(k)) or 0
        for k in ("blocks", "capacity", "lookups", "hits", "reused_tokens")
    }
    return {**view, "hit_rate": _rate(raw.get("hit_rate"))}


def _rate(value: Any, top: float = 1.0) -> float:
    """A finite number in [0, top] (0 for anything else)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= top:
        return 0.0
    return float(value)


def _served(model: str, **fields: Any) -> dict[str, Any]:
    base = {"url": "", "state": "", "reason": "", "stages": [], "sessions": None, "job_id": ""}
    return {"model": model, **base, **fields}


def served_views(
    status: Mapping[str, Any], jobs: list[dict[str, Any]], names: Mapping[str, str]
) -> list[dict[str, Any]]:
    served = []
    for item in status.get("served") or []:
        if isinstance(item, Mapping) and item.get("model"):
            served.append(
                _served(
                    str(item["model"]),
                    url=str(item.get("url") or ""),
                    state=str(item.get("state") or ""),
                    reason=str(item.get("reason") or ""),
                    stages=stage_views({"stages": item.get("stages") or []}, names),
                    sessions=sessions_view(item.get("sessions")),
                    job_id=str(item.get("job_id") or ""),
                )
            )
    listed = {m["model"] for m in served}
    for job in jobs:  # a serve job this node does not answer for (its API is elsewhere)
        if job["kind"] == "serve" and job["state"] == "running" and job["name"] not in listed:
            served.append(
                _served(job["name"], state="running", stages=job["stages"], job_id=job["job_id"])
            )
    return served


def dashboard_view(status: Mapping[str, Any], *, now: float) -> dict[str, Any]:
    """The JSON the dashboard page polls, from ``Daemon.status()``; ``now`` is wall time."""
    nodes = [node_view(p) for p in status.get("peers") or [] if isinstance(p, Mapping)]
    names = {n["node_id"]: n["name"] for n in nodes if n["name"] and isinstance(n["name"], str)}
    jobs = [job_view(j, names) for j in status.get("jobs") or [] if isinstance(j, Mapping)]
    return {
        "format": VIEW_FORMAT,
        "generated_at": now,
        "node_id": status.get("node_id", ""),
        "name": status.get("name", ""),
        "swarm_id": status.get("swarm_id", ""),
        "version": status.get("version", ""),
        "leader": status.get("leader", ""),
        "leader_ready": bool(status.get("leader_ready", False)),
        "term": status.get("term"),
        "table_version": status.get("table_version"),
        "nodes": nodes,
        "alive": sum(n["alive"] for n in nodes),
        "jobs": jobs,
        "served": served_views(status, jobs, names),
    }
