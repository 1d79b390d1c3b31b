"""Running training jobs over the daemons: the leader places, wires and watches; every node
starts and reports its stages' workers. Never imports torch.

Leader: each heartbeat round, ``tick()`` places waiting jobs on the live nodes (PENDING with a
reason when the plan is blocked), starts the stages last to first (each ``job.stage_start``
answers with the worker's bound port, which the stage before dials), folds the workers'
reports into the job table, and re-plans a job whose stage node was lost (RESUMING, from the
last snapshot every stage holds; a copy of each snapshot is pulled by another peer).

Every node answers the job messages here; its own stages are ``stages.StageHost``'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from swarmp2p.net.rpc import RpcError, RpcTimeout
from swarmp2p.node import jobs
from swarmp2p.node.messages import (
    FilePull,
    JobAck,
    JobCancel,
    ShardRead,
    StageReady,
    StageReport,
    StageStart,
    StageStop,
)
from swarmp2p.node.registry import model_entry, unique_model_id
from swarmp2p.node.stages import StageHost
from swarmp2p.node.workers import READY_TIMEOUT_S
from swarmp2p.plan import Plan

if TYPE_CHECKING:
    from swarmp2p.node.daemon import Daemon

log = logging.getLogger("swarmp2p.node.dispatch")

STOP_TIMEOUT_S = 5.0


class Dispatcher:
    """The job side of one daemon."""

    def __init__(self, daemon: Daemon, clock: Callable[[], float] = time.time) -> None:
        self.d = daemon
        self.wall = clock
        self.stages = StageHost(daemon, self._send)
        self._busy: dict[str, asyncio.Task] = {}
        """Leader: job id -> its placing / launching / recovering task."""
        self._report_lock = asyncio.Lock()
        """Leader: reports are folded one at a time (read, fold, write)."""

    # --- leader ------------------------------------------------------------------------------

    @property
    def leading(self) -> bool:
        return self.d.leader == self.d.node_id and self.d._leader_ready

    def _records(self) -> list[dict[str, Any]]:
        return [self.d.record] + [p.record for p in self.d.members.alive_peers()]

    def _cluster(self) -> list[dict[str, Any]]:
        return jobs.cluster_records(self._records())

    def _alive(self) -> set[str]:
        return {self.d.node_id} | {p.node_id for p in self.d.members.alive_peers()}

    def tick(self) -> None:
        """Leader: place waiting jobs; recover running jobs that lost a stage node."""
        if not self.leading:
            return
        alive = self._alive()
        for job_id, entry in sorted(self.d.table.jobs.items()):
            if not jobs.is_training(entry) or job_id in self._busy:
                continue
            state, record = entry["state"], entry["record"]
            if state in jobs.WAITING_STATES:
                self._run(job_id, self._place(job_id))
            elif state in jobs.ACTIVE_STATES:
                nodes = {s["node_id"] for s in record.get("plan", {}).get("stages", [])}
                lost = sorted(nodes - alive)
                if lost:
                    self._run(job_id, self._recover(job_id, lost))
                elif record.get("placed_by") != self.d.node_id and state != "running":
                    # a leader that died while wiring the stages: start the wiring over
                    self._run(job_id, self._recover(job_id, []))

    def _run(self, job_id: str, coro: Any) -> None:
        task = self.d._spawn(coro, f"job:{job_id}")
        self._busy[job_id] = task
        task.add_done_callback(lambda t: self._busy.pop(job_id, None))

    def _entry(self, job_id: str) -> dict[str, Any]:
        entry = self.d.table.jobs.get(job_id)
        if entry is None:
            raise RpcError("no_job", f"no job {job_id!r} in the table; see `swarm jobs`")
        return {"state": entry["state"], "record": jobs._copy(entry["record"])}

    def _history(self, record: dict[str, Any], state: str) -> list[dict]:
        return [*record.get("history", []), {"state": state, "at": round(self.wall(), 3)}]

    async def _set(self, job_id: str, state: str | None, fields: dict[str, Any]) -> None:
        record = self._entry(job_id)["record"]
        if state is not None and state != self.d.table.jobs[job_id]["state"]:
            fields = {**fields, "history": self._history(record, state)}
        await self.d.update_job(job_id, fields, state or "")

    async def _place(self, job_id: str) -> None:
        entry = self._entry(job_id)
        record = entry["record"]
        cluster = self._cluster()
        try:
            result = jobs.compute_plan(record["job"], cluster)
        except ValueError as exc:  # JobError, a model that cannot be read here
            await self._set(job_id, "failed", {"error": jobs.failure(stage=-1, node=self.d.node_id, message=str(exc))})  # fmt: skip
            return
        if not isinstance(result, Plan):
            reason = jobs.blocked_note(result.reason, self._records())
            if entry["state"] != "pending" or record.get("reason") != reason:
                log.info("job %s waits: %s", job_id, reason)
                await self._set(job_id, "pending", {"reason": reason})
            return
        resume = jobs.resume_step(record, self._alive()) if record.get("plan") else 0
        if resume:
            old = [s["layers"] for s in record["plan"]["stages"]]
            if old != [[s.layer_start, s.layer_end] for s in result.stages]:
                # per-stage snapshots fit only the same cuts; a learned boundary is never
                # re-split (its bottleneck was trained on these cuts): wait for a node instead
                reason = (
                    f"the nodes left give cuts {[[s.layer_start, s.layer_end] for s in result.stages]}"
                    f", not the snapshots' {old}; waiting for a node to return"
                )
                if entry["state"] != "pending" or record.get("reason") != reason:
                    await self._set(job_id, "pending", {"reason": reason})
                return
        attempt = int(record.get("attempt", 0)) + 1
        plan = result.to_dict()
        await self._set(
            job_id,
            "resuming" if resume else "placed",
            {
                "plan": plan,
                "plan_json": result.to_json(),
                "cluster": cluster,
                "attempt": attempt,
                "reason": None,
                "done_stages": [],
                "shards": {},
                "resume_step": resume,
                "placed_by": self.d.node_id,
            },
        )
        log.info("job %s attempt %d placed on %s", job_id, attempt, [s["node_id"] for s in plan["stages"]])  # fmt: skip
        await self._launch(job_id, attempt)

    async def _launch(self, job_id: str, attempt: int) -> None:
        record = self._entry(job_id)["record"]
        plan = record["plan"]
        n = len(plan["stages"])
        nxt = ""
        resume = int(record.get("resume_step") or 0)
        for i in reversed(range(n)):
            node_id = plan["stages"][i]["node_id"]
            msg = StageStart(
                job_id=job_id,
                attempt=attempt,
                stage=i,
                job=record["job"],
                cluster=record["cluster"],
                plan=record["plan_json"],
                next=nxt,
                resume_step=resume,
                snapshot_nodes=jobs.snapshot_holders(record, i, resume) if resume else [],
                leader=self.d.node_id,
            )
            try:
                reply = await self._send(node_id, msg, READY_TIMEOUT_S + 30)
                if not isinstance(reply, StageReady):
                    raise RpcError("bad_reply", f"{type(reply).TYPE} is not job.stage_ready")
            except (RpcError, RpcTimeout, RuntimeError, asyncio.TimeoutError) as exc:
                if self._entry(job_id)["record"].get("attempt") != attempt:
                    return
                await self._stop_everywhere(job_id, -1)
                error = jobs.failure(stage=i, node=node_id, message=f"could not start: {exc}")
                await self._set(job_id, "failed", {"error": error})
                return
            nxt = f"tcp://{reply.host}:{reply.port}"
        if self._entry(job_id)["state"] == "placed":
            await self._set(job_id, "running", {})

    async def _recover(self, job_id: str, lost: list[str]) -> None:
        record = self._entry(job_id)["record"]
        why = f"node(s) {', '.join(lost)} lost" if lost else "the leader that placed it was lost"
        log.warning("job %s: %s; re-planning", job_id, why)
        await self._set(job_id, "resuming", {"reason": why})
        await self._stop_everywhere(job_id, int(record.get("attempt", 0)))
        await self._place(job_id)

    async def _stop_everywhere(self, job_id: str, attempt: int) -> None:
        msg = StageStop(job_id=job_id, attempt=attempt)
        await asyncio.gather(
            *(self._send(n, msg, STOP_TIMEOUT_S) for n in sorted(self._alive())),
            return_exceptions=True,
        )

    async def _send(self, node_id: str, msg: Any, timeout: float) -> Any:
        if node_id == self.d.node_id:
            return await self.handle(msg)
        peer = self.d.members.peers.get(node_id)
        if peer is None or not peer.alive:
            raise RpcError("no_peer", f"node {node_id} is not a live member")
        return await self.d._call(peer.endpoint, msg, timeout)

    async def cancel(self, job_id: str) -> dict[str, Any]:
        """Leader (a follower forwards): stop the job's workers, mark it CANCELLED."""
        if self.d.leader != self.d.node_id:
            peer = self.d.members.peers.get(self.d.leader)
            if peer is None:
                raise RpcError("no_leader", "no leader is known yet; retry in a moment")
            await self.d._call(peer.endpoint, JobCancel(job_id=job_id), STOP_TIMEOUT_S * 3)
            return {"job_id": job_id, "state": "CANCELLED"}
        entry = self._entry(job_id)
        if entry["state"] in jobs.FINAL_STATES:
            raise RpcError(
                "final", f"job {job_id} is already {entry['state'].upper()}; nothing to cancel"
            )
        task = self._busy.pop(job_id, None)
        if task is not None:
            task.cancel()
        await self._set(job_id, "cancelled", {"reason": "cancelled by the user"})
        await self._stop_everywhere(job_id, -1)
        return {"job_id": job_id, "state": "CANCELLED"}

    async def on_report(self, msg: StageReport) -> None:
        """Leader: fold one batch of a stage's events into the job."""
        async with self._report_lock:
            await self._fold_report(msg)

    async def _fold_report(self, msg: StageReport) -> None:
        entry = self.d.table.jobs.get(msg.job_id)
        if entry is None or entry["state"] in jobs.FINAL_STATES:
            return
        record = jobs._copy(entry["record"])
        if record.get("attempt") != msg.attempt:
            return  # a stage of a re-planned attempt, already stopped
        fields: dict[str, Any] = {}
        state: str | None = None
        for event in msg.events:
            if not isinstance(event, dict):
                continue
            kind = event.get("event")
            if kind == "snapshot":
                snaps = fields.get("snapshots", record.get("snapshots", {}))
                fields["snapshots"] = jobs.add_snapshot(
                    snaps, msg.stage, event["step"], msg.node_id
                )
                self._replicate(msg.job_id, msg.stage, msg.node_id, event)
                continue
            update = jobs.fold_event({**record, **fields}, event)
            fields.update(update)
            if kind == "step" and entry["state"] in ("resuming", "placed"):
                state = "running"
            elif kind == "exported":
                shards = {**fields.get("shards", record.get("shards", {}))}
                shards[str(msg.stage)] = {
                    "node": msg.node_id,
                    "folder": f"export/stage-{msg.stage}",
                    "manifest": event.get("manifest_data"),
                }
                fields["shards"] = shards
            elif kind == "done":
                done = sorted({*fields.get("done_stages", record.get("done_stages", [])), msg.stage})  # fmt: skip
                fields["done_stages"] = done
                if len(done) == len(record["plan"]["stages"]):
                    state = "completed"
            elif kind == "error":
                fields["last_error"] = {"stage": msg.stage, "message": event.get("message")}
            elif kind == "exit" and event.get("code") != 0 and state != "completed":
                message = fields.get("last_error", record.get("last_error") or {}).get("message")
                how = jobs.exit_message(event.get("code"))
                error = jobs.failure(
                    stage=msg.stage,
                    node=msg.node_id,
                    message=f"{message} ({how})" if message else how,
                    stderr_tail=event.get("stderr_tail", []),
                )
                fields["error"] = error
                state = "failed"
        if state == "completed":
            merged = {**record, **fields}
            models = [
                e["record"]["model"]["id"]
                for e in self.d.table.jobs.values()
                if isinstance(e["record"].get("model"), dict)
            ]
            fields["model"] = model_entry(
                unique_model_id(record["name"], models), msg.job_id, merged
            )
            fields["step"] = record["job"]["train"]["steps"]
        if fields or state:
            await self._set(msg.job_id, state, fields)
        if state == "failed":
            self._run_stop(msg.job_id, msg.attempt)

    def _run_stop(self, job_id: str, attempt: int) -> None:
        self.d._spawn(self._stop_everywhere(job_id, attempt), f"stop:{job_id}")

    def _replicate(self, job_id: str, stage: int, holder: str, event: dict) -> None:
        """Have another live peer pull a copy of a stage's snapshot."""
        others = sorted(self._alive() - {holder})
        peer = self.d.members.peers.get(holder)
        source = peer.endpoint if peer is not None else self.d._own_endpoint()
        if not others or not event.get("file"):
            return
        target = others[stage % len(others)]

        async def pull() -> None:
            try:
                await self._send(
                    target,
                    FilePull(job_id=job_id, file=event["file"], source=source),
                    60.0,
                )
            except (RpcError, RpcTimeout) as exc:
                log.warning("snapshot copy of job %s stage %d failed: %s", job_id, stage, exc)
                return
            async with self._report_lock:
                entry = self.d.table.jobs.get(job_id)
                if entry is None or not self.leading:
                    return
                snaps = entry["record"].get("snapshots", {})
                if str(event["step"]) not in snaps.get(str(stage), {}).get("steps", {}):
                    return  # already forgotten: newer snapshots came since
                snaps = jobs.add_snapshot(snaps, stage, event["step"], target)
                await self.d.update_job(job_id, {"snapshots": snaps}, "")

        self.d._spawn(pull(), f"replicate:{job_id}:{stage}")

    # --- every node ---------------------------------------------------------------------------

    async def handle(self, msg: Any) -> Any:
        """The job messages this node answers."""
        if isinstance(msg, StageStart):
            return await self.stages.start_stage(msg)
        if isinstance(msg, StageStop):
            await self.stages.stop_job(msg.job_id, msg.attempt)
            return JobAck(job_id=msg.job_id)
        if isinstance(msg, StageReport):
            if not self.leading:  # the sender keeps the events and retries
                raise RpcError("not_leader", f"node {self.d.node_id} is not leading (yet)")
            await self.on_report(msg)
            return JobAck(job_id=msg.job_id)
        if isinstance(msg, JobCancel):
            await self.cancel(msg.job_id)
            return JobAck(job_id=msg.job_id)
        if isinstance(msg, ShardRead):
            return self.stages.read(msg)
        if isinstance(msg, FilePull):
            await self.stages.pull_file(msg.job_id, msg.file, msg.source)
            return JobAck(job_id=msg.job_id)
        raise RpcError("unexpected", f"no job handler for {type(msg).TYPE}")

    async def close(self) -> None:
        await self.stages.close()
