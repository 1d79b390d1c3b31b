"""The leader starts an attempt's stages: every stage's node prepares (checks the plan, fetches
its files) at once, then the workers start replica by replica, each replica's stages last to
first. Never imports torch.

Each ``job.stage_start`` is answered once the worker bound its links (``job.stage_ready``):
the stage before dials the port it names. With replicas (``split.replicas``) each stage's
members form a ring: replica 0 starts first and its member of stage i binds both of that
ring's ends; replica r dials replica r - 1's bound end (``ring_prev``) and binds its own for
replica r + 1, and the last replica closes the ring on replica 0's other end (``ring_next``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from swarmp2p.errors import SwarmError
from swarmp2p.net.rpc import RpcError
from swarmp2p.node.messages import StageReady, StageStart
from swarmp2p.node.table import events as ev
from swarmp2p.node.table.jobtable import JobEntry
from swarmp2p.node.training import jobs

if TYPE_CHECKING:
    from swarmp2p.node.training.leader import JobsLeader


def stage_start(
    leader: JobsLeader,
    entry: JobEntry,
    attempt: int,
    i: int,
    nxt: str,
    prepare: bool,
    replica: int = 0,
    ring: tuple[str, str] = ("", ""),
) -> StageStart:
    """Stage ``i`` of replica ``replica``'s start message (``ring``: the ring ends it dials,
    (next, prev); empty: it binds them)."""
    assert entry.plan is not None
    resume = entry.resume_step
    return StageStart(
        job_id=entry.job_id,
        attempt=attempt,
        stage=i,
        job=entry.job,
        cluster=entry.cluster,
        plan=entry.plan,
        next=nxt,
        resume_step=resume,
        snapshot_nodes=jobs.snapshot_holders(entry, i, resume)
        if resume and not entry.resplit
        else [],
        leader=leader.ctx.node_id,
        inputs=entry.inputs,
        prepare=prepare,
        resplit=entry.resplit or None,
        cuts=list(entry.cuts) or None,
        replica=replica,
        ring_next=ring[0],
        ring_prev=ring[1],
    )


def slots(entry: JobEntry) -> list[tuple[int, int, str]]:
    """(replica, stage, node) of every stage of every replica, replica by replica."""
    assert entry.plan is not None
    return [
        (r, i, s.node_id)
        for r in range(entry.plan.n_replicas)
        for i, s in enumerate(entry.plan.replica_stages(r))
    ]


def _where(replica: int, stage: int) -> str:
    return f"replica {replica} " if replica else ""


async def prepare(leader: JobsLeader, job_id: str, attempt: int) -> bool:
    """Every stage's node checks the plan and fetches its files, all at once; False (the
    job failed, naming the node and the file) when one cannot."""
    ctx = leader.ctx
    entry = ctx.table.jobs[job_id]
    every = slots(entry)
    replies = await asyncio.gather(
        *(
            ctx.call(
                n,
                stage_start(leader, entry, attempt, i, "", True, r),
                ctx.config.timings.stage_prepare_s,
            )
            for r, i, n in every
        ),
        return_exceptions=True,
    )
    for (r, i, node_id), reply in zip(every, replies):
        if isinstance(reply, BaseException):
            if ctx.table.jobs[job_id].attempt == attempt:
                await fail_start(
                    leader, job_id, attempt, i, node_id, f"{_where(r, i)}could not prepare: {reply}"
                )
            return False
    return True


async def fail_start(
    leader: JobsLeader, job_id: str, attempt: int, stage: int, node_id: str, message: str
) -> None:
    """An attempt's stage could not be prepared or started: stop its stages everywhere and
    fail the attempt, naming the stage and the node."""
    await leader._stop_everywhere(job_id, -1)
    failed = ev.JobFailed(
        job_id=job_id,
        attempt=attempt,
        stage=stage,
        node_id=node_id,
        message=message,
        at=leader.wall(),
    )
    await leader._append([failed])


async def launch(leader: JobsLeader, job_id: str, attempt: int) -> None:
    """Start the attempt's workers (every replica's, in order) and mark it running."""
    ctx = leader.ctx
    entry = ctx.table.jobs[job_id]
    assert entry.plan is not None
    if entry.inputs is not None and not await prepare(leader, job_id, attempt):
        return
    n = entry.plan.n_replicas
    bound: dict[int, StageReady] = {}
    """Stage -> the ready answer of its member in the replica before (replica 0's kept for
    the last replica, which closes the ring on it)."""
    first: dict[int, StageReady] = {}
    for r in range(n):
        nxt = ""
        for i in reversed(range(entry.n_stages)):
            node_id = entry.plan.replica_stages(r)[i].node_id
            ring = ("", "")
            if r > 0:
                before, zero = bound[i], first[i]
                ring = (
                    f"tcp://{zero.host}:{zero.ring_prev_port}" if r == n - 1 else "",
                    f"tcp://{before.host}:{before.ring_next_port}",
                )
            msg = stage_start(leader, ctx.table.jobs[job_id], attempt, i, nxt, False, r, ring)
            try:
                reply = await ctx.call(node_id, msg, ctx.config.timings.worker_ready_s + 30)
                if not isinstance(reply, StageReady):
                    raise RpcError("bad_reply", f"{type(reply).TYPE} is not job.stage_ready")
                if n > 1 and r < n - 1 and not reply.ring_next_port:
                    raise RpcError("bad_reply", "job.stage_ready names no ring port")
            except (SwarmError, OSError, asyncio.TimeoutError) as exc:
                if ctx.table.jobs[job_id].attempt == attempt:
                    why = f"{_where(r, i)}could not start: {exc}"
                    await fail_start(leader, job_id, attempt, i, node_id, why)
                return
            nxt = f"tcp://{reply.host}:{reply.port}"
            bound[i] = reply
            if r == 0:
                first[i] = reply
    if ctx.table.jobs[job_id].state in ("placed", "resuming"):
        await leader._append([ev.JobRunning(job_id=job_id, attempt=attempt, at=leader.wall())])


__all__ = ["fail_start", "launch", "prepare", "slots", "stage_start"]
