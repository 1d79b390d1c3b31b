"""Heartbeats: this node's beat (its table key, live memory, serve claims, fetches) to one
peer and its answer to a peer's beat; a peer's live memory and fetches from its beat; an mDNS
goodbye confirmed by one heartbeat before the peer counts as dead. The rounds over every peer
are the daemon's. Never imports torch."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from swarmp2p.errors import Unavailable
from swarmp2p.net.rpc import RpcError, RpcTimeout
from swarmp2p.node import hardware
from swarmp2p.node.cluster.hellos import Hellos, rpc_timeout
from swarmp2p.node.cluster.membership import Change
from swarmp2p.node.context import NodeContext
from swarmp2p.node.messages import Heartbeat
from swarmp2p.node.records import Held, MemoryReport
from swarmp2p.node.serving.service import Serving
from swarmp2p.node.table.replication import Replication
from swarmp2p.node.training.stages import StageHost

log = logging.getLogger("swarmp2p.node")


@dataclass(eq=False)
class Heartbeats:
    """One node's heartbeats with its peers; ``on_change`` gets the membership changes."""

    ctx: NodeContext
    rep: Replication
    stages: StageHost
    serving: Serving
    hellos: Hellos
    on_change: Callable[[list[Change]], None]
    env: Mapping[str, str]
    skews: dict[str, float] = field(default_factory=dict, init=False)
    """node -> its wall clock minus this node's, from the last heartbeat it answered."""
    _fetching: dict[str, list[dict]] = field(default_factory=dict, init=False)
    """node -> the fetches its last heartbeat listed (``swarm status`` shows them)."""
    _disk: tuple[float, int] = field(default=(-1e18, 0), init=False)
    """(when, free bytes) of the last look at the model cache's disk."""

    def __post_init__(self) -> None:
        self._live = hardware.LiveMemory(self.ctx.me.record)
        """Free memory re-read with the heartbeats (live, not the probe at start)."""

    def fetches(self) -> list[dict]:
        """What the live peers' last heartbeats listed as fetching (``swarm status``)."""
        return [f for n, fs in sorted(self._fetching.items()) if self.ctx.is_alive(n) for f in fs]

    def answer(self, beat: Heartbeat, now: float) -> Heartbeat:
        """A peer's heartbeat (it must have sent a hello first): this node's in reply."""
        if not self.ctx.members.seen(beat.node_id, now, beat.version):
            raise RpcError("unknown_peer", f"node {beat.node_id} must send node.hello first")
        self.serving.stages.issuer_claims(beat.node_id, beat.serving, now)
        self._report(beat)
        return self.message()

    def on_mdns_remove(self, node_id: str) -> None:
        """An mDNS goodbye: the peer is dead only if one heartbeat to it fails."""
        peer = self.ctx.members.peers.get(node_id)
        if peer is not None and peer.alive:
            self.ctx.spawn(self._confirm_gone(node_id, peer.endpoint), f"confirm:{node_id}")

    async def _confirm_gone(self, node_id: str, endpoint: str) -> None:
        try:
            await self.ctx.call_endpoint(endpoint, self.message(), rpc_timeout(self.ctx.config))
            self.ctx.members.seen(node_id, self.ctx.clock())
        except (RpcTimeout, RpcError, Unavailable):
            self.on_change(
                self.ctx.members.dead(node_id, self.ctx.clock(), "mDNS goodbye and no heartbeat")
            )

    def message(self) -> Heartbeat:
        """This node's heartbeat (its live memory read again)."""
        term, version = self.rep.held
        return Heartbeat(
            node_id=self.ctx.node_id,
            term=term,
            version=version,
            leader=self.ctx.leader,
            wall_time=time.time(),
            serving=self.serving.issued(),
            memory=self.memory(),
            fetching=self.stages.inputs.status(),
        )

    def memory(self) -> MemoryReport:
        """This node's live memory: free per device, and what its own workers hold."""
        memory = MemoryReport(
            free=self._live.read(),
            held=Held(jobs=self.stages.held(), serve=self.serving.stages.held()),
            disk=self._disk_free(),
        )
        self.ctx.set_record(self.ctx.me.record.with_memory(memory))
        return memory

    def _disk_free(self) -> int:
        now = self.ctx.clock()
        if now - self._disk[0] >= self.ctx.config.timings.live_memory_every_s:
            self._disk = (now, hardware.free_disk(self.env))
        return self._disk[1]

    def _report(self, beat: Heartbeat) -> None:
        """A peer's heartbeat: its live memory into its record, its fetches for status."""
        peer = self.ctx.members.peers.get(beat.node_id)
        if peer is not None:
            peer.record = peer.record.with_memory(beat.memory)
        self._fetching[beat.node_id] = list(beat.fetching or [])

    async def beat(self, node_id: str, endpoint: str, alive: bool, join_endpoint: str = "") -> None:
        """Heartbeat one peer (a dead one gets a hello instead); its answer updates its view,
        clock skew and table key."""
        if not alive:
            self.hellos.say(endpoint, join_endpoint)
            return
        sent = time.time()
        try:
            reply = await self.ctx.call_endpoint(
                endpoint, self.message(), rpc_timeout(self.ctx.config)
            )
        except (RpcTimeout, Unavailable):
            return
        except RpcError as exc:
            if exc.code in ("unknown_peer", "not_member"):
                self.hellos.forget_endpoint(endpoint)
                self.hellos.say(endpoint, join_endpoint)
            else:
                log.warning("heartbeat to %s refused: %s", node_id, exc)
            return
        if not isinstance(reply, Heartbeat) or reply.node_id != node_id:
            return
        self.ctx.members.seen(node_id, self.ctx.clock(), reply.version)
        self.serving.stages.issuer_claims(node_id, reply.serving, self.ctx.clock())
        self._report(reply)
        if reply.wall_time:
            self.skews[node_id] = reply.wall_time - (sent + time.time()) / 2
        if self.rep.ready:
            self.rep.push(node_id, (reply.term, reply.version))
