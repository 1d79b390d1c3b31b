"""The narrow interface a daemon's parts get instead of the daemon. Never imports torch.

A part (the table's replication, the jobs' leader side, a node's stages, serving) needs to know
who this node is, who is alive, who leads, how to reach a node (this one included) and how to
run a task; it gets a :class:`NodeContext` and nothing else. Every "is X alive", "send to a
node or to myself" and "forward to the leader" of the daemon lives here, once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from swarmp2p.errors import Failed, NotApplied, Unavailable
from swarmp2p.net.auth import ClientKeys
from swarmp2p.net.rpc import RpcClient
from swarmp2p.node.cluster.election import eligible_leader
from swarmp2p.node.cluster.election import leader as lowest_live
from swarmp2p.node.cluster.membership import Keyring, Membership
from swarmp2p.node.records import Host, NodeRecord

if TYPE_CHECKING:
    from swarmp2p.net.security import NodeKey, SwarmSecret
    from swarmp2p.node.config import NodeConfig
    from swarmp2p.node.state import StateDir
    from swarmp2p.node.table.events import Event
    from swarmp2p.node.table.jobtable import JobTable
    from swarmp2p.node.table.replication import Replication
    from swarmp2p.wire.messages import Message

log = logging.getLogger("swarmp2p.node")

LocalHandler = Callable[["Message"], Awaitable["Message"]]


@dataclass(frozen=True, kw_only=True, slots=True)
class Identity:
    """Who this node is and where it listens."""

    node_id: str
    name: str
    addresses: tuple[str, ...]
    record: NodeRecord
    """Its hardware node record (``NodeContext.set_record`` puts a new one)."""
    host: Host
    """CPU cores, machine, NVIDIA driver."""


class NodeContext:
    """This node, its live view of the swarm, and the ways to reach any member."""

    def __init__(
        self,
        *,
        me: Identity,
        state: StateDir,
        secret: SwarmSecret,
        key: NodeKey,
        config: NodeConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.me = me
        self.node_id = me.node_id
        self.state = state
        self.secret = secret
        """The swarm secret: it only admits (the join port); ``swarm token --rotate`` swaps it."""
        self.key = key
        """This node's own key pair: its control port's server key, its client key."""
        self.config = config
        self.clock = clock
        self.members = Membership(me.node_id)
        """The live view: who answered lately (not the table's members)."""
        self.keyring = Keyring(me.node_id, key.public, lambda: self.table, clock)
        """Who each admitted public key is (the table's members and nodes that joined)."""
        self.started_at = clock()
        self.port = 0
        self.join_port = 0
        """The join port (``node.join``, keyed by the secret)."""
        self.zmq = None
        """The daemon's zmq.asyncio context, once it started."""
        self.closing = False
        self._clients: dict[str, RpcClient] = {}
        self._retired: list[RpcClient] = []
        self._tasks: set[asyncio.Task] = set()
        self._local: LocalHandler | None = None
        self._replication: Replication | None = None

    def set_record(self, record: NodeRecord) -> None:
        """This node's hardware record from now on (live memory, measured speeds)."""
        self.me = replace(self.me, record=record)

    def attach(self, *, local: LocalHandler, replication: Replication) -> None:
        """The daemon's own request handler (a call to this node) and the table's replication."""
        self._local, self._replication = local, replication

    # --- who is who ------------------------------------------------------------------------

    @property
    def leader(self) -> str:
        """The lowest live node id in this node's view that may lead (``election``): a member
        of this node's table, or, where it lists none, a node that holds a table."""
        view = self.members.live_view()
        if self._replication is None:
            return lowest_live(view)
        table = self._replication.table
        held = {**self.members.held_view(), self.node_id: table.version}
        if table.leader:  # the leader that wrote this node's table holds it, whatever it said
            held[table.leader] = max(held.get(table.leader, 0), table.version)
        return eligible_leader(view, table.member_ids, held)

    @property
    def leading(self) -> bool:
        """This node is the leader in its view and holds the votes of a majority."""
        return (
            self.leader == self.node_id
            and self._replication is not None
            and self._replication.ready
        )

    @property
    def table(self) -> JobTable:
        return self._replication.table

    async def append(self, events: list[Event]) -> int:
        """Leader: add table events (validated, persisted, replicated); the last version."""
        return await self._replication.append(events)

    def live_nodes(self) -> frozenset[str]:
        return frozenset({self.node_id, *(p.node_id for p in self.members.alive_peers())})

    def live_records(self) -> list[NodeRecord]:
        """The hardware records of the live nodes, this one first."""
        return [self.me.record, *(p.record for p in self.members.alive_peers())]

    def is_alive(self, node_id: str) -> bool:
        return node_id in self.live_nodes()

    @property
    def own_endpoint(self) -> str:
        return f"tcp://{self.me.addresses[0]}:{self.port}"

    def endpoint_of(self, node_id: str) -> str:
        """``tcp://host:port`` of a live node's control socket; Unavailable when it is not live."""
        if node_id == self.node_id:
            return self.own_endpoint
        peer = self.members.peers.get(node_id)
        if peer is None or not peer.alive:
            raise Unavailable(f"node {node_id} is not a live member", code="no_peer")
        return peer.endpoint

    # --- reaching nodes --------------------------------------------------------------------

    def key_at(self, endpoint: str) -> str:
        """The public key of the node whose control port is ``endpoint`` (a peer in the view,
        or this node); Unavailable when no known node listens there."""
        if endpoint == self.own_endpoint:
            return self.key.public
        for peer in self.members.peers.values():
            if peer.endpoint == endpoint:
                key = self.keyring.key_of(peer.node_id) or peer.key
                if key:
                    return key
        raise Unavailable(f"no known node listens on {endpoint}", code="no_peer")

    def client(self, endpoint: str, key: str | None = None) -> RpcClient:
        """The RPC client to ``endpoint``, expecting the server key ``key`` (default: that of
        the node known to listen there)."""
        key = key or self.key_at(endpoint)
        c = self._clients.get(endpoint)
        if c is not None and c.server_key != key:  # another node listens there now
            self._retired.append(self._clients.pop(endpoint))
            c = None
        if c is None:
            creds = ClientKeys(public=self.key.public, secret=self.key.secret, server=key)
            c = self._clients[endpoint] = RpcClient(self.zmq, creds, endpoint)
        return c

    async def call_endpoint(
        self, endpoint: str, msg: Message, timeout: float, key: str | None = None
    ) -> Message:
        """A request to the control port at ``endpoint`` (server key ``key``, default: the
        key of the node known to listen there)."""
        return await self.client(endpoint, key).request(msg, timeout)

    async def call(self, node_id: str, msg: Message, timeout: float) -> Message:
        """A request to a live node; to this node it goes straight to the local handler."""
        if node_id == self.node_id:
            assert self._local is not None
            return await self._local(msg)
        return await self.call_endpoint(self.endpoint_of(node_id), msg, timeout)

    async def to_leader(self, msg: Message, timeout: float) -> Message:
        """A request for the leader (this node, or forwarded); Unavailable when none is ready."""
        leader = self.leader
        if leader == self.node_id and not self.leading:
            quorum = self._replication.quorum() if self._replication else {"ok": True}
            if not quorum["ok"]:
                raise Unavailable(quorum["reason"], code="no_quorum")
            why = self._replication.why_not_ready() if self._replication else "starting"
            raise Unavailable(f"leader {leader} is not ready: {why}", code="not_ready")
        return await self.call(leader, msg, timeout)

    async def prune_clients(self, keep: set[str]) -> None:
        """Close the clients of endpoints nobody names any more."""
        for endpoint in [e for e in self._clients if e not in keep]:
            await self._clients.pop(endpoint).close()
        retired, self._retired = self._retired, []
        for c in retired:
            await c.close()

    async def close_clients(self) -> None:
        for c in [*self._clients.values(), *self._retired]:
            await c.close()
        self._clients.clear()
        self._retired.clear()

    # --- tasks -----------------------------------------------------------------------------

    def member_key(self, node_id: str, what: str = "node", *, code: str = "stage_failed") -> str:
        """The public key of member ``node_id`` (the plan names it ``what``); Failed with
        ``code`` when this node knows none (not a member, or removed)."""
        found = self.keyring.key_of(node_id)
        if not found:
            raise Failed(
                f"{what} {node_id} has no key node {self.node_id} knows (not a member?)",
                code=code,
            )
        return found

    def spawn(self, coro: Awaitable[object], name: str) -> asyncio.Task:
        """Run ``coro`` as a task the daemon cancels when it stops; failures are logged."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def running(self, name: str) -> bool:
        return any(t.get_name() == name and not t.done() for t in self._tasks)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled() or (exc := task.exception()) is None:
            return
        if isinstance(exc, NotApplied):  # what the task acted on moved on meanwhile
            log.info("task %s stopped: %s", task.get_name(), exc)
        else:
            log.error("task %s failed", task.get_name(), exc_info=exc)

    async def cancel_tasks(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except BaseException:
                pass


__all__ = ["Identity", "NodeContext"]
