"""Running training jobs over the daemons: the leader places, wires and watches; every node
starts and reports its stages' workers. Never imports torch.

Leader: each heartbeat round, ``tick()`` places waiting jobs on the live nodes (PENDING with a
reason when the plan is blocked), starts the stages last to first (each ``job.stage_start``
answers with the worker's bound port, which the stage before dials), folds the workers'
reports into the job table, and re-plans a job whose stage node was lost (RESUMING, from the
last snapshot every stage holds; a copy of each snapshot is pulled by another peer).

Node: ``job.stage_start`` recomputes the plan from the leader's inputs and refuses a mismatch,
then starts the worker; its events go to whoever leads now, in batches (``job.report``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmp2p.net.rpc import RpcError, RpcTimeout
from swarmp2p.node import jobs
from swarmp2p.node.corpus import prepare_tokens
from swarmp2p.node.messages import (
    FilePull,
    JobAck,
    JobCancel,
    ShardChunk,
    ShardRead,
    StageReady,
    StageReport,
    StageStart,
    StageStop,
)
from swarmp2p.node.registry import model_entry, unique_model_id
from swarmp2p.node.workers import READY_TIMEOUT_S, WorkerProcess
from swarmp2p.plan import Plan

if TYPE_CHECKING:
    from swarmp2p.node.daemon import Daemon

log = logging.getLogger("swarmp2p.node.dispatch")

REPORT_EVERY_S = 0.2
CHUNK_BYTES = 1 << 20
STOP_TIMEOUT_S = 5.0
_SAFE_FILE = re.compile(r"^(?!/)(?!.*(^|/)\.\.(/|$))[\w./-]+$")


def _safe(file: str) -> str:
    if not _SAFE_FILE.match(file):
        raise RpcError("bad_field", f"file {file!r} must be a relative path inside the job folder")
    return file


class Dispatcher:
    """The job side of one daemon."""

    def __init__(self, daemon: Daemon, clock: Callable[[], float] = time.time) -> None:
        self.d = daemon
        self.wall = clock
        self.workers: dict[tuple[str, int, int], WorkerProcess] = {}
        self._outbox: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
        self._busy: dict[str, asyncio.Task] = {}
        """Leader: job id -> its placing / launching / recovering task."""
        self._report_lock = asyncio.Lock()
        """Leader: reports are folded one at a time (read, fold, write)."""

    # --- paths -------------------------------------------------------------------------------

    def job_dir(self, job_id: str) -> Path:
        if not re.fullmatch(r"[\w.-]+", job_id):
            raise RpcError(
                "bad_field", f"job id {job_id!r} has characters other than [A-Za-z0-9_.-]"
            )
        return self.d.state.root / "jobs" / job_id

    # --- leader ------------------------------------------------------------------------------

    @property
    def leading(self) -> bool:
        return self.d.leader == self.d.node_id and self.d._leader_ready

    def _cluster(self) -> list[dict[str, Any]]:
        records = [self.d.record] + [p.record for p in self.d.members.alive_peers()]
        return jobs.cluster_records(records)

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

    def _history(self, record: dict[str, Any], state: str, **extra: Any) -> list[dict]:
        return [*record.get("history", []), {"state": state, "at": round(self.wall(), 3), **extra}]

    async def _set(self, job_id: str, state: str | None, fields: dict[str, Any]) -> None:
        record = self._entry(job_id)["record"]
        if state is not None and state != self.d.table.jobs[job_id]["state"]:
            fields = {**fields, "history": self._history(record, state)}
        await self.d.update_job(job_id, fields, state or "")

    async def _place(self, job_id: str, lost: list[str] | None = None) -> None:
        entry = self._entry(job_id)
        record = entry["record"]
        cluster = self._cluster()
        try:
            result = jobs.compute_plan(record["job"], cluster)
        except ValueError as exc:  # JobError, a model that cannot be read here
            await self._set(job_id, "failed", {"error": jobs.failure(stage=-1, node=self.d.node_id, message=str(exc))})  # fmt: skip
            return
        if not isinstance(result, Plan):
            if entry["state"] != "pending" or record.get("reason") != result.reason:
                log.info("job %s waits: %s", job_id, result.reason)
                await self._set(job_id, "pending", {"reason": result.reason})
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
        await self._place(job_id, lost)

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

    # --- every node: workers -----------------------------------------------------------------

    async def handle(self, msg: Any) -> Any:
        """The job messages this node answers."""
        if isinstance(msg, StageStart):
            return await self._start_stage(msg)
        if isinstance(msg, StageStop):
            await self.stop_job(msg.job_id, msg.attempt)
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
            return self._read(msg)
        if isinstance(msg, FilePull):
            await self.pull_file(msg.job_id, msg.file, msg.source)
            return JobAck(job_id=msg.job_id)
        raise RpcError("unexpected", f"no job handler for {type(msg).TYPE}")

    def _read(self, msg: ShardRead) -> ShardChunk:
        path = self.job_dir(msg.job_id) / _safe(msg.file)
        if msg.size <= 0 or msg.size > CHUNK_BYTES or msg.offset < 0:
            raise RpcError("bad_field", f"size must be in 1..{CHUNK_BYTES}, offset >= 0")
        try:
            with open(path, "rb") as f:
                total = os.fstat(f.fileno()).st_size
                f.seek(msg.offset)
                data = f.read(msg.size)
        except FileNotFoundError:
            raise RpcError(
                "no_file", f"node {self.d.node_id} has no {msg.file} for job {msg.job_id}"
            ) from None
        return ShardChunk(data=data, total=total)

    async def pull_file(self, job_id: str, file: str, source: str) -> Path:
        """Copy a file of a job's folder from the node at ``source``, atomically."""
        dest = self.job_dir(job_id) / _safe(file)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part")
        offset = 0
        with open(tmp, "wb") as out:
            while True:
                reply = await self.d._call(
                    source,
                    ShardRead(job_id=job_id, file=file, offset=offset, size=CHUNK_BYTES),
                    30.0,
                )
                if not isinstance(reply, ShardChunk):
                    raise RpcError("bad_reply", f"{type(reply).TYPE} is not job.shard_chunk")
                out.write(reply.data)
                offset += len(reply.data)
                if offset >= reply.total or not reply.data:
                    break
        os.replace(tmp, dest)
        return dest

    async def _start_stage(self, msg: StageStart) -> StageReady:
        try:
            plan = jobs.check_plan(msg.job, msg.cluster, msg.plan, node_id=self.d.node_id)
        except jobs.PlanMismatch as exc:
            raise RpcError("plan_mismatch", str(exc)) from None
        except ValueError as exc:
            raise RpcError("bad_plan", f"node {self.d.node_id} cannot check the plan: {exc}") from None  # fmt: skip
        stage = plan.stages[msg.stage]
        if stage.node_id != self.d.node_id:
            raise RpcError("not_mine", f"stage {msg.stage} is planned on {stage.node_id}")
        await self.stop_job(msg.job_id, -1, keep_attempt=msg.attempt)
        folder = self.job_dir(msg.job_id)
        snap_dir = folder / "snapshots"
        if msg.resume_step:
            await self._ensure_snapshot(msg, snap_dir)
        plan_dict = json.loads(msg.plan)
        device, visible = jobs.device_for(plan_dict["stages"][msg.stage], self.d.record)
        tokens = None
        if msg.stage == 0 and jobs.needs_tokens(msg.job):
            data = msg.job["data"]
            try:
                tokens = await prepare_tokens(
                    msg.job["model"]["pretrained"],
                    data["source"],
                    data["text_field"],
                    folder / "data" / "tokens.npy",
                )
            except ValueError as exc:
                raise RpcError("bad_data", f"node {self.d.node_id}: {exc}") from None
        try:
            spec = jobs.worker_spec(
                msg.job,
                plan_dict,
                msg.stage,
                token=self.d.secret.token,
                host=self.d.addresses[0],
                next_endpoint=msg.next or None,
                device=device,
                snapshot_dir=str(snap_dir) if msg.job["train"]["checkpoint_every"] else None,
                export_dir=str(folder / "export"),
                resume=bool(msg.resume_step),
                tokens_path=str(tokens) if tokens is not None else None,
            )
        except ValueError as exc:
            raise RpcError("bad_job", str(exc)) from None
        folder.mkdir(parents=True, exist_ok=True)
        env = {"CUDA_VISIBLE_DEVICES": visible if visible is not None else ""}
        if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # stages sharing this host's cores must not oversubscribe them: measured 40x
            # slower steps with two 2-thread CPU stages on 2 cores under load
            here = sum(1 for st in plan.stages if st.node_id == self.d.node_id)
            cores = int(self.d.host.get("cpu_cores") or 1)
            env["OMP_NUM_THREADS"] = str(max(1, cores // here))
        key = (msg.job_id, msg.attempt, msg.stage)
        self._outbox[key] = []
        worker = WorkerProcess(
            job_id=msg.job_id,
            attempt=msg.attempt,
            stage=msg.stage,
            spec=spec,
            env=env,
            on_event=lambda e: self._queue(key, e),
            on_exit=lambda code, tail: self._queue(
                key, {"event": "exit", "stage": msg.stage, "code": code, "stderr_tail": tail}
            ),
            log_path=str(folder / f"stage-{msg.stage}.log"),
        )
        self.workers[key] = worker
        self._ensure_sender()
        await worker.start()
        try:
            ready = await worker.wait_ready()
        except (RuntimeError, asyncio.TimeoutError) as exc:
            await worker.stop()
            self.workers.pop(key, None)
            tail = "\n".join(list(worker.stderr_tail)[-5:])
            raise RpcError("worker_failed", f"{exc}{chr(10) + tail if tail else ''}") from None
        log.info("job %s attempt %d stage %d worker up (port %s)", *key, ready.get("port"))
        return StageReady(
            job_id=msg.job_id,
            attempt=msg.attempt,
            stage=msg.stage,
            host=self.d.addresses[0],
            port=int(ready.get("port") or 0),
        )

    async def _ensure_snapshot(self, msg: StageStart, snap_dir: Path) -> None:
        """Keep only snapshots up to ``resume_step`` here; pull the one needed if missing."""
        stage_dir = snap_dir / f"stage-{msg.stage}"
        name = None
        if stage_dir.is_dir():
            for p in stage_dir.iterdir():
                step = _snapshot_step(p.name)
                if step is not None and step > msg.resume_step:
                    p.unlink()
                elif step == msg.resume_step:
                    name = p.name
        if name is not None:
            return
        for node_id in msg.snapshot_nodes:
            peer = self.d.members.peers.get(node_id)
            if node_id == self.d.node_id or peer is None or not peer.alive:
                continue
            file = f"snapshots/stage-{msg.stage}/{_snapshot_name(msg.resume_step)}"
            with contextlib.suppress(RpcError, RpcTimeout):
                await self.pull_file(msg.job_id, file, peer.endpoint)
                return
        raise RpcError(
            "no_snapshot",
            f"no copy of stage {msg.stage}'s snapshot at step {msg.resume_step} is reachable "
            f"(held by {msg.snapshot_nodes})",
        )

    def _queue(self, key: tuple[str, int, int], event: dict[str, Any]) -> None:
        if event.get("event") == "exported":
            with contextlib.suppress(OSError, ValueError):
                path = Path(event["manifest"])
                event = {**event, "manifest_data": json.loads(path.read_text())}
        if event.get("event") == "snapshot" and event.get("path"):
            folder = self.job_dir(key[0])
            with contextlib.suppress(ValueError):
                event = {**event, "file": str(Path(event["path"]).relative_to(folder))}
        self._outbox.setdefault(key, []).append(event)

    def _ensure_sender(self) -> None:
        if not any(t.get_name() == "job-reports" for t in self.d._rt.tasks):
            self.d._spawn(self._sender(), "job-reports")

    async def _sender(self) -> None:
        while self._outbox or self.workers:
            for key in list(self._outbox):
                events = self._outbox.get(key) or []
                if events:
                    batch = events[:200]
                    report = StageReport(
                        node_id=self.d.node_id,
                        job_id=key[0],
                        attempt=key[1],
                        stage=key[2],
                        events=batch,
                    )
                    try:
                        await self._send(self.d.leader, report, 10.0)
                    except (RpcError, RpcTimeout) as exc:
                        log.debug("report to leader %s failed: %s", self.d.leader, exc)
                        continue
                    del events[: len(batch)]
                worker = self.workers.get(key)
                if not events and (worker is None or worker.returncode is not None):
                    self._outbox.pop(key, None)
                    if worker is not None:
                        self.workers.pop(key, None)
            await asyncio.sleep(REPORT_EVERY_S)

    async def stop_job(self, job_id: str, attempt: int, keep_attempt: int | None = None) -> None:
        """Stop this node's workers of ``job_id`` (``attempt`` -1: all but ``keep_attempt``)."""
        victims = [
            w
            for k, w in self.workers.items()
            if k[0] == job_id and (attempt == -1 or k[1] == attempt) and k[1] != keep_attempt
        ]
        await asyncio.gather(*(w.stop() for w in victims))
        for w in victims:
            self.workers.pop(w.key, None)
            self._outbox.pop(w.key, None)

    async def close(self) -> None:
        await asyncio.gather(*(w.stop() for w in list(self.workers.values())))
        self.workers.clear()


_SNAP = re.compile(r"^step-(\d{8})\.pt$")
"""The runtime's snapshot file names (``runtime.torch.snapshot.snapshot_path``)."""


def _snapshot_step(name: str) -> int | None:
    m = _SNAP.match(name)
    return int(m.group(1)) if m else None


def _snapshot_name(step: int) -> str:
    return f"step-{step:08d}.pt"
