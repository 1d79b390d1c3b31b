"""Membership: who is in this node's view, alive or not; time is passed in (``now``).

The view is changed only by the methods below, each returning the membership events it caused,
so the daemon can log them and recompute the leader after each change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True, slots=True)
class Peer:
    """What this node knows about one other node."""

    node_id: str
    name: str
    endpoint: str
    """``tcp://host:port`` of its control socket."""
    record: dict[str, Any] = field(default_factory=dict)
    """Its hardware node record from the hello."""
    host: dict[str, Any] = field(default_factory=dict)
    """Its host dict (CPU cores, driver) from the hello."""
    software: str = ""
    """The swarmp2p release it runs (from its hello)."""
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
        record: dict[str, Any],
        now: float,
        host: dict[str, Any] | None = None,
    ) -> list[Change]:
        """A hello from (or a hello reply of) ``node_id``: it is alive at ``endpoint``."""
        if node_id == self.self_id:
            raise ValueError(
                f"a peer claims this node's id {node_id!r}; give one of them another --node-id"
            )
        peer = self.peers.get(node_id)
        joined = peer is None or not peer.alive
        if peer is None:
            peer = self.peers[node_id] = Peer(node_id=node_id, name=name, endpoint=endpoint)
        peer.name, peer.endpoint, peer.record, peer.host = name, endpoint, record, host or {}
        peer.alive, peer.last_seen = True, now
        return [Change(kind="join", node_id=node_id)] if joined else []

    def seen(self, node_id: str, now: float) -> bool:
        """A heartbeat or reply from a live known peer; False if it must say hello first."""
        peer = self.peers.get(node_id)
        if peer is None or not peer.alive:
            return False
        peer.last_seen = max(peer.last_seen, now)
        return True

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
