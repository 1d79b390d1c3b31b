"""The daemon's local API for jobs and models: submit (forwarded to the leader), live plan, jobs, job, cancel, logs, models,
export (gather a model's shards here, every file checked against its sha256). Every stage
name and file name read from the table is confined to its folder before it touches a path."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from swarmp2p._atomic import write_atomic
from swarmp2p.errors import Failed, SwarmError, UserError
from swarmp2p.node import requests as rq
from swarmp2p.node import views
from swarmp2p.node.api import ApiHandler
from swarmp2p.node.messages import ShardChunk, ShardRead, Submit
from swarmp2p.node.serving import model_files
from swarmp2p.node.table import registry
from swarmp2p.node.training import jobs
from swarmp2p.node.training.stages import CHUNK_BYTES, stage_log
from swarmp2p.paths import UnsafeName, confine
from swarmp2p.schema import Data, to_data

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext
    from swarmp2p.node.table.jobtable import JobEntry
    from swarmp2p.node.training.leader import JobsLeader
    from swarmp2p.node.training.stages import StageHost

LOG_BYTES = 256 * 1024
"""`swarm jobs logs` shows at most the last this many bytes of a stage's log."""


def handlers(ctx: NodeContext, leader: JobsLeader, stages: StageHost) -> dict[str, ApiHandler]:
    def entry(key: str) -> JobEntry:
        found = views.find_entry(ctx.table, key)
        if found is None:
            raise UserError(f"no job {key!r} in the table; see `swarm jobs`", code="no_job")
        return found

    async def submit(req: rq.SubmitRequest) -> dict[str, Data]:
        from swarmp2p.plan import JobError, parse_job

        try:
            job = parse_job(req.job)
        except JobError as exc:
            raise UserError(str(exc), code="invalid_job") from None
        job, inputs = await stages.inputs.submit(job, req.cwd)  # its files travel from here
        reply = await ctx.to_leader(
            Submit(job_id=req.job_id, job=job, submitted_by=req.submitted_by, inputs=inputs),
            15.0,
        )
        return {
            "job_id": reply.job_id,
            "term": reply.term,
            "version": reply.version,
            "replicas": reply.replicas,
        }

    async def live_plan(req: rq.LivePlanRequest) -> dict[str, Data]:
        from swarmp2p.plan import JobError, parse_job

        try:
            job = parse_job(req.job)
        except JobError as exc:
            raise UserError(str(exc), code="invalid_job") from None
        from swarmp2p.node.decide import available_memory
        from swarmp2p.node.training.resolve import resolve_model

        records = available_memory(ctx.live_records(), ctx.table)
        cluster = jobs.cluster_records(records)
        try:  # the shape as a submission from here would resolve it
            _, shape, _ = await asyncio.to_thread(
                resolve_model, job.model.pretrained, cwd=req.cwd, node_id=ctx.node_id
            )
            result = await asyncio.to_thread(jobs.compute_plan, job, cluster, shape=shape)
        except ValueError as exc:
            raise UserError(str(exc), code="invalid_job") from None
        out = result.to_dict()
        if out.get("reason"):
            out["reason"] = jobs.blocked_note(out["reason"], records)
        out["cluster"] = to_data(cluster)  # the planner's inputs, as every assigned peer gets them
        free = {n.node_id: n.disk_free for n in cluster}
        for s in out.get("stages", []):
            s["disk_free"] = free.get(s["node_id"], 0)
        return out

    async def list_jobs(req: rq.JobsRequest) -> list[dict[str, Data]]:
        return views.jobs_list(ctx.table, {j: leader.metrics.get(j) for j in ctx.table.jobs})

    async def show(req: rq.JobRequest) -> dict[str, Data]:
        e = entry(req.job_id)
        return views.job_view(e, await leader.job_metrics(e.job_id))

    async def cancel(req: rq.CancelRequest) -> dict[str, Data]:
        return await leader.cancel(entry(req.job_id).job_id)

    async def logs(req: rq.LogsRequest) -> dict[str, Data]:
        e = entry(req.job_id)
        if e.plan is None:
            raise UserError(
                f"job {e.job_id} was never placed: it has no stage logs", code="no_file"
            )
        n, replicas = e.n_stages, e.n_replicas
        stage = n - 1 if req.stage is None else req.stage
        if not 0 <= stage < n:
            raise UserError(f"'stage' must be in 0..{n - 1}, got {stage!r}", code="bad_field")
        if req.replica >= replicas:
            raise UserError(
                f"'replica' must be in 0..{replicas - 1}, got {req.replica!r}", code="bad_field"
            )
        node = e.plan.replica_stages(req.replica)[stage].node_id
        log_file = stage_log(req.replica, stage)
        data = await read_whole(ctx, node, e.job_id, log_file, tail=LOG_BYTES)
        return {
            "job_id": e.job_id,
            "stage": stage,
            **({"replica": req.replica} if replicas > 1 else {}),
            "node": node,
            "text": data.decode(errors="replace"),
        }

    async def models(req: rq.ModelsRequest) -> list[registry.ModelEntry]:
        return registry.models(ctx.table.jobs)

    async def export(req: rq.ExportRequest) -> dict[str, object]:
        model = registry.find_model(ctx.table.jobs, req.model)
        out = Path(req.dest)
        dirs = []
        for stage in model["manifest"]["stages"]:
            index = stage.get("stage")
            if type(index) is not int or index < 0:
                raise Failed(
                    f"model {model['id']}: a stage index {index!r} in the registry", code="internal"
                )
            target = confine(out, f"stage-{index}", what="stage folder")
            if target.exists():
                await asyncio.to_thread(shutil.rmtree, target)
            problems = []
            for node in registry.holders(stage):  # the trainer first, then its copies
                try:
                    await _gather_stage(ctx, model, stage, node, target)
                    break
                except SwarmError as exc:
                    problems.append(str(exc))
            else:
                raise Failed("; ".join(problems), code="no_file")
            dirs.append(str(target))
        out_view: dict[str, object] = {"model": model, "shards": dirs}
        job = ctx.table.jobs.get(str(model.get("job_id")))
        inputs = job.inputs if job is not None else None
        if inputs is not None and inputs.model.kind != "embedded":
            # the export rebuilds the whole model: its base's files, from wherever they are
            out_view["base_dir"] = await stages.inputs.model_folder(
                inputs.model, sorted(inputs.model.files), what=f"export of {model['id']}: its base"
            )
        return out_view

    return {
        "submit": submit,
        "live_plan": live_plan,
        "jobs": list_jobs,
        "job": show,
        "cancel": cancel,
        "logs": logs,
        "models": models,
        "export": export,
    }


async def _gather_stage(
    ctx: NodeContext,
    model: registry.ModelEntry,
    stage: registry.RegistryStage,
    node: str,
    dest: Path,
) -> None:
    """Copy one stage's shard from ``node`` into ``dest``, every file checked."""
    folder = stage.get("folder")
    files = stage.get("files")
    if not isinstance(folder, str) or not isinstance(files, dict):
        raise Failed(
            f"model {model['id']} stage {stage.get('stage')}: bad registry entry", code="internal"
        )
    try:
        targets = {
            rel: confine(dest, rel, what="shard file") for rel in ["manifest.json", *sorted(files)]
        }
    except UnsafeName as exc:
        raise Failed(f"model {model['id']}: {exc}", code="bad_field") from None
    for rel, target in targets.items():
        want = files.get(rel)
        # a file the registry lists no sha256 for (the manifest) is small; any must fit the disk
        room = await asyncio.to_thread(model_files.disk_room, dest)
        limit = room if want is not None else min(room, model_files.MAX_UNLISTED_BYTES)
        data = await read_whole(ctx, node, model["job_id"], f"{folder}/{rel}", limit=limit)
        if want is not None and hashlib.sha256(data).hexdigest() != want:
            raise Failed(
                f"model {model['id']} stage {stage['stage']}: {rel} from node {node} does not "
                "match its sha256; the shard is damaged",
                code="no_file",
            )
        await asyncio.to_thread(write_atomic, target, data)


async def read_whole(
    ctx: NodeContext, node: str, job_id: str, file: str, tail: int = 0, limit: int | None = None
) -> bytes:
    """A file of a job's folder on ``node`` (this one or a peer), over CURVE RPC in chunks;
    Failed, before a second chunk is asked for, when it has more than ``limit`` bytes (a
    ``tail`` reads only that many) or changes size while it is read."""
    offset, parts, total = 0, [], None
    while total is None or offset < total:
        msg = ShardRead(job_id=job_id, file=file, offset=offset, size=CHUNK_BYTES)
        try:
            reply = await ctx.call(node, msg, 30.0)
        except SwarmError as exc:
            raise Failed(
                f"cannot read {file} of job {job_id} from node {node}: {exc}", code="no_file"
            ) from None
        if not isinstance(reply, ShardChunk):
            raise Failed(f"node {node} answered {type(reply).TYPE} to a file read", code="internal")
        if total is None and limit is not None and min(reply.total, tail or reply.total) > limit:
            raise Failed(
                f"{file} of job {job_id} on node {node} has {reply.total} bytes, over the {limit} this node takes (the free disk, or a small file's cap); refused",
                code="no_file",
            )
        if total is None and tail and reply.total > tail:
            total, offset, parts = reply.total, reply.total - tail, []
            continue
        if total is not None and reply.total != total and not tail:  # a log may grow
            raise Failed(
                f"{file} of job {job_id} on node {node} changed size while read; try again",
                code="no_file",
            )
        total = reply.total
        parts.append(reply.data)
        offset += len(reply.data)
        if not reply.data:
            break
    return b"".join(parts)
