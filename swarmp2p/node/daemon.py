"""The node daemon behind `swarm up`: one asyncio loop for discovery, membership, the rounds
of heartbeats, the control socket and the local API; meeting peers (``hellos``), heartbeats
(``heartbeats``), the table, jobs and serving are parts it composes, each given the node's
context. Never imports torch.

Protocol (CURVE RPC; each node speaks with its own key, see ``join.py`` and ``authz.py``):

- ``node.join`` on a peer's join port (keyed by the swarm secret) before the first hello to it:
  both bind the other's node id to its public key; the leader lists a newcomer as a member.
- ``node.hello`` both ways when a peer is found (mDNS, ``--peer``, or its own hello): identity,
  addresses, hardware, table key. A hello makes the sender live in this node's view.
- ``node.heartbeat`` every ``heartbeat_s`` to every live peer; a peer silent past
  ``failure_timeout_s`` is dead. An mDNS removal triggers one immediate heartbeat and kills
  the peer only if it fails. ``node.leave`` on a clean stop forgets the sender at once (after
  the leader removed it from the members).
- The leader is the lowest live node id of a node's view; it leads once a majority of the
  table's members voted for it (``replication``). Heartbeat replies carry table keys: the
  leader brings a peer that is behind up to date.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

from swarmp2p import PROTOCOL_VERSION, __version__
from swarmp2p._ratelog import RateLimitedLog
from swarmp2p.dashboard import start_dashboard
from swarmp2p.errors import SwarmError, Unavailable
from swarmp2p.net.auth import KeyCheck, ServerKeys
from swarmp2p.net.discovery import (
    Advert,
    Discovery,
    list_interfaces,
    select_interfaces,
)
from swarmp2p.net.rpc import AddressInUse, RpcError, RpcServer
from swarmp2p.net.security import NodeKey, SwarmSecret, fingerprint
from swarmp2p.node import hardware, speed_probe, views
from swarmp2p.node import requests as rq
from swarmp2p.node.api import ApiServer
from swarmp2p.node.cluster import api as members_api
from swarmp2p.node.cluster import authz
from swarmp2p.node.cluster import join as jn
from swarmp2p.node.cluster.heartbeats import Heartbeats
from swarmp2p.node.cluster.hellos import Hellos
from swarmp2p.node.cluster.membership import Change
from swarmp2p.node.cluster.pairing import PairingPort
from swarmp2p.node.config import NodeConfig, parse_peer, port_in_use
from swarmp2p.node.context import Identity, NodeContext
from swarmp2p.node.messages import (
    SERVE_MESSAGES,
    FilePull,
    Heartbeat,
    InputRead,
    JobCancel,
    JobMetricsFetch,
    LeadRequest,
    Leave,
    NodeHello,
    ShardCopy,
    ShardRead,
    StageReport,
    StageStart,
    StageStop,
    Submit,
    TableEvents,
    TableFetch,
    TablePush,
)
from swarmp2p.node.serving.service import Serving
from swarmp2p.node.state import StateDir
from swarmp2p.node.table import events as ev
from swarmp2p.node.table.jobtable import ACTIVE_STATES
from swarmp2p.node.table.replication import Replication
from swarmp2p.node.training import api as jobs_api
from swarmp2p.node.training.leader import JobsLeader
from swarmp2p.node.training.stages import StageHost
from swarmp2p.schema import Data, to_data
from swarmp2p.wire.messages import Message

log = logging.getLogger("swarmp2p.node")


class Daemon:
    """One node. ``await run()`` serves until ``stop()`` (or SIGTERM via ``serve``)."""

    def __init__(
        self,
        config: NodeConfig,
        secret: SwarmSecret,
        *,
        clock: Callable[[], float] = time.monotonic,
        env: dict[str, str] | None = None,
    ) -> None:
        state = StateDir(root=config.state_dir).ensure()
        node_id = state.node_id(config.node_id)
        key = NodeKey.load_or_create(state.node_key_file)
        name = config.name or socket.gethostname()
        chosen = select_interfaces(list_interfaces(), config.interface)
        if not chosen:
            raise ValueError("no IPv4 interface to use; pass --interface NAME_OR_IP")
        addresses = tuple(ip for _, ip in chosen)
        record, host = hardware.probe(
            node_id=node_id,
            name=name,
            version=__version__,
            env=env,
            capabilities=runtime_capabilities(),
        )
        record = record.with_link_speed(speed_probe.link_speed([iface for iface, _ in chosen]))
        self.ctx = NodeContext(
            me=Identity(node_id=node_id, name=name, addresses=addresses, record=record, host=host),
            state=state,
            secret=secret,
            key=key,
            config=config,
            clock=clock,
        )
        self._probe_stop = threading.Event()
        """Set when the daemon stops: its speed probe (a subprocess on a thread) is killed."""
        self.rep = Replication(self.ctx, state.table_file, state.root / "vote.json")
        self.admission = jn.Admission(self.ctx, self.rep, on_secret=self._adopt_secret)
        self.hellos = Hellos(self.ctx, self.rep, self.admission, on_change=self._changed)
        self.bind_host = addresses[0] if config.interface else "0.0.0.0"
        self.pairing = PairingPort(self.ctx, self.bind_host, on_change=self._readvertise)
        self.jobs = JobsLeader(self.ctx, self.rep)
        self.stages = StageHost(self.ctx)
        self.serving = Serving(self.ctx, self.stages, self.jobs)
        self.ctx.attach(local=self._dispatch, replication=self.rep)
        self._stop = asyncio.Event()
        self._bad = RateLimitedLog(clock=clock)
        self._static = [parse_peer(p) for p in config.peers]
        self._server: RpcServer | None = None
        self._join: jn.JoinPort | None = None
        self._api: ApiServer | None = None
        self._discovery: Discovery | None = None
        self._env = os.environ if env is None else env
        self.heartbeats = Heartbeats(
            ctx=self.ctx,
            rep=self.rep,
            stages=self.stages,
            serving=self.serving,
            hellos=self.hellos,
            on_change=self._changed,
            env=self._env,
        )
        self._dashboard, self._dashboard_note = None, ""
        self._view_leader = node_id
        self._removed = False
        self._status_at = -1e9
        self._metrics_at = -1e9

    @property
    def node_id(self) -> str:
        return self.ctx.node_id

    # --- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Start, serve until ``stop()``, then shut down cleanly."""
        try:
            await self._start()
            await self._stop.wait()
        except SwarmError as exc:  # a cause the user can fix: daemon.log says it first
            log.error("cannot start: %s", exc)  # client.control.CANNOT_START
            raise
        finally:
            await self._close()

    def stop(self) -> None:
        self._stop.set()

    async def _start(self) -> None:
        from swarmp2p.net.auth import AsyncSecureContext

        ctx = self.ctx
        ctx.zmq = AsyncSecureContext()
        keys = ServerKeys(
            public=ctx.key.public,
            secret=ctx.key.secret,
            admits=KeyCheck(ctx.keyring.admits),
            domain=f"swarmp2p-members-{ctx.node_id}",
        )
        self._server = RpcServer(ctx.zmq, keys, self.bind_host, ctx.config.port, self._handle)
        try:
            await self._server.start()
        except AddressInUse as exc:
            raise port_in_use(exc.port, "control") from None
        ctx.port = self._server.port
        join_port = ctx.port + jn.JOIN_PORT_OFFSET if ctx.config.port else 0
        self._join = jn.JoinPort(ctx, self.bind_host, join_port, self.hellos.on_join)
        try:
            await self._join.start()
        except AddressInUse as exc:
            raise port_in_use(exc.port, "join") from None
        ctx.join_port = self._join.port
        self._api = ApiServer(
            ctx.state.api_socket,
            {
                "status": self._api_status,
                "peers": self._api_peers,
                "down": self._api_down,
                "bench": self._api_bench,
                **jobs_api.handlers(ctx, self.jobs, self.stages),
                **members_api.handlers(ctx, self.admission, self.pairing),
                **self.serving.api_handlers(),
            },
        )
        await self._api.start()
        self._dashboard, self._dashboard_note = await start_dashboard(
            self.status, self._env, key_file=ctx.state.dashboard_key_file
        )
        ctx.state.write_pid()
        log.info(
            "node %s (%s, key %s) of swarm %s listening on %s port %d (join port %d); table "
            "term %d version %d",
            ctx.node_id,
            ctx.me.name,
            ctx.key.fingerprint,
            ctx.secret.swarm_id,
            ",".join(ctx.me.addresses),
            ctx.port,
            self._join.port,
            self.rep.table.term,
            self.rep.table.version,
        )
        if ctx.config.mdns:
            self._discovery = Discovery(
                self._advert(),
                list(ctx.me.addresses),
                on_add=self.hellos.on_mdns_add,
                on_remove=self.heartbeats.on_mdns_remove,
                accept=self.hellos.accept_advert,
            )
            await self._discovery.start()
        if ctx.config.open_swarm:
            await self.pairing.open_swarm()
        ctx.spawn(self._heartbeat_loop(), "heartbeats")
        ctx.spawn(self._measure_speeds(), "speed-probe")
        self._elect()

    def _advert(self) -> Advert:
        ctx = self.ctx
        return Advert(
            swarm_id=ctx.secret.swarm_id,
            node_id=ctx.node_id,
            name=ctx.me.name,
            port=ctx.port,
            protocol=PROTOCOL_VERSION,
            hardware=hardware.summary(ctx.me.record, ctx.me.host),
            join_port=self._join.port if self._join is not None else 0,
            key=ctx.key.public,
            invites=self.pairing.advertised,
        )

    async def _readvertise(self) -> None:
        if self._discovery is not None:
            await self._discovery.update(self._advert())

    async def _close(self) -> None:
        ctx = self.ctx
        log.info("stopping node %s", ctx.node_id)
        self._probe_stop.set()  # a speed probe in flight is killed, not waited for
        await self._leave_members()
        ctx.closing = True
        # stop heartbeats and hellos first: a hello sent after our leave would re-add us
        await self.serving.close()
        await self.stages.close()
        await ctx.cancel_tasks()
        if ctx.zmq is not None:
            leave = Leave(node_id=ctx.node_id)
            await asyncio.gather(
                *(ctx.call_endpoint(p.endpoint, leave, 0.5) for p in ctx.members.alive_peers()),
                return_exceptions=True,
            )
        if self._discovery is not None:
            with contextlib.suppress(Exception):
                await self._discovery.close()
        await ctx.close_clients()
        await self.pairing.close()
        if self._join is not None:
            await self._join.close()
        if self._server is not None:
            await self._server.close()
        if self._api is not None:
            await self._api.close()
        if self._dashboard is not None:
            await self._dashboard.close()
        if ctx.zmq is not None:
            ctx.zmq.destroy(linger=0)
        for path in (ctx.state.api_socket, ctx.state.pid_file):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        log.info("node %s stopped", ctx.node_id)

    async def _leave_members(self) -> None:
        """A member that stops cleanly asks the leader to take it off the members first, so
        the nodes left keep their majority (best effort: a crash leaves it a member)."""
        ctx = self.ctx
        if ctx.zmq is None or ctx.node_id not in self.rep.table.member_ids:
            return
        if len(self.rep.table.voters - {ctx.node_id}) < 1:
            return  # the last voter keeps the swarm's history: it stays listed as up
        try:
            if ctx.leading:
                await asyncio.wait_for(
                    self.rep.append(
                        [ev.MemberLeft(node_id=ctx.node_id, reason="stopped")], wait=True
                    ),
                    self.ctx.config.timings.leave_s,
                )
            else:
                await ctx.to_leader(Leave(node_id=ctx.node_id), self.ctx.config.timings.leave_s)
        except (SwarmError, OSError, asyncio.TimeoutError) as exc:
            log.info("left without the leader's acknowledgement: %s", exc)

    # --- peers -------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self._heartbeat_round()
            except Exception:  # never let one bad round stop the heartbeats
                log.exception("heartbeat round failed")
            await asyncio.sleep(self.ctx.config.heartbeat_s)

    async def _heartbeat_round(self) -> None:
        """Heartbeat every peer (hello the dead and static ones), expire the silent, act."""
        ctx = self.ctx
        self._drop_revoked()
        self.heartbeats.memory()  # this node's own record is live too, peers or none
        peers = list(ctx.members.peers.values())
        results = await asyncio.gather(
            *(self.heartbeats.beat(p.node_id, p.endpoint, p.alive, p.join_endpoint) for p in peers),
            return_exceptions=True,
        )
        for peer, result in zip(peers, results):
            if isinstance(result, Exception):
                log.warning("heartbeat to %s failed: %r", peer.node_id, result)
        for endpoint in self._static:
            if not any(p.alive and p.endpoint == endpoint for p in peers):
                self.hellos.say(endpoint)
        now = ctx.clock()
        self._changed(
            ctx.members.expire(now, ctx.config.failure_timeout_s, ctx.config.forget_after_s)
        )
        ctx.keyring.prune(
            {p.node_id for p in ctx.members.alive_peers()}, now, ctx.config.forget_after_s
        )
        keep = (
            {p.endpoint for p in ctx.members.peers.values()}
            | set(self._static)
            | self.hellos.pending
        )
        await ctx.prune_clients(keep)
        self._bad.flush()
        self.admission.check_secret()
        await self.pairing.tick()
        self.rep.note_view()
        self.rep.check_quorum()
        if ctx.leader == ctx.node_id and not self.rep.ready:
            self.rep.start_takeover()
        self.jobs.tick()
        self.stages.reap()
        self.serving.tick()
        if (
            not ctx.leading
            and now - self._status_at < self.ctx.config.timings.metrics_wanted_s
            and now - self._metrics_at >= 1.0
        ):
            self._metrics_at = now
            ctx.spawn(self._refresh_metrics(), "metrics")

    def _drop_revoked(self) -> None:
        """Forget the peers whose key this node no longer admits (`swarm remove`), once the
        removal is committed: a leader cut off from its majority rolls an uncommitted one back,
        and must not have forgotten the peer meanwhile (a follower's committed table is the
        latest it holds, as Raft's followers reason with the latest configuration)."""
        ctx = self.ctx
        revoked = set(self.rep.committed.revoked)
        if ctx.key.public in revoked and not self._removed:
            self._removed = True
            log.error(
                "this node (%s) was removed from swarm %s: its key is revoked; it can join "
                "again only under a new identity (remove %s) with a new invite or token",
                ctx.node_id,
                ctx.secret.swarm_id,
                ctx.state.node_key_file,
            )
        for peer in list(ctx.members.peers.values()):
            if peer.key and peer.key in revoked:
                ctx.members.forget(peer.node_id)
                self.hellos.forget_node(peer.node_id)
                self._changed(
                    [Change(kind="leave", node_id=peer.node_id, reason="removed: key revoked")]
                )

    async def _refresh_metrics(self) -> None:
        """A follower someone is watching (its dashboard, `swarm status`) keeps the running
        jobs' metrics fetched from the leader, and each finished job's once."""
        for job_id, entry in sorted(self.rep.table.jobs.items()):
            if entry.state in ACTIVE_STATES or not self.jobs.metrics.get(job_id):
                await self.jobs.job_metrics(job_id)

    def _changed(self, changes: list[Change]) -> None:
        for change in changes:
            peer = self.ctx.members.peers.get(change.node_id)
            where = f" at {peer.endpoint}" if peer is not None else ""
            if change.kind == "join":
                log.info("node %s joined%s", change.node_id, where)
            else:
                log.info("node %s left (%s)", change.node_id, change.reason)
        if changes:
            self._elect()

    def _elect(self) -> None:
        new = self.ctx.leader
        if new != self._view_leader:
            log.info("leader is now %s (was %s)", new, self._view_leader)
            self._view_leader = new
        if new != self.ctx.node_id:
            self.rep.lost_lead()
        elif not self.rep.ready:
            self.rep.start_takeover()

    # --- the control socket ------------------------------------------------------------------

    async def _handle(self, msg: Message, key: str) -> Message:
        """A request from the node ``key`` is bound to, if it may send it (``authz``)."""
        ctx = self.ctx
        try:
            node_id = ctx.keyring.node_of(key)
            if node_id is None:
                raise RpcError(
                    "not_member",
                    f"node {ctx.node_id} does not admit key {fingerprint(key)} (removed, or not "
                    "joined: join again with the swarm's secret or a pairing code)",
                )
            sender = authz.Sender(node_id=node_id, member=ctx.keyring.is_member(node_id))
            why = authz.refusal(msg, sender, self.rep.table, ctx.leader)
            if why:
                raise RpcError(authz.refusal_code(sender, why), why)
            return await self._dispatch(msg, node_id)
        except SwarmError as exc:
            if exc.kind != "unavailable":  # not leading, stopping: normal during a change
                self._bad.warning("refused %s: %s", type(msg).TYPE, exc)
            raise
        except ValueError as exc:
            self._bad.warning("refused %s: %s", type(msg).TYPE, exc)
            raise RpcError("bad_field", str(exc)) from None

    async def _dispatch(self, msg: Message, sender: str | None = None) -> Message:
        """Answer ``msg`` from node ``sender`` (authorized; None: this node itself)."""
        ctx = self.ctx
        sender = sender or ctx.node_id
        now = ctx.clock()
        if ctx.closing and not isinstance(msg, Leave):
            raise Unavailable(f"node {ctx.node_id} is stopping", code="stopping")
        if isinstance(msg, Heartbeat):
            return self.heartbeats.answer(msg, now)
        if isinstance(msg, NodeHello):
            self.hellos.check(msg)
            self.hellos.met(msg, self.hellos.endpoint_of(msg), ctx.keyring.key_of(sender) or "")
            return self.hellos.message()
        if isinstance(msg, Leave):
            return await self._on_leave(msg)
        if isinstance(msg, LeadRequest):
            return self.rep.on_vote_request(msg)
        if isinstance(msg, TableFetch):
            return self.rep.on_fetch(msg)
        if isinstance(msg, TableEvents):
            return await self.rep.on_events(msg, sender)
        if isinstance(msg, TablePush):
            return await self.rep.on_table(msg, sender)
        if isinstance(msg, jn.ADMISSION_MESSAGES):
            return await self.admission.handle(msg, sender)
        if isinstance(msg, (Submit, StageReport, JobCancel, JobMetricsFetch, ShardCopy)):
            return await self.jobs.handle(msg, sender)
        if isinstance(msg, (StageStart, StageStop, ShardRead, FilePull, InputRead)):
            return await self.stages.handle(msg)
        if isinstance(msg, SERVE_MESSAGES):
            return await self.serving.handle(msg, sender)
        raise RpcError("unexpected", f"node daemon does not take {type(msg).TYPE} requests")

    async def _on_leave(self, msg: Leave) -> Leave:
        """A peer stops: the leader takes a member off the members first (so the rest keep
        their majority), then every node forgets it."""
        ctx = self.ctx
        if ctx.leading and msg.node_id in self.rep.table.member_ids:
            with contextlib.suppress(SwarmError):
                await self.rep.append(
                    [ev.MemberLeft(node_id=msg.node_id, reason="stopped")], wait=True
                )
        if msg.node_id in ctx.members.peers:
            ctx.members.forget(msg.node_id)
            self._changed([Change(kind="leave", node_id=msg.node_id, reason="stopped")])
        return Leave(node_id=ctx.node_id)

    # --- the local API -----------------------------------------------------------------------

    def status(self) -> dict[str, Data]:
        """What `swarm status --json` prints."""
        ctx = self.ctx
        now = ctx.clock()
        self._status_at = now
        me = {
            "node_id": ctx.node_id,
            "name": ctx.me.name,
            "address": f"{ctx.me.addresses[0]}:{ctx.port}",
            "alive": True,
            "is_leader": ctx.leader == ctx.node_id,
            "last_seen_s": 0.0,
            "key": ctx.key.fingerprint,
            "member": ctx.node_id in self.rep.table.member_ids,
            "host": to_data(ctx.me.host),
            "devices": views.devices(ctx.me.record),
            "version": __version__,
            "capabilities": sorted(ctx.me.record.node.capabilities),
        }
        table = self.rep.table
        rows = views.peer_rows(
            me=me,
            peers=list(ctx.members.peers.values()),
            leader=ctx.leader,
            now=now,
            skews=self.heartbeats.skews,
        )
        for row in rows[1:]:  # each member's key, as `swarm peers` shows it
            key = ctx.keyring.key_of(row["node_id"])
            row["key"] = fingerprint(key) if key else ""
            row["member"] = row["node_id"] in table.member_ids
        return {
            "node_id": ctx.node_id,
            "name": ctx.me.name,
            "key": ctx.key.fingerprint,
            "removed": ctx.key.public in table.revoked,
            "join_port": self._join.port if self._join else 0,
            "swarm_id": ctx.secret.swarm_id,
            "version": __version__,
            "leader": ctx.leader,
            "leader_ready": ctx.leading or (ctx.leader != ctx.node_id and self.rep.quorum()["ok"]),
            "term": table.term,
            "table_version": table.version,
            "quorum": self.rep.quorum(),
            "replication": dict(self.rep.stats),
            "port": ctx.port,
            "pid": os.getpid(),
            "uptime_s": round(now - ctx.started_at, 3),
            "peers": rows,
            "jobs": [
                views.entry_json(e, self.jobs.metrics.get(job_id))
                for job_id, e in sorted(table.jobs.items())
            ],
            "dashboard": self._dashboard.url if self._dashboard else None,
            "dashboard_note": self._dashboard_note,
            "served": self.serving.status(),
            "served_in_swarm": self.serving.swarm_status(),
            "fetching": [
                *self.stages.inputs.status(),
                *self.heartbeats.fetches(),
            ],
        }

    async def _measure_speeds(self, fresh: bool = False) -> speed_probe.Speeds:
        """Measure this node's speeds (cached per hardware and software version; ``fresh``:
        again) and advertise them: a new hello to every live peer."""
        speeds = await speed_probe.measure_node(
            self.ctx.me.record, self.ctx.me.host, self._env, fresh=fresh, stop=self._probe_stop
        )
        record = self.ctx.me.record.with_speeds(speeds)  # the live one: memory moved meanwhile
        if record != self.ctx.me.record:
            self.ctx.set_record(record)
            log.info("measured speeds (FLOP/s): %s", speeds)
            self.ctx.spawn(self._advertise(), "advertise")
        return speeds

    async def _advertise(self) -> None:
        """A new hello (this node's record) to every known peer, once any hello to it that
        was already under way (with the old record) is answered."""
        pending = {p.endpoint for p in self.ctx.members.peers.values()} | set(self._static)
        for _ in range(100):
            for endpoint in sorted(pending):
                if endpoint not in self.hellos.pending:
                    self.hellos.say(endpoint)
                    pending.discard(endpoint)
            if not pending:
                return
            await asyncio.sleep(0.05)

    async def _api_bench(self, req: rq.BenchRequest) -> dict[str, Data]:
        try:
            speeds = await self._measure_speeds(fresh=True)
        except (OSError, RuntimeError, ValueError, TimeoutError) as exc:
            raise SwarmError(f"the speed probe failed: {exc}", code="failed") from None
        return {
            "node_id": self.ctx.node_id,
            "speeds": speeds,
            "devices": views.devices(self.ctx.me.record),
        }

    async def _api_down(self, req: rq.DownRequest) -> dict[str, Data]:
        asyncio.get_running_loop().call_soon(self.stop)
        return {"node_id": self.ctx.node_id, "pid": os.getpid()}

    async def _api_status(self, req: rq.StatusRequest) -> dict[str, Data]:
        return self.status()

    async def _adopt_secret(self, secret: SwarmSecret) -> None:
        """Run with ``secret`` from now on: saved (0600), the join port keyed by it, advertised."""
        ctx = self.ctx
        if secret == ctx.secret:
            return
        await asyncio.to_thread(secret.save, ctx.state.secret_file)
        old, ctx.secret = ctx.secret, secret
        if self._join is not None:
            await self._join.rekey()
        if self._discovery is not None:
            with contextlib.suppress(Exception):
                await self._discovery.update(self._advert())
        log.warning("swarm secret changed: swarm id %s (was %s)", secret.swarm_id, old.swarm_id)

    async def _api_peers(self, req: rq.PeersRequest) -> list[dict[str, Data]]:
        return self.status()["peers"]


def runtime_capabilities() -> list[str]:
    """The plan's CAPABILITIES when the torch runtime is importable here, else none (the
    daemon only looks for torch; it never imports it)."""
    from swarmp2p.plan.hardware import CAPABILITIES

    return sorted(CAPABILITIES) if importlib.util.find_spec("torch") is not None else []


def serve(config: NodeConfig, secret: SwarmSecret) -> None:
    """Run a daemon in this process until SIGTERM/SIGINT or `swarm down`."""

    async def main() -> None:
        daemon = Daemon(config, secret)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.stop)
        await daemon.run()

    asyncio.run(main())
