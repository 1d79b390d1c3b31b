"""Every node's side of training jobs: check the plan and start this node's stage workers,
send their events to the leader in batches, stop them (and those the table no longer wants),
and serve the files of a job's folder (logs, snapshots, exported shards) to peers in chunks.
Never imports torch. Every job id and file name from a peer is confined to the job's folder
(``swarmp2p.paths``) before it touches a file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmp2p.errors import Failed, SwarmError, UserError
from swarmp2p.node import jobs
from swarmp2p.node.corpus import prepare_tokens
from swarmp2p.node.decide import stale_workers
from swarmp2p.node.messages import (
    FilePull,
    JobAck,
    ShardChunk,
    ShardRead,
    StageReady,
    StageReport,
    StageStart,
    StageStop,
)
from swarmp2p.node.workers import WorkerProcess
from swarmp2p.paths import UnsafeName, check_id, confine
from swarmp2p.plan.worker_spec import needs_tokens, worker_spec

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext

log = logging.getLogger("swarmp2p.node.stages")

REPORT_EVERY_S = 0.2
"""How often a node sends its workers' new events to the leader (one batch per worker)."""
REPORT_BATCH = 200
CHUNK_BYTES = 1 << 20


def job_dir(state_root: Path, job_id: str) -> Path:
    """``<state>/jobs/<job id>``; UserError for an id that is not one safe path component."""
    try:
        return state_root / "jobs" / check_id(job_id, what="job id")
    except UnsafeName as exc:
        raise UserError(str(exc), code="bad_field") from None


def job_file(state_root: Path, job_id: str, file: str) -> Path:
    """A file of a job's folder named by a peer, confined to that folder."""
    try:
        return confine(job_dir(state_root, job_id), file, what="file")
    except UnsafeName as exc:
        raise UserError(str(exc), code="bad_field") from None


class StageHost:
    """This node's training stage workers."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.workers: dict[tuple[str, int, int], WorkerProcess] = {}
        self._outbox: dict[tuple[str, int, int], list[dict[str, Any]]] = {}

    def job_dir(self, job_id: str) -> Path:
        return job_dir(self.ctx.state.root, job_id)

    # --- files ------------------------------------------------------------------------------

    def read(self, msg: ShardRead) -> ShardChunk:
        path = job_file(self.ctx.state.root, msg.job_id, msg.file)
        if msg.size <= 0 or msg.size > CHUNK_BYTES or msg.offset < 0:
            raise UserError(f"size must be in 1..{CHUNK_BYTES}, offset >= 0", code="bad_field")
        try:
            with open(path, "rb") as f:
                total = os.fstat(f.fileno()).st_size
                f.seek(msg.offset)
                data = f.read(msg.size)
        except (FileNotFoundError, IsADirectoryError):
            raise Failed(f"node {self.ctx.node_id} has no {msg.file} for job {msg.job_id}", code="no_file") from None  # fmt: skip
        return ShardChunk(data=data, total=total)

    async def pull_file(self, job_id: str, file: str, source: str) -> Path:
        """Copy a file of a job's folder from the node at ``source``, atomically."""
        from swarmp2p.node import model_files

        dest = job_file(self.ctx.state.root, job_id, file)
        read = model_files.rpc_reader(
            self.ctx.call_endpoint,
            source,
            lambda f, offset, size: ShardRead(job_id=job_id, file=f, offset=offset, size=size),
        )
        await model_files.pull_file(read, file, dest, None, CHUNK_BYTES)
        return dest

    # --- starting a stage ---------------------------------------------------------------------

    async def start_stage(self, msg: StageStart) -> StageReady:
        folder = self.job_dir(msg.job_id)
        try:
            plan = await asyncio.to_thread(
                jobs.check_plan, msg.job, msg.cluster, msg.plan, node_id=self.ctx.node_id
            )
        except jobs.PlanMismatch:
            raise
        except ValueError as exc:
            raise Failed(f"node {self.ctx.node_id} cannot check the plan: {exc}", code="plan_mismatch") from None  # fmt: skip
        stage = plan.stages[msg.stage]
        if stage.node_id != self.ctx.node_id:
            raise UserError(f"stage {msg.stage} is planned on {stage.node_id}", code="bad_field")
        await self.stop_job(msg.job_id, -1, keep_attempt=msg.attempt)
        snap_dir = folder / "snapshots"
        if msg.resume_step:
            await self._ensure_snapshot(msg, snap_dir)
        device, visible = jobs.device_for(stage.devices, self.ctx.me.record)
        tokens = None
        if msg.stage == 0 and needs_tokens(msg.job):
            data = msg.job.data
            try:
                tokens = await prepare_tokens(
                    msg.job.model.pretrained,
                    data.source,
                    data.text_field,
                    folder / "data" / "tokens.npy",
                )
            except ValueError as exc:
                raise Failed(f"node {self.ctx.node_id}: {exc}", code="failed") from None
        spec = worker_spec(
            msg.job,
            plan,
            msg.stage,
            token=self.ctx.secret.token,
            host=self.ctx.me.addresses[0],
            next_endpoint=msg.next or None,
            device=device,
            snapshot_dir=str(snap_dir),
            export_dir=str(folder / "export"),
            resume=bool(msg.resume_step),
            tokens_path=str(tokens) if tokens is not None else None,
            link_timeout_s=jobs.LINK_TIMEOUT_S,
        )
        folder.mkdir(parents=True, exist_ok=True)
        env = {"CUDA_VISIBLE_DEVICES": visible if visible is not None else ""}
        if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            machines = {p.node_id: str(p.host.get("machine") or "") for p in self.ctx.members.alive_peers()}  # fmt: skip
            machines[self.ctx.node_id] = str(self.ctx.me.host.get("machine") or "")
            here = jobs.stages_on_machine(plan, self.ctx.node_id, machines)  # they share its cores
            cores = int(self.ctx.me.host.get("cpu_cores") or 1)
            env["OMP_NUM_THREADS"] = str(jobs.cpu_threads(cores, here))
        key = (msg.job_id, msg.attempt, msg.stage)
        self._outbox[key] = []
        worker = WorkerProcess(
            job_id=msg.job_id,
            attempt=msg.attempt,
            stage=msg.stage,
            spec=spec.to_dict(),
            env=env,
            on_event=lambda e: self._queue(key, e),
            on_exit=lambda code, tail: self._exited(key, code, tail),
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
            raise Failed(f"{exc}{chr(10) + tail if tail else ''}", code="worker_failed") from None
        log.info("job %s attempt %d stage %d worker up (port %s)", *key, ready.get("port"))
        return StageReady(
            job_id=msg.job_id,
            attempt=msg.attempt,
            stage=msg.stage,
            host=self.ctx.me.addresses[0],
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
        file = f"snapshots/stage-{msg.stage}/{_snapshot_name(msg.resume_step)}"
        for node_id in msg.snapshot_nodes:
            if node_id == self.ctx.node_id or not self.ctx.is_alive(node_id):
                continue
            with contextlib.suppress(SwarmError, OSError, ValueError):
                await self.pull_file(msg.job_id, file, self.ctx.endpoint_of(node_id))
                return
        raise Failed(
            f"no copy of stage {msg.stage}'s snapshot at step {msg.resume_step} is reachable "
            f"(held by {msg.snapshot_nodes})",
            code="no_snapshot",
        )

    # --- reports to the leader --------------------------------------------------------------

    def _queue(self, key: tuple[str, int, int], event: dict[str, Any]) -> None:
        if event.get("event") == "exported":
            with contextlib.suppress(OSError, ValueError):
                event = {**event, "manifest_data": json.loads(Path(event["manifest"]).read_text())}
        if event.get("event") == "snapshot" and event.get("path"):
            with contextlib.suppress(ValueError):
                rel = Path(event["path"]).relative_to(self.job_dir(key[0]))
                event = {**event, "file": str(rel)}
        self._outbox.setdefault(key, []).append(event)

    def _exited(self, key: tuple[str, int, int], code: int, tail: list[str]) -> None:
        worker = self.workers.get(key)
        error = worker.last_error if worker is not None else None
        self._queue(key, {"event": "exit", "stage": key[2], "code": code, "stderr_tail": tail, "error": error})  # fmt: skip

    def _ensure_sender(self) -> None:
        if not self.ctx.running("job-reports"):
            self.ctx.spawn(self._sender(), "job-reports")

    async def _sender(self) -> None:
        while self._outbox or self.workers:
            for key in list(self._outbox):
                events = self._outbox.get(key) or []
                if events:
                    batch = events[:REPORT_BATCH]
                    report = StageReport(
                        node_id=self.ctx.node_id, job_id=key[0], attempt=key[1], stage=key[2],
                        events=batch,
                    )  # fmt: skip
                    try:
                        await self.ctx.to_leader(report, 10.0)
                    except (SwarmError, OSError) as exc:  # kept; sent again next round
                        log.debug("report to leader %s failed: %s", self.ctx.leader, exc)
                        continue
                    del events[: len(batch)]
                worker = self.workers.get(key)
                if not events and (worker is None or worker.returncode is not None):
                    self._outbox.pop(key, None)
                    if worker is not None:
                        self.workers.pop(key, None)
            await asyncio.sleep(REPORT_EVERY_S)

    # --- stopping ---------------------------------------------------------------------------

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

    def reap(self) -> None:
        """Stop the workers the table no longer wants (a partition healed, a leader's stop
        message was lost)."""
        for key in stale_workers(self.ctx.table, list(self.workers)):
            log.info("stopping job %s attempt %d stage %d: the job moved on", *key)
            self.ctx.spawn(self.stop_job(key[0], key[1]), f"reap:{key[0]}")

    async def handle(self, msg: Any) -> Any:
        if isinstance(msg, StageStart):
            return await self.start_stage(msg)
        if isinstance(msg, StageStop):
            await self.stop_job(msg.job_id, msg.attempt)
            return JobAck(job_id=msg.job_id)
        if isinstance(msg, ShardRead):
            return await asyncio.to_thread(self.read, msg)
        if isinstance(msg, FilePull):
            await self.pull_file(msg.job_id, msg.file, msg.source)
            return JobAck(job_id=msg.job_id)
        raise Failed(f"a stage host does not take {type(msg).TYPE}", code="internal")

    async def close(self) -> None:
        await asyncio.gather(*(w.stop() for w in list(self.workers.values())))
        self.workers.clear()


_SNAP = re.compile(r"step-(\d{8})\.pt")
"""The runtime's snapshot file names (``runtime.torch.snapshot.snapshot_path``)."""


def _snapshot_step(name: str) -> int | None:
    m = _SNAP.fullmatch(name)
    return int(m.group(1)) if m else None


def _snapshot_name(step: int) -> str:
    return f"step-{step:08d}.pt"


__all__ = ["CHUNK_BYTES", "REPORT_EVERY_S", "StageHost", "job_dir", "job_file"]
