"""Every node's side of ``swarm serve``: check the serve plan, make the stage's files local (the
model's files or a trained stage's shard, fetched from a node that has them when this node
holds no intact copy), start a serve worker (``workers.WorkerProcess``), connect it to
the next stage, stop it. Never imports torch."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmp2p.errors import Failed, SwarmError, UserError
from swarmp2p.node.messages import (
    JobAck,
    ServeFileRead,
    ServeShardHold,
    ServeStage,
    ServeStageConnect,
    ServeStageExit,
    ServeStageStart,
    ServeStageStop,
    ShardCopy,
    ShardRead,
)
from swarmp2p.node.records import device_key
from swarmp2p.node.training.jobs import PlanMismatch, device_for
from swarmp2p.node.training.stages import CHUNK_BYTES, worker_env
from swarmp2p.paths import UnsafeName, check_id, confine
from swarmp2p.plan.serve import ServeInputs, ServePlan, ServeStagePlan
from swarmp2p.serve.spec import serve_spec
from swarmp2p.workers import WorkerProcess, exit_message

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from swarmp2p.node.context import NodeContext
    from swarmp2p.node.serving.model_files import Reader
    from swarmp2p.node.training.stages import StageHost
    from swarmp2p.wire.messages import Message

log = logging.getLogger("swarmp2p.node.serving.stages")

SERVE_WORKER_MODULE = "swarmp2p.runtime.serve_worker"


def check_serve_plan(inputs: ServeInputs, plan_json: str, *, node_id: str) -> ServePlan:
    """Plan again from ``inputs`` on this peer; PlanMismatch unless it is byte-identical."""
    mine = inputs.plan()
    if not isinstance(mine, ServePlan):
        raise PlanMismatch(
            f"node {node_id} cannot place this serving ring from the same inputs: "
            f"{mine.reason}; run the same swarmp2p version on every node"
        )
    text = mine.to_json()
    if text != plan_json:
        at = next(
            (i for i, (x, y) in enumerate(zip(text, plan_json)) if x != y),
            min(len(text), len(plan_json)),
        )
        raise PlanMismatch(
            f"node {node_id} computes a different serve plan from the same inputs (first "
            f"difference at byte {at}); run the same swarmp2p version on every node"
        )
    return mine


def _confined(root: Path, name: object, what: str) -> Path:
    """``root / name`` for a name a peer sent, confined to ``root``; UserError otherwise."""
    try:
        return confine(root, name, what=what)
    except UnsafeName as exc:
        raise UserError(str(exc), code="bad_field") from None


class ServeStages:
    """This node's serve workers."""

    HANDLES = (ServeStageStart, ServeShardHold, ServeStageConnect, ServeStageStop)
    """The messages :meth:`handle` takes (the serving dispatch forwards these here)."""

    def __init__(self, ctx: NodeContext, stage_host: StageHost) -> None:
        self.ctx = ctx
        self.stage_host = stage_host
        self.workers: dict[tuple[str, int, int], WorkerProcess] = {}
        self._pulls: dict[str, asyncio.Lock] = {}
        self._issuers: dict[str, tuple[str, float]] = {}
        """serve id -> (issuing node, when its first stage started here)."""
        self._claims: dict[str, tuple[set[str], float]] = {}
        """node -> (the serve ids its last heartbeat claimed, when it came)."""
        self._held: dict[tuple[str, int, int], tuple[str, int]] = {}
        """worker key -> (device, the bytes its placement priced): what serving holds here."""

    # --- workers nobody issues any more ---------------------------------------------------------

    def issuer_claims(self, node_id: str, serving: list | None, now: float) -> None:
        """A heartbeat from ``node_id`` lists the serve ids it issues (None: a peer that does
        not say; its workers are then reaped only when it dies)."""
        if serving is not None:
            self._claims[node_id] = ({str(s) for s in serving}, now)

    def reap(self, alive: set[str], mine: set[str], now: float) -> None:
        """Stop the workers of every serve id whose issuer died, or no longer claims it (it
        restarted, or stopped serving while this node was unreachable)."""
        grace = 2 * self.ctx.config.heartbeat_s
        for serve_id in sorted({k[0] for k in self.workers}):
            issuer, since = self._issuers.get(serve_id, ("", now))
            if issuer == self.ctx.node_id:
                why = None if serve_id in mine else "this node no longer serves it"
            elif issuer not in alive:
                why = f"its issuing node {issuer} is gone"
            else:
                claimed, at = self._claims.get(issuer, (None, 0.0))
                stale = claimed is not None and at > since + grace and serve_id not in claimed
                why = f"its issuing node {issuer} no longer serves it" if stale else None
            if why is not None:
                log.warning("stopping the serve workers of %s: %s", serve_id, why)
                victims = [self.workers.pop(k) for k in list(self.workers) if k[0] == serve_id]
                self.ctx.spawn(_stop_all(victims), f"serve-reap:{serve_id}")
        running = {k[0] for k in self.workers}
        for serve_id in [s for s in self._issuers if s not in running]:
            del self._issuers[serve_id]

    def issuer_of(self, serve_id: str) -> str | None:
        """The issuing node of the stages of ``serve_id`` on this node (None: none runs)."""
        found = self._issuers.get(serve_id)
        return found[0] if found is not None else None

    def _authorize(
        self, msg: ServeStageStart | ServeStageConnect | ServeStageStop, sender: str
    ) -> None:
        """Only a serve id's issuing node, or the leader, commands its stages here (its
        issuer is the one this node recorded when it started the first of them)."""
        from swarmp2p.node.cluster import authz

        leaders = {self.ctx.leader, self.ctx.table.leader}
        claimants = frozenset(n for n, (ids, _) in self._claims.items() if msg.serve_id in ids)
        why = authz.serve_refusal(msg, sender, self.issuer_of(msg.serve_id), leaders, claimants)
        if why:
            raise UserError(why, code="forbidden")

    async def handle(self, msg: Message, sender: str | None = None) -> Message:
        """Answer ``msg`` from node ``sender`` (None: this node)."""
        sender = sender or self.ctx.node_id
        if isinstance(msg, (ServeStageStart, ServeStageConnect, ServeStageStop)):
            self._authorize(msg, sender)
        if isinstance(msg, ServeStageStart):
            return await self.start(msg)
        if isinstance(msg, ServeShardHold):
            return await self.hold_shard(msg)
        if isinstance(msg, ServeStageConnect):
            worker = self._worker(msg.serve_id, msg.attempt, msg.stage)
            try:
                await worker.send_line({"op": "connect", "next": msg.next})
                await worker.wait_event("serving", self.ctx.config.timings.serve_stage_connect_s)
            except (RuntimeError, OSError) as exc:
                raise Failed(f"node {self.ctx.node_id}: {exc}", code="stage_failed") from None
            return ServeStage(
                serve_id=msg.serve_id,
                attempt=msg.attempt,
                stage=msg.stage,
                endpoint="",
                state="serving",
            )
        if isinstance(msg, ServeStageStop):
            return await self._stop(msg, sender)
        raise UserError(f"a serve stage does not take {type(msg).TYPE}", code="bad_request")

    async def _stop(self, msg: ServeStageStop, sender: str) -> ServeStage:
        """Stop the workers ``msg`` names; one the issuer did not ask to stop (the leader
        did) is reported to the issuer as it would be had it died, so its ring fails over
        instead of waiting for tokens that never come."""
        issuer = self.issuer_of(msg.serve_id)
        keys = [
            k
            for k in self.workers
            if k[0] == msg.serve_id and k[1] == msg.attempt and (msg.stage < 0 or k[2] == msg.stage)
        ]
        await asyncio.gather(*(self.workers.pop(key).stop() for key in keys))
        if issuer is not None and sender != issuer:
            for key in keys:
                log.warning("serve worker %s stage %d stopped by node %s", key[0], key[2], sender)
                exited = ServeStageExit(
                    serve_id=key[0],
                    attempt=key[1],
                    stage=key[2],
                    node_id=self.ctx.node_id,
                    message=f"stopped by node {sender}",
                )
                self.ctx.spawn(self._report_exit(issuer, exited), f"serve-exit:{key}")
        return ServeStage(
            serve_id=msg.serve_id,
            attempt=msg.attempt,
            stage=msg.stage,
            endpoint="",
            state="stopped",
        )

    async def _report_exit(self, issuer: str, msg: ServeStageExit) -> None:
        try:
            await self.ctx.call(issuer, msg, self.ctx.config.timings.serve_stage_connect_s)
        except SwarmError as exc:
            log.info("could not tell %s that a serve worker died: %s", issuer, exc)

    def _worker(self, serve_id: str, attempt: int, stage: int) -> WorkerProcess:
        worker = self.workers.get((serve_id, attempt, stage))
        if worker is None:
            raise UserError(
                f"no serve worker {serve_id} attempt {attempt} stage {stage} on node "
                f"{self.ctx.node_id}",
                code="bad_field",
            )
        return worker

    # --- the files a stage loads ---------------------------------------------------------------

    def _lock(self, key: str) -> asyncio.Lock:
        return self._pulls.setdefault(key, asyncio.Lock())

    def _reader(self, node_id: str, read_msg: Callable[[str, int, int], Message]) -> Reader:
        """A model_files Reader over RPC: ``read_msg(file, offset, size)`` is the request."""
        from swarmp2p.node.serving.model_files import rpc_reader

        return rpc_reader(self.ctx.call_endpoint, self.ctx.endpoint_of(node_id), read_msg)

    async def _local_model(
        self, msg: ServeStageStart, planned: ServeStagePlan, n_stages: int
    ) -> str:
        """The folder this stage loads: only the files its blocks read made local, from this
        node's own copy when it matches the issuer's listing (at the same path, or its
        embedded model), else fetched (``node.inputs``: the issuer first, then any node that
        holds them, into ``<state>/models/<digest>``); a Hub model's from the Hub."""
        from swarmp2p.models import embedded_dir

        start, end = planned.layers
        layers = (start, end, planned.index == 0, planned.index == n_stages - 1)
        reader = None
        if msg.issuer != self.ctx.node_id:
            serve_id = msg.serve_id
            reader = self._reader(
                msg.issuer,
                lambda f, o, n: ServeFileRead(serve_id=serve_id, file=f, offset=o, size=n),
            )
        return await self.stage_host.inputs.serve_stage_folder(
            msg.model,
            msg.files,
            issuer=msg.issuer,
            revision=msg.revision,
            layers=layers,
            what=f"serve {msg.serve_id} stage {msg.stage}",
            first_reader=reader,
            also=[embedded_dir()] if msg.embedded else [],
        )

    async def _local_shard(
        self, ask: dict[str, Any], stage: int, announce: bool = True
    ) -> tuple[str, str | None]:
        """(shard folder, tied-head file or None) of trained stage ``stage`` on this node: the
        copy in its job folder when intact, else fetched from a holder first (and then listed
        in the registry: this node tells the leader it holds a copy)."""
        from swarmp2p.node.serving import model_files

        job_id = str(ask.get("job_id", ""))
        job_dir = self.stage_host.job_dir(job_id)
        rel = str(ask.get("folder", ""))
        folder = _confined(job_dir, rel, "shard folder")
        files = ask.get("files")
        if not isinstance(files, dict) or not files:
            raise UserError(f"shard {rel}: no file list", code="bad_field")
        for name in files:
            _confined(job_dir, f"{rel}/{name}", "shard file")

        def intact() -> bool:
            try:
                manifest = json.loads((folder / "manifest.json").read_text())
            except (OSError, ValueError):
                return False
            if manifest.get("files") != files:
                return False
            return all(
                (folder / n).is_file() and model_files.sha256_file(folder / n) == sha
                for n, sha in files.items()
            )

        def job_reader(node: str, prefix: str) -> Reader:
            if node == self.ctx.node_id:
                return model_files.local_reader(job_dir / prefix)
            return self._reader(
                node,
                lambda f, o, n: ShardRead(job_id=job_id, file=f"{prefix}/{f}", offset=o, size=n),
            )

        async def from_any(
            sources: list[str], what: str, fetch: Callable[[str], Awaitable[object]]
        ) -> None:
            errors = []
            for node in sources:
                if node == self.ctx.node_id and what == "shard":
                    continue  # this node's copy is the damaged one
                try:
                    await fetch(node)
                    return
                except (SwarmError, OSError, ValueError) as exc:
                    errors.append(f"{node}: {exc}")
            raise Failed(
                f"cannot fetch {what} of job {job_id} from any holder ("
                + ("; ".join(errors) or "none alive")
                + ")",
                code="no_file",
            )

        async with self._lock(str(folder)):
            if not await asyncio.to_thread(intact):
                log.info("fetching shard %s of job %s", rel, job_id)
                await from_any(
                    list(ask.get("sources") or []),
                    "shard",
                    lambda node: model_files.pull_files(
                        job_reader(node, rel),
                        {**files, "manifest.json": None},
                        folder,
                        CHUNK_BYTES,
                        last="manifest.json",
                    ),
                )
                if not await asyncio.to_thread(intact):
                    raise Failed(
                        f"shard {rel} of job {job_id}: its manifest lists other files than the registry",
                        code="no_file",
                    )
                if announce:
                    self.ctx.spawn(self._announce(job_id, stage), f"shard-copy:{job_id}:{stage}")
        tied = ask.get("tied")
        if not tied:
            return str(folder), None
        file = str(tied.get("file", ""))
        _confined(job_dir, file, "tied head file")
        dest = job_dir / "serve" / (file.replace("/", "-") + ".head.safetensors")
        async with self._lock(str(dest)):
            if not dest.is_file():
                prefix, name = file.rsplit("/", 1)
                await from_any(
                    list(tied.get("sources") or []),
                    f"{file}'s embedding",
                    lambda node: model_files.pull_non_block_tensors(
                        job_reader(node, prefix), name, dest, CHUNK_BYTES
                    ),
                )
        return str(folder), str(dest)

    async def _announce(self, job_id: str, stage: int) -> bool:
        """Tell the leader this node holds a copy of ``stage``'s shard (only the holder may):
        the registry lists it, so serving and ``swarm export`` find it when the node that
        trained the stage is gone. Best effort: a copy it misses is only not found later."""
        note = ShardCopy(job_id=job_id, stage=stage, node_id=self.ctx.node_id)
        try:
            await self.ctx.to_leader(note, 10.0)
        except SwarmError as exc:
            log.info(
                "the registry does not list this node's copy of stage %d of %s: %s",
                stage,
                job_id,
                exc,
            )
            return False
        return True

    async def hold_shard(self, msg: ServeShardHold) -> JobAck:
        """A standby copy: make stage ``msg.stage``'s shard local and have it listed."""
        shard = {**msg.shard, "tied": None}
        try:
            await self._local_shard(shard, msg.stage, announce=False)
        except (ValueError, OSError) as exc:
            raise Failed(f"node {self.ctx.node_id}: {exc}", code="no_file") from None
        await self._announce(str(shard.get("job_id", "")), msg.stage)
        return JobAck(job_id=str(shard.get("job_id", "")))

    # --- starting a stage ----------------------------------------------------------------------

    async def start(self, msg: ServeStageStart) -> ServeStage:
        me = self.ctx.node_id
        try:
            check_id(msg.serve_id, what="serve id")
        except UnsafeName as exc:
            raise UserError(str(exc), code="bad_field") from None
        try:
            plan = await asyncio.to_thread(check_serve_plan, msg.inputs, msg.plan, node_id=me)
        except PlanMismatch:
            raise
        except ValueError as exc:
            raise Failed(
                f"node {me} cannot check the serve plan: {exc}", code="plan_mismatch"
            ) from None
        if msg.stage >= len(plan.stages):
            raise UserError(
                f"stage {msg.stage}: the plan has {len(plan.stages)} stage(s)", code="bad_field"
            )
        planned = plan.stages[msg.stage]
        if planned.node_id != me:
            raise UserError(
                f"stage {msg.stage} is planned on {planned.node_id}, not {me}", code="bad_field"
            )
        key = (msg.serve_id, msg.attempt, msg.stage)
        if key in self.workers:
            raise UserError(f"stage {msg.stage} of {msg.serve_id} already runs", code="exists")
        device, visible = device_for([planned.device], self.ctx.me.record)
        link_keys = self._link_keys(plan, msg.stage, msg.issuer)
        try:
            model = await self._local_model(msg, planned, len(plan.stages))
            shard, tied = (
                await self._local_shard(msg.shard, msg.stage) if msg.shard else (None, None)
            )
        except (ValueError, OSError) as exc:
            raise Failed(f"node {me}: {exc}", code="stage_failed") from None
        spec = serve_spec(
            plan,
            msg.stage,
            model=model,
            token=self.ctx.secret.token,
            host=self.ctx.me.addresses[0],
            device=device,
            shard=shard,
            tied_head=tied,
            link_keys=link_keys,
            draft=msg.inputs.draft if msg.stage == 0 else None,
        )
        env = worker_env(self.ctx, plan, device, visible)
        issuer, _ = self._issuers.setdefault(msg.serve_id, (msg.issuer, self.ctx.clock()))
        if issuer != msg.issuer:  # another issuer's start of the same id got here meanwhile
            raise UserError(
                f"serve.stage_start for serve {msg.serve_id}: it is issued by node {issuer}, not by node {msg.issuer}",
                code="forbidden",
            )
        log_dir = self.ctx.state.root / "serve"
        log_dir.mkdir(parents=True, exist_ok=True)
        worker: WorkerProcess | None = None

        def on_exit(code: int, tail: list[str]) -> None:
            why = exit_message(code) + (f": {tail[-1]}" if tail else "")
            log.warning("serve worker %s stage %d %s", msg.serve_id, msg.stage, why)
            if self.workers.get(key) is worker:
                self.workers.pop(key)
            exited = ServeStageExit(
                serve_id=msg.serve_id, attempt=msg.attempt, stage=msg.stage, node_id=me, message=why
            )
            self.ctx.spawn(self._report_exit(msg.issuer, exited), f"serve-exit:{key}")

        worker = WorkerProcess(
            job_id=msg.serve_id,
            attempt=msg.attempt,
            stage=msg.stage,
            spec=spec.to_dict(),
            env=env,
            on_event=lambda event: None,
            on_exit=on_exit,
            log_path=str(log_dir / f"{msg.serve_id}-{msg.attempt}-{msg.stage}.log"),
            module=SERVE_WORKER_MODULE,
            keep_stdin=True,
        )
        self.workers[key] = worker
        self._held[key] = (device_key(planned.device), int(planned.memory.peak))
        try:
            await worker.start()
            ready = await worker.wait_event("ready", self.ctx.config.timings.serve_stage_load_s)
        except (RuntimeError, OSError) as exc:
            self.workers.pop(key, None)
            await worker.stop()
            raise Failed(f"node {me}: {exc}", code="stage_failed") from None
        return ServeStage(
            serve_id=msg.serve_id,
            attempt=msg.attempt,
            stage=msg.stage,
            endpoint=str(ready["endpoint"]),
            state="ready",
        )

    def _link_keys(self, plan: ServePlan, stage: int, issuer: str) -> dict[str, str]:
        """This node's key pair and its ring neighbours' public keys (issue 15): the stage
        before's node (the issuing node, which dials stage 0) is the only client its bound
        link admits; it dials the next stage's node (the last stage: the issuer's return
        link)."""

        def key(i: int) -> str:
            node_id, what = (
                (plan.stages[i].node_id, f"stage {i}'s node")
                if 0 <= i < len(plan.stages)
                else (issuer, "the issuing node")
            )
            return self.ctx.member_key(node_id, what, code="plan_mismatch")

        return {
            "public": self.ctx.key.public,
            "secret": self.ctx.key.secret,
            "prev": key(stage - 1),
            "next": key(stage + 1),
        }

    def held(self) -> dict[str, int]:
        """Bytes this node's serve workers hold per device (their placements' prices)."""
        out: dict[str, int] = {}
        for key, (device, nbytes) in list(self._held.items()):
            if key not in self.workers:
                del self._held[key]
                continue
            out[device] = out.get(device, 0) + nbytes
        return out

    async def close(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers.values()))
        self.workers.clear()


async def _stop_all(workers: list) -> None:
    """Stop ``workers`` at once (a coroutine: ``ctx.spawn`` names a task, not a gather's
    future, whose missing ``set_name`` failed the heartbeat round that reaped them)."""
    await asyncio.gather(*(w.stop() for w in workers))


__all__ = ["ServeStages", "check_serve_plan"]
