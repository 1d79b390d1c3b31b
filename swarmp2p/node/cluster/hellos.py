"""Meeting peers: a node at an endpoint is joined first (``node.join`` on its join port,
unless its key is known), then greeted (``node.hello``); a hello or a join from a peer is
answered; an mDNS advert is a peer to meet. Each endpoint has one hello under way at a time,
and the (node id, key) bound to it is remembered so the next hello needs no join.
Never imports torch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from swarmp2p import PROTOCOL_VERSION, __version__
from swarmp2p.errors import Unavailable
from swarmp2p.net.discovery import Advert, best_address, local_networks
from swarmp2p.net.rpc import RpcError, RpcTimeout
from swarmp2p.node.cluster import join as jn
from swarmp2p.node.cluster.membership import Change, Refused
from swarmp2p.node.config import NodeConfig
from swarmp2p.node.context import NodeContext
from swarmp2p.node.messages import NodeHello
from swarmp2p.node.table.jobtable import Member
from swarmp2p.node.table.replication import Replication

log = logging.getLogger("swarmp2p.node")


def rpc_timeout(config: NodeConfig) -> float:
    """How long a hello or a heartbeat waits for its answer."""
    return max(config.heartbeat_s * 2, 0.2)


class Hellos:
    """This node's side of meeting its peers; ``on_change`` gets the membership changes."""

    def __init__(
        self,
        ctx: NodeContext,
        rep: Replication,
        admission: jn.Admission,
        on_change: Callable[[list[Change]], None],
    ) -> None:
        self.ctx = ctx
        self.rep = rep
        self.admission = admission
        self._networks = local_networks()
        self._on_change = on_change
        self.pending: set[str] = set()
        """The endpoints with a hello under way."""
        self._unanswered: set[str] = set()
        self._met_at: dict[str, tuple[str, str]] = {}
        """control endpoint -> (node id, key) bound by a join or a hello: hello it directly."""

    def endpoint_of(self, hello: NodeHello | jn.NodeJoin) -> str:
        """The control endpoint of the node that sent ``hello`` (its best address here)."""
        return f"tcp://{best_address(hello.addresses, self._networks)}:{hello.control_port}"

    def forget_endpoint(self, endpoint: str) -> None:
        """Join the node at ``endpoint`` again before the next hello (it may have a new key)."""
        self._met_at.pop(endpoint, None)

    def forget_node(self, node_id: str) -> None:
        """Forget every endpoint bound to ``node_id`` (its key was revoked)."""
        for endpoint, (bound, _) in list(self._met_at.items()):
            if bound == node_id:
                del self._met_at[endpoint]

    def message(self) -> NodeHello:
        """This node's hello: who it is, where it listens, its record and table key."""
        ctx = self.ctx
        term, version = self.rep.held
        return NodeHello(
            node_id=ctx.node_id,
            name=ctx.me.name,
            versions=[PROTOCOL_VERSION],
            software=__version__,
            swarm_id=ctx.secret.swarm_id,
            control_port=ctx.port,
            addresses=list(ctx.me.addresses),
            record=ctx.me.record,
            host=ctx.me.host,
            term=term,
            version=version,
            join_port=self.ctx.join_port,
        )

    def check(self, hello: NodeHello) -> None:
        """RpcError unless ``hello`` speaks this protocol and names another node id."""
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

    def say(self, endpoint: str, join_endpoint: str = "") -> None:
        """Meet the node at ``endpoint`` in the background (once at a time per endpoint)."""
        if endpoint in self.pending or self.ctx.closing:
            return
        self.pending.add(endpoint)
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
            reply = await self.ctx.call_endpoint(
                endpoint, self.message(), rpc_timeout(self.ctx.config), key=key
            )
            if not isinstance(reply, NodeHello) or reply.node_id != node_id:
                raise RpcError("bad_reply", f"{endpoint} did not answer as node {node_id}")
            self.check(reply)
            self.met(reply, endpoint, key)
            self._unanswered.discard(endpoint)
        except RpcTimeout:
            self._met_at.pop(endpoint, None)  # join again next time (it may have a new key)
            if endpoint not in self._unanswered:  # once per endpoint until it answers
                self._unanswered.add(endpoint)
                log.info(
                    "no answer to hello from %s (nor from its join port): not running, or holding another swarm's secret",
                    endpoint,
                )
        except RpcError as exc:
            self._met_at.pop(endpoint, None)
            log.warning("hello to %s refused: %s", endpoint, exc)
        except Unavailable as exc:
            log.info("hello to %s: %s", endpoint, exc)
        finally:
            self.pending.discard(endpoint)

    async def _member_at(self, endpoint: str) -> tuple[str, str] | None:
        """The member (id, key) whose control port is ``endpoint``: a hello with each listed
        member's key at once (only the right one completes a handshake); None if none."""
        from swarmp2p.net.auth import ClientKeys
        from swarmp2p.net.rpc import RpcClient

        ctx = self.ctx
        alive = {p.node_id for p in ctx.members.alive_peers()}
        candidates = [
            m for m in ctx.table.members if m.node_id != ctx.node_id and m.node_id not in alive
        ]
        if not candidates:
            return None

        async def probe(member: Member) -> tuple[str, str] | None:
            keys = ClientKeys(public=ctx.key.public, secret=ctx.key.secret, server=member.key)
            client = RpcClient(ctx.zmq, keys, endpoint)
            try:
                reply = await client.request(self.message(), rpc_timeout(self.ctx.config))
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
        msg = jn.join_request(ctx, self.ctx.join_port)
        reply = await jn.join_at(
            ctx, endpoint, msg, rpc_timeout(self.ctx.config) + self.ctx.config.timings.join_reply_s
        )
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
                self.say(n.endpoint, n.join_endpoint)
        return reply

    async def on_join(self, msg: jn.NodeJoin) -> jn.NodeJoined:
        """A node on this node's join port: it holds the secret."""
        ctx = self.ctx
        if ctx.closing:
            raise Unavailable(f"node {ctx.node_id} is stopping", code="stopping")
        me = jn.NodeJoined(
            node_id=ctx.node_id,
            name=ctx.me.name,
            key=ctx.key.public,
            control_port=ctx.port,
            join_port=self.ctx.join_port,
            addresses=list(ctx.me.addresses),
            nodes=jn.known_nodes(ctx),
        )
        reply = await self.admission.on_join(msg, me)
        self._met_at[self.endpoint_of(msg)] = (msg.node_id, msg.key)
        return reply

    def met(self, hello: NodeHello, endpoint: str, key: str) -> None:
        """A hello from or to the node at ``endpoint`` (speaking with ``key``): it is live."""
        host = endpoint.removeprefix("tcp://").rpartition(":")[0]
        changes = self.ctx.members.hello(
            node_id=hello.node_id,
            name=hello.name,
            endpoint=endpoint,
            record=hello.record,
            host=hello.host,
            now=self.ctx.clock(),
            key=key,
            held=hello.version,
            join_endpoint=f"tcp://{host}:{hello.join_port}" if hello.join_port else "",
        )
        self._met_at[endpoint] = (hello.node_id, key)
        peer = self.ctx.members.peers.get(hello.node_id)
        if peer is not None:
            peer.software = hello.software
        self._on_change(changes)

    def accept_advert(self, advert: Advert) -> bool:
        """An advert of this swarm, or of a member (known by its key) that moved to a rotated
        secret this node has not fetched yet."""
        if advert.swarm_id == self.ctx.secret.swarm_id:
            return True
        keyring = self.ctx.keyring
        return (
            bool(advert.key)
            and keyring.is_member(advert.node_id)
            and keyring.key_of(advert.node_id) == advert.key
        )

    def on_mdns_add(self, advert: Advert, addresses: list[str]) -> None:
        """An mDNS advert: meet the node unless it is live at that endpoint already."""
        if not addresses:
            return
        address = best_address(addresses, self._networks)
        endpoint = f"tcp://{address}:{advert.port}"
        join = f"tcp://{address}:{advert.join_port}" if advert.join_port else ""
        peer = self.ctx.members.peers.get(advert.node_id)
        if peer is None or not peer.alive or peer.endpoint != endpoint:
            log.info("mDNS: found node %s (%s) at %s", advert.node_id, advert.name, endpoint)
            keyring = self.ctx.keyring
            if (
                advert.key
                and keyring.is_member(advert.node_id)
                and keyring.key_of(advert.node_id) == advert.key
            ):
                self._met_at.setdefault(endpoint, (advert.node_id, advert.key))  # no join needed
            self.say(endpoint, join)
