"""Joining a swarm and leaving it for good: the join port, admission by the leader, removal and
rotation of the secret. Never imports torch.

**Who is who.** Each node has its own key pair (``node.key``); the table lists every member
with its public key, and a member's control port admits only keys it knows (ZAP). The swarm
secret only *admits*: it keys the **join port** (control port + :data:`JOIN_PORT_OFFSET`), a
second socket whose CURVE server key and only client key both derive from the secret, which
takes one request, ``node.join``.

**First contact (the bootstrap).** Before its first hello to a peer, a node sends it
``node.join`` on that peer's join port: its node id and public key. The handshake itself
proves both sides hold the secret, so each binds the other's id to its key (pending in the
:class:`~swarmp2p.node.cluster.membership.Keyring` until the table lists it) and from then on they
talk on their control ports with their own keys. The joined node answers with the members and
live peers it knows (ids, keys, endpoints). The leader lists the newcomer (``MemberJoined``
with its key) only on its own proof: the newcomer joined through the leader's join port too
and speaks on the leader's control port with that key (a member cannot vouch for another id;
``node.admit`` from a member is only a nudge, checked the same way). Why a separate port rather than letting
unknown keys onto the control port: the control port then never runs a handshake for a key
nobody vouched for, so a node without the secret (or a removed one) reaches no handler at
all, and a peer found by address alone (``--peer HOST:PORT``) needs no key but the secret's.

**Removal and rotation.** ``node.remove`` (any member, to the leader) commits
``MemberRemoved``: the key is revoked, refused by every member at its next message and by
every join. ``node.rotate`` makes the leader draw a new secret, hand it to every live member
(``node.secret``, inside their own CURVE channels), then commit ``AdmissionChanged``; a
member whose secret does not match the table's admission key fetches it from the leader. The
old token then admits nobody: no join port keys by it any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarmp2p import PROTOCOL_VERSION, __version__
from swarmp2p.errors import SwarmError, UserError
from swarmp2p.net.rpc import RpcClient, RpcError, RpcServer
from swarmp2p.net.security import SwarmSecret, fingerprint
from swarmp2p.node.cluster.election import check_node_id
from swarmp2p.node.cluster.membership import Refused
from swarmp2p.node.table import events as ev
from swarmp2p.node.table.events import NodeId, PublicKey
from swarmp2p.schema import field
from swarmp2p.wire.messages import Message, message

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext
    from swarmp2p.node.table.replication import Replication

log = logging.getLogger("swarmp2p.node.cluster.join")

JOIN_PORT_OFFSET = 2
"""The join port is the control port + 2 (7739 beside the default 7737; 7738 is the
dashboard's), so a peer named by its control port alone (``--peer HOST:PORT``) can be joined;
with ``--port 0`` both are random and the join port travels in mDNS adverts and hellos."""


def join_endpoint(control_endpoint: str) -> str:
    """``tcp://host:port+1`` for a control endpoint ``tcp://host:port``."""
    head, _, port = control_endpoint.rpartition(":")
    return f"{head}:{int(port) + JOIN_PORT_OFFSET}"


# --- messages ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class KnownNode:
    """A node the answering node knows: its id bound to its key, and where it listens."""

    node_id: NodeId
    name: str = field(default="", max_len=256)
    key: PublicKey
    endpoint: str = field(default="", max_len=80)
    join_endpoint: str = field(default="", max_len=80)
    member: bool = False


@message("node.join")
class NodeJoin(Message):
    """On a join port: I hold the secret; I am ``node_id`` and speak with ``key``."""

    node_id: NodeId
    name: str = field(default="", max_len=256)
    key: PublicKey
    versions: list[int] = field(max_len=16)
    software: str = field(default="", max_len=64)
    control_port: int = field(ge=1, le=65535)
    join_port: int = field(ge=1, le=65535)
    addresses: list[str] = field(max_len=32)


@message("node.joined")
class NodeJoined(Message):
    """The answer: who answered (bound the same way), the nodes it knows, whether the leader
    listed the newcomer as a member (``reason`` when not yet)."""

    node_id: NodeId
    name: str = field(default="", max_len=256)
    key: PublicKey
    control_port: int = field(ge=1, le=65535)
    join_port: int = field(ge=1, le=65535)
    addresses: list[str] = field(max_len=32)
    nodes: tuple[KnownNode, ...] = field(default=(), max_len=4096)
    leader: str = field(default="", max_len=64)
    admitted: bool = False
    reason: str = field(default="", max_len=2000)


@message("node.admit")
class MemberAdmit(Message):
    """A member to the leader: list this node (it passed my join port) as a member."""

    node_id: NodeId
    name: str = field(default="", max_len=256)
    key: PublicKey


@message("node.remove")
class MemberRemove(Message):
    """A member to the leader: remove ``node_id`` and revoke its key (`swarm remove`)."""

    node_id: NodeId
    reason: str = field(default="", max_len=1000)


@message("node.rotate")
class SecretRotate(Message):
    """A member to the leader: draw a new swarm secret (`swarm token --rotate`)."""

    reason: str = field(default="", max_len=1000)


@message("node.secret_fetch")
class SecretFetch(Message):
    """A member to the leader: the current secret (mine no longer matches the table)."""

    admission: str = field(default="", max_len=40)


@message("node.secret")
class SecretPush(Message):
    """The swarm's current secret (leader to a member, inside their own CURVE channel)."""

    token: str = field(max_len=128)
    swarm_id: str = field(max_len=16)


@message("node.membership")
class MembershipChanged(Message):
    """The leader's answer to admit/remove/rotate: the table version that holds it."""

    node_id: str = field(default="", max_len=64)
    key: str = field(default="", max_len=40)
    version: int = field(default=0, ge=0)
    swarm_id: str = field(default="", max_len=16)


ADMISSION_MESSAGES = (MemberAdmit, MemberRemove, SecretRotate, SecretFetch, SecretPush)
"""The control-port requests :class:`Admission` answers."""


# --- the join port -------------------------------------------------------------------------


class JoinPort:
    """The join port: an RpcServer keyed by the swarm secret that takes only ``node.join``."""

    def __init__(self, ctx: NodeContext, host: str, port: int, on_join) -> None:
        self.ctx, self.host, self.port = ctx, host, port
        self._on_join = on_join
        self._server: RpcServer | None = None

    async def start(self) -> None:
        self._server = RpcServer(self.ctx.zmq, self.ctx.secret, self.host, self.port, self._handle)
        await self._server.start()
        self.port = self._server.port

    async def rekey(self) -> None:
        """Serve on the same port with the context's (new) secret; the old one admits nobody."""
        await self.close()
        await self.start()

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
            self._server = None

    @property
    def guard(self):
        return self._server.guard if self._server is not None else None

    async def _handle(self, msg: Message, sender: str) -> Message:
        if not isinstance(msg, NodeJoin):
            raise RpcError("unexpected", f"a join port takes only node.join, not {type(msg).TYPE}")
        return await self._on_join(msg)


async def join_at(ctx: NodeContext, endpoint: str, msg: NodeJoin, timeout: float) -> NodeJoined:
    """Send ``msg`` to the join port at ``endpoint`` with the swarm secret; RpcTimeout when
    nobody holding this secret answers there."""
    client = RpcClient(ctx.zmq, ctx.secret, endpoint)
    try:
        reply = await client.request(msg, timeout)
    finally:
        await client.close()
    if not isinstance(reply, NodeJoined):
        raise RpcError("bad_reply", f"{type(reply).TYPE} is not node.joined")
    return reply


# --- admission, removal, rotation ----------------------------------------------------------


class Admission:
    """This node's part in who belongs: answering joins, and (on the leader) listing,
    removing and re-keying members."""

    def __init__(self, ctx: NodeContext, rep: Replication, *, on_secret) -> None:
        self.ctx, self.rep = ctx, rep
        self._on_secret = on_secret
        """``async on_secret(SwarmSecret)``: adopt a new secret (save, re-key the join port,
        re-advertise)."""
        self.next_secret: SwarmSecret | None = None
        """A secret the leader handed over before the table says it admits."""
        self._fetching = False

    # --- answering a join ----------------------------------------------------------------

    async def on_join(self, msg: NodeJoin, me: NodeJoined) -> NodeJoined:
        """``me``: this node's own part of the answer (id, key, ports, what it knows)."""
        ctx = self.ctx
        try:
            check_node_id(msg.node_id)
            if PROTOCOL_VERSION not in msg.versions:
                raise UserError(
                    f"node {msg.node_id} speaks protocol {msg.versions}, this node "
                    f"{PROTOCOL_VERSION}; run the same swarmp2p version everywhere",
                    code="version",
                )
            ctx.keyring.admit(msg.node_id, msg.key, ctx.clock())
        except Refused as exc:
            log.warning("refused a join as %s (key %s): %s", msg.node_id, fingerprint(msg.key), exc)
            raise UserError(str(exc), code="refused") from None
        admitted, reason = ctx.keyring.is_member(msg.node_id), ""
        if not admitted and ctx.table.members:
            # bound here already, so its hello needs no wait; the leader lists it once the
            # node has met the leader itself (decide.leader_actions)
            reason = "the leader lists it once it has met it"
        elif not ctx.table.members:
            reason = "no swarm is founded yet: the first leader lists the nodes it meets"
        log.info(
            "node %s (key %s) joined through this node%s",
            msg.node_id,
            fingerprint(msg.key),
            "" if admitted else f" ({reason})",
        )
        return NodeJoined(
            node_id=me.node_id,
            name=me.name,
            key=me.key,
            control_port=me.control_port,
            join_port=me.join_port,
            addresses=me.addresses,
            nodes=me.nodes,
            leader=ctx.leader,
            admitted=admitted,
            reason=reason,
        )

    async def _append_joined(self, node_id: str, name: str, key: str) -> int:
        """Leader: list ``node_id`` with ``key``, on this leader's own proof only: the node
        passed a join handshake (it holds the secret) and speaks on this leader's control
        port with ``key`` (it holds the private half). A member cannot vouch for another id."""
        table = self.ctx.table
        member = table.member(node_id)
        if member is not None and member.key == key and not member.down:
            return table.version
        try:
            self.ctx.keyring.check(node_id, key)
        except Refused as exc:
            raise UserError(str(exc), code="refused") from None
        peer = self.ctx.members.peers.get(node_id)
        if (
            peer is None
            or not peer.alive
            or peer.key != key
            or self.ctx.keyring.key_of(node_id) != key
        ):
            raise UserError(
                f"node {node_id} has not shown the leader {self.ctx.node_id} that it holds key "
                f"{fingerprint(key)}: a node is listed once it joined through the leader's join "
                "port and said hello on its control port; nothing was listed",
                code="joining",
            )
        version = await self.rep.append(
            [ev.MemberJoined(node_id=node_id, name=name, key=key)], wait=True
        )
        if self.ctx.table.member(node_id) is None:
            raise UserError(f"node {node_id} could not be listed", code="refused")
        log.info("node %s (key %s) is a member of the swarm now", node_id, fingerprint(key))
        return version

    # --- the leader's requests -----------------------------------------------------------

    async def handle(self, msg: Message, sender: str) -> Message:
        """``sender``: the node id the request's key is bound to (a member: checked before)."""
        if isinstance(msg, SecretPush):
            return await self._on_push(msg)
        self.rep.require_ready()
        if isinstance(msg, MemberAdmit):
            version = await self._append_joined(msg.node_id, msg.name, msg.key)
            return MembershipChanged(node_id=msg.node_id, key=msg.key, version=version)
        if isinstance(msg, MemberRemove):
            return await self.remove(msg.node_id, msg.reason or f"removed by {sender}")
        if isinstance(msg, SecretRotate):
            return await self.rotate(msg.reason or f"rotated by {sender}")
        if isinstance(msg, SecretFetch):
            return SecretPush(token=self.ctx.secret.token, swarm_id=self.ctx.secret.swarm_id)
        raise RpcError("unexpected", f"admission does not take {type(msg).TYPE}")

    async def remove(self, node_id: str, reason: str) -> MembershipChanged:
        """Leader: take ``node_id`` off the members and revoke its key."""
        ctx = self.ctx
        if node_id == ctx.node_id:
            raise UserError(
                f"node {node_id} leads; it cannot remove itself: stop it (`swarm down` there), "
                "then remove it from another member",
                code="bad_request",
            )
        key = ctx.keyring.key_of(node_id)
        if key is None:
            known = ", ".join(sorted(ctx.table.member_ids)) or "none"
            raise UserError(
                f"no node {node_id!r} is a member or joining (members: {known})", code="no_peer"
            )
        version = await self.rep.append(
            [ev.MemberRemoved(node_id=node_id, key=key, reason=reason[:1000])], wait=True
        )
        ctx.keyring.drop(node_id)
        log.warning("node %s removed, key %s revoked: %s", node_id, fingerprint(key), reason)
        return MembershipChanged(node_id=node_id, key=key, version=version)

    async def rotate(self, reason: str) -> MembershipChanged:
        """Leader: a new secret, handed to every live member, then committed as the one that
        admits; the old token admits nobody from then on."""
        ctx = self.ctx
        new = SwarmSecret.generate()
        push = SecretPush(token=new.token, swarm_id=new.swarm_id)
        members = sorted(m for m in ctx.table.member_ids if m != ctx.node_id and ctx.is_alive(m))
        results = await asyncio.gather(
            *(ctx.call(m, push, self.ctx.config.timings.rotate_s / 2) for m in members),
            return_exceptions=True,
        )
        missed = [m for m, r in zip(members, results) if isinstance(r, BaseException)]
        await self._on_secret(new)
        event = ev.AdmissionChanged(swarm_id=new.swarm_id, key=new.admission_key)
        version = await self.rep.append([event], wait=True)
        log.warning(
            "swarm secret rotated (%s): swarm id %s%s",
            reason,
            new.swarm_id,
            f"; {', '.join(missed)} will fetch it" if missed else "",
        )
        return MembershipChanged(version=version, swarm_id=new.swarm_id)

    # --- every member: keeping the secret the table names ------------------------------------

    async def _on_push(self, msg: SecretPush) -> MembershipChanged:
        try:
            secret = SwarmSecret.from_token(msg.token)
        except ValueError as exc:
            raise UserError(f"node.secret: {exc}", code="bad_field") from None
        if self.ctx.table.admission == secret.admission_key:
            await self._on_secret(secret)
        else:
            self.next_secret = secret  # adopted once the table says it admits
        return MembershipChanged(swarm_id=secret.swarm_id)

    def check_secret(self) -> None:
        """Each heartbeat: adopt the secret the table names (handed over, or fetched)."""
        wanted = self.ctx.table.admission
        if not wanted or wanted == self.ctx.secret.admission_key or self._fetching:
            return
        self._fetching = True
        self.ctx.spawn(self._catch_up(wanted), "secret")

    async def _catch_up(self, wanted: str) -> None:
        try:
            secret = self.next_secret
            if secret is None or secret.admission_key != wanted:
                secret = None
                for node_id in self._holders():
                    with contextlib.suppress(SwarmError, OSError, ValueError):
                        reply = await self.ctx.call(node_id, SecretFetch(admission=wanted), 5.0)
                        if isinstance(reply, SecretPush):
                            got = SwarmSecret.from_token(reply.token)
                            if got.admission_key == wanted:
                                secret = got
                                break
            if secret is not None:
                self.next_secret = None
                await self._on_secret(secret)
        finally:
            self._fetching = False

    def _holders(self) -> list[str]:
        """Live members to ask for the current secret, the leader first."""
        live = [
            m
            for m in sorted(self.ctx.table.member_ids)
            if m != self.ctx.node_id and self.ctx.is_alive(m)
        ]
        lead = self.ctx.table.leader
        return sorted(live, key=lambda m: m != lead)


def known_nodes(ctx: NodeContext) -> tuple[KnownNode, ...]:
    """The members (with keys) and the live peers (with endpoints) this node knows."""
    out: dict[str, KnownNode] = {}
    for m in ctx.table.members:
        if m.node_id != ctx.node_id:
            out[m.node_id] = KnownNode(node_id=m.node_id, name=m.name, key=m.key, member=True)
    for peer in ctx.members.alive_peers():
        key = ctx.keyring.key_of(peer.node_id)
        if key is None:
            continue
        out[peer.node_id] = KnownNode(
            node_id=peer.node_id,
            name=peer.name,
            key=key,
            endpoint=peer.endpoint,
            join_endpoint=peer.join_endpoint,
            member=peer.node_id in ctx.table.member_ids,
        )
    return tuple(out[n] for n in sorted(out))


def join_request(ctx: NodeContext, join_port: int) -> NodeJoin:
    return NodeJoin(
        node_id=ctx.node_id,
        name=ctx.me.name,
        key=ctx.key.public,
        versions=[PROTOCOL_VERSION],
        software=__version__,
        control_port=ctx.port,
        join_port=join_port,
        addresses=list(ctx.me.addresses),
    )


__all__ = [
    "ADMISSION_MESSAGES",
    "JOIN_PORT_OFFSET",
    "Admission",
    "JoinPort",
    "KnownNode",
    "MemberAdmit",
    "MemberRemove",
    "MembershipChanged",
    "NodeJoin",
    "NodeJoined",
    "SecretFetch",
    "SecretPush",
    "SecretRotate",
    "join_at",
    "join_endpoint",
    "join_request",
    "known_nodes",
]
