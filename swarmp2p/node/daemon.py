"""The node daemon behind `swarm up`: one asyncio loop for discovery, membership, election,
job-table replication and the local API. Never imports torch.

Protocol (all over CURVE RPC with the swarm secret):

- ``node.hello`` both ways when a peer is found (mDNS, ``--peer``, or its own hello): identity,
  addresses, hardware, table key. A hello makes the sender a live member.
- ``node.heartbeat`` every ``heartbeat_s`` to every live peer; a peer silent past
  ``failure_timeout_s`` is dead. An mDNS removal triggers one immediate heartbeat and kills
  the peer only if it fails. ``node.leave`` on a clean stop forgets the sender at once.
- The leader is ``election.leader`` of this node's view, recomputed on every change. A node
  that becomes leader waits ``startup grace`` (so a restarted node first meets its swarm),
  fetches the tables of all live peers, continues from the newest with a ``lead`` event and
  pushes it. Heartbeat replies carry table keys: the leader pushes to a peer that is behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from swarmp2p import PROTOCOL_VERSION, __version__
from swarmp2p.dashboard import start_dashboard
from swarmp2p.net.discovery import (
    Advert,
    Discovery,
    best_address,
    list_interfaces,
    local_networks,
    select_interfaces,
)
from swarmp2p.net.rpc import RpcClient, RpcError, RpcServer, RpcTimeout
from swarmp2p.net.security import SwarmSecret
from swarmp2p.node import hardware, jobtable
from swarmp2p.node.api import ApiError, ApiServer
from swarmp2p.node.config import SUBMIT_TIMEOUT_S, NodeConfig, parse_peer
from swarmp2p.node.dispatch import Dispatcher
from swarmp2p.node.election import leader as elect
from swarmp2p.node.jobtable import JobEvent, JobTable
from swarmp2p.node.membership import Change, Membership
from swarmp2p.node.messages import (
    SERVE_MESSAGES,
    FilePull,
    Heartbeat,
    JobCancel,
    Leave,
    NodeHello,
    ShardRead,
    StageReport,
    StageStart,
    StageStop,
    Submit,
    Submitted,
    TableAck,
    TableFetch,
    TablePush,
)
from swarmp2p.node.serving import Serving
from swarmp2p.node.state import StateDir
from swarmp2p.wire.messages import Message

log = logging.getLogger("swarmp2p.node")


class _RateLimitedLog:
    """Log at most ``per_second`` lines a second; count and report what was dropped."""

    def __init__(self, per_second: int = 5, clock: Callable[[], float] = time.monotonic) -> None:
        self._per_second, self._clock = per_second, clock
        self._window, self._count, self._dropped = 0.0, 0, 0

    def flush(self) -> None:
        """Report what was dropped once its one-second window is over."""
        now = self._clock()
        if now - self._window >= 1.0:
            if self._dropped:
                log.warning("... %d more bad requests in the last second", self._dropped)
            self._window, self._count, self._dropped = now, 0, 0

    def warning(self, fmt: str, *args: Any) -> None:
        self.flush()
        if self._count < self._per_second:
            self._count += 1
            log.warning(fmt, *args)
        else:
            self._dropped += 1


@dataclass(kw_only=True, slots=True)
class _Runtime:
    clients: dict[str, RpcClient] = field(default_factory=dict)
    tasks: set[asyncio.Task] = field(default_factory=set)
    hellos: set[str] = field(default_factory=set)
    unanswered: set[str] = field(default_factory=set)
    skews: dict[str, float] = field(default_factory=dict)
    """node id -> its wall clock minus ours (s), from the last heartbeat round trip."""


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
        self.config = config
        self.secret = secret
        self.clock = clock
        self.state = StateDir(root=config.state_dir).ensure()
        self.node_id = self.state.node_id(config.node_id)
        self.name = config.name or socket.gethostname()
        chosen = select_interfaces(list_interfaces(), config.interface)
        if not chosen:
            raise ValueError("no IPv4 interface to use; pass --interface NAME_OR_IP")
        self.addresses = [ip for _, ip in chosen]
        self._networks = local_networks()
        self.bind_host = self.addresses[0] if config.interface else "0.0.0.0"
        self.record, self.host = hardware.probe(
            node_id=self.node_id,
            name=self.name,
            version=__version__,
            env=env,
            capabilities=runtime_capabilities(),
        )
        self.table = jobtable.load(self.state.table_file)
        self.members = Membership(self.node_id)
        self.leader = self.node_id
        self._leader_ready = False
        self._closing = False
        self._started = 0.0
        self._stop = asyncio.Event()
        self._table_lock = asyncio.Lock()
        self._takeover: asyncio.Task | None = None
        self._rt = _Runtime()
        self._bad = _RateLimitedLog(clock=clock)
        self._static = [parse_peer(p) for p in config.peers]
        self._ctx = None
        self._server: RpcServer | None = None
        self._api: ApiServer | None = None
        self._discovery: Discovery | None = None
        self.port = 0
        self._env = os.environ if env is None else env
        self._dashboard, self._dashboard_note = None, ""
        self.jobs = Dispatcher(self)
        self.serving = Serving(self)

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

        self._started = self.clock()
        self._ctx = AsyncSecureContext()
        self._server = RpcServer(
            self._ctx, self.secret, self.bind_host, self.config.port, self._handle
        )
        await self._server.start()
        self.port = self._server.port
        self._api = ApiServer(
            self.state.api_socket,
            {
                "status": self._api_status,
                "peers": self._api_peers,
                "submit": self._api_submit,
                "down": self._api_down,
                **self._job_api(),
                **self.serving.api_handlers(),
            },
        )
        await self._api.start()
        self._dashboard, self._dashboard_note = await start_dashboard(self.status, self._env)
        self.state.pid_file.write_text(f"{os.getpid()}\n")
        log.info(
            "node %s (%s) of swarm %s listening on %s port %d; table term %d version %d",
            self.node_id,
            self.name,
            self.secret.swarm_id,
            ",".join(self.addresses),
            self.port,
            self.table.term,
            self.table.version,
        )
        if self.config.mdns:
            advert = Advert(
                swarm_id=self.secret.swarm_id,
                node_id=self.node_id,
                name=self.name,
                port=self.port,
                protocol=PROTOCOL_VERSION,
                hardware=hardware.summary(self.record, self.host),
            )
            self._discovery = Discovery(
                advert, self.addresses, on_add=self._on_mdns_add, on_remove=self._on_mdns_remove
            )
            await self._discovery.start()
        self._spawn(self._heartbeat_loop(), "heartbeats")
        self._elect()
        self.serving.restore()

    async def _close(self) -> None:
        log.info("stopping node %s", self.node_id)
        self._closing = True
        # stop heartbeats and hellos first: a hello sent after our leave would re-add us
        await self.serving.close()
        await self.jobs.close()
        for task in list(self._rt.tasks):
            task.cancel()
        for task in list(self._rt.tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._ctx is not None:
            leave = Leave(node_id=self.node_id)
            await asyncio.gather(
                *(self._call(p.endpoint, leave, 0.5) for p in self.members.alive_peers()),
                return_exceptions=True,
            )
        if self._discovery is not None:
            with contextlib.suppress(Exception):
                await self._discovery.close()
        for client in self._rt.clients.values():
            await client.close()
        if self._server is not None:
            await self._server.close()
        if self._api is not None:
            await self._api.close()
        if self._dashboard is not None:
            await self._dashboard.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        for path in (self.state.api_socket, self.state.pid_file):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        log.info("node %s stopped", self.node_id)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._rt.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._rt.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    # --- talking to peers --------------------------------------------------------------------

    def _client(self, endpoint: str) -> RpcClient:
        client = self._rt.clients.get(endpoint)
        if client is None:
            client = self._rt.clients[endpoint] = RpcClient(self._ctx, self.secret, endpoint)
        return client

    async def _call(self, endpoint: str, msg: Message, timeout: float) -> Message:
        return await self._client(endpoint).request(msg, timeout)

    @property
    def _rpc_timeout(self) -> float:
        return max(self.config.heartbeat_s * 2, 0.2)

    def _hello_msg(self) -> NodeHello:
        return NodeHello(
            node_id=self.node_id,
            name=self.name,
            versions=[PROTOCOL_VERSION],
            software=__version__,
            swarm_id=self.secret.swarm_id,
            control_port=self.port,
            addresses=self.addresses,
            record=self.record,
            host=self.host,
            term=self.table.term,
            version=self.table.version,
        )

    def _check_hello(self, hello: NodeHello) -> None:
        if hello.swarm_id != self.secret.swarm_id:
            raise RpcError("wrong_swarm", f"swarm {hello.swarm_id} is not {self.secret.swarm_id}")
        if PROTOCOL_VERSION not in hello.versions:
            raise RpcError(
                "version",
                f"node {hello.node_id} speaks protocol {hello.versions}, this node "
                f"{PROTOCOL_VERSION}; run the same swarmp2p version everywhere",
            )
        if hello.node_id == self.node_id:
            raise RpcError(
                "node_id_taken",
                f"node id {hello.node_id} is this node's; give one of them another --node-id",
            )

    def _say_hello(self, endpoint: str) -> None:
        if endpoint in self._rt.hellos or self._closing:
            return
        self._rt.hellos.add(endpoint)
        self._spawn(self._hello(endpoint), f"hello:{endpoint}")

    async def _hello(self, endpoint: str) -> None:
        try:
            reply = await self._call(endpoint, self._hello_msg(), self._rpc_timeout)
            if not isinstance(reply, NodeHello):
                raise RpcError("bad_reply", f"{type(reply).TYPE} is not node.hello")
            self._check_hello(reply)
            changes = self.members.hello(
                node_id=reply.node_id,
                name=reply.name,
                endpoint=endpoint,
                record=reply.record,
                host=reply.host,
                now=self.clock(),
            )
            self._rt.unanswered.discard(endpoint)
            self._changed(changes)
        except RpcTimeout:
            if endpoint not in self._rt.unanswered:  # once per endpoint until it answers
                self._rt.unanswered.add(endpoint)
                log.info(
                    "no answer to hello from %s: not running, or refusing our swarm's key", endpoint
                )
            return
        except RpcError as exc:
            log.warning("hello to %s refused: %s", endpoint, exc)
        finally:
            self._rt.hellos.discard(endpoint)

    def _on_mdns_add(self, advert: Advert, addresses: list[str]) -> None:
        if not addresses:
            return
        endpoint = f"tcp://{best_address(addresses, self._networks)}:{advert.port}"
        peer = self.members.peers.get(advert.node_id)
        if peer is None or not peer.alive or peer.endpoint != endpoint:
            log.info("mDNS: found node %s (%s) at %s", advert.node_id, advert.name, endpoint)
            self._say_hello(endpoint)

    def _on_mdns_remove(self, node_id: str) -> None:
        peer = self.members.peers.get(node_id)
        if peer is not None and peer.alive:
            self._spawn(self._confirm_gone(node_id, peer.endpoint), f"confirm:{node_id}")

    async def _confirm_gone(self, node_id: str, endpoint: str) -> None:
        try:
            await self._call(endpoint, self._heartbeat_msg(), self._rpc_timeout)
            self.members.seen(node_id, self.clock())
        except (RpcTimeout, RpcError):
            self._changed(self.members.dead(node_id, self.clock(), "mDNS goodbye and no heartbeat"))

    def _heartbeat_msg(self) -> Heartbeat:
        return Heartbeat(
            node_id=self.node_id,
            term=self.table.term,
            version=self.table.version,
            leader=self.leader,
            wall_time=time.time(),
            serving=self.serving.issued(),
        )

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self._heartbeat_round()
            except Exception:  # never let one bad round stop the heartbeats
                log.exception("heartbeat round failed")
            await asyncio.sleep(self.config.heartbeat_s)

    async def _heartbeat_round(self) -> None:
        """Heartbeat every peer (hello the dead and static ones), expire the silent."""
        peers = list(self.members.peers.values())
        results = await asyncio.gather(
            *(self._beat(p.node_id, p.endpoint, p.alive) for p in peers),
            return_exceptions=True,
        )
        for peer, result in zip(peers, results):
            if isinstance(result, Exception):
                log.warning("heartbeat to %s failed: %r", peer.node_id, result)
        for endpoint in self._static:
            if not any(p.alive and p.endpoint == endpoint for p in peers):
                self._say_hello(endpoint)
        now = self.clock()
        self._changed(
            self.members.expire(now, self.config.failure_timeout_s, self.config.forget_after_s)
        )
        for endpoint in [e for e in self._rt.clients if e not in self._known_endpoints()]:
            await self._rt.clients.pop(endpoint).close()
        self._bad.flush()
        if self.leader == self.node_id and self._should_take_over():
            self._start_takeover()
        self.jobs.tick()
        self.serving.tick()

    def _known_endpoints(self) -> set[str]:
        return (
            {p.endpoint for p in self.members.peers.values()} | set(self._static) | self._rt.hellos
        )

    async def _beat(self, node_id: str, endpoint: str, alive: bool) -> None:
        if not alive:
            self._say_hello(endpoint)
            return
        sent = time.time()
        try:
            reply = await self._call(endpoint, self._heartbeat_msg(), self._rpc_timeout)
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
        self.members.seen(node_id, self.clock())
        self.serving.stages.issuer_claims(node_id, reply.serving, self.clock())
        if reply.wall_time:
            self._rt.skews[node_id] = reply.wall_time - (sent + time.time()) / 2
        theirs = (reply.term, reply.version)
        if self._leader_ready and theirs < self.table.key:
            self._spawn(self._push(endpoint, self.table), f"push:{node_id}")
        elif self._leader_ready and theirs > self.table.key:
            log.warning(
                "node %s holds a newer table %s than the leader's; merging", node_id, theirs
            )
            self._leader_ready = False
            self._start_takeover()
        elif not self._leader_ready and node_id == self.leader and theirs > self.table.key:
            self._spawn(self._pull(endpoint), f"pull:{node_id}")

    # --- membership changes and election -----------------------------------------------------

    def _changed(self, changes: list[Change]) -> None:
        for change in changes:
            peer = self.members.peers.get(change.node_id)
            where = f" at {peer.endpoint}" if peer is not None else ""
            if change.kind == "join":
                log.info("node %s joined%s", change.node_id, where)
            else:
                log.info("node %s left (%s)", change.node_id, change.reason)
        if changes:
            self._elect()

    def _elect(self) -> None:
        new = elect(self.members.live_view())
        if new != self.leader:
            log.info("leader is now %s (was %s)", new, self.leader)
            self.leader = new
        if new != self.node_id:
            self._leader_ready = False
        elif not self._leader_ready:
            self._start_takeover()

    def _should_take_over(self) -> bool:
        return not self._leader_ready

    def _start_takeover(self) -> None:
        if self._takeover is None or self._takeover.done():
            self._takeover = self._spawn(self._take_over(), "takeover")

    async def _take_over(self) -> None:
        # a restarted node first meets its swarm, so it never continues from its stale table
        grace = self._started + self.config.failure_timeout_s - self.clock()
        if grace > 0:
            await asyncio.sleep(grace)
        if self.leader != self.node_id:
            return
        async with self._table_lock:
            peers = self.members.alive_peers()
            fetch = TableFetch(node_id=self.node_id)
            replies = await asyncio.gather(
                *(self._call(p.endpoint, fetch, self._rpc_timeout) for p in peers),
                return_exceptions=True,
            )
            tables = [self.table]
            for peer, reply in zip(peers, replies):
                if isinstance(reply, TablePush):
                    try:
                        tables.append(JobTable.from_dict(reply.table))
                    except ValueError as exc:
                        log.warning("node %s sent a bad table: %s", peer.node_id, exc)
            if self.leader != self.node_id:
                return
            base = jobtable.newest(tables)
            table = jobtable.apply(
                base, JobEvent(version=base.version + 1, kind="lead", leader=self.node_id)
            )
            jobtable.save(self.state.table_file, table)
            self.table = table
            self._leader_ready = True
        log.info(
            "leading swarm %s: term %d, table version %d, %d job(s), newest of %d table(s)",
            self.secret.swarm_id,
            table.term,
            table.version,
            len(table.jobs),
            len(tables),
        )
        await self._push_all(table)

    async def _push(self, endpoint: str, table: JobTable) -> bool:
        try:
            reply = await self._call(
                endpoint, TablePush(node_id=self.node_id, table=table.to_dict()), self._rpc_timeout
            )
        except (RpcTimeout, RpcError) as exc:
            log.debug("table push to %s failed: %s", endpoint, exc)
            return False
        return isinstance(reply, TableAck) and (reply.term, reply.version) >= table.key

    async def _push_all(self, table: JobTable) -> int:
        peers = self.members.alive_peers()
        acks = await asyncio.gather(*(self._push(p.endpoint, table) for p in peers))
        return sum(acks)

    async def _pull(self, endpoint: str) -> None:
        try:
            reply = await self._call(endpoint, TableFetch(node_id=self.node_id), self._rpc_timeout)
        except (RpcTimeout, RpcError):
            return
        if isinstance(reply, TablePush):
            self._accept_table(reply.table)

    def _accept_table(self, data: dict) -> None:
        table = JobTable.from_dict(data)
        if table.key > self.table.key:
            jobtable.save(self.state.table_file, table)
            self.table = table

    # --- jobs --------------------------------------------------------------------------------

    async def submit(self, job_id: str, record: dict) -> Submitted:
        """Add a job: on the leader directly, else forwarded to it; returns once durable on
        the leader and one other live peer (when one exists)."""
        if self.leader != self.node_id:
            peer = self.members.peers.get(self.leader)
            if peer is None:
                raise RpcError("no_leader", "no leader is known yet; retry in a moment")
            reply = await self._call(
                peer.endpoint, Submit(job_id=job_id, record=record), SUBMIT_TIMEOUT_S
            )
            if not isinstance(reply, Submitted):
                raise RpcError("bad_reply", f"leader answered {type(reply).TYPE}")
            return reply
        if not self._leader_ready:
            raise RpcError("not_ready", f"leader {self.node_id} is still taking over; retry")
        async with self._table_lock:
            job_id = job_id or f"j{self.table.version + 1:06d}-{secrets.token_hex(3)}"
            try:
                event = JobEvent(
                    version=self.table.version + 1, kind="submit", job_id=job_id, record=record
                )
                table = jobtable.apply(self.table, event)
            except ValueError as exc:
                raise RpcError("bad_job", str(exc)) from None
            jobtable.save(self.state.table_file, table)
            self.table = table
        peers = len(self.members.alive_peers())
        acks = await self._push_all(table)
        if peers and not acks:
            raise RpcError(
                "not_durable",
                f"job {job_id} is saved on the leader only: none of {peers} live peer(s) "
                "acknowledged it; check `swarm peers`",
            )
        log.info("job %s submitted at version %d, on %d node(s)", job_id, table.version, 1 + acks)
        return Submitted(job_id=job_id, term=table.term, version=table.version, replicas=1 + acks)

    async def update_job(self, job_id: str, fields: dict[str, Any], state: str = "") -> None:
        """Leader: set ``fields`` (and ``state``) of a job, durably here, pushed to the peers."""
        if self.leader != self.node_id:
            raise RpcError("not_leader", f"node {self.node_id} is not the leader")
        async with self._table_lock:
            event = JobEvent(
                version=self.table.version + 1,
                kind="update",
                job_id=job_id,
                record=fields,
                state=state,
            )
            table = jobtable.apply(self.table, event)
            jobtable.save(self.state.table_file, table)
            self.table = table
        self._spawn(self._push_all(table), f"push:{job_id}")

    def _own_endpoint(self) -> str:
        return f"tcp://{self.addresses[0]}:{self.port}"

    def _job_api(self) -> dict[str, Any]:
        from swarmp2p.node import jobs_api

        return jobs_api.handlers(self)

    # --- the control socket ------------------------------------------------------------------

    async def _handle(self, msg: Message, identity: bytes) -> Message:
        try:
            return await self._dispatch(msg)
        except RpcError as exc:
            self._bad.warning("refused %s: %s", type(msg).TYPE, exc)
            raise
        except ValueError as exc:
            self._bad.warning("refused %s: %s", type(msg).TYPE, exc)
            raise RpcError("bad_field", str(exc)) from None

    async def _dispatch(self, msg: Message) -> Message:
        now = self.clock()
        if self._closing and not isinstance(msg, Leave):
            raise RpcError("stopping", f"node {self.node_id} is stopping")
        if isinstance(msg, Heartbeat):
            if not self.members.seen(msg.node_id, now):
                raise RpcError("unknown_peer", f"node {msg.node_id} must send node.hello first")
            self.serving.stages.issuer_claims(msg.node_id, msg.serving, now)
            return self._heartbeat_msg()
        if isinstance(msg, NodeHello):
            self._check_hello(msg)
            endpoint = f"tcp://{best_address(msg.addresses, self._networks)}:{msg.control_port}"
            changes = self.members.hello(
                node_id=msg.node_id,
                name=msg.name,
                endpoint=endpoint,
                record=msg.record,
                host=msg.host,
                now=now,
            )
            self._changed(changes)
            return self._hello_msg()
        if isinstance(msg, Leave):
            if msg.node_id in self.members.peers:
                self.members.forget(msg.node_id)
                self._changed([Change(kind="leave", node_id=msg.node_id, reason="stopped")])
            return Leave(node_id=self.node_id)
        if isinstance(msg, TableFetch):
            return TablePush(node_id=self.node_id, table=self.table.to_dict())
        if isinstance(msg, TablePush):
            self._accept_table(msg.table)
            return TableAck(node_id=self.node_id, term=self.table.term, version=self.table.version)
        if isinstance(msg, (StageStart, StageStop, StageReport, JobCancel, ShardRead, FilePull)):
            return await self.jobs.handle(msg)
        if isinstance(msg, SERVE_MESSAGES):
            return await self.serving.handle(msg)
        if isinstance(msg, Submit):
            if self.leader != self.node_id:
                raise RpcError(
                    "not_leader", f"node {self.node_id} is not the leader; {self.leader} is"
                )
            return await self.submit(msg.job_id, msg.record)
        raise RpcError("unexpected", f"node daemon does not take {type(msg).TYPE} requests")

    # --- the local API -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What `swarm status --json` prints."""
        now = self.clock()
        me = {
            "node_id": self.node_id,
            "name": self.name,
            "address": f"{self.addresses[0]}:{self.port}",
            "alive": True,
            "is_leader": self.leader == self.node_id,
            "last_seen_s": 0.0,
            "host": self.host,
            "devices": _devices(self.record),
            "version": __version__,
            "capabilities": list(self.record.get("capabilities", [])),
        }
        peers = [me]
        for peer in sorted(self.members.peers.values(), key=lambda p: p.node_id):
            peers.append(
                {
                    "node_id": peer.node_id,
                    "name": peer.name,
                    "address": peer.endpoint.removeprefix("tcp://"),
                    "alive": peer.alive,
                    "is_leader": peer.alive and peer.node_id == self.leader,
                    "last_seen_s": round(now - peer.last_seen, 3),
                    "clock_skew_s": _round(self._rt.skews.get(peer.node_id)),
                    "host": peer.host,
                    "devices": _devices(peer.record),
                    "version": str(peer.record.get("version", "")),
                    "capabilities": list(peer.record.get("capabilities", [])),
                }
            )
        return {
            "node_id": self.node_id,
            "name": self.name,
            "swarm_id": self.secret.swarm_id,
            "version": __version__,
            "leader": self.leader,
            "leader_ready": self._leader_ready,
            "term": self.table.term,
            "table_version": self.table.version,
            "port": self.port,
            "pid": os.getpid(),
            "uptime_s": round(now - self._started, 3),
            "peers": peers,
            "jobs": [jobtable._thaw(job) for _, job in sorted(self.table.jobs.items())],
            "dashboard": self._dashboard.url if self._dashboard else None,
            "dashboard_note": self._dashboard_note,
            "served": self.serving.status(),
        }

    async def _api_submit(self, req: dict[str, Any]) -> dict[str, Any]:
        record = req.get("record")
        if not isinstance(record, dict):
            raise ValueError("submit needs a JSON object 'record'")
        job_id = req.get("job_id") or ""
        if not isinstance(job_id, str):
            raise ValueError("submit 'job_id' must be a string")
        try:
            done = await self.submit(job_id, record)
        except (RpcError, RpcTimeout) as exc:
            raise ApiError(str(exc)) from None
        return {
            "job_id": done.job_id,
            "term": done.term,
            "version": done.version,
            "replicas": done.replicas,
        }

    async def _api_down(self, req: dict[str, Any]) -> dict[str, Any]:
        asyncio.get_running_loop().call_soon(self.stop)
        return {"node_id": self.node_id, "pid": os.getpid()}

    async def _api_status(self, req: dict[str, Any]) -> dict[str, Any]:
        return self.status()

    async def _api_peers(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        return self.status()["peers"]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def runtime_capabilities() -> list[str]:
    """The plan's CAPABILITIES when the torch runtime is importable here, else none (the
    daemon only looks for torch; it never imports it)."""
    from swarmp2p.plan.hardware import CAPABILITIES

    return sorted(CAPABILITIES) if importlib.util.find_spec("torch") is not None else []


def _devices(record: dict[str, Any]) -> list[dict[str, Any]]:
    keys = ("kind", "index", "name", "memory_total", "memory_free", "compute_capability")
    return [
        {**{k: d.get(k) for k in keys}, "fake": d.get("fake", False)}
        for d in record.get("devices", [])
    ]


def serve(config: NodeConfig, secret: SwarmSecret) -> None:
    """Run a daemon in this process until SIGTERM/SIGINT or `swarm down`."""

    async def main() -> None:
        daemon = Daemon(config, secret)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.stop)
        await daemon.run()

    asyncio.run(main())
