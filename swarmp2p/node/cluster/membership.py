"""Membership: who is in this node's view, alive or not, and which key speaks for whom.

The view is changed only by the methods below, each returning the membership events it caused,
so the daemon can log them and recompute the leader after each change; time is passed in
(``now``). :class:`Keyring` binds node ids to public keys: the table's members (bound by
``MemberJoined``) and the nodes met through the join handshake, which proved they hold the
secret but are not members yet. ZAP admits exactly the keys it knows, and every request is
taken as coming from the node its key is bound to (issue 15).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from swarmp2p.node.records import Host, NodeRecord

if TYPE_CHECKING:
    from swarmp2p.node.table.jobtable import JobTable


@dataclass(kw_only=True, slots=True)
class Peer:
    """What this node knows about one other node."""

    node_id: str
    name: str
    endpoint: str
    """``tcp://host:port`` of its control socket."""
    record: NodeRecord
    """Its hardware node record from the hello (live memory from its heartbeats)."""
    host: Host = field(default_factory=Host)
    """Its host facts (CPU cores, machine, driver) from the hello."""
    software: str = ""
    """The swarmp2p release it runs (from its hello)."""
    key: str = ""
    """Its z85 public key: its control port's server key."""
    join_endpoint: str = ""
    """``tcp://host:port`` of its join port (from its hello; "" when unknown)."""
    held: int = 0
    """The table version it last said it holds (0: it never held the swarm's table)."""
    alive: bool = True
    last_seen: float = 0.0
    """``now`` of the last hello, heartbeat or reply from it."""
    died_at: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Change:
    """A membership event: ``kind`` is ``"join"`` or ``"leave"``."""

    kind: str
    node_id: str
    reason: str = ""


class Membership:
    """This node's view of the swarm (not including itself)."""

    def __init__(self, self_id: str) -> None:
        self.self_id = self_id
        self.peers: dict[str, Peer] = {}

    def live_view(self) -> dict[str, bool]:
        """node id -> alive, with this node alive: the input of ``election.leader``."""
        view = {node_id: peer.alive for node_id, peer in self.peers.items()}
        view[self.self_id] = True
        return view

    def alive_peers(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.alive]

    def hello(
        self,
        *,
        node_id: str,
        name: str,
        endpoint: str,
        record: NodeRecord,
        now: float,
        host: Host | None = None,
        key: str = "",
        join_endpoint: str = "",
        held: int = 0,
    ) -> list[Change]:
        """A hello from (or a hello reply of) ``node_id``: it is alive at ``endpoint``."""
        if node_id == self.self_id:
            raise ValueError(
                f"a peer claims this node's id {node_id!r}; give one of them another --node-id"
            )
        peer = self.peers.get(node_id)
        joined = peer is None or not peer.alive
        if peer is None:
            peer = Peer(node_id=node_id, name=name, endpoint=endpoint, record=record)
            self.peers[node_id] = peer
        peer.name, peer.endpoint, peer.record, peer.host = name, endpoint, record, host or Host()
        peer.key = key or peer.key
        peer.join_endpoint = join_endpoint or peer.join_endpoint
        peer.held = held
        peer.alive, peer.last_seen = True, now
        return [Change(kind="join", node_id=node_id)] if joined else []

    def seen(self, node_id: str, now: float, held: int | None = None) -> bool:
        """A heartbeat or reply from a live known peer (``held``: the table version it says
        it holds); False if it must say hello first."""
        peer = self.peers.get(node_id)
        if peer is None or not peer.alive:
            return False
        peer.last_seen = max(peer.last_seen, now)
        if held is not None:
            peer.held = held
        return True

    def held_view(self) -> dict[str, int]:
        """Live peer id -> the table version it last said it holds."""
        return {p.node_id: p.held for p in self.peers.values() if p.alive}

    def dead(self, node_id: str, now: float, reason: str) -> list[Change]:
        """Mark ``node_id`` dead now (a clean leave, or an mDNS removal confirmed by a failed
        heartbeat)."""
        peer = self.peers.get(node_id)
        if peer is None or not peer.alive:
            return []
        peer.alive, peer.died_at = False, now
        return [Change(kind="leave", node_id=node_id, reason=reason)]

    def expire(self, now: float, timeout: float, forget_after: float) -> list[Change]:
        """Peers silent for more than ``timeout`` die; dead ones are forgotten after
        ``forget_after`` more seconds."""
        changes = []
        for peer in list(self.peers.values()):
            if peer.alive and now - peer.last_seen > timeout:
                changes += self.dead(peer.node_id, now, f"silent for {now - peer.last_seen:.1f} s")
            elif not peer.alive and now - peer.died_at > forget_after:
                del self.peers[peer.node_id]
        return changes

    def forget(self, node_id: str) -> None:
        self.peers.pop(node_id, None)


class Refused(ValueError):
    """A key or node id the keyring will not bind (revoked, or bound to another)."""


class Keyring:
    """Public key <-> node id: the table's members and the nodes that passed the join
    handshake (pending until the leader lists them). ``table()`` is read at each lookup, so a
    member removed from the table is refused at its next message."""

    def __init__(
        self,
        self_id: str,
        self_key: str,
        table: Callable[[], JobTable],
        clock: Callable[[], float],
    ) -> None:
        self.self_id, self.self_key = self_id, self_key
        self._table, self._clock = table, clock
        self._pending: dict[str, tuple[str, float]] = {}
        """node id -> (key, when it joined)."""
        self._rev = 0
        self._cache: tuple[int, int, int, int] | tuple[()] = ()
        self._index: dict[str, str] = {}
        self._members: dict[str, str] = {}

    def _keys(self) -> dict[str, str]:
        """key -> node id, rebuilt when the table or the pending set changed. A member that
        left cleanly stays bound as pending (its goodbyes still count; it may come back)."""
        table = self._table()
        stamp = (id(table), table.version, table.term, self._rev)
        if stamp != self._cache:
            revoked = set(table.revoked)
            members = {m.node_id: m.key for m in table.members}
            for node_id, key in self._members.items():
                if node_id not in members and key not in revoked and node_id not in self._pending:
                    self._pending = {**self._pending, node_id: (key, self._clock())}
                    self._rev += 1
            self._members = members
            index = {
                k: n for n, (k, _) in self._pending.items() if k not in revoked and n not in members
            }
            index.update({k: n for n, k in members.items()})
            index[self.self_key] = self.self_id
            self._index, self._cache = index, (id(table), table.version, table.term, self._rev)
        return self._index

    def node_of(self, key: str) -> str | None:
        """The node id ``key`` speaks for (None: nobody this node admits)."""
        return self._keys().get(key)

    def key_of(self, node_id: str) -> str | None:
        if node_id == self.self_id:
            return self.self_key
        member = self._table().member(node_id)
        if member is not None:
            return member.key
        self._keys()
        pending = self._pending.get(node_id)
        if pending is not None and pending[0] not in self._table().revoked:
            return pending[0]
        return None

    def admits(self, key: str) -> bool:
        """ZAP's rule for the control port."""
        return key in self._keys()

    def is_member(self, node_id: str) -> bool:
        return self._table().member(node_id) is not None

    def check(self, node_id: str, key: str) -> None:
        """Refused (saying why) unless ``node_id`` may be bound to ``key``."""
        table = self._table()
        if key in table.revoked:
            raise Refused(f"the key of node {node_id} was revoked (`swarm remove`); it cannot join")
        if node_id == self.self_id:
            raise Refused(f"node id {node_id} is this node's; give one of them another --node-id")
        member = table.member(node_id)
        if member is not None and member.key != key:
            raise Refused(
                f"node id {node_id} belongs to a member with another key; a node that lost its "
                f"node.key joins under a new --node-id (or `swarm remove {node_id}` first)"
            )
        holder = self._keys().get(key)
        if (
            holder is not None
            and holder != node_id
            and (member is not None or self.is_member(holder))
        ):
            raise Refused(f"node {node_id} presents the key of {holder}")
        if key == self.self_key:
            raise Refused(f"node {node_id} presents this node's key")
        if member is None and node_id in table.removed:
            raise Refused(
                f"node id {node_id} was removed (`swarm remove`); it is free again only after "
                "`swarm token --rotate`"
            )

    def admit(self, node_id: str, key: str, now: float) -> None:
        """Bind ``node_id`` to ``key`` for now (it proved the secret); Refused saying why not."""
        self.check(node_id, key)
        if self._table().member(node_id) is None:
            pending = dict(self._pending)
            for other, (k, _) in self._pending.items():
                if k == key and other != node_id:
                    del pending[other]
            pending[node_id] = (key, now)
            self._pending = pending
            self._rev += 1

    def drop(self, node_id: str) -> None:
        if node_id in self._pending:
            pending = dict(self._pending)
            del pending[node_id]
            self._pending = pending
            self._rev += 1

    def prune(self, keep: set[str], now: float, older_than: float) -> None:
        """Forget pending bindings not in ``keep`` (live nodes) made over ``older_than`` s ago."""
        stale = [
            n for n, (_, at) in self._pending.items() if n not in keep and now - at > older_than
        ]
        for node_id in stale:
            self.drop(node_id)

    @property
    def pending(self) -> dict[str, str]:
        """node id -> key of the nodes admitted by a join that are not members."""
        members = self._table().member_ids
        return {n: k for n, (k, _) in self._pending.items() if n not in members}
