"""A follower's side of the table: whose writes it takes, the deltas and whole tables its
leader sends, and catching up from a member when that leader cannot reach it. No torch.

**Followers** take events only from the leader of the newest term they know, never from an
older term, and only from a member their own view names as leader. The sender is the node the
request's key is bound to (``authz``), never a name the message claims (issue 15). What they
take goes into the table through the replication's seam (``advance``: entries that follow;
``replace``: a whole table; ``persist_follower``: saved, then acknowledged).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from swarmp2p.errors import Unavailable
from swarmp2p.net.rpc import RpcError, RpcTimeout
from swarmp2p.node.messages import TableAck, TableEvents, TableFetch, TablePush
from swarmp2p.node.table import events as ev
from swarmp2p.node.table import jobtable
from swarmp2p.node.table.jobtable import JobTable
from swarmp2p.schema import SchemaError

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext
    from swarmp2p.node.table.election import Election

log = logging.getLogger("swarmp2p.node.table.replication")


class Replica(Protocol):
    """What a follower needs of this node's copy of the table (``Replication``)."""

    table: JobTable
    ready: bool
    commit: int
    write_lock: asyncio.Lock
    election: Election

    @property
    def held(self) -> tuple[int, int]: ...
    def lost_lead(self) -> None: ...
    def set_aside(self, table: JobTable, why: str) -> None: ...
    def advance(self, table: JobTable, entries: list[ev.Entry]) -> None: ...
    def replace(self, table: JobTable) -> None: ...
    async def persist_follower(self, commit: int) -> None: ...
    async def fetch_table(self, node_id: str) -> JobTable | None: ...


class Follower:
    """This node as a follower: it answers its leader's writes and pulls what it missed."""

    def __init__(self, ctx: NodeContext, rep: Replica) -> None:
        self.ctx, self.rep = ctx, rep
        self._catching_up: asyncio.Task | None = None
        self._behind: tuple[str, int] | None = None
        """A member that held a newer table than this node's at the last heartbeat round."""

    def pull_if_behind(self, held: dict[str, int]) -> None:
        """Anti-entropy for a follower the leader does not write to: its view (over its own,
        older members) names a node that does not lead, or the leader is one its table does
        not list. A member that has held a newer version for two heartbeat rounds running
        (a leader that writes here brings this node up within one) is asked for its table
        (``fetch_from`` takes it only if it is newer, of this history, and lists this node)."""
        if self.rep.ready or not self.rep.table.members:
            self._behind = None
            return
        table = self.rep.table
        ahead = [(v, n) for n, v in held.items() if n in table.member_ids and v > table.version]
        if not ahead:
            self._behind = None
            return
        version, source = max(ahead)
        if self._behind is not None and self._behind[1] > table.version:
            self.fetch_from(self._behind[0])
        self._behind = (source, version)

    def on_fetch(self, msg: TableFetch) -> TablePush:
        return TablePush(
            node_id=self.ctx.node_id,
            term=self.rep.table.term,
            table=self.rep.table.to_dict(),
            commit=self.rep.commit,
        )

    async def on_events(self, msg: TableEvents, sender: str) -> TableAck:
        """A delta from the leader ``sender``: applied when it follows what this node holds."""
        refusal = self._refuse_writer(sender, msg.term)
        if refusal:
            return self._ack(False, refusal)
        mine = self.rep.table
        held = (mine.epoch, mine.version, mine.term if mine.version else 0)
        if held != (msg.epoch, msg.prev_version, msg.prev_term) and msg.prev_version:
            return self._ack(False, "need the whole table")
        if msg.prev_version == 0 and mine.version:
            return self._ack(False, "need the whole table")
        async with self.rep.write_lock:
            table, entries = self.rep.table, []
            try:
                for data in msg.entries:
                    entries.append(ev.entry_from_data(data))
                    table = jobtable.apply(table, entries[-1])
            except (SchemaError, ValueError) as exc:
                log.warning("refused a delta from %s: %s", msg.leader, exc)
                return self._ack(False, f"bad delta: {exc}")
            self.rep.advance(table, entries)
            self._writer_holds(sender)
            await self.rep.persist_follower(msg.commit)
        return self._ack(True, "")

    async def on_table(self, msg: TablePush, sender: str) -> TableAck:
        """A whole table from the leader ``sender`` (a follower that was behind, or of another
        history)."""
        refusal = self._refuse_writer(sender, msg.term)
        if refusal:
            return self._ack(False, refusal)
        try:
            table = JobTable.from_dict(msg.table)
        except SchemaError as exc:
            log.warning("refused a table from %s: %s", msg.node_id, exc)
            return self._ack(False, f"bad table: {exc}")
        async with self.rep.write_lock:
            if table.epoch != self.rep.table.epoch and self.rep.table.jobs:
                self.rep.set_aside(self.rep.table, f"node {msg.node_id} leads another history")
            elif table.epoch == self.rep.table.epoch and table.key < self.rep.table.key:
                return self._ack(False, "older than this node's table")
            self.rep.replace(table)
            self._writer_holds(sender)
            await self.rep.persist_follower(msg.commit)
        return self._ack(True, "")

    def _refuse_writer(self, sender: str, term: int) -> str:
        """Why a write from ``sender`` (the authenticated node) at ``term`` is refused (""
        when it is accepted): only a member this node's view names as leader, at the newest
        term this node knows, and the one that leads it."""
        table, newest = self.rep.table, self.rep.election.newest_term()
        if sender == self.ctx.node_id:
            return "a node does not write its own table over the wire"
        if term < newest:
            return f"term {term} is older than {newest}"
        if term == table.term and table.leader and table.leader != sender:
            return f"{table.leader} leads term {term}, not {sender}"
        if table.members and sender not in table.member_ids:
            if term > table.term:  # it may have joined after this node's table
                self._catch_up(sender)
            return f"{sender} is not a member"
        if self.ctx.leader != sender and table.version:  # an empty table has nothing to lose
            return f"this node's view says {self.ctx.leader} leads, not {sender}"
        if self.rep.ready:
            self.rep.lost_lead()
        return ""

    def _catch_up(self, writer: str) -> None:
        """``writer`` leads a newer term than this node's table, yet this table does not list
        it: it joined while this node was away, and this node's view (over its own, older
        members) names a member that follows it. Fetch the newer table from that member,
        which this table lists, so the view moves to the leader and its writes are taken."""
        source = self.ctx.leader
        if source in (self.ctx.node_id, writer) or source not in self.rep.table.member_ids:
            return
        self.fetch_from(source, writer)

    def fetch_from(self, source: str, writer: str | None = None) -> None:
        """Fetch ``source``'s table (a member of this node's) and take it if it is newer, of
        this history, and still lists this node (and ``writer``, when one is named)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a view round outside the loop: the next round fetches
            return
        if self._catching_up is None or self._catching_up.done():
            self._catching_up = self.ctx.spawn(self._fetch_newer(source, writer), "catch up")

    async def _fetch_newer(self, source: str, writer: str | None) -> None:
        try:
            table = await self.rep.fetch_table(source)
        except (RpcError, RpcTimeout, SchemaError, Unavailable) as exc:
            log.debug("could not fetch the newer table from %s: %s", source, exc)
            return
        if table is None or table.epoch != self.rep.table.epoch or table.key <= self.rep.table.key:
            return
        if self.ctx.node_id not in table.member_ids or not (
            writer is None or writer in table.member_ids
        ):
            return  # it no longer lists this node, or does not explain the writer
        async with self.rep.write_lock:
            if self.rep.ready or table.key <= self.rep.table.key:
                return
            log.info(
                "caught up from %s: table version %d of term %d", source, table.version, table.term
            )
            self.rep.replace(table)
            await self.rep.persist_follower(self.rep.commit)

    def _writer_holds(self, sender: str) -> None:
        """The leader that wrote to this node holds the table (whatever its last hello said)."""
        peer = self.ctx.members.peers.get(sender)
        if peer is not None:
            peer.held = max(peer.held, self.rep.table.version)

    def _ack(self, ok: bool, reason: str) -> TableAck:
        return TableAck(
            node_id=self.ctx.node_id,
            term=self.rep.election.newest_term(),
            version=self.rep.held[1],
            ok=ok,
            reason=reason,
        )


__all__ = ["Follower", "Replica"]
