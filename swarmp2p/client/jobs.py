"""What the `swarm train/plan/jobs/job/cancel/logs/models/export/serve` commands do: each
asks the local daemon over its API socket (`node/api.py`); the CLI only parses and prints."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from swarmp2p.node import api
from swarmp2p.node import requests as rq
from swarmp2p.node.state import StateDir
from swarmp2p.timings import TIMINGS


def submit_job(
    state_dir: Path, job: dict[str, Any], job_id: str = "", timeout: float = 20.0
) -> dict[str, Any]:
    """Submit a job (job.json, as a dict) through the local daemon (forwarded to the leader);
    returns once a majority of the members hold it. Retries while no leader is ready (an
    ``unavailable`` refusal); a refusal of the job itself is raised at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            req = rq.SubmitRequest(
                job=job,
                job_id=job_id,
                submitted_by="cli",
                cwd=os.getcwd(),  # relative model and data paths are the CLI's
            )
            return api.send(StateDir(root=state_dir).api_socket, req, timeout=timeout)
        except api.ApiError as exc:
            wait = exc.kind == "unavailable" and exc.code not in ("no_daemon", "no_quorum")
            if not wait or time.monotonic() > deadline:  # a partition does not heal in seconds
                raise
            time.sleep(0.2)


JOB_FINAL = ("COMPLETED", "FAILED", "CANCELLED")


def _send(state_dir: Path, req: rq.ApiRequest, timeout: float = 10.0) -> Any:
    return api.send(StateDir(root=state_dir).api_socket, req, timeout=timeout)


def load_train_job(path: str, overrides: dict[str, Any]):
    """A parsed Job from JOB.json with the `swarm train` flags applied; JobError lists every
    problem with its field path."""
    from swarmp2p.node.training.jobs import apply_overrides
    from swarmp2p.plan import JobError, parse_job
    from swarmp2p.schema import read_json

    data = read_json(path, JobError)
    if json_depth(data, MAX_JOB_DEPTH) > MAX_JOB_DEPTH:
        raise _too_deep(path)
    return parse_job(apply_overrides(data, overrides))


def _too_deep(path: str):
    from swarmp2p.plan import FieldError, JobError

    message = f"nested deeper than {MAX_JOB_DEPTH} levels; a job.json is a few levels deep"
    return JobError([FieldError(path=str(path), message=message)])


MAX_JOB_DEPTH = 32
"""Levels of nesting a job.json may have (it needs about 4): deeper input is refused before
any recursive code (validation, copies, msgpack) walks it."""


def json_depth(value: Any, stop: int) -> int:
    """The nesting depth of decoded JSON (a scalar is 0), counted without recursion; stops
    counting past ``stop``."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > stop:
                return depth
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def live_plan(state_dir: Path, job) -> dict[str, Any]:
    """The plan the leader would make now over the live nodes (each stage with its node's
    free disk beside its download share); nothing is submitted."""
    return _send(state_dir, rq.LivePlanRequest(job=job.to_dict(), cwd=os.getcwd()))


def submit_train(state_dir: Path, job) -> dict[str, Any]:
    """Submit a parsed training Job; returns ``{"job_id", ...}`` once durable."""
    return submit_job(state_dir, job.to_dict())


def jobs(state_dir: Path) -> list[dict[str, Any]]:
    return _send(state_dir, rq.JobsRequest())


def job(state_dir: Path, job_id: str) -> dict[str, Any]:
    return _send(state_dir, rq.JobRequest(job_id=job_id))


def cancel_job(state_dir: Path, job_id: str) -> dict[str, Any]:
    return _send(state_dir, rq.CancelRequest(job_id=job_id), timeout=30.0)


def job_logs(state_dir: Path, job_id: str, stage: int | None, replica: int = 0) -> dict[str, Any]:
    req = rq.LogsRequest(job_id=job_id, stage=stage, replica=replica)
    return _send(state_dir, req, timeout=30.0)


def models(state_dir: Path) -> list[dict[str, Any]]:
    return _send(state_dir, rq.ModelsRequest())


def export_model(
    state_dir: Path, model_id: str, out: Path, file_mode: int = 0o644
) -> dict[str, Any]:
    """Gather a model's shards over the swarm (sha256-checked) and write a Hugging Face folder
    in ``out`` (`runtime.torch.export.write_export`): the merged model, or (adapters export) a
    PEFT adapter naming its base by Hub id; files ``file_mode``. Imports the torch runtime
    (only here, never in the daemon): ModuleNotFoundError where it is missing."""
    import shutil

    out = Path(out).resolve()
    shards = out / ".shards"
    got = _send(state_dir, rq.ExportRequest(model=model_id, dest=str(shards)), timeout=600.0)
    from swarmp2p.runtime.torch.train.export import write_export

    done = write_export(
        got["model"], got["shards"], out, file_mode=file_mode, base_dir=got.get("base_dir")
    )
    shutil.rmtree(shards)
    return {**done, "model": model_id}


def _loss(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "-"


def format_jobs(rows: list[dict[str, Any]]) -> str:
    """The jobs as a table: TRAIN LOSS is the last training step's (one batch), HELD-OUT the
    trained model's loss on the held-out split once the job evaluated it (`swarm models`)."""
    table = [("ID", "NAME", "STATE", "STEP", "STAGES", "TRAIN LOSS", "HELD-OUT")]
    for j in rows:
        loss = j["metrics"].get("loss")
        held_out = ((j.get("evaluation") or {}).get("trained") or {}).get("loss")
        table.append(
            (
                j["id"],
                j["name"] or "",
                j["state"],
                f"{j['step']}/{j['steps']}",
                ",".join(s["node"] for s in j["plan"]["stages"]) or "-",
                _loss(loss),
                _loss(held_out),
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table)


def format_models(rows: list[dict[str, Any]]) -> str:
    """A line per trained model; its loss is the held-out split's (the training steps' loss is
    `swarm jobs`' TRAIN LOSS), beside the base model's on the same split when measured."""
    lines = []
    for m in rows:
        passes = m["manifest"]["evaluation"]
        loss, base = (passes.get(p, {}).get("loss") for p in ("trained", "base"))
        held_out = ""
        if isinstance(loss, (int, float)):
            held_out = f"held-out loss {loss:.4f}" + (
                f" (base model {base:.4f})" if isinstance(base, (int, float)) else ""
            )
        lines.append(
            f"{m['id']}  job {m['job_id']}  base {m['base']}  "
            f"{len(m['manifest']['stages'])} stage(s)  {held_out}".rstrip()
        )
    return "\n".join(lines)


def serve(state_dir: Path, request: dict[str, Any]) -> dict[str, Any]:
    """Ask the local daemon to serve a model across the swarm; its ``{"model", "url",
    "stages", ...}`` once every stage serves and the HTTP API listens."""
    return _send(state_dir, rq.ServeStartRequest(request=request), TIMINGS.serve_start_s)


def serve_stop(state_dir: Path, model: str) -> dict[str, Any]:
    return _send(state_dir, rq.ServeStopRequest(model=model), timeout=60.0)


def served(state_dir: Path) -> list[dict[str, Any]]:
    return _send(state_dir, rq.ServedRequest())


def serve_endpoint(state_dir: Path, model: str) -> dict[str, Any]:
    """``{"model", "url", "api_key"}`` of a model the local daemon serves."""
    return _send(state_dir, rq.ServeEndpointRequest(model=model))
