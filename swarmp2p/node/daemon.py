"""The node daemon behind `swarm up`: one asyncio loop for discovery, membership, heartbeats,
the control socket and the local API; the table, jobs and serving are parts it composes, each
given the node's context. Never imports torch.

Protocol (all over CURVE RPC with the swarm secret):

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
import time
from collections.abc import Callable
from typing import Any

from swarmp2p import PROTOCOL_VERSION, __version__
from swarmp2p.dashboard import start_dashboard
from swarmp2p.errors import SwarmError, Unavailable, UserError
from swarmp2p.net.discovery import (
    Advert,
    Discovery,
    best_address,
    list_interfaces,
    local_networks,
    select_interfaces,
)
from swarmp2p.net.rpc import RpcError, RpcServer, RpcTimeout
from swarmp2p.net.security import SwarmSecret
from swarmp2p.node import events as ev
from swarmp2p.node import hardware, jobs_api, speed_probe, views
from swarmp2p.node.api import ApiServer
from swarmp2p.node.config import NodeConfig, RateLimitedLog, parse_peer
from swarmp2p.node.context import Identity, NodeContext
from swarmp2p.node.jobs_leader import JobsLeader
from swarmp2p.node.jobtable import ACTIVE_STATES
from swarmp2p.node.membership import Change
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
from swarmp2p.node.replication import Replication
from swarmp2p.node.serving import Serving
from swarmp2p.node.stages import StageHost
from swarmp2p.node.state import StateDir
from swarmp2p.wire.messages import Message

log = logging.getLogger("swarmp2p.node")

LEAVE_TIMEOUT_S = 2.0
"""How long a stopping member waits for the leader to take it off the members."""
METRICS_WANTED_S = 10.0
"""A follower fetches job metrics from the leader while its status was asked this recently."""


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
        name = config.name or socket.gethostname()
        chosen = select_interfaces(list_interfaces(), config.interface)
        if not chosen:
            raise ValueError("no IPv4 interface to use; pass --interface NAME_OR_IP")
        addresses = tuple(ip for _, ip in chosen)
        record, host = hardware.probe(
            node_id=node_id, name=name, version=__version__, env=env,
            capabilities=runtime_capabilities(),
        )  # fmt: skip
        record["link_speed"] = speed_probe.link_speed([iface for iface, _ in chosen])
        self.ctx = NodeContext(
            me=Identity(node_id=node_id, name=name, addresses=addresses, record=record, host=host),
            state=state,
            secret=secret,
            config=config,
            clock=clock,
        )
        self._live = hardware.LiveMemory(record)
        """Free memory re-read with the heartbeats (live, not the probe at start)."""
        self._disk_at, self._disk_free = -1e18, 0
        self._fetching: dict[str, list] = {}
        """node -> the fetches its last heartbeat listed (``swarm status`` shows them)."""
        self.rep = Replication(self.ctx, state.table_file, state.root / "vote.json")
        self.jobs = JobsLeader(self.ctx, self.rep)
        self.stages = StageHost(self.ctx)
        self.serving = Serving(self.ctx, self.stages, self.jobs)
        self.ctx.attach(local=self._dispatch, replication=self.rep)
        self.bind_host = addresses[0] if config.interface else "0.0.0.0"
        self._networks = local_networks()
        self._stop = asyncio.Event()
        self._bad = RateLimitedLog(clock=clock)
        self._static = [parse_peer(p) for p in config.peers]
        self._hellos: set[str] = set()
        self._unanswered: set[str] = set()
        self._skews: dict[str, float] = {}
        self._server: RpcServer | None = None
        self._api: ApiServer | None = None
        self._discovery: Discovery | None = None
        self._env = os.environ if env is None else env
        self._dashboard, self._dashboard_note = None, ""
        self._view_leader = node_id
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
        finally:
            await self._close()

    def stop(self) -> None:
        self._stop.set()

    async def _start(self) -> None:
        from swarmp2p.net.auth import AsyncSecureContext

        ctx = self.ctx
        ctx.zmq = AsyncSecureContext()
        self._server = RpcServer(ctx.zmq, ctx.secret, self.bind_host, ctx.config.port, self._handle)
        await self._server.start()
        ctx.port = self._server.port
        self._api = ApiServer(
            ctx.state.api_socket,
            {
                "status": self._api_status,
                "peers": self._api_peers,
                "submit": self._api_submit,
                "down": self._api_down,
                "bench": self._api_bench,
                **jobs_api.handlers(ctx, self.jobs, self.stages),
                **self.serving.api_handlers(),
            },
        )
        await self._api.start()
        self._dashboard, self._dashboard_note = await start_dashboard(
            self.status, self._env, key_file=ctx.state.dashboard_key_file
        )
        ctx.state.write_pid()
        log.info(
            "node %s (%s) of swarm %s listening on %s port %d; table term %d version %d",
            ctx.node_id, ctx.me.name, ctx.secret.swarm_id, ",".join(ctx.me.addresses), ctx.port,
            self.rep.table.term, self.rep.table.version,
        )  # fmt: skip
        if ctx.config.mdns:
            advert = Advert(
                swarm_id=ctx.secret.swarm_id,
                node_id=ctx.node_id,
                name=ctx.me.name,
                port=ctx.port,
                protocol=PROTOCOL_VERSION,
                hardware=hardware.summary(ctx.me.record, ctx.me.host),
            )
            self._discovery = Discovery(
                advert,
                list(ctx.me.addresses),
                on_add=self._on_mdns_add,
                on_remove=self._on_mdns_remove,
            )
            await self._discovery.start()
        ctx.spawn(self._heartbeat_loop(), "heartbeats")
        ctx.spawn(self._measure_speeds(), "speed-probe")
        self._elect()
        self.serving.restore()

    async def _close(self) -> None:
        ctx = self.ctx
        log.info("stopping node %s", ctx.node_id)
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
        if len(self.rep.table.members) <= 1:
            return
        try:
            if ctx.leading:
                await asyncio.wait_for(
                    self.rep.append([ev.MemberLeft(node_id=ctx.node_id, reason="stopped")], wait=True),
                    LEAVE_TIMEOUT_S,
                )  # fmt: skip
            else:
                await ctx.to_leader(Leave(node_id=ctx.node_id), LEAVE_TIMEOUT_S)
        except (SwarmError, OSError, asyncio.TimeoutError) as exc:
            log.info("left without the leader's acknowledgement: %s", exc)

    # --- peers -------------------------------------------------------------------------------

    @property
    def _rpc_timeout(self) -> float:
        return max(self.ctx.config.heartbeat_s * 2, 0.2)

    def _hello_msg(self) -> NodeHello:
        ctx = self.ctx
        term, version = self.rep.held
        return NodeHello(
            node_id=ctx.node_id, name=ctx.me.name, versions=[PROTOCOL_VERSION],
            software=__version__, swarm_id=ctx.secret.swarm_id, control_port=ctx.port,
            addresses=list(ctx.me.addresses), record=ctx.me.record, host=ctx.me.host,
            term=term, version=version,
        )  # fmt: skip

    def _check_hello(self, hello: NodeHello) -> None:
        if hello.swarm_id != self.ctx.secret.swarm_id:
            raise RpcError("wrong_swarm", f"swarm {hello.swarm_id} is not {self.ctx.secret.swarm_id}")  # fmt: skip
        if PROTOCOL_VERSION not in hello.versions:
            raise RpcError(
                "version",
                f"node {hello.node_id} speaks protocol {hello.versions}, this node "
                f"{PROTOCOL_VERSION}; run the same swarmp2p version everywhere",
            )
        if hello.node_id == self.ctx.node_id:
            raise RpcError(
                "node_id_taken",
                f"node id {hello.node_id} is this node's; give one of them another --node-id",
            )

    def _say_hello(self, endpoint: str) -> None:
        if endpoint in self._hellos or self.ctx.closing:
            return
        self._hellos.add(endpoint)
        self.ctx.spawn(self._hello(endpoint), f"hello:{endpoint}")

    async def _hello(self, endpoint: str) -> None:
        try:
            reply = await self.ctx.call_endpoint(endpoint, self._hello_msg(), self._rpc_timeout)
            if not isinstance(reply, NodeHello):
                raise RpcError("bad_reply", f"{type(reply).TYPE} is not node.hello")
            self._check_hello(reply)
            self._met(reply, endpoint)
            self._unanswered.discard(endpoint)
        except RpcTimeout:
            if endpoint not in self._unanswered:  # once per endpoint until it answers
                self._unanswered.add(endpoint)
                log.info("no answer to hello from %s: not running, or refusing our swarm's key", endpoint)  # fmt: skip
        except RpcError as exc:
            log.warning("hello to %s refused: %s", endpoint, exc)
        finally:
            self._hellos.discard(endpoint)

    def _met(self, hello: NodeHello, endpoint: str) -> None:
        changes = self.ctx.members.hello(
            node_id=hello.node_id, name=hello.name, endpoint=endpoint, record=hello.record,
            host=hello.host, now=self.ctx.clock(),
        )  # fmt: skip
        peer = self.ctx.members.peers.get(hello.node_id)
        if peer is not None:
            peer.software = hello.software
        self._changed(changes)

    def _on_mdns_add(self, advert: Advert, addresses: list[str]) -> None:
        if not addresses:
            return
        endpoint = f"tcp://{best_address(addresses, self._networks)}:{advert.port}"
        peer = self.ctx.members.peers.get(advert.node_id)
        if peer is None or not peer.alive or peer.endpoint != endpoint:
            log.info("mDNS: found node %s (%s) at %s", advert.node_id, advert.name, endpoint)
            self._say_hello(endpoint)

    def _on_mdns_remove(self, node_id: str) -> None:
        peer = self.ctx.members.peers.get(node_id)
        if peer is not None and peer.alive:
            self.ctx.spawn(self._confirm_gone(node_id, peer.endpoint), f"confirm:{node_id}")

    async def _confirm_gone(self, node_id: str, endpoint: str) -> None:
        try:
            await self.ctx.call_endpoint(endpoint, self._heartbeat_msg(), self._rpc_timeout)
            self.ctx.members.seen(node_id, self.ctx.clock())
        except (RpcTimeout, RpcError):
            self._changed(self.ctx.members.dead(node_id, self.ctx.clock(), "mDNS goodbye and no heartbeat"))  # fmt: skip

    def _heartbeat_msg(self) -> Heartbeat:
        term, version = self.rep.held
        return Heartbeat(
            node_id=self.ctx.node_id, term=term, version=version, leader=self.ctx.leader,
            wall_time=time.time(), serving=self.serving.issued(), memory=self._memory(),
            fetching=self.stages.inputs.status(),
        )  # fmt: skip

    def _memory(self) -> dict[str, Any]:
        """This node's live memory: free per device, and what its own workers hold."""
        memory = {
            "free": self._live.read(),
            "held": {"jobs": self.stages.held(), "serve": self.serving.stages.held()},
            "disk": self._disk(),
        }
        hardware.apply_memory(self.ctx.me.record, memory)
        return memory

    def _disk(self) -> int:
        now = self.ctx.clock()
        if now - self._disk_at >= hardware.LIVE_EVERY_S:
            self._disk_at, self._disk_free = now, hardware.free_disk(self._env)
        return self._disk_free

    def _peer_report(self, beat: Heartbeat) -> None:
        """A peer's heartbeat: its live memory into its record, its fetches for status."""
        peer = self.ctx.members.peers.get(beat.node_id)
        if peer is not None:
            hardware.apply_memory(peer.record, beat.memory)
        self._fetching[beat.node_id] = list(beat.fetching or [])

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
        self._memory()  # this node's own record is live too, peers or none
        peers = list(ctx.members.peers.values())
        results = await asyncio.gather(
            *(self._beat(p.node_id, p.endpoint, p.alive) for p in peers), return_exceptions=True
        )
        for peer, result in zip(peers, results):
            if isinstance(result, Exception):
                log.warning("heartbeat to %s failed: %r", peer.node_id, result)
        for endpoint in self._static:
            if not any(p.alive and p.endpoint == endpoint for p in peers):
                self._say_hello(endpoint)
        now = ctx.clock()
        self._changed(ctx.members.expire(now, ctx.config.failure_timeout_s, ctx.config.forget_after_s))  # fmt: skip
        keep = {p.endpoint for p in ctx.members.peers.values()} | set(self._static) | self._hellos
        await ctx.prune_clients(keep)
        self._bad.flush()
        if ctx.leader == ctx.node_id and not self.rep.ready:
            self.rep.start_takeover()
        self.jobs.tick()
        self.stages.reap()
        self.serving.tick()
        if (
            not ctx.leading
            and now - self._status_at < METRICS_WANTED_S
            and now - self._metrics_at >= 1.0
        ):
            self._metrics_at = now
            ctx.spawn(self._refresh_metrics(), "metrics")

    async def _refresh_metrics(self) -> None:
        """A follower someone is watching (its dashboard, `swarm status`) keeps the running
        jobs' metrics fetched from the leader, and each finished job's once."""
        for job_id, entry in sorted(self.rep.table.jobs.items()):
            if entry.state in ACTIVE_STATES or not self.jobs.metrics.get(job_id):
                await self.jobs.job_metrics(job_id)

    async def _beat(self, node_id: str, endpoint: str, alive: bool) -> None:
        if not alive:
            self._say_hello(endpoint)
            return
        sent = time.time()
        try:
            reply = await self.ctx.call_endpoint(endpoint, self._heartbeat_msg(), self._rpc_timeout)
        except RpcTimeout:
            return
        except RpcError as exc:
            if exc.code == "unknown_peer":
                self._say_hello(endpoint)
            else:
                log.warning("heartbeat to %s refused: %s", node_id, exc)
            return
        if not isinstance(reply, Heartbeat) or reply.node_id != node_id:
            return
        self.ctx.members.seen(node_id, self.ctx.clock())
        self.serving.stages.issuer_claims(node_id, reply.serving, self.ctx.clock())
        self._peer_report(reply)
        if reply.wall_time:
            self._skews[node_id] = reply.wall_time - (sent + time.time()) / 2
        if self.rep.ready:
            self.rep.push(node_id, (reply.term, reply.version))

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

    async def _handle(self, msg: Message, identity: bytes) -> Message:
        try:
            return await self._dispatch(msg)
        except SwarmError as exc:
            if exc.kind != "unavailable":  # not leading, stopping: normal during a change
                self._bad.warning("refused %s: %s", type(msg).TYPE, exc)
            raise
        except ValueError as exc:
            self._bad.warning("refused %s: %s", type(msg).TYPE, exc)
            raise RpcError("bad_field", str(exc)) from None

    async def _dispatch(self, msg: Message) -> Message:
        ctx = self.ctx
        now = ctx.clock()
        if ctx.closing and not isinstance(msg, Leave):
            raise Unavailable(f"node {ctx.node_id} is stopping", code="stopping")
        if isinstance(msg, Heartbeat):
            if not ctx.members.seen(msg.node_id, now):
                raise RpcError("unknown_peer", f"node {msg.node_id} must send node.hello first")
            self.serving.stages.issuer_claims(msg.node_id, msg.serving, now)
            self._peer_report(msg)
            return self._heartbeat_msg()
        if isinstance(msg, NodeHello):
            self._check_hello(msg)
            endpoint = f"tcp://{best_address(msg.addresses, self._networks)}:{msg.control_port}"
            self._met(msg, endpoint)
            return self._hello_msg()
        if isinstance(msg, Leave):
            return await self._on_leave(msg)
        if isinstance(msg, LeadRequest):
            return self.rep.on_vote_request(msg)
        if isinstance(msg, TableFetch):
            return self.rep.on_fetch(msg)
        if isinstance(msg, TableEvents):
            return await self.rep.on_events(msg)
        if isinstance(msg, TablePush):
            return await self.rep.on_table(msg)
        if isinstance(msg, (Submit, StageReport, JobCancel, JobMetricsFetch, ShardCopy)):
            return await self.jobs.handle(msg)
        if isinstance(msg, (StageStart, StageStop, ShardRead, FilePull, InputRead)):
            return await self.stages.handle(msg)
        if isinstance(msg, SERVE_MESSAGES):
            return await self.serving.handle(msg)
        raise RpcError("unexpected", f"node daemon does not take {type(msg).TYPE} requests")

    async def _on_leave(self, msg: Leave) -> Leave:
        """A peer stops: the leader takes a member off the members first (so the rest keep
        their majority), then every node forgets it."""
        ctx = self.ctx
        if ctx.leading and msg.node_id in self.rep.table.member_ids:
            with contextlib.suppress(SwarmError):
                await self.rep.append([ev.MemberLeft(node_id=msg.node_id, reason="stopped")], wait=True)  # fmt: skip
        if msg.node_id in ctx.members.peers:
            ctx.members.forget(msg.node_id)
            self._changed([Change(kind="leave", node_id=msg.node_id, reason="stopped")])
        return Leave(node_id=ctx.node_id)

    # --- the local API -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What `swarm status --json` prints."""
        ctx = self.ctx
        now = ctx.clock()
        self._status_at = now
        me = {
            "node_id": ctx.node_id, "name": ctx.me.name, "address": f"{ctx.me.addresses[0]}:{ctx.port}",
            "alive": True, "is_leader": ctx.leader == ctx.node_id, "last_seen_s": 0.0,
            "host": ctx.me.host, "devices": views.devices(ctx.me.record), "version": __version__,
            "capabilities": list(ctx.me.record.get("capabilities", [])),
        }  # fmt: skip
        table = self.rep.table
        return {
            "node_id": ctx.node_id,
            "name": ctx.me.name,
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
            "peers": views.peer_rows(
                me=me,
                peers=list(ctx.members.peers.values()),
                leader=ctx.leader,
                now=now,
                skews=self._skews,
            ),
            "jobs": [
                views.entry_json(e, self.jobs.metrics.get(job_id))
                for job_id, e in sorted(table.jobs.items())
            ],
            "dashboard": self._dashboard.url if self._dashboard else None,
            "dashboard_note": self._dashboard_note,
            "served": self.serving.status(),
            "fetching": [
                *self.stages.inputs.status(),
                *(f for n, fs in sorted(self._fetching.items()) if ctx.is_alive(n) for f in fs),
            ],
        }

    async def _api_submit(self, req: dict[str, Any]) -> dict[str, Any]:
        from swarmp2p.plan import JobError, parse_job

        job_id = req.get("job_id") or ""
        if not isinstance(job_id, str):
            raise UserError("submit 'job_id' must be a string", code="bad_field")
        try:
            job = parse_job(req.get("job"))
        except JobError as exc:
            raise UserError(str(exc), code="invalid_job") from None
        cwd = req.get("cwd") if isinstance(req.get("cwd"), str) else None
        job, inputs = await self.stages.inputs.submit(job, cwd)  # its files travel from here
        reply = await self.ctx.to_leader(Submit(job_id=job_id, job=job, submitted_by=str(req.get("submitted_by") or "cli"), inputs=inputs), 15.0)  # fmt: skip
        return {"job_id": reply.job_id, "term": reply.term, "version": reply.version, "replicas": reply.replicas}  # fmt: skip

    async def _measure_speeds(self, fresh: bool = False) -> dict[str, Any]:
        """Measure this node's speeds (cached per hardware and software version; ``fresh``:
        again) and advertise them: a new hello to every live peer."""
        if not speed_probe.can_probe(self._env):
            return {}
        omp = str(self._env.get("OMP_NUM_THREADS", "")).strip()
        threads = int(omp) if omp.isdigit() and int(omp) > 0 else int(self.ctx.me.host.get("cpu_cores") or 1)  # fmt: skip
        try:
            speeds = await asyncio.to_thread(
                speed_probe.measure, self.ctx.me.record, threads=threads, env=self._env, fresh=fresh
            )
        except (OSError, RuntimeError, ValueError, TimeoutError) as exc:
            log.warning("speed probe failed (the planner splits by free memory): %s", exc)
            if fresh:
                raise
            return {}
        if speed_probe.apply_speeds(self.ctx.me.record, speeds):
            log.info("measured speeds (FLOP/s): %s", speeds)
            self.ctx.spawn(self._advertise(), "advertise")
        return speeds

    async def _advertise(self) -> None:
        """A new hello (this node's record) to every known peer, once any hello to it that
        was already under way (with the old record) is answered."""
        pending = {p.endpoint for p in self.ctx.members.peers.values()} | set(self._static)
        for _ in range(100):
            for endpoint in sorted(pending):
                if endpoint not in self._hellos:
                    self._say_hello(endpoint)
                    pending.discard(endpoint)
            if not pending:
                return
            await asyncio.sleep(0.05)

    async def _api_bench(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            speeds = await self._measure_speeds(fresh=True)
        except (OSError, RuntimeError, ValueError, TimeoutError) as exc:
            raise SwarmError(f"the speed probe failed: {exc}", code="failed") from None
        return {"node_id": self.ctx.node_id, "speeds": speeds,
                "devices": views.devices(self.ctx.me.record)}  # fmt: skip

    async def _api_down(self, req: dict[str, Any]) -> dict[str, Any]:
        asyncio.get_running_loop().call_soon(self.stop)
        return {"node_id": self.ctx.node_id, "pid": os.getpid()}

    async def _api_status(self, req: dict[str, Any]) -> dict[str, Any]:
        return self.status()

    async def _api_peers(self, req: dict[str, Any]) -> list[dict[str, Any]]:
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
