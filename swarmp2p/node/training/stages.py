"""Every node's side of training jobs: check the plan and start this node's stage workers,
send their events to the leader in batches, stop them (and those the table no longer wants),
and serve the files of a job's folder (logs, snapshots, exported shards) to peers in chunks.
Never imports torch. Every job id and file name from a peer is confined to the job's folder
(``swarmp2p.paths``) before it touches a file."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmp2p.errors import Failed, SwarmError, UserError
from swarmp2p.node.decide import stale_workers
from swarmp2p.node.messages import (
    FilePull,
    InputRead,
    JobAck,
    ShardChunk,
    ShardRead,
    StageReady,
    StageReport,
    StageStart,
    StageStop,
)
from swarmp2p.node.training import jobs
from swarmp2p.node.training.corpus import prepare_tokens
from swarmp2p.node.training.inputs import Inputs
from swarmp2p.node.training.snapshots import (
    SNAPSHOT_SLACK,
    listed_snapshot,
    snapshot_dir,
    snapshot_limit,
    snapshot_name,
    snapshot_step,
)
from swarmp2p.paths import UnsafeName, check_id, confine
from swarmp2p.plan.inputs import stage_files
from swarmp2p.plan.worker_spec import needs_tokens, reads_data, worker_spec
from swarmp2p.schema import SchemaError
from swarmp2p.workers import WorkerProcess
from swarmp2p.workers import events as we
from swarmp2p.workers.events import Exited, Exported, SnapshotSaved, WorkerEvent, decode, encode

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext
    from swarmp2p.plan import Plan, ServePlan
    from swarmp2p.wire.messages import Message

log = logging.getLogger("swarmp2p.node.training.stages")

Key = tuple[str, int, int, int]
"""A stage worker's key on its node: (job, attempt, replica, stage)."""

REPORT_BATCH = 200
CHUNK_BYTES = 1 << 20


def worker_env(
    ctx: NodeContext, plan: Plan | ServePlan, device: str, visible: str | None
) -> dict[str, str]:
    """A stage worker's environment (a training or a serve stage): the GPUs it may see and, on
    the CPU, its share of this machine's cores with the plan's other stages on the machine (an
    ``OMP_NUM_THREADS`` the daemon was started with wins). Serve stages share them too: giving
    each every core measured the same for one user on 2 idle cores and 2.8x slower beside a
    2-core load (``bench/serve.py --only daemons``: spinning intra-op threads oversubscribe)."""
    env = {"CUDA_VISIBLE_DEVICES": visible if visible is not None else ""}
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        machines = {p.node_id: p.host.machine for p in ctx.members.alive_peers()}
        machines[ctx.node_id] = ctx.me.host.machine
        here = jobs.stages_on_machine(plan, ctx.node_id, machines)  # they share its cores
        env["OMP_NUM_THREADS"] = str(jobs.cpu_threads(ctx.me.host.cpu_cores, here))
    return env


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
        self.workers: dict[Key, WorkerProcess] = {}
        self._outbox: dict[Key, list[WorkerEvent]] = {}
        self.inputs = Inputs(ctx)
        """The job inputs this node offers, and those it fetches for its stages."""

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
            raise Failed(
                f"node {self.ctx.node_id} has no {msg.file} for job {msg.job_id}", code="no_file"
            ) from None
        return ShardChunk(data=data, total=total)

    async def pull_file(
        self, job_id: str, file: str, source: str, limit: int, dest: Path | None = None
    ) -> Path:
        """Copy a file (a snapshot, at most ``limit`` bytes) of a job's folder from the node at
        ``source``, atomically (to the same name here, or to ``dest``); its size is checked
        against ``limit`` and the free disk before a byte is written."""
        from swarmp2p.node.serving import model_files

        dest = dest or job_file(self.ctx.state.root, job_id, file)
        read = model_files.rpc_reader(
            self.ctx.call_endpoint,
            source,
            lambda f, offset, size: ShardRead(job_id=job_id, file=f, offset=offset, size=size),
        )
        await model_files.pull_file(read, file, dest, None, CHUNK_BYTES, limit=limit)
        return dest

    async def pull_listed(self, msg: FilePull) -> JobAck:
        """``job.file_pull``: copy a snapshot the table lists for the job (``listed_snapshot``),
        refused before any byte or folder is written here. A copy asked for right after the
        leader listed the snapshot may arrive before the table change: it waits for it a
        moment (``Timings.snapshot_listed_s``)."""
        job_file(self.ctx.state.root, msg.job_id, msg.file)  # a name that escapes: bad_field
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ctx.config.timings.snapshot_listed_s
        while True:
            try:
                limit = listed_snapshot(self.ctx.table, msg.job_id, msg.file)
                break
            except UserError as exc:
                if exc.code != "not_listed" or loop.time() >= deadline:
                    raise
            await asyncio.sleep(0.1)
        try:
            await self.pull_file(msg.job_id, msg.file, msg.source, limit)
        except ValueError as exc:
            raise Failed(
                f"node {self.ctx.node_id} refused {msg.file} of job {msg.job_id}: {exc}",
                code="no_file",
            ) from None
        return JobAck(job_id=msg.job_id)

    # --- starting a stage ---------------------------------------------------------------------

    async def start_stage(self, msg: StageStart) -> StageReady | JobAck:
        folder = self.job_dir(msg.job_id)
        inputs = msg.inputs
        try:
            plan = await asyncio.to_thread(
                jobs.check_plan,
                msg.job,
                msg.cluster,
                msg.plan,
                node_id=self.ctx.node_id,
                shape=inputs.shape if inputs is not None else None,
                cuts=msg.cuts,
            )
        except jobs.PlanMismatch:
            raise
        except ValueError as exc:  # no shape in the record, and the model is not readable here
            raise Failed(
                f"node {self.ctx.node_id} cannot read the model to check the plan: {exc}",
                code="input_missing",
            ) from None
        if msg.replica >= plan.n_replicas:
            raise UserError(
                f"the plan has {plan.n_replicas} replica(s), no replica {msg.replica}",
                code="bad_field",
            )
        stage = plan.replica_stages(msg.replica)[msg.stage]
        if stage.node_id != self.ctx.node_id:
            raise UserError(f"stage {msg.stage} is planned on {stage.node_id}", code="bad_field")
        key = (msg.job_id, msg.attempt, msg.replica, msg.stage)
        model, data = await self._local_inputs(msg, stage.files)
        if msg.prepare:
            return JobAck(job_id=msg.job_id)
        await self.stop_job(msg.job_id, -1, keep_attempt=msg.attempt)
        snap_dir = snapshot_dir(folder, [st.layers for st in plan.stages])
        if msg.resume_step and msg.resplit:
            tied = bool(inputs is not None and inputs.shape.tie_embeddings)
            await self._resplit_snapshot(
                msg, snap_dir, stage.layers, plan.n_layers, tied, snapshot_limit(plan)
            )
        elif msg.resume_step:
            await self._ensure_snapshot(msg, snap_dir, snapshot_limit(plan))
        device, visible = jobs.device_for(stage.devices, self.ctx.me.record)
        tokens = None
        if msg.stage == 0 and needs_tokens(msg.job):
            source = msg.job.data
            self._queue(key, we.Phase(name="tokenizing"))  # the leader hears it: nothing runs yet
            self._ensure_sender()
            try:
                tokens = await prepare_tokens(
                    model or msg.job.model.pretrained,
                    str(data) if data is not None else source.source,
                    source.text_field,
                    folder / "data" / "corpus.npz",
                )
            except ValueError as exc:
                raise Failed(f"node {self.ctx.node_id}: {exc}", code="failed") from None
        elif msg.stage == 0 and data is not None:  # a .npy of token ids: read as it is
            tokens = data
        spec = worker_spec(
            msg.job,
            plan,
            msg.stage,
            model=model,
            token=self.ctx.secret.token,
            host=self.ctx.me.addresses[0],
            next_endpoint=msg.next or None,
            device=device,
            snapshot_dir=str(snap_dir),
            export_dir=str(folder / "export") if msg.replica == 0 else None,
            resume=bool(msg.resume_step),
            tokens_path=str(tokens) if tokens is not None else None,
            link_timeout_s=self.ctx.config.timings.link_timeout_s,
            link_keys=self._link_keys(plan, msg.replica, msg.stage),
            **self._ring(plan, msg),
        )
        folder.mkdir(parents=True, exist_ok=True)
        env = worker_env(self.ctx, plan, device, visible)
        self._outbox.setdefault(key, [])
        worker = WorkerProcess(
            job_id=msg.job_id,
            attempt=msg.attempt,
            stage=msg.stage,
            spec=spec.to_dict(),
            env=env,
            on_event=lambda e: self._received(key, e),
            on_exit=lambda code, tail: self._exited(key, code, tail),
            log_path=str(folder / stage_log(msg.replica, msg.stage)),
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
        log.info(
            "job %s attempt %d replica %d stage %d worker up (port %s)", *key, ready.get("port")
        )
        return StageReady(
            job_id=msg.job_id,
            attempt=msg.attempt,
            stage=msg.stage,
            host=self.ctx.me.addresses[0],
            port=int(ready.get("port") or 0),
            replica=msg.replica,
            ring_next_port=int(ready.get("ring_next_port") or 0),
            ring_prev_port=int(ready.get("ring_prev_port") or 0),
        )

    def _link_keys(self, plan: Plan, replica: int, stage: int) -> dict[str, str]:
        """This node's key pair and the neighbouring stages' nodes' public keys: the stage's
        links admit only the members the plan puts next to it (issue 15)."""
        stages = plan.replica_stages(replica)

        def key(i: int) -> str:
            return self.ctx.member_key(stages[i].node_id, f"stage {i}'s node", code="plan_mismatch")

        last = len(stages) - 1
        return {
            "public": self.ctx.key.public,
            "secret": self.ctx.key.secret,
            "prev": key(stage - 1) if stage > 0 else "",
            "next": key(stage + 1) if stage < last else "",
        }

    def _ring(self, plan: Plan, msg: StageStart) -> dict[str, Any]:
        """A replicated stage's ring (``WorkerSpec.ring_*``): the ends the leader had it dial
        and the keys of this stage's members in the replicas before and after it, from the
        member table (the ring admits only them); nothing with one replica."""
        n = plan.n_replicas
        if n == 1:
            return {}

        def key(r: int) -> str:
            node = plan.replica_stages(r)[msg.stage].node_id
            return self.ctx.member_key(node, f"replica {r}'s node", code="plan_mismatch")

        keys = {"public": self.ctx.key.public, "secret": self.ctx.key.secret}
        keys |= {"prev": key((msg.replica - 1) % n), "next": key((msg.replica + 1) % n)}
        return {
            "replica": msg.replica,
            "ring_next": msg.ring_next or None,
            "ring_prev": msg.ring_prev or None,
            "ring_keys": keys,
        }

    async def _local_inputs(
        self, msg: StageStart, planned_files: tuple[str, ...]
    ) -> tuple[str | None, Path | None]:
        """(the model folder this stage loads, stage 0's data file), made local from the
        job's inputs; (None, None) for a job without inputs (each node reads its own)."""
        inputs = msg.inputs
        if inputs is None:
            return None, None
        what = f"job {msg.job_id} stage {msg.stage}"
        try:
            names = stage_files(inputs.model, planned_files)
        except ValueError as exc:
            raise Failed(f"node {self.ctx.node_id}: {what}: {exc}", code="input_missing") from None
        key = (msg.job_id, msg.attempt, msg.replica, msg.stage)
        watch = self.ctx.spawn(self._report_fetch(key, what), f"fetch-phase:{what}")
        try:
            model = await self.inputs.model_folder(inputs.model, names, what=what)
            data = None
            if msg.stage == 0 and inputs.data is not None and reads_data(msg.job):
                data = await self.inputs.data_file(inputs.data, what=f"{what} data")
        finally:
            watch.cancel()
        return model, data

    async def _resplit_snapshot(
        self,
        msg: StageStart,
        snap_dir: Path,
        layers: tuple[int, int],
        n_layers: int,
        tied: bool,
        limit: int,
    ) -> None:
        """This stage's snapshot at ``resume_step`` cut from the old cuts' snapshots (those of
        the old stages holding its blocks, the embeddings or the head), each fetched from a
        holder, by ``python -m swarmp2p.runtime.torch.train.reslice``."""
        from swarmp2p.node.training.corpus import run_module

        start, end = layers
        n = len(msg.plan.stages)
        first, last = msg.stage == 0, msg.stage == n - 1
        name = snapshot_name(msg.resume_step)
        folder = self.job_dir(msg.job_id)
        old_dir = snapshot_dir(folder, [r.layers for r in msg.resplit or ()])
        sources = []
        for old in msg.resplit or ():
            i, (a, b) = old.stage, old.layers
            was_first, was_last = a == 0, b == n_layers
            if (
                not (a < end and start < b)
                and not (first and was_first)
                and not (last and was_last)
            ):
                continue
            dest = old_dir / f"stage-{i}" / name  # where its holders keep it too
            if not dest.is_file():
                file = str(dest.relative_to(folder))
                await self._pull_from(
                    msg, file, [n for n in old.nodes if n != self.ctx.node_id], dest, limit
                )
            sources.append(f"{dest}:{a}:{b}:{int(was_first)}:{int(was_last)}")
        out = snap_dir / f"stage-{msg.stage}" / name  # the new cuts' own folder
        if out.parent.is_dir():  # a later step of an earlier attempt on these cuts: not ours
            for p in out.parent.iterdir():
                step = snapshot_step(p.name)
                if step is not None and step > msg.resume_step:
                    p.unlink()
        args = [str(out), str(msg.stage), str(start), str(end), str(int(first)), str(int(last))]
        try:
            await run_module(
                "swarmp2p.runtime.torch.train.reslice", [*args, str(int(tied)), *sources]
            )
        except ValueError as exc:
            raise Failed(
                f"node {self.ctx.node_id}: re-slicing the step-{msg.resume_step} snapshots for stage {msg.stage}: {exc}",
                code="no_snapshot",
            ) from None
        log.info(
            "job %s stage %d: snapshot of step %d re-sliced from %d old stage(s)",
            msg.job_id,
            msg.stage,
            msg.resume_step,
            len(sources),
        )

    async def _pull_from(
        self, msg: StageStart, file: str, nodes: list[str], dest: Path, limit: int
    ) -> None:
        for node_id in nodes:
            if not self.ctx.is_alive(node_id):
                continue
            with contextlib.suppress(SwarmError, OSError, ValueError):
                await self.pull_file(msg.job_id, file, self.ctx.endpoint_of(node_id), limit, dest)
                return
        raise Failed(
            f"no copy of {file} of job {msg.job_id} is reachable (held by {nodes})",
            code="no_snapshot",
        )

    async def _ensure_snapshot(self, msg: StageStart, snap_dir: Path, limit: int) -> None:
        """Keep only snapshots up to ``resume_step`` here; pull the one needed if missing."""
        stage_dir = snap_dir / f"stage-{msg.stage}"
        name = None
        if stage_dir.is_dir():
            for p in stage_dir.iterdir():
                step = snapshot_step(p.name)
                if step is not None and step > msg.resume_step:
                    p.unlink()
                elif step == msg.resume_step:
                    name = p.name
        if name is not None:
            return
        rel = snap_dir.relative_to(self.job_dir(msg.job_id))
        file = f"{rel}/stage-{msg.stage}/{snapshot_name(msg.resume_step)}"
        for node_id in msg.snapshot_nodes:
            if node_id == self.ctx.node_id or not self.ctx.is_alive(node_id):
                continue
            with contextlib.suppress(SwarmError, OSError, ValueError):
                await self.pull_file(msg.job_id, file, self.ctx.endpoint_of(node_id), limit)
                return
        raise Failed(
            f"no copy of stage {msg.stage}'s snapshot at step {msg.resume_step} is reachable "
            f"(held by {msg.snapshot_nodes})",
            code="no_snapshot",
        )

    # --- reports to the leader --------------------------------------------------------------

    def _received(self, key: Key, raw: dict[str, Any]) -> None:
        """One line of a worker's stdout: checked, queued for the leader; a malformed one is
        logged with the field it got wrong and dropped."""
        try:
            event = decode(raw)
        except SchemaError as exc:
            log.warning("job %s attempt %d replica %d stage %d: %s", *key, exc)
            return
        self._queue(key, event)

    def _queue(self, key: Key, event: WorkerEvent) -> None:
        if isinstance(event, Exported):  # the leader registers the model from it
            with contextlib.suppress(OSError, ValueError):
                manifest = json.loads(Path(event.manifest).read_text())
                if isinstance(manifest, dict):
                    event = dataclasses.replace(event, manifest_data=manifest)
        if isinstance(event, SnapshotSaved):  # the name peers ask this node for
            with contextlib.suppress(ValueError):
                rel = Path(event.path).relative_to(self.job_dir(key[0]))
                event = dataclasses.replace(event, file=str(rel))
        self._outbox.setdefault(key, []).append(event)

    def _exited(self, key: Key, code: int, tail: list[str]) -> None:
        worker = self.workers.get(key)
        error = worker.last_error if worker is not None else None
        self._queue(key, Exited(code=code, stderr_tail=tuple(tail), error=error))

    async def _report_fetch(self, key: Key, what: str) -> None:
        """While stage ``key``'s files are fetched: its bytes so far, each report round."""
        said = None
        while True:
            if (fetch := self.inputs.fetching.get(what)) and (fetch.done, fetch.total) != said:
                said = fetch.done, fetch.total
                self._queue(key, we.Phase(name="fetching", done=fetch.done, total=fetch.total))
                self._ensure_sender()
            await asyncio.sleep(self.ctx.config.timings.report_every_s)

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
                        node_id=self.ctx.node_id,
                        job_id=key[0],
                        attempt=key[1],
                        stage=key[3],
                        events=[encode(e, key[3]) for e in batch],
                        replica=key[2],
                    )
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
            await asyncio.sleep(self.ctx.config.timings.report_every_s)

    def held(self) -> dict[str, int]:
        """Bytes this node's stage workers hold per device (their plans' peaks)."""
        from swarmp2p.node.records import device_key

        out: dict[str, int] = {}
        for job_id, attempt, replica, stage in self.workers:
            entry = self.ctx.table.jobs.get(job_id)
            if entry is None or entry.attempt != attempt or entry.plan is None:
                continue
            if replica >= entry.plan.n_replicas:
                continue
            planned = entry.plan.replica_stages(replica)[stage]
            key = device_key(planned.devices[0])
            out[key] = out.get(key, 0) + int(planned.memory.peak)
        return out

    # --- stopping ---------------------------------------------------------------------------

    async def stop_job(self, job_id: str, attempt: int, keep_attempt: int | None = None) -> None:
        """Stop this node's workers of ``job_id`` (``attempt`` -1: all but ``keep_attempt``)."""
        victims = {
            k: w
            for k, w in self.workers.items()
            if k[0] == job_id and (attempt == -1 or k[1] == attempt) and k[1] != keep_attempt
        }
        await asyncio.gather(*(w.stop() for w in victims.values()))
        for k in victims:
            self.workers.pop(k, None)
            self._outbox.pop(k, None)

    def reap(self) -> None:
        """Stop the workers the table no longer wants (a partition healed, a leader's stop
        message was lost)."""
        for key in stale_workers(self.ctx.table, list(self.workers)):
            log.info("stopping job %s attempt %d replica %d stage %d: the job moved on", *key)
            self.ctx.spawn(self.stop_job(key[0], key[1]), f"reap:{key[0]}")

    async def handle(self, msg: Message) -> Message:
        if isinstance(msg, StageStart):
            return await self.start_stage(msg)
        if isinstance(msg, StageStop):
            await self.stop_job(msg.job_id, msg.attempt)
            return JobAck(job_id=msg.job_id)
        if isinstance(msg, ShardRead):
            return await asyncio.to_thread(self.read, msg)
        if isinstance(msg, FilePull):
            return await self.pull_listed(msg)
        if isinstance(msg, InputRead):
            data, total = await asyncio.to_thread(
                self.inputs.read, msg.kind, msg.key, msg.file, msg.offset, msg.size
            )
            return ShardChunk(data=data, total=total)
        raise Failed(f"a stage host does not take {type(msg).TYPE}", code="internal")

    async def close(self) -> None:
        await asyncio.gather(*(w.stop() for w in list(self.workers.values())))
        self.workers.clear()


def stage_log(replica: int, stage: int) -> str:
    """A stage worker's log in its job's folder (replica 0's: ``stage-N.log``, as before)."""
    return f"stage-{stage}.log" if replica == 0 else f"replica-{replica}-stage-{stage}.log"


__all__ = [
    "CHUNK_BYTES",
    "SNAPSHOT_SLACK",
    "Key",
    "StageHost",
    "job_dir",
    "job_file",
    "listed_snapshot",
    "snapshot_dir",
    "snapshot_limit",
    "stage_log",
]
