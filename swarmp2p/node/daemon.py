"""The node daemon behind `swarm up`: one asyncio loop for discovery, membership, heartbeats,
the control socket and the local API; the table, jobs and serving are parts it composes, each
given the node's context. Never imports torch.

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
from typing import Any

from swarmp2p import PROTOCOL_VERSION, __version__
from swarmp2p.dashboard import start_dashboard
from swarmp2p.errors import SwarmError, Unavailable, UserError
from swarmp2p.net.auth import KeyCheck, ServerKeys
from swarmp2p.net.discovery import (
    Advert,
    Discovery,
    best_address,
    list_interfaces,
    local_networks,
    select_interfaces,
)
from swarmp2p.net.rpc import RpcError, RpcServer, RpcTimeout
from swarmp2p.net.security import NodeKey, SwarmSecret, fingerprint
from swarmp2p.node import authz, hardware, jobs_api, speed_probe, views
from swarmp2p.node import events as ev
from swarmp2p.node import join as jn
from swarmp2p.node.api import ApiServer
from swarmp2p.node.config import NodeConfig, RateLimitedLog, parse_peer
from swarmp2p.node.context import Identity, NodeContext
from swarmp2p.node.jobs_leader import JobsLeader
from swarmp2p.node.jobtable import ACTIVE_STATES
from swarmp2p.node.membership import Change, Refused
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
from swarmp2p.node.pairing import PairingPort
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
        key = NodeKey.load_or_create(state.node_key_file)
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
            key=key,
            config=config,
            clock=clock,
        )
        self._probe_stop = threading.Event()
        """Set when the daemon stops: its speed probe (a subprocess on a thread) is killed."""
        self._live = hardware.LiveMemory(record)
        """Free memory re-read with the heartbeats (live, not the probe at start)."""
        self._disk_at, self._disk_free = -1e18, 0
        self._fetching: dict[str, list] = {}
        """node -> the fetches its last heartbeat listed (``swarm status`` shows them)."""
        self.rep = Replication(self.ctx, state.table_file, state.root / "vote.json")
        self.admission = jn.Admission(self.ctx, self.rep, on_secret=self._adopt_secret)
        self.bind_host = addresses[0] if config.interface else "0.0.0.0"
        self.pairing = PairingPort(self.ctx, self.bind_host, on_change=self._readvertise)
        self.jobs = JobsLeader(self.ctx, self.rep)
        self.stages = StageHost(self.ctx)
        self.serving = Serving(self.ctx, self.stages, self.jobs)
        self.ctx.attach(local=self._dispatch, replication=self.rep)
        self._networks = local_networks()
        self._stop = asyncio.Event()
        self._bad = RateLimitedLog(clock=clock)
        self._static = [parse_peer(p) for p in config.peers]
        self._hellos: set[str] = set()
        self._unanswered: set[str] = set()
        self._skews: dict[str, float] = {}
        self._server: RpcServer | None = None
        self._join: jn.JoinPort | None = None
        self._met_at: dict[str, tuple[str, str]] = {}
        """control endpoint -> (node id, key) bound by a join or a hello: hello it directly."""
        self._api: ApiServer | None = None
        self._discovery: Discovery | None = None
        self._env = os.environ if env is None else env
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
        finally:
            await self._close()

    def stop(self) -> None:
        self._stop.set()

    async def _start(self) -> None:
        from swarmp2p.net.auth import AsyncSecureContext

        ctx = self.ctx
        ctx.zmq = AsyncSecureContext()
        keys = ServerKeys(
            public=ctx.key.public, secret=ctx.key.secret,
            admits=KeyCheck(ctx.keyring.admits), domain=f"swarmp2p-members-{ctx.node_id}",
        )  # fmt: skip
        self._server = RpcServer(ctx.zmq, keys, self.bind_host, ctx.config.port, self._handle)
        await self._server.start()
        ctx.port = self._server.port
        join_port = ctx.port + jn.JOIN_PORT_OFFSET if ctx.config.port else 0
        self._join = jn.JoinPort(ctx, self.bind_host, join_port, self._on_join)
        await self._join.start()
        ctx.join_port = self._join.port
        self._api = ApiServer(
            ctx.state.api_socket,
            {
                "status": self._api_status,
                "peers": self._api_peers,
                "submit": self._api_submit,
                "down": self._api_down,
                "remove": self._api_remove,
                "rotate": self._api_rotate,
                "invite": self._api_invite,
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
            "node %s (%s, key %s) of swarm %s listening on %s port %d (join port %d); table "
            "term %d version %d", ctx.node_id, ctx.me.name, ctx.key.fingerprint,
            ctx.secret.swarm_id, ",".join(ctx.me.addresses), ctx.port, self._join.port,
            self.rep.table.term, self.rep.table.version,
        )  # fmt: skip
        if ctx.config.mdns:
            self._discovery = Discovery(
                self._advert(),
                list(ctx.me.addresses),
                on_add=self._on_mdns_add,
                on_remove=self._on_mdns_remove,
                accept=self._accept_advert,
            )
            await self._discovery.start()
        if ctx.config.open_swarm:
            await self.pairing.open_swarm()
        ctx.spawn(self._heartbeat_loop(), "heartbeats")
        ctx.spawn(self._measure_speeds(), "speed-probe")
        self._elect()
        self.serving.restore()

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
            term=term, version=version, join_port=self._join.port if self._join else 0,
        )  # fmt: skip

    def _check_hello(self, hello: NodeHello) -> None:
        # no swarm id check: the key it came with is bound to a member or to a node that
        # proved the secret (mid-rotation two members may name different swarm ids)
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

    def _say_hello(self, endpoint: str, join_endpoint: str = "") -> None:
        if endpoint in self._hellos or self.ctx.closing:
            return
        self._hellos.add(endpoint)
        self.ctx.spawn(self._hello(endpoint, join_endpoint), f"hello:{endpoint}")

    async def _hello(self, endpoint: str, join_endpoint: str) -> None:
        """Meet the node at ``endpoint``: join it first (unless its key is known), then hello."""
        try:
            known = self._met_at.get(endpoint)
            if known is None:
                try:
                    joined = await self._join_peer(join_endpoint or jn.join_endpoint(endpoint))
                    known = (joined.node_id, joined.key)
                except RpcTimeout:
                    # no join port keyed by our secret there: the swarm may have rotated it
                    # while this node was away; a member still knows its peers by their keys
                    known = await self._member_at(endpoint)
                    if known is None:
                        raise
                self._met_at[endpoint] = known
            node_id, key = known
            reply = await self.ctx.call_endpoint(endpoint, self._hello_msg(), self._rpc_timeout, key=key)  # fmt: skip
            if not isinstance(reply, NodeHello) or reply.node_id != node_id:
                raise RpcError("bad_reply", f"{endpoint} did not answer as node {node_id}")
            self._check_hello(reply)
            self._met(reply, endpoint, key)
            self._unanswered.discard(endpoint)
        except RpcTimeout:
            self._met_at.pop(endpoint, None)  # join again next time (it may have a new key)
            if endpoint not in self._unanswered:  # once per endpoint until it answers
                self._unanswered.add(endpoint)
                log.info("no answer to hello from %s (nor from its join port): not running, or holding another swarm's secret", endpoint)  # fmt: skip
        except RpcError as exc:
            self._met_at.pop(endpoint, None)
            log.warning("hello to %s refused: %s", endpoint, exc)
        except Unavailable as exc:
            log.info("hello to %s: %s", endpoint, exc)
        finally:
            self._hellos.discard(endpoint)

    async def _member_at(self, endpoint: str) -> tuple[str, str] | None:
        """The member (id, key) whose control port is ``endpoint``: a hello with each listed
        member's key at once (only the right one completes a handshake); None if none."""
        from swarmp2p.net.auth import ClientKeys
        from swarmp2p.net.rpc import RpcClient

        ctx = self.ctx
        alive = {p.node_id for p in ctx.members.alive_peers()}
        candidates = [m for m in ctx.table.members if m.node_id != ctx.node_id and m.node_id not in alive]  # fmt: skip
        if not candidates:
            return None

        async def probe(member) -> tuple[str, str] | None:
            keys = ClientKeys(public=ctx.key.public, secret=ctx.key.secret, server=member.key)
            client = RpcClient(ctx.zmq, keys, endpoint)
            try:
                reply = await client.request(self._hello_msg(), self._rpc_timeout)
                ok = isinstance(reply, NodeHello) and reply.node_id == member.node_id
                return (member.node_id, member.key) if ok else None
            except (RpcTimeout, RpcError):
                return None
            finally:
                await client.close()

        found = [f for f in await asyncio.gather(*(probe(m) for m in candidates)) if f]
        return found[0] if found else None

    async def _join_peer(self, endpoint: str) -> jn.NodeJoined:
        """``node.join`` on the join port at ``endpoint``: bind its node id to its key, learn
        the nodes it knows, and have it ask the leader to list this node."""
        ctx = self.ctx
        msg = jn.join_request(ctx, self._join.port if self._join else 0)
        reply = await jn.join_at(ctx, endpoint, msg, self._rpc_timeout + jn.JOIN_TIMEOUT_S)
        now = ctx.clock()
        try:
            ctx.keyring.admit(reply.node_id, reply.key, now)
        except Refused as exc:
            raise RpcError("refused", f"the node at {endpoint}: {exc}") from None
        if reply.reason:
            log.info("joined through %s (%s): %s", reply.node_id, endpoint, reply.reason)
        for n in reply.nodes:
            if n.node_id == ctx.node_id:
                continue
            with contextlib.suppress(Refused):
                ctx.keyring.admit(n.node_id, n.key, now)
            peer = ctx.members.peers.get(n.node_id)
            if n.endpoint and (peer is None or not peer.alive):
                self._say_hello(n.endpoint, n.join_endpoint)
        return reply

    async def _on_join(self, msg: jn.NodeJoin) -> jn.NodeJoined:
        """A node on this node's join port: it holds the secret."""
        ctx = self.ctx
        if ctx.closing:
            raise Unavailable(f"node {ctx.node_id} is stopping", code="stopping")
        me = jn.NodeJoined(
            node_id=ctx.node_id, name=ctx.me.name, key=ctx.key.public, control_port=ctx.port,
            join_port=self._join.port, addresses=list(ctx.me.addresses),
            nodes=jn.known_nodes(ctx),
        )  # fmt: skip
        reply = await self.admission.on_join(msg, me)
        endpoint = f"tcp://{best_address(msg.addresses, self._networks)}:{msg.control_port}"
        self._met_at[endpoint] = (msg.node_id, msg.key)
        return reply

    def _met(self, hello: NodeHello, endpoint: str, key: str) -> None:
        host = endpoint.removeprefix("tcp://").rpartition(":")[0]
        changes = self.ctx.members.hello(
            node_id=hello.node_id, name=hello.name, endpoint=endpoint, record=hello.record,
            host=hello.host, now=self.ctx.clock(), key=key,
            join_endpoint=f"tcp://{host}:{hello.join_port}" if hello.join_port else "",
        )  # fmt: skip
        self._met_at[endpoint] = (hello.node_id, key)
        peer = self.ctx.members.peers.get(hello.node_id)
        if peer is not None:
            peer.software = hello.software
        self._changed(changes)

    def _accept_advert(self, advert: Advert) -> bool:
        """An advert of this swarm, or of a member (known by its key) that moved to a rotated
        secret this node has not fetched yet."""
        if advert.swarm_id == self.ctx.secret.swarm_id:
            return True
        keyring = self.ctx.keyring
        return bool(advert.key) and keyring.is_member(advert.node_id) and keyring.key_of(advert.node_id) == advert.key  # fmt: skip

    def _on_mdns_add(self, advert: Advert, addresses: list[str]) -> None:
        if not addresses:
            return
        address = best_address(addresses, self._networks)
        endpoint = f"tcp://{address}:{advert.port}"
        join = f"tcp://{address}:{advert.join_port}" if advert.join_port else ""
        peer = self.ctx.members.peers.get(advert.node_id)
        if peer is None or not peer.alive or peer.endpoint != endpoint:
            log.info("mDNS: found node %s (%s) at %s", advert.node_id, advert.name, endpoint)
            keyring = self.ctx.keyring
            if advert.key and keyring.is_member(advert.node_id) and keyring.key_of(advert.node_id) == advert.key:  # fmt: skip
                self._met_at.setdefault(endpoint, (advert.node_id, advert.key))  # no join needed
            self._say_hello(endpoint, join)

    def _on_mdns_remove(self, node_id: str) -> None:
        peer = self.ctx.members.peers.get(node_id)
        if peer is not None and peer.alive:
            self.ctx.spawn(self._confirm_gone(node_id, peer.endpoint), f"confirm:{node_id}")

    async def _confirm_gone(self, node_id: str, endpoint: str) -> None:
        try:
            await self.ctx.call_endpoint(endpoint, self._heartbeat_msg(), self._rpc_timeout)
            self.ctx.members.seen(node_id, self.ctx.clock())
        except (RpcTimeout, RpcError, Unavailable):
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
        self._drop_revoked()
        self._memory()  # this node's own record is live too, peers or none
        peers = list(ctx.members.peers.values())
        results = await asyncio.gather(
            *(self._beat(p.node_id, p.endpoint, p.alive, p.join_endpoint) for p in peers),
            return_exceptions=True,
        )
        for peer, result in zip(peers, results):
            if isinstance(result, Exception):
                log.warning("heartbeat to %s failed: %r", peer.node_id, result)
        for endpoint in self._static:
            if not any(p.alive and p.endpoint == endpoint for p in peers):
                self._say_hello(endpoint)
        now = ctx.clock()
        self._changed(ctx.members.expire(now, ctx.config.failure_timeout_s, ctx.config.forget_after_s))  # fmt: skip
        ctx.keyring.prune({p.node_id for p in ctx.members.alive_peers()}, now, ctx.config.forget_after_s)  # fmt: skip
        keep = {p.endpoint for p in ctx.members.peers.values()} | set(self._static) | self._hellos
        await ctx.prune_clients(keep)
        self._bad.flush()
        self.admission.check_secret()
        await self.pairing.tick()
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

    def _drop_revoked(self) -> None:
        """Forget the peers whose key this node no longer admits (`swarm remove`)."""
        ctx = self.ctx
        revoked = set(ctx.table.revoked)
        if ctx.key.public in revoked and not self._removed:
            self._removed = True
            log.error(
                "this node (%s) was removed from swarm %s: its key is revoked; it can join "
                "again only under a new identity (remove %s) with a new invite or token",
                ctx.node_id, ctx.secret.swarm_id, ctx.state.node_key_file,
            )  # fmt: skip
        for peer in list(ctx.members.peers.values()):
            if peer.key and peer.key in revoked:
                ctx.members.forget(peer.node_id)
                for endpoint, (node_id, _) in list(self._met_at.items()):
                    if node_id == peer.node_id:
                        del self._met_at[endpoint]
                self._changed([Change(kind="leave", node_id=peer.node_id, reason="removed: key revoked")])  # fmt: skip

    async def _refresh_metrics(self) -> None:
        """A follower someone is watching (its dashboard, `swarm status`) keeps the running
        jobs' metrics fetched from the leader, and each finished job's once."""
        for job_id, entry in sorted(self.rep.table.jobs.items()):
            if entry.state in ACTIVE_STATES or not self.jobs.metrics.get(job_id):
                await self.jobs.job_metrics(job_id)

    async def _beat(
        self, node_id: str, endpoint: str, alive: bool, join_endpoint: str = ""
    ) -> None:
        if not alive:
            self._say_hello(endpoint, join_endpoint)
            return
        sent = time.time()
        try:
            reply = await self.ctx.call_endpoint(endpoint, self._heartbeat_msg(), self._rpc_timeout)
        except (RpcTimeout, Unavailable):
            return
        except RpcError as exc:
            if exc.code in ("unknown_peer", "not_member"):
                self._met_at.pop(endpoint, None)
                self._say_hello(endpoint, join_endpoint)
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
            if not ctx.members.seen(msg.node_id, now):
                raise RpcError("unknown_peer", f"node {msg.node_id} must send node.hello first")
            self.serving.stages.issuer_claims(msg.node_id, msg.serving, now)
            self._peer_report(msg)
            return self._heartbeat_msg()
        if isinstance(msg, NodeHello):
            self._check_hello(msg)
            endpoint = f"tcp://{best_address(msg.addresses, self._networks)}:{msg.control_port}"
            self._met(msg, endpoint, ctx.keyring.key_of(sender) or "")
            return self._hello_msg()
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
            "key": ctx.key.fingerprint, "member": ctx.node_id in self.rep.table.member_ids,
            "host": ctx.me.host, "devices": views.devices(ctx.me.record), "version": __version__,
            "capabilities": list(ctx.me.record.get("capabilities", [])),
        }  # fmt: skip
        table = self.rep.table
        rows = views.peer_rows(
            me=me, peers=list(ctx.members.peers.values()), leader=ctx.leader, now=now,
            skews=self._skews,
        )  # fmt: skip
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
                speed_probe.measure, self.ctx.me.record, threads=threads, env=self._env,
                fresh=fresh, stop=self._probe_stop,
            )  # fmt: skip
        except speed_probe.ProbeStopped:
            return {}
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

    async def _api_remove(self, req: dict[str, Any]) -> dict[str, Any]:
        """`swarm remove NODE`: the leader takes it off the members and revokes its key."""
        node_id = req.get("node_id")
        if not isinstance(node_id, str) or not node_id:
            raise UserError("remove 'node_id' must be a node id (see `swarm peers`)", code="bad_field")  # fmt: skip
        msg = jn.MemberRemove(node_id=node_id, reason=f"removed from node {self.ctx.node_id}")
        reply = await self.ctx.to_leader(msg, jn.ROTATE_TIMEOUT_S + 5)
        return {"node_id": node_id, "key": fingerprint(reply.key), "version": reply.version}

    async def _api_rotate(self, req: dict[str, Any]) -> dict[str, Any]:
        """`swarm token --rotate`: a new secret for the whole swarm; the old one admits nobody."""
        msg = jn.SecretRotate(reason=f"rotated from node {self.ctx.node_id}")
        reply = await self.ctx.to_leader(msg, jn.ROTATE_TIMEOUT_S + 5)
        deadline = self.ctx.clock() + jn.ROTATE_TIMEOUT_S
        while self.ctx.secret.swarm_id != reply.swarm_id and self.ctx.clock() < deadline:
            self.admission.check_secret()
            await asyncio.sleep(0.05)
        if self.ctx.secret.swarm_id != reply.swarm_id:
            raise Unavailable(
                f"the leader rotated the secret (swarm id {reply.swarm_id}) but this node has "
                "not fetched it yet; run `swarm token` again in a moment",
                code="not_ready",
            )
        return {"swarm_id": reply.swarm_id, "version": reply.version}

    async def _api_invite(self, req: dict[str, Any]) -> dict[str, Any]:
        """`swarm invite`: a one-time pairing code for a new machine on this LAN."""
        minutes = req.get("minutes", 10)
        if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not 0 < minutes <= 24 * 60:  # fmt: skip
            raise UserError("invite 'minutes' must be a number in (0, 1440]", code="bad_field")
        if not self.ctx.config.mdns:
            raise UserError(
                "this node runs with --no-mdns: a new machine cannot find its invite; give it "
                "the token instead (`swarm token | ssh HOST swarm up --token -`)",
                code="bad_request",
            )
        result = await self.pairing.invite(float(minutes) * 60)
        return {**result, "node_id": self.ctx.node_id, "swarm_id": self.ctx.secret.swarm_id}

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
