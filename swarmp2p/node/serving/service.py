"""``swarm serve`` across the swarm: the local API's serve/stop/list, the HTTP API on the
issuing node, restoring served models after a restart, and failover. Never imports torch.

Roles (each in its own module):

- The issuing node (the one whose CLI ran ``swarm serve``) parses the ServeRequest, asks the
  leader for a plan (``serve.plan``), starts one serve worker per stage on the stages' nodes
  and connects them (``node/serving/ring.py``), drives the ring with a
  :class:`~swarmp2p.serve.RingClient` and answers the OpenAI-compatible API on
  ``--host``/``--port``.
- The leader plans the ring with ``plan.serve.plan_serve`` over the live nodes' records, and
  writes the issuing node's serving events into the table (``serve.note``).
- Every stage's node recomputes the plan from the same inputs and refuses a mismatch, makes
  the stage's files local and runs its worker (``node/serving/stages.py``).
- Once a trained model serves, every shard gets a standby copy (``node/serving/standby.py``).

State: every served model is a ``ServedModel`` of the replicated table (``node/table/
served.py``), changed only by serving events; what the issuing node does next is
``decide_serving`` (``node/serving/decide.py``), a pure function of those records, who is
alive and what this node runs. This module only carries the actions out; the runtime handles
(ring client, links, HTTP API) live in ``Serving.live`` beside the record, keyed by serve id.

Failover: each heartbeat round, a stage whose node is gone is marked lost; a ring that lost a
stage is re-placed on the live nodes, the survivors' old workers stopped, and the new ring
handed to ``RingClient.reroute``: every open session replays its prompt and the tokens
generated so far, so a greedy request completes with the same text. When no placement fits,
the model is degraded, retried each round, and its open requests fail with the reason.

Restart: served models outlive their issuing node's daemon: the table still lists them, and
the restarted daemon serves each again from its request (``swarm serve --stop`` removes it).
The API key never enters the table (replicated to every member and written to disk there):
the table holds its sha256, the key stays in ``serve/keys/<serve id>.key`` (0600) on the
issuing node, which alone answers the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from swarmp2p._tasks import cancel_all
from swarmp2p.errors import Failed, SwarmError, Unavailable, UserError
from swarmp2p.node import requests as rq
from swarmp2p.node.api import ApiHandler
from swarmp2p.node.messages import (
    ServeFileRead,
    ServeNote,
    ServeNoted,
    ServePlace,
    ServeRelayNext,
    ServeRelayOpen,
    ServeStage,
    ServeStageExit,
    ShardChunk,
)
from swarmp2p.node.serving import decide as dc
from swarmp2p.node.serving import ring as serve_ring
from swarmp2p.node.serving.keys import ApiKeys, key_digest
from swarmp2p.node.serving.model import resolve_served
from swarmp2p.node.serving.notes import ServeNotes
from swarmp2p.node.serving.relay import Relays
from swarmp2p.node.serving.ring import Served, served_view
from swarmp2p.node.serving.stages import ServeStages
from swarmp2p.node.serving.standby import Standby
from swarmp2p.node.table import events as ev
from swarmp2p.plan.serve import ServePlan, parse_serve_request
from swarmp2p.schema import SchemaError
from swarmp2p.wire.messages import Message

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext
    from swarmp2p.node.table.served import ServedModel
    from swarmp2p.node.training.leader import JobsLeader
    from swarmp2p.node.training.stages import StageHost
    from swarmp2p.serve.ring import RingEnds
    from swarmp2p.serve.sessions import RingClient

log = logging.getLogger("swarmp2p.node.serving.service")

MAX_CRASH_REBUILDS = 3
"""Rings rebuilt after worker crashes (not node losses) before the model is left degraded."""


class Serving:
    """The serving side of one daemon (issuing node, leader and stage host at once)."""

    def __init__(
        self,
        ctx: NodeContext,
        stage_host: StageHost,
        jobs: JobsLeader,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.ctx = ctx
        self.stage_host = stage_host
        self.jobs = jobs
        self.wall = wall
        self.live: dict[str, Served] = {}
        """serve id -> what this node runs for it (its handles)."""
        self._busy: dict[str, asyncio.Task] = {}
        """serve id -> its open or rebuild in flight."""
        self._retry_at: dict[str, float] = {}
        """serve id -> when to open it again (an open after a restart failed)."""
        self.notes = ServeNotes(ctx)
        self.keys = ApiKeys(ctx.state.root / "serve")
        self.stages = ServeStages(ctx, stage_host)
        self.standby = Standby(ctx, stage_host)
        self.relays = Relays(ctx, self._relay_target)
        self._serving_lock = asyncio.Lock()
        started = wall()
        self._restore_from = started + 2 * ctx.config.failure_timeout_s  # peers meet first
        self._restore_until = started + ctx.config.timings.serve_restore_for_s

    # --- the table's served models, as this node sees them ------------------------------------

    def mine(self) -> dict[str, ServedModel]:
        """The served models this node issues: the table's, with its own events on top."""
        return {k: v for k, v in self.notes.view().items() if v.issuer == self.ctx.node_id}

    # --- status and the local API -------------------------------------------------------------

    def issued(self) -> list[str]:
        """The serve ids this node issues now (sent with every heartbeat): the ones it runs and
        the table's it serves again after a restart (their old workers are its to stop)."""
        mine = {k for k, v in self.mine().items() if v.state != "failed"}
        return sorted({*self.live, *mine})

    def status(self) -> list[dict[str, Any]]:
        """The models this node serves (or serves again after a restart), by name."""
        mine = self.mine()
        views = [
            served_view(mine.get(k), self.live.get(k), self._restoring(k))
            for k in sorted({*mine, *self.live})
        ]
        return sorted(views, key=lambda v: v["model"])

    def swarm_status(self) -> list[dict[str, object]]:
        """Every served model of the table (any issuer): name, issuer, state, URL, stages."""
        return [
            {
                "model": m.name,
                "serve_id": m.serve_id,
                "issuer": m.issuer,
                "state": m.state,
                "url": m.url,
                "failovers": m.failovers,
                "stages": list(m.stage_nodes),
            }
            for m in sorted(self.ctx.table.served.values(), key=lambda m: (m.name, m.serve_id))
        ]

    def _restoring(self, serve_id: str) -> bool:
        here = self.live.get(serve_id)
        return here is None or here.client is None

    def api_handlers(self) -> dict[str, ApiHandler]:
        return {
            "serve": self._api_serve,
            "serve_stop": self._api_stop,
            "served": self._api_list,
            "serve_endpoint": self._api_endpoint,
            **self.relays.api_handlers(),
        }

    async def _api_list(self, req: rq.ServedRequest) -> list[dict[str, Any]]:
        return self.status()

    def _by_name(self, name: str) -> tuple[Served | None, ServedModel | None]:
        """This node's handle and table record of the model it serves as ``name``."""
        here = next((s for s in self.live.values() if s.name == name), None)
        record = next((m for m in self.mine().values() if m.name == name), None)
        return here, record

    def _known(self) -> str:
        names = {s.name for s in self.live.values()} | {m.name for m in self.mine().values()}
        return ", ".join(sorted(names)) or "none"

    async def _api_endpoint(self, req: rq.ServeEndpointRequest) -> dict[str, str | None]:
        """Where a model served from this node answers, and its API key (for `swarm generate`
        and `swarm chat`: the local socket is its owner's alone)."""
        here, _ = self._by_name(req.model)
        if here is not None and here.url:
            return {"model": here.name, "url": here.url, "api_key": here.request.api_key}
        node = self.relays.issuer_of(req.model)
        if here is not None or node == self.ctx.node_id:
            raise Unavailable(f"model {req.model!r} is starting on this node", code="not_ready")
        if node is None:
            raise UserError(
                f"model {req.model!r} is not served in the swarm (served: "
                f"{self.relays.served_names()}); `swarm serve {req.model}` serves it",
                code="not_served",
            )
        return {"model": req.model, "url": "", "api_key": None, "node": node}

    def _relay_target(self, name: str) -> tuple[str, str | None] | None:
        """Where this node's API answers for ``name`` and its key (None: not running here)."""
        here, _ = self._by_name(name)
        if here is None or not here.url or here.client is None:
            return None
        return here.url, here.request.api_key

    async def _api_stop(self, req: rq.ServeStopRequest) -> dict[str, object]:
        name = req.model
        here, record = self._by_name(name)
        if here is None and record is None:
            raise UserError(
                f"model {name!r} is not served from this node (served: {self._known()})",
                code="not_served",
            )
        serve_id = here.serve_id if here is not None else record.serve_id
        if record is not None:  # first: while the ring closes, no round may serve it again
            self.notes.add(ev.ServeStopped(serve_id=serve_id, at=self.wall()))
        await cancel_all(self._busy.pop(serve_id, None))
        if here is not None:
            await self._teardown(here)
            self.live.pop(serve_id, None)
        elif record.live_attempt:  # serving again after a restart: its old workers stop
            await serve_ring.stop_stages(
                self.ctx, serve_id, record.live_attempt, set(record.stage_nodes)
            )
        self._retry_at.pop(serve_id, None)
        self.keys.remove(serve_id)
        out: dict[str, object] = {"model": name, "stopped": True}
        if record is not None and not await self.notes.flush():
            out["warning"] = (
                "no leader wrote the stop yet: the swarm's table still lists the model "
                "until one does (this node keeps sending it)"
            )
        log.info("stopped serving %s", name)
        return out

    async def _api_serve(self, req: rq.ServeStartRequest) -> dict[str, Any]:
        try:
            request = parse_serve_request(req.request)
        except SchemaError as exc:
            raise UserError(str(exc), code="bad_field") from None
        serve_id = f"s{int(time.time() * 1000) % 10**10}-{os.getpid() % 1000}"
        served = await resolve_served(self.ctx, self.stage_host, request, serve_id)
        async with self._serving_lock:
            here, record = self._by_name(request.served_name)
            if record is not None and (here is None or here.client is None):
                what = (
                    "failed" if record.state == "failed" else "being served again after a restart"
                )
                raise UserError(
                    f"model {record.name!r} is {what} ({record.reason or record.state}); "
                    f"`swarm serve --stop {record.name}` first",
                    code="exists",
                )
            if here is not None:
                raise UserError(
                    f"model {here.name!r} is already served at {here.url or '(starting)'}; "
                    f"`swarm serve --stop {here.name}` first",
                    code="exists",
                )
            self.live[serve_id] = served
        self._busy[serve_id] = asyncio.current_task()
        try:
            plan, ends = await self._open(served)
            if served.request.api_key:  # before the table lists it: a restart needs the key
                await asyncio.to_thread(self.keys.write, serve_id, served.request.api_key)
        except BaseException:
            try:  # still listed while its workers stop: reap() would stop them unawaited
                await self._teardown(served)
            finally:
                self.live.pop(serve_id, None)
                self._busy.pop(serve_id, None)
            raise
        self._busy.pop(serve_id, None)
        bare = dataclasses.replace(request, api_key=None)
        self.notes.add(
            ev.ServeRequested(
                serve_id=serve_id,
                issuer=self.ctx.node_id,
                request=bare,
                api_key_sha256=key_digest(request.api_key),
                at=self.wall(),
            ),
            self._placed(served, plan, ends.endpoints, failover=False),
        )
        log.info("serving %s at %s on %d stage(s)", served.name, served.url, len(plan.stages))
        if not await self.notes.flush():  # it serves; only a restart forgets it meanwhile
            log.warning("serving %s: no leader wrote it into the table yet", served.name)
        self._spawn_standby(served)
        return served_view(self.mine().get(serve_id), served, False)

    def _placed(
        self,
        served: Served,
        plan: ServePlan,
        endpoints: tuple[str, ...],
        *,
        failover: bool,
        replayed: int = 0,
    ) -> ev.ServePlaced:
        return ev.ServePlaced(
            serve_id=served.serve_id,
            attempt=served.live_attempt,
            plan=plan,
            endpoints=tuple(endpoints),
            url=served.url,
            failover=failover,
            replayed=replayed,
            at=self.wall(),
        )

    # --- opening and closing a served model ----------------------------------------------------

    async def _open(self, served: Served) -> tuple[ServePlan, RingEnds]:
        return await serve_ring.open_served(
            self.ctx, served, self._on_copy(served), self.ctx.config.timings.serve_step_s
        )

    def _on_copy(self, served: Served) -> Callable[[int, str], None]:
        return lambda stage, node: self.standby.note_copy(served, stage, node)

    async def _teardown(self, served: Served) -> None:
        await serve_ring.close_served(self.ctx, served)

    async def close(self) -> None:
        """This daemon stops: its rings and APIs close (the table keeps the models: the next
        start serves them again)."""
        await cancel_all(*self._busy.values())
        self._busy.clear()
        await self.relays.close()
        for served in list(self.live.values()):
            with contextlib.suppress(Exception):
                await self._teardown(served)
        self.live.clear()
        await self.stages.close()

    # --- each round: what the table says to do --------------------------------------------------

    def tick(self) -> None:
        """Each heartbeat round: stop stage workers nobody issues any more, send the serving
        events that wait for a leader, and carry out what ``decide_serving`` says."""
        alive = self.ctx.live_nodes()
        self.stages.reap(set(alive), set(self.issued()), self.ctx.clock())
        self.relays.reap()
        self.notes.kick()
        self._decide(alive)

    def _decide(self, alive: frozenset[str]) -> None:
        local = {
            k: dc.Local(
                running=s.client is not None,
                busy=k in self._busy and not self._busy[k].done(),
                retry_at=self._retry_at.get(k, 0.0),
            )
            for k, s in self.live.items()
        }
        for k, at in self._retry_at.items():
            local.setdefault(k, dc.Local(running=False, busy=False, retry_at=at))
        actions = dc.decide_serving(
            self.mine(),
            me=self.ctx.node_id,
            alive=alive,
            local=local,
            now=self.wall(),
            grace_s=2 * self.ctx.config.failure_timeout_s,
            restore_from=self._restore_from,
            restore_until=self._restore_until,
            max_crash_rebuilds=MAX_CRASH_REBUILDS,
        )
        for action in actions:
            self._carry_out(action)

    def _carry_out(self, action: dc.ServeAction) -> None:
        serve_id = action.serve_id
        here = self.live.get(serve_id)
        if isinstance(action, dc.MarkLost):
            self.notes.add(
                ev.ServeStageLost(
                    serve_id=serve_id,
                    attempt=action.attempt,
                    stage=action.stage,
                    node_id=action.node_id,
                    at=self.wall(),
                )
            )
            log.warning(
                "serving %s: stage %d's node %s was lost; re-placing",
                here.name if here else serve_id,
                action.stage,
                action.node_id,
            )
        elif isinstance(action, dc.FailOpen):
            if here is not None and here.client is not None:
                _fail_open(here.client, action.reason)
        elif isinstance(action, dc.GiveUp):
            log.warning("serving %s: %s; giving up", serve_id, action.reason)
            self.notes.add(ev.ServeFailed(serve_id=serve_id, reason=action.reason, at=self.wall()))
            self._retry_at.pop(serve_id, None)
            if here is not None and here.client is not None:
                _fail_open(here.client, action.reason)
        elif isinstance(action, dc.Replan) and here is not None:
            task = self.ctx.spawn(self._failover(here), f"serve-failover:{here.name}")
            self._busy[serve_id] = task
        elif isinstance(action, dc.Restore):
            task = self.ctx.spawn(self._restore(action), f"serve-restore:{serve_id}")
            self._busy[serve_id] = task
            self._retry_at.pop(serve_id, None)

    async def _failover(self, served: Served) -> None:
        """A new ring for ``served`` on the live nodes; the open sessions move onto it."""
        record = self.mine().get(served.serve_id)
        if record is None:
            return
        what = record.reason.removesuffix("; re-placing") if record.state == "replacing" else ""
        what = what or (record.reason.split(" and the model cannot")[0] or "a stage was lost")
        old_attempt, old_nodes = served.live_attempt, set(served.live_nodes)
        try:
            plan, ends = await serve_ring.build(self.ctx, served, self._on_copy(served))
        except (SwarmError, RuntimeError, OSError) as exc:
            reason = f"{what} and the model cannot be re-placed on the live nodes: {exc}"
            if record.state != "degraded" or record.reason != reason:
                log.warning("serving %s: %s", served.name, reason)
                self.notes.add(
                    ev.ServeDegraded(
                        serve_id=served.serve_id,
                        attempt=max(served.attempt, record.attempt),
                        reason=reason,
                        at=self.wall(),
                    )
                )
            return
        await serve_ring.stop_stages(self.ctx, served.serve_id, old_attempt, old_nodes)
        client = served.client
        replayed = client.active
        olds = await asyncio.to_thread(client.reroute, ends.first, ends.back)
        for link in olds:
            link.close()
            with contextlib.suppress(ValueError):
                served.links.remove(link)
        self.notes.add(self._placed(served, plan, ends.endpoints, failover=True, replayed=replayed))
        self._spawn_standby(served)

    async def _restore(self, action: dc.Restore) -> None:
        """Serve a model of the table again after this daemon restarted: stop the workers of
        the ring it drove before, open the API and a new ring."""
        record = self.mine().get(action.serve_id)
        if record is None:
            return
        served: Served | None = None
        try:
            if action.stop_attempt:
                await serve_ring.stop_stages(
                    self.ctx, record.serve_id, action.stop_attempt, set(action.stop_nodes)
                )
            key = self.keys.read(record.serve_id, record.api_key_sha256, record.name)
            request = dataclasses.replace(record.request, api_key=key)
            served = await resolve_served(self.ctx, self.stage_host, request, record.serve_id)
            served.attempt = record.attempt
            self.live[record.serve_id] = served
            plan, ends = await self._open(served)
        except (SwarmError, ValueError, OSError) as exc:
            if served is not None:
                with contextlib.suppress(Exception):
                    await self._teardown(served)
                self.live.pop(record.serve_id, None)
            self._retry_at[record.serve_id] = (
                self.wall() + self.ctx.config.timings.serve_restore_every_s
            )
            reason = f"waiting to serve it again after a restart: {exc}"
            if record.reason != reason:
                log.info("serving %s: %s", record.name, reason)
                attempt = max(record.attempt, served.attempt if served else 0)
                self.notes.add(
                    ev.ServeDegraded(
                        serve_id=record.serve_id, attempt=attempt, reason=reason, at=self.wall()
                    )
                )
            return
        except BaseException:
            if served is not None:
                with contextlib.suppress(Exception):
                    await self._teardown(served)
                self.live.pop(record.serve_id, None)
            raise
        self.notes.add(self._placed(served, plan, ends.endpoints, failover=False))
        log.info("serving %s again after a restart", served.name)
        self._spawn_standby(served)

    def _spawn_standby(self, served: Served) -> None:
        self.standby.spawn(served, lambda: self.live.get(served.serve_id) is served)

    # --- every node: dispatch ---------------------------------------------------------------

    async def handle(self, msg: Message, sender: str | None = None) -> Message:
        """Answer ``msg`` from node ``sender`` (None: this node)."""
        if isinstance(msg, ServePlace):
            return serve_ring.place(self.ctx, msg)
        if isinstance(msg, ServeNote):
            return await self._noted(msg, sender or self.ctx.node_id)
        if isinstance(msg, ServeFileRead):
            return await self._read_file(msg)
        if isinstance(msg, (ServeRelayOpen, ServeRelayNext)):
            return await self.relays.handle(msg, sender or self.ctx.node_id)
        if isinstance(msg, ServeStageExit):
            return self._stage_exited(msg)
        if isinstance(msg, ServeStages.HANDLES):
            return await self.stages.handle(msg, sender)
        raise UserError(f"serving does not take {type(msg).TYPE}", code="bad_request")

    async def _noted(self, msg: ServeNote, sender: str) -> ServeNoted:
        """The leader: write an issuing node's serving event (only for a model it issues)."""
        from swarmp2p.node.cluster import authz

        try:
            event = ev.event_from_data(msg.event, "serve.note event")
        except SchemaError as exc:
            raise UserError(str(exc), code="bad_field") from None
        why = authz.serve_note_refusal(self.ctx.table, event, sender)
        if why:
            raise UserError(why, code="forbidden")
        return ServeNoted(version=await self.ctx.append([event]))

    def _stage_exited(self, msg: ServeStageExit) -> ServeStage:
        """A stage's node says the worker of a stage of the live ring ended (it died, or the
        leader stopped it): the ring is rebuilt now, not at the next round, so a request in
        flight waits for the rebuild rather than for tokens that never come."""
        from swarmp2p.node.cluster import authz

        served = self.live.get(msg.serve_id)
        record = self.mine().get(msg.serve_id)
        live = (
            served is not None
            and record is not None
            and served.live_attempt == msg.attempt == record.live_attempt
        )
        why = authz.serve_exit_refusal(msg, list(record.stage_nodes) if live else None)
        if why:
            raise UserError(why, code="forbidden")
        if live and msg.stage not in record.lost:
            self.notes.add(
                ev.ServeStageLost(
                    serve_id=msg.serve_id,
                    attempt=msg.attempt,
                    stage=msg.stage,
                    node_id=msg.node_id,
                    crashed=True,
                    reason=f"stage worker(s) ended (stage {msg.stage}: node {msg.node_id}: "
                    f"{msg.message})"[:2000],
                    at=self.wall(),
                )
            )
            log.warning("serving %s: stage %d's worker ended; re-placing", served.name, msg.stage)
            self._decide(self.ctx.live_nodes())
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

        served = self.live.get(msg.serve_id)
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


def _fail_open(client: RingClient, reason: str) -> None:
    """Fail every open session of ``client`` now with ``reason`` (RingClient has no public
    "fail all"; ``cancel`` per session does it)."""
    for session in list(getattr(client, "_sessions", {}).values()):
        client.cancel(session, reason)


__all__ = ["Serving"]
