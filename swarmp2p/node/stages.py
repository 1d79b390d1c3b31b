"""The stage side of a node: start this node's stage workers (after checking the plan),
send their events to the leader in batches, stop them, and serve the files of a job's folder
(logs, snapshots, exported shards) to peers in chunks. Never imports torch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmp2p.net.rpc import RpcError, RpcTimeout
from swarmp2p.node import jobs
from swarmp2p.node.corpus import prepare_tokens
from swarmp2p.node.messages import ShardChunk, ShardRead, StageReady, StageReport, StageStart
from swarmp2p.node.workers import WorkerProcess
from swarmp2p.plan import parse_job
from swarmp2p.plan.worker_spec import needs_tokens, worker_spec

if TYPE_CHECKING:
    from swarmp2p.node.daemon import Daemon

log = logging.getLogger("swarmp2p.node.stages")

REPORT_EVERY_S = 0.2
CHUNK_BYTES = 1 << 20
_SAFE_FILE = re.compile(r"^(?!/)(?!.*(^|/)\.\.(/|$))[\w./-]+$")


def _safe(file: str) -> str:
    if not _SAFE_FILE.match(file):
        raise RpcError("bad_field", f"file {file!r} must be a relative path inside the job folder")
    return file


class StageHost:
    """This node's stage workers. ``send(node_id, msg, timeout)`` reaches a node (or this one)."""

    def __init__(self, daemon: Daemon, send: Callable[[str, Any, float], Awaitable[Any]]) -> None:
        self.d = daemon
        self._send = send
        self.workers: dict[tuple[str, int, int], WorkerProcess] = {}
        self._outbox: dict[tuple[str, int, int], list[dict[str, Any]]] = {}

    def job_dir(self, job_id: str) -> Path:
        if not re.fullmatch(r"[\w.-]+", job_id):
            raise RpcError(
                "bad_field", f"job id {job_id!r} has characters other than [A-Za-z0-9_.-]"
            )
        return self.d.state.root / "jobs" / job_id

    def read(self, msg: ShardRead) -> ShardChunk:
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
        from swarmp2p.node import model_files

        dest = self.job_dir(job_id) / _safe(file)
        read = model_files.rpc_reader(
            self.d._call,
            source,
            lambda f, offset, size: ShardRead(job_id=job_id, file=f, offset=offset, size=size),
        )
        await model_files.pull_file(read, file, dest, None, CHUNK_BYTES)
        return dest

    async def start_stage(self, msg: StageStart) -> StageReady:
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
        job = parse_job(msg.job)
        tokens = None
        if msg.stage == 0 and needs_tokens(job):
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
            spec = worker_spec(
                job,
                plan,
                msg.stage,
                token=self.d.secret.token,
                host=self.d.addresses[0],
                next_endpoint=msg.next or None,
                device=device,
                snapshot_dir=str(snap_dir),
                export_dir=str(folder / "export"),
                resume=bool(msg.resume_step),
                tokens_path=str(tokens) if tokens is not None else None,
                link_timeout_s=jobs.LINK_TIMEOUT_S,
            ).to_dict()
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
            with contextlib.suppress(RpcError, RpcTimeout, OSError, ValueError):
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
