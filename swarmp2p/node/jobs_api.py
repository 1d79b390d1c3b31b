"""The daemon's local API for jobs and models: live plan, jobs, job, cancel, logs, models,
export (gather a model's shards here, every file checked against its sha256)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmp2p._atomic import write_atomic
from swarmp2p.net.rpc import RpcError, RpcTimeout
from swarmp2p.node import jobs, registry
from swarmp2p.node.api import ApiError
from swarmp2p.node.messages import ShardChunk, ShardRead
from swarmp2p.node.stages import CHUNK_BYTES

if TYPE_CHECKING:
    from swarmp2p.node.daemon import Daemon

LOG_BYTES = 256 * 1024
"""`swarm jobs logs` shows at most the last this many bytes of a stage's log."""


def handlers(d: Daemon) -> dict[str, Any]:
    def entry(req: dict[str, Any]) -> dict[str, Any]:
        job_id = req.get("job_id")
        if not isinstance(job_id, str) or not job_id:
            raise ValueError("'job_id' must be a non-empty string")
        found = d.table.jobs.get(job_id)
        if found is None:
            by_name = [e for e in d.table.jobs.values() if e["record"].get("name") == job_id]
            if len(by_name) != 1:
                raise ApiError(f"no job {job_id!r} in the table; see `swarm jobs`")
            found = by_name[0]
        return jobs._copy(found)

    async def live_plan(req: dict[str, Any]) -> dict[str, Any]:
        cluster = d.jobs._cluster()
        try:
            result = jobs.compute_plan(req["job"], cluster)
        except ValueError as exc:
            raise ApiError(str(exc)) from None
        out = result.to_dict()
        if out.get("reason"):
            out["reason"] = jobs.blocked_note(out["reason"], d.jobs._records())
        out["cluster"] = cluster  # the planner's inputs, as every assigned peer gets them
        free = {r["node_id"]: r.get("disk_free", 0) for r in cluster}
        for s in out.get("stages", []):
            s["disk_free"] = free.get(s["node_id"], 0)
        return out

    async def list_jobs(req: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            jobs.job_view(jobs._copy(e))
            for _, e in sorted(d.table.jobs.items(), key=lambda kv: kv[1].get("version", 0))
            if jobs.is_training(e)
        ]

    async def show(req: dict[str, Any]) -> dict[str, Any]:
        return jobs.job_view(entry(req))

    async def cancel(req: dict[str, Any]) -> dict[str, Any]:
        job_id = entry(req)["job_id"]
        try:
            return await d.jobs.cancel(job_id)
        except (RpcError, RpcTimeout) as exc:
            raise ApiError(str(exc)) from None

    async def logs(req: dict[str, Any]) -> dict[str, Any]:
        e = entry(req)
        stages = e["record"].get("plan", {}).get("stages", [])
        if not stages:
            raise ApiError(f"job {e['job_id']} was never placed: it has no stage logs")
        stage = req.get("stage", len(stages) - 1)
        if not isinstance(stage, int) or not 0 <= stage < len(stages):
            raise ValueError(f"'stage' must be in 0..{len(stages) - 1}, got {stage!r}")
        node = stages[stage]["node_id"]
        data = await _read_whole(d, node, e["job_id"], f"stage-{stage}.log", tail=LOG_BYTES)
        return {"job_id": e["job_id"], "stage": stage, "node": node, "text": data.decode(errors="replace")}  # fmt: skip

    async def models(req: dict[str, Any]) -> list[dict[str, Any]]:
        return registry.models(d.table.jobs)

    async def export(req: dict[str, Any]) -> dict[str, Any]:
        try:
            model = registry.find_model(d.table.jobs, req["model"])
        except ValueError as exc:
            raise ApiError(str(exc)) from None
        out = Path(req["dest"])
        dirs = []
        for stage in model["manifest"]["stages"]:
            dest = out / f"stage-{stage['stage']}"
            if dest.exists():
                shutil.rmtree(dest)
            problems = []
            for node in registry.holders(stage):  # the trainer first, then its copies
                try:
                    await _gather_stage(d, model, stage, node, dest)
                    break
                except ApiError as exc:
                    problems.append(str(exc))
            else:
                raise ApiError("; ".join(problems))
            dirs.append(str(dest))
        return {"model": model, "shards": dirs}

    return {
        "live_plan": live_plan,
        "jobs": list_jobs,
        "job": show,
        "cancel": cancel,
        "logs": logs,
        "models": models,
        "export": export,
    }


async def _gather_stage(
    d: Daemon, model: dict[str, Any], stage: dict[str, Any], node: str, dest: Path
) -> None:
    """Copy one stage's shard from ``node`` into ``dest``, every file checked."""
    for rel in ["manifest.json", *sorted(stage["files"])]:
        data = await _read_whole(d, node, model["job_id"], f"{stage['folder']}/{rel}")
        want = stage["files"].get(rel)
        if want is not None and hashlib.sha256(data).hexdigest() != want:
            raise ApiError(
                f"model {model['id']} stage {stage['stage']}: {rel} from node {node} does not "
                "match its sha256; the shard is damaged"
            )
        _write_atomic(dest / rel, data)


def _write_atomic(path: Path, data: bytes) -> None:
    write_atomic(path, data)


async def _read_whole(d: Daemon, node: str, job_id: str, file: str, tail: int = 0) -> bytes:
    """A file of a job's folder on ``node`` (this one or a peer), over CURVE RPC in chunks."""
    offset, parts, total = 0, [], None
    while total is None or offset < total:
        msg = ShardRead(job_id=job_id, file=file, offset=offset, size=CHUNK_BYTES)
        try:
            reply = await d.jobs._send(node, msg, 30.0)
        except (RpcError, RpcTimeout) as exc:
            raise ApiError(f"cannot read {file} of job {job_id} from node {node}: {exc}") from None
        if not isinstance(reply, ShardChunk):
            raise ApiError(f"node {node} answered {type(reply).TYPE} to a file read")
        if total is None and tail and reply.total > tail:
            total, offset, parts = reply.total, reply.total - tail, []
            continue
        total = reply.total
        parts.append(reply.data)
        offset += len(reply.data)
        if not reply.data:
            break
    return b"".join(parts)
