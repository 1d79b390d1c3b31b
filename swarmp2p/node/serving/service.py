"""``swarm serve`` across the swarm: the local API's serve/stop/list, the HTTP API on the
issuing node, restoring served models after a restart, and failover. Never imports torch.

Roles (each in its own module):

- The issuing node (the one whose CLI ran ``swarm serve``) parses the ServeRequest, asks the
  leader for a plan (``serve.plan``), starts one serve worker per stage on the stages' nodes
  and connects them (``node/serving/ring.py``), drives the ring with a
  :class:`~swarmp2p.serve.RingClient` and answers the OpenAI-compatible API on
  ``--host``/``--port``.
- The leader plans the ring with ``plan.serve.plan_serve`` over the live nodes' records: the
  dtype rules, memory priced with the KV cache, the split training uses, a trained model's
  stages where their shards are.
- Every stage's node recomputes the plan from the same inputs and refuses a mismatch, makes
  the stage's files local and runs its worker (``node/serving/stages.py``).
- Once a trained model serves, every shard gets a standby copy (``node/serving/standby.py``).

Failover: each heartbeat round the issuing node checks that every stage's node is alive. When
one is lost it re-plans on the live nodes, stops the survivors' old workers, starts a new ring
and hands it to ``RingClient.reroute``: every open session replays its prompt and the tokens
generated so far, so a greedy request completes with the same text. When no placement fits,
every open request fails at once with the reason, and the ring is retried each round.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmp2p._atomic import write_atomic
from swarmp2p._tasks import cancel_all
from swarmp2p.errors import Failed, SwarmError, UserError
from swarmp2p.node.messages import ServeFileRead, ServePlace, ServeStage, ServeStageExit, ShardChunk
from swarmp2p.node.serving import ring as serve_ring
from swarmp2p.node.serving.model import resolve_model, trained_entry, trained_settings
from swarmp2p.node.serving.ring import Served
from swarmp2p.node.serving.stages import ServeStages
from swarmp2p.node.serving.standby import Standby
from swarmp2p.node.table.registry import holders
from swarmp2p.plan.model_shape import EMBEDDED
from swarmp2p.plan.serve import parse_serve_request
from swarmp2p.schema import SchemaError

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext
    from swarmp2p.node.training.leader import JobsLeader
    from swarmp2p.node.training.stages import StageHost

log = logging.getLogger("swarmp2p.node.serving.service")

MAX_CRASH_REBUILDS = 3
"""Rings rebuilt after worker crashes (not node losses) before the model is left degraded."""
STEP_TIMEOUT_S = 60.0
"""A session that gets no token for this long fails (covers a re-placement's reload)."""
SAVED_FILE = "served.json"
RESTORE_FOR_S = 600.0
"""How long a restarted daemon keeps trying to serve its saved models again."""
RESTORE_EVERY_S = 5.0


class Serving:
    """The serving side of one daemon (issuing node, leader and stage host at once)."""

    def __init__(self, ctx: NodeContext, stage_host: StageHost, jobs: JobsLeader) -> None:
        self.ctx = ctx
        self.stage_host = stage_host
        self.jobs = jobs
        self.served: dict[str, Served] = {}
        self.stages = ServeStages(ctx, stage_host)
        self.standby = Standby(ctx, stage_host)
        self._serving_lock = asyncio.Lock()
        self._restoring: dict[str, tuple[dict[str, Any], str, asyncio.Task | None]] = {}
        """name -> (request, why it does not serve yet, its retry task): saved models being
        served again after this daemon restarted."""

    # --- served models outlive a restart of this daemon ----------------------------------------

    @property
    def _saved_file(self) -> Path:
        return self.ctx.state.root / "serve" / SAVED_FILE

    def _save(self) -> None:
        """Record the requests of every served (and still restoring) model, 0600: a request
        may hold an API key."""
        saved = {name: req for name, (req, _, _) in self._restoring.items()}
        saved.update({name: s.request.to_dict() for name, s in self.served.items()})
        write_atomic(self._saved_file, json.dumps(saved, indent=2, sort_keys=True), mode=0o600)

    def restore(self) -> None:
        """Serve again what this node served when it stopped (``swarm serve --stop`` forgets a
        model); each is retried until it serves or RESTORE_FOR_S has passed."""
        try:
            saved = json.loads(self._saved_file.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s (%s); serving nothing again", self._saved_file, exc)
            return
        for name, req in sorted(saved.items()) if isinstance(saved, dict) else []:
            if isinstance(req, dict):
                task = self.ctx.spawn(self._restore(name, req), f"serve-restore:{name}")
                self._restoring[name] = (req, "waiting for the swarm to gather", task)

    async def _restore(self, name: str, req: dict[str, Any]) -> None:
        await asyncio.sleep(2 * self.ctx.config.failure_timeout_s)  # peers find each other first
        deadline = self.ctx.clock() + RESTORE_FOR_S
        while True:
            try:
                await self._api_serve(req, restoring=True)
            except (SwarmError, ValueError, OSError) as exc:
                self._restoring[name] = (req, str(exc), self._restoring[name][2])
                if self.ctx.clock() > deadline:
                    log.warning("gave up serving %s again after a restart: %s", name, exc)
                    self._restoring[name] = (req, f"gave up: {exc}", None)
                    return
                await asyncio.sleep(RESTORE_EVERY_S)
                continue
            self._restoring.pop(name, None)
            log.info("serving %s again after a restart", name)
            return

    # --- status and the local API -------------------------------------------------------------

    def issued(self) -> list[str]:
        """The serve ids this node issues now (sent with every heartbeat)."""
        return sorted(s.serve_id for s in self.served.values())

    def status(self) -> list[dict[str, Any]]:
        views = {name: s.view() for name, s in self.served.items()}
        for name, (_, why, task) in self._restoring.items():
            views.setdefault(
                name,
                {
                    "model": name,
                    "trained": None,
                    "url": "",
                    "failovers": 0,
                    "replayed": 0,
                    "state": "restoring" if task is not None else "failed",
                    "reason": why,
                    "dtype": None,
                    "max_context": None,
                    "stages": [],
                },
            )
        return [views[name] for name in sorted(views)]

    def api_handlers(self) -> dict[str, Any]:
        return {
            "serve": self._api_serve,
            "serve_stop": self._api_stop,
            "served": self._api_list,
            "serve_endpoint": self._api_endpoint,
        }

    async def _api_list(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        return self.status()

    async def _api_endpoint(self, req: dict[str, Any]) -> dict[str, Any]:
        """Where a model served from this node answers, and its API key (for `swarm generate`
        and `swarm chat`: the local socket is its owner's alone)."""
        name = req.get("model")
        served = self.served.get(name) if isinstance(name, str) else None
        if served is None or not served.url:
            known = ", ".join(sorted(n for n, s in self.served.items() if s.url)) or "none"
            raise UserError(
                f"model {name!r} is not served from this node (served: {known})", code="not_served"
            )
        return {"model": served.name, "url": served.url, "api_key": served.request.api_key}

    async def _api_stop(self, req: dict[str, Any]) -> dict[str, Any]:
        name = req.get("model")
        served = self.served.get(name) if isinstance(name, str) else None
        pending = self._restoring.pop(name, None) if isinstance(name, str) else None
        if pending is not None and pending[2] is not None:
            pending[2].cancel()
        if served is None and pending is None:
            known = ", ".join(sorted({*self.served, *self._restoring})) or "none"
            raise UserError(
                f"model {name!r} is not served from this node (served: {known})", code="not_served"
            )
        if served is not None:
            await self._teardown(served)
            self.served.pop(served.name, None)
        await asyncio.to_thread(self._save)
        log.info("stopped serving %s", name)
        return {"model": name, "stopped": True}

    async def _api_serve(self, req: dict[str, Any], restoring: bool = False) -> dict[str, Any]:
        served = await self._parse(req)
        if not restoring and served.name in self._restoring:
            raise UserError(
                f"model {served.name!r} is being served again after a restart "
                f"({self._restoring[served.name][1]}); `swarm serve --stop {served.name}` first",
                code="exists",
            )
        async with self._serving_lock:
            if served.name in self.served:
                raise UserError(
                    f"model {served.name!r} is already served at {self.served[served.name].url}; "
                    f"`swarm serve --stop {served.name}` first",
                    code="exists",
                )
            self.served[served.name] = served
        try:
            await self._open(served)
        except BaseException:
            try:  # still listed while its workers stop: reap() would stop them unawaited
                await self._teardown(served)
            finally:
                self.served.pop(served.name, None)
            raise
        served.state = "serving"
        log.info(
            "serving %s at %s on %d stage(s)", served.name, served.url, len(served.plan.stages)
        )
        self._restoring.pop(served.name, None)
        await asyncio.to_thread(self._save)
        self._spawn_standby(served)
        return served.view()

    async def _parse(self, req: dict[str, Any]) -> Served:
        try:
            request = parse_serve_request({k: v for k, v in req.items() if k != "op"})
        except SchemaError as exc:
            raise UserError(str(exc), code="bad_field") from None
        serve_ring.check_request(request)
        model = request.model
        trained = trained_entry(self.ctx.table, model)
        model_arg = model
        if trained is None and request.cwd and model != EMBEDDED and not os.path.isabs(model):
            here = os.path.join(request.cwd, os.path.expanduser(model))
            model_arg = os.path.abspath(here) if os.path.isdir(here) else model
        dtype, quantization = request.dtype, request.quantization
        if trained is not None:
            dtype, quantization = trained_settings(trained, request.stages, dtype, quantization)
        job = self.ctx.table.jobs.get(str(trained["job_id"])) if trained else None
        # a Hub model, or a trained model's base this node lacks, is read from elsewhere
        here = await self.stage_host.inputs.serve_model(
            trained["base"] if trained else model_arg,
            trained=job.inputs if job is not None else None,
            local=lambda ref: resolve_model(ref, trained),
        )
        folder, shape = here.folder, here.shape
        return Served(
            request=request,
            serve_id=f"s{int(time.time() * 1000) % 10**10}-{os.getpid() % 1000}",
            folder=folder,
            shape=shape,
            dtype=dtype,
            quantization=quantization,
            trained=trained,
            holders=[holders(st) for st in trained["manifest"]["stages"]] if trained else [],
            embedded=model == EMBEDDED or (trained is not None and trained["base"] == EMBEDDED),
            files=here.files,
            local=here,
        )

    # --- opening and closing a served model ----------------------------------------------------

    async def _open(self, served: Served) -> None:
        from swarmp2p.net import SecureContext
        from swarmp2p.serve import ServedModel, build_app
        from swarmp2p.serve.api import ApiServer
        from swarmp2p.serve.text import TextCodec

        served.ctx = SecureContext()
        codec_folder = served.local.codec if served.local is not None else served.folder
        codec = await asyncio.to_thread(TextCodec.from_folder, codec_folder)
        if served.files is None and os.path.isdir(served.folder):
            from swarmp2p.node.serving.model_files import folder_listing

            try:
                served.files = await asyncio.to_thread(folder_listing, served.folder)
            except (OSError, ValueError) as exc:
                raise Failed(f"model {served.name!r}: {exc}", code="no_file") from None
        plan, ends = await self._build(served)
        served.client = ends.open_client(plan, step_timeout=STEP_TIMEOUT_S)
        model = ServedModel(
            name=served.name, client=served.client, codec=codec, max_context=plan.max_context
        )
        req = served.request
        served.api = ApiServer(build_app([model], api_key=req.api_key), req.host, req.port)
        try:
            served.url = await served.api.start_async()  # on this daemon's loop
        except OSError as exc:
            served.api = None
            raise UserError(
                f"port: cannot listen on {req.host}:{req.port}: {exc}", code="bad_field"
            ) from None

    async def _build(self, served: Served) -> Any:
        return await serve_ring.build(
            self.ctx, served, lambda i, node: self.standby.note_copy(served, i, node)
        )

    async def _teardown(self, served: Served) -> None:
        await cancel_all(served.rebuilding)
        if served.api is not None:
            await served.api.close_async()
            served.api = None
        if served.client is not None:
            await asyncio.to_thread(served.client.close)
            served.client = None
        if served.live_attempt and served.plan is not None:
            nodes = {s.node_id for s in served.plan.stages}
            await serve_ring.stop_stages(self.ctx, served.serve_id, served.live_attempt, nodes)
        for link in served.links:
            link.close()
        served.links = []
        if served.ctx is not None:
            from swarmp2p.net import stop_zero_copy_collector

            stop_zero_copy_collector()
            served.ctx.destroy(0)
            served.ctx = None

    async def close(self) -> None:
        for served in list(self.served.values()):
            with contextlib.suppress(Exception):
                await self._teardown(served)
        self.served.clear()
        await self.stages.close()

    # --- failover -------------------------------------------------------------------------------

    def tick(self) -> None:
        """Each heartbeat round: stop stage workers nobody issues any more; rebuild a ring that
        lost a stage node."""
        alive = set(self.ctx.live_nodes())
        self.stages.reap(alive, set(self.issued()), self.ctx.clock())
        for served in self.served.values():
            self._check(served, alive)

    def _check(self, served: Served, alive: set[str]) -> None:
        """Fail the open requests of a failed model; rebuild a ring that lost a stage node or
        a stage's worker (unless a rebuild runs)."""
        if served.state == "failed" and served.client is not None:
            _fail_open(served.client, served.reason)  # requests sent since fail at once
            return
        if served.state not in ("serving", "degraded") or served.client is None:
            return
        if served.rebuilding is not None and not served.rebuilding.done():
            return
        placed = {s.node_id for s in served.plan.stages} if served.plan else set()
        lost = sorted(placed - alive)
        if served.crashed and not lost and served.state == "serving":
            served.crash_rebuilds += 1
            if served.crash_rebuilds > MAX_CRASH_REBUILDS:
                reason = f"stage worker(s) died {served.crash_rebuilds} times; last: " + "; ".join(
                    f"stage {i}: {m}" for i, m in sorted(served.crashed.items())
                )
                served.state, served.reason = "failed", reason
                log.warning("serving %s: %s; giving up", served.name, reason)
                _fail_open(served.client, reason)
                return
        if lost or served.crashed or served.state == "degraded":
            served.rebuilding = self.ctx.spawn(
                self._failover(served, lost), f"serve-failover:{served.name}"
            )

    def _rebuild_grace_s(self) -> float:
        return 2 * self.ctx.config.failure_timeout_s

    async def _failover(self, served: Served, lost: list[str]) -> None:
        died = "; ".join(f"stage {i}: {m}" for i, m in sorted(served.crashed.items()))
        if lost:
            what = f"a stage node was lost ({', '.join(lost)})"
        elif died:
            what = f"stage worker(s) ended ({died})"
        else:
            what = "a stage node was lost (earlier)"
        if lost or died:
            log.warning("serving %s: %s; re-placing", served.name, what)
            if served.state == "serving":  # `swarm status` says why while the ring is rebuilt
                served.reason = f"{what}; re-placing"
        old_attempt = served.live_attempt
        old_nodes = {s.node_id for s in served.plan.stages} if served.plan else set()
        try:
            _, ends = await self._build(served)
        except (SwarmError, RuntimeError, OSError) as exc:
            reason = f"{what} and the model cannot be re-placed on the live nodes: {exc}"
            if served.state != "degraded" or served.reason != reason:
                log.warning("serving %s: %s", served.name, reason)
            now = time.monotonic()
            if served.degraded_since is None:
                served.degraded_since = now
            served.state, served.reason = "degraded", reason
            # The leader may still count the lost node alive for up to a failure timeout and
            # place a stage on it: keep the open sessions and retry each round for a grace of
            # two failure timeouts; only then fail them, with the reason.
            if now - served.degraded_since > self._rebuild_grace_s():
                _fail_open(served.client, reason)
            return
        await serve_ring.stop_stages(self.ctx, served.serve_id, old_attempt, old_nodes)
        served.replayed += served.client.active
        olds = await asyncio.to_thread(served.client.reroute, ends.first, ends.back)
        for link in olds:
            link.close()
            with contextlib.suppress(ValueError):
                served.links.remove(link)
        served.failovers += 1
        served.state, served.reason, served.degraded_since = "serving", "", None
        self._spawn_standby(served)

    def _spawn_standby(self, served: Served) -> None:
        self.standby.spawn(served, lambda: self.served.get(served.name) is served)

    # --- every node: dispatch ---------------------------------------------------------------

    async def handle(self, msg: Any, sender: str | None = None) -> Any:
        """Answer ``msg`` from node ``sender`` (None: this node)."""
        if isinstance(msg, ServePlace):
            return serve_ring.place(self.ctx, msg)
        if isinstance(msg, ServeFileRead):
            return await self._read_file(msg)
        if isinstance(msg, ServeStageExit):
            return self._stage_exited(msg)
        if isinstance(msg, ServeStages.HANDLES):
            return await self.stages.handle(msg, sender)
        raise UserError(f"serving does not take {type(msg).TYPE}", code="bad_request")

    def _stage_exited(self, msg: ServeStageExit) -> ServeStage:
        """A stage's node says the worker of a stage of the live ring ended (it died, or the
        leader stopped it): the ring is rebuilt now, not at the next round, so a request in
        flight waits for the rebuild rather than for tokens that never come."""
        from swarmp2p.node.cluster import authz

        served = next((s for s in self.served.values() if s.serve_id == msg.serve_id), None)
        live = served is not None and served.live_attempt == msg.attempt and served.plan
        nodes = [s.node_id for s in served.plan.stages] if live else None
        why = authz.serve_exit_refusal(msg, nodes)
        if why:
            raise UserError(why, code="forbidden")
        if live:
            served.crashed[msg.stage] = f"node {msg.node_id}: {msg.message}"
            self._check(served, set(self.ctx.live_nodes()))
        return ServeStage(
            serve_id=msg.serve_id,
            attempt=msg.attempt,
            stage=msg.stage,
            endpoint="",
            state="exited",
        )

    async def _read_file(self, msg: ServeFileRead) -> ShardChunk:
        """A chunk of a file of a folder model this node serves (to a stage node fetching it)."""
        from swarmp2p.node.training.stages import CHUNK_BYTES

        served = next((s for s in self.served.values() if s.serve_id == msg.serve_id), None)
        if served is None or not served.files or msg.file not in served.files:
            raise Failed(
                f"node {self.ctx.node_id} serves no file {msg.file!r} of {msg.serve_id}",
                code="no_file",
            )
        if not 0 < msg.size <= CHUNK_BYTES or msg.offset < 0:
            raise UserError(f"size must be in 1..{CHUNK_BYTES}, offset >= 0", code="bad_field")

        def read() -> ShardChunk:
            with open(os.path.join(served.folder, msg.file), "rb") as f:
                total = os.fstat(f.fileno()).st_size
                f.seek(msg.offset)
                return ShardChunk(data=f.read(msg.size), total=total)

        try:
            return await asyncio.to_thread(read)
        except FileNotFoundError:  # a trained model's base: this node holds only its config
            raise Failed(
                f"node {self.ctx.node_id} holds no {msg.file} of {msg.serve_id}", code="no_file"
            ) from None


def _fail_open(client: Any, reason: str) -> None:
    """Fail every open session of ``client`` now with ``reason`` (RingClient has no public
    "fail all"; ``cancel`` per session does it)."""
    for session in list(getattr(client, "_sessions", {}).values()):
        client.cancel(session, reason)


__all__ = ["Serving"]
