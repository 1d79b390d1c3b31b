"""The job table across the members: the leader's log, deltas, acks, commit, roll-back. No torch.

A term's election (votes, takeover) is ``election.py``'s, its rules ``votes.py``'s; a
follower's side (whose writes it takes, catching up) is ``follower.py``'s. Here the leader
writes, ships and commits, and the table changes (entries that follow, a whole table, a
roll-back) and is saved.

- **Writes.** Only the ready leader appends events. Each is applied (validated) and persisted
  here, then shipped to every live peer as a delta (``node.table_events``: the entries after
  the follower's version, checked against the version and term it holds) or, when a follower
  holds another history or is too far behind, as the whole table (``node.table``).
- **Commit.** A version commits once a majority of the voters of the *committed*
  configuration hold it durably (acks carry what a follower saved): a membership change that
  is not committed yet never counts towards the majority that would commit it, and only one
  membership change may be uncommitted at a time (Raft's single-server changes: any majority
  of the old configuration meets any majority of the new). A submission returns only when
  committed.
- **Minority.** A node whose view holds fewer than a majority of the voters cannot lead; it
  keeps its stages running, accepts no writes, and says why (``why_not_ready``). A leader that
  loses its majority steps down and rolls its table back to the newest committed version: the
  entries it wrote since are dropped, logged, and listed in ``swarm status`` (``dropped``).
- **Followers** take events only from the leader of the newest term they know, and only
  from a member their own view names as leader (``follower.py``).

Later nodes join by ``MemberJoined``; a node that stops cleanly is marked down by
``MemberLeft`` (so the rest keep their majority, and its id stays its own).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmp2p.errors import NotApplied, Unavailable, UserError
from swarmp2p.net.rpc import RpcError, RpcTimeout
from swarmp2p.node.messages import (
    LeadRequest,
    LeadVote,
    TableAck,
    TableEvents,
    TableFetch,
    TablePush,
)
from swarmp2p.node.table import events as ev
from swarmp2p.node.table import jobtable, store, votes
from swarmp2p.node.table.election import Election, rpc_timeout
from swarmp2p.node.table.follower import Follower
from swarmp2p.node.table.jobtable import JobTable
from swarmp2p.node.table.store import TableStore

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext

log = logging.getLogger("swarmp2p.node.table.replication")

LOG_KEEP = 4096
"""Entries the leader keeps to send followers deltas; one further behind gets the table."""
MAX_EVENTS_PER_PUSH = 256
DROPPED_KEPT = 16
"""Roll-backs of uncommitted entries remembered for ``swarm status``."""


class Replication:
    """This node's copy of the table and its part in keeping the members' copies equal."""

    def __init__(self, ctx: NodeContext, table_file: Path, vote_file: Path) -> None:
        self.ctx = ctx
        self.table_file, self.vote_file = table_file, vote_file
        self.store = TableStore(table_file)
        self.table = self.store.load()
        self._unsaved: list[ev.Entry] | None = []
        """The entries that lead from the table on disk to ``self.table``; None when it does
        not follow that table by entries (it is written whole then)."""
        self.election = Election(ctx, self, vote_file)
        self.follower = Follower(ctx, self)
        self.ready = False
        self.commit = 0
        """The newest version known to be held by a majority."""
        self.committed = self.table
        """The table at ``commit`` (the leader's; a new leader starts from the table it
        continues): its voters are the configuration a majority is counted over."""
        self._after: dict[int, JobTable] = {}
        """Leader: version -> the table after it, for the versions not committed yet."""
        self.dropped: collections.deque[dict[str, Any]] = collections.deque(maxlen=DROPPED_KEPT)
        """Uncommitted writes this node rolled back (``swarm status``)."""
        self.reason = "starting"
        """Why this node is not ready (``why_not_ready``)."""
        self._log: collections.deque[ev.Entry] = collections.deque(maxlen=LOG_KEEP)
        self._match: dict[str, int] = {}
        """Leader: node id -> the version it acknowledged holding."""
        self._pushing: set[str] = set()
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self.write_lock = asyncio.Lock()
        self._saved = self.table.version
        self._save_lock = asyncio.Lock()
        self.commit_timeout = self.ctx.config.timings.commit_s
        self.stats = {"bytes_sent": 0, "deltas": 0, "snapshots": 0, "events": 0}
        """Bytes and messages this node sent to replicate the table (``swarm status --json``)."""

    # --- the heartbeat round's view -------------------------------------------------------------

    def note_view(self) -> None:
        """Each heartbeat round: remember (on disk) that a peer holds the swarm's table, and
        pull a newer one a member holds when nobody brought it here since the last round."""
        held = self.ctx.members.held_view()
        self.election.note_held(held)
        self.follower.pull_if_behind(held)

    # --- status ---------------------------------------------------------------------------

    @property
    def held(self) -> tuple[int, int]:
        """(term, version) this node holds durably: what its heartbeats report."""
        return (self.table.term, self._saved)

    def config(self) -> frozenset[str]:
        """The voters a majority is counted over: the committed table's (the table's own
        while a founding is not committed yet)."""
        return self.committed.voters or self.table.voters or frozenset({self.ctx.node_id})

    def holders(self, version: int) -> int:
        """How many voters hold ``version`` durably, this leader included."""
        held = {**self._match, self.ctx.node_id: self._saved}
        return sum(1 for m in self.config() if held.get(m, 0) >= version)

    def sees_majority(self) -> bool:
        """Whether this node's view holds a majority of the configuration's voters."""
        return votes.sees_majority(self.config(), self.ctx.live_nodes())

    def why_not_ready(self) -> str:
        return "" if self.ready else self.reason

    def quorum(self) -> dict[str, Any]:
        """What `swarm status` says about the majority, from this node's view."""
        return votes.quorum_report(
            self.table,
            self.config(),
            self.ctx.live_nodes(),
            me=self.ctx.node_id,
            leader=self.ctx.leader,
            reason=self.why_not_ready(),
            commit=self.commit,
            dropped=self.dropped,
        )

    # --- leading ---------------------------------------------------------------------------

    def lost_lead(self) -> None:
        """This node is no longer the leader in its view: stop writing."""
        if self.ready:
            log.info("no longer leading (term %d)", self.table.term)
        self.ready = False
        self.reason = f"{self.ctx.leader} leads in this node's view"
        self._fail_waiters(Unavailable("the leader changed; retry", code="not_leader"))

    def step_down(self, why: str) -> None:
        """This leader lost its majority (or a membership change did not commit): stop
        writing and roll the table back to the newest committed version."""
        if self.ready:
            log.warning("stepping down (term %d): %s", self.table.term, why)
        self.ready = False
        self.reason = why
        self._fail_waiters(Unavailable(f"the leader stepped down: {why}", code="no_quorum"))
        self._roll_back(why)

    def check_quorum(self) -> None:
        """Each heartbeat round, on the leader: step down when the view lost the majority."""
        if self.ready and not self.sees_majority():
            self.step_down(f"{votes.sees(self.config(), self.ctx.live_nodes())}: no majority")

    def _roll_back(self, why: str) -> None:
        """Drop the entries after the committed table (this node wrote them as leader and no
        majority holds them): persisted, logged, remembered for ``swarm status``."""
        base = self.committed
        if base.epoch != self.table.epoch or base.key >= self.table.key:
            self._after = {}
            return
        gone = [e for e in self._log if e.version > base.version]
        record = {
            "term": self.table.term,
            "versions": [base.version + 1, self.table.version],
            "events": [e.event.NAME for e in gone][:64],
            "why": why[:500],
            "at": time.time(),
        }
        self.dropped.append(record)
        log.warning(
            "dropped %d uncommitted table entr%s (versions %d-%d: %s): %s",
            self.table.version - base.version,
            "y" if self.table.version - base.version == 1 else "ies",
            base.version + 1,
            self.table.version,
            ", ".join(record["events"]) or "?",
            why,
        )
        self.table = base
        self._log = collections.deque(
            (e for e in self._log if e.version <= base.version), maxlen=LOG_KEEP
        )
        self._after = {}
        self._match = {n: min(v, base.version) for n, v in self._match.items()}
        self.store.snapshot(base)  # at once: a write in flight then writes nothing
        self._unsaved, self._saved = [], base.version

    def start_takeover(self) -> asyncio.Task:
        """Take over as leader (this node's view names it): ``election.py``."""
        return self.election.start()

    async def lead(
        self, base: JobTable, term: int, events: list[ev.Event], acked: dict[str, int]
    ) -> None:
        """An election won in ``term``: continue from ``base`` (this node's table or the newest
        of its voters', ``acked``: voter -> the version it is counted as holding) with a fresh
        log, write ``events`` (``LeaderElected`` first) and ship them; ready once a majority
        holds them. The caller holds ``write_lock``."""
        me = self.ctx.node_id
        if base is not self.table:
            self.replace(base)
        self._log = collections.deque(maxlen=LOG_KEEP)
        self.committed, self._after = base, {}
        self._match = dict(acked)
        version = self._apply_local(events, term)
        await self._persist()
        log.info(
            "leading swarm %s: term %d, table version %d, %d job(s), %d member(s)",
            self.ctx.secret.swarm_id,
            term,
            version,
            len(self.table.jobs),
            len(self.table.members),
        )
        self._push_all()
        self.reason = "waiting for a majority to hold the new term"
        if await self._wait_commit(version, self.commit_timeout):
            self.ready = self.ctx.leader == me
            self.reason = ""
        else:
            self.reason = "a majority did not acknowledge the new term in time"

    async def fetch_table(self, node_id: str) -> JobTable | None:
        """``node_id``'s whole table (None when it answers with something else)."""
        reply = await self.ctx.call(
            node_id, TableFetch(node_id=self.ctx.node_id), rpc_timeout(self.ctx) * 4
        )
        return JobTable.from_dict(reply.table) if isinstance(reply, TablePush) else None

    # --- writing ---------------------------------------------------------------------------

    def _apply_local(self, events: list[ev.Event], term: int) -> int:
        """Apply events as new entries of ``term``, all or none: NotApplied naming the first
        that does not follow from the table (nothing of the batch is written then)."""
        table, entries, after = self.table, [], {}
        for event in events:
            entry = ev.Entry(version=table.version + 1, term=term, event=event)
            try:
                table = jobtable.apply(table, entry)
            except ValueError as exc:
                raise NotApplied(
                    f"{event.NAME} does not follow from table version {table.version}: {exc}"
                ) from None
            entries.append(entry)
            after[entry.version] = table
        self.advance(table, entries)
        self._log.extend(entries)
        self._after.update(after)
        return table.version

    async def append(self, events: list[ev.Event], *, wait: bool = False) -> int:
        """Leader: apply, persist and replicate ``events``; the table version after them.
        ``wait``: return only once a majority holds them (Unavailable if not in time)."""
        if not self.ready:
            raise Unavailable(
                f"node {self.ctx.node_id} cannot write the table: {self.reason or 'not the leader'}",
                code="not_ready",
            )
        changes = [e for e in events if isinstance(e, ev.MEMBERSHIP_EVENTS)]
        if changes:
            busy = self.membership_in_flight()
            if busy or len(changes) > 1:
                what = busy or "more than one in one write"
                raise Unavailable(
                    f"a membership change is still committing ({what}); retry once it has",
                    code="membership_busy",
                )
        if not self.sees_majority():
            self.check_quorum()
            raise Unavailable(
                f"node {self.ctx.node_id} cannot write the table: {self.reason}", code="no_quorum"
            )
        version = self._apply_local(events, self.table.term)
        await self._persist()
        self._push_all()
        if wait and not await self._wait_commit(version, self.commit_timeout):
            members = ", ".join(sorted(self.config()))
            if changes and self.commit < version:  # a failed membership change leaves nothing
                self.step_down(
                    f"membership change {changes[0].NAME} of {changes[0].node_id} did not commit in {self.commit_timeout:g} s"
                )
                raise Unavailable(
                    f"{changes[0].NAME} of node {changes[0].node_id} did not reach a majority of "
                    f"the voters ({members}) in time; nothing changed (the leader stepped down "
                    "and rolled it back); check `swarm status`",
                    code="no_quorum",
                )
            raise Unavailable(
                f"version {version} is saved on the leader but not yet on a majority of the "
                f"members ({members}); check `swarm status`",
                code="no_quorum",
            )
        return version

    def membership_in_flight(self) -> str:
        """The uncommitted membership change this leader wrote ("" when none is)."""
        for entry in self._log:
            if entry.version > self.commit and isinstance(entry.event, ev.MEMBERSHIP_EVENTS):
                return f"{entry.event.NAME} of {entry.event.node_id}, version {entry.version}"
        return ""

    async def _persist(self) -> None:
        if self.table.version <= self._saved:
            return
        await self._write_table()
        self._advance_commit()

    def advance(self, table: JobTable, entries: list[ev.Entry]) -> None:
        """``self.table`` becomes ``table``, which ``entries`` lead to from it."""
        self.table = table
        if self._unsaved is not None:
            self._unsaved.extend(entries)

    def replace(self, table: JobTable) -> None:
        """``self.table`` becomes ``table``, which does not follow it by entries."""
        self.table, self._unsaved = table, None

    async def _write_table(self) -> None:
        """Save the newest table in a thread (the loop keeps answering): its new entries
        appended to the log, or the table whole when it does not follow the one on disk
        (``store.py``). One write at a time, again until the files hold ``self.table``
        (appends that came meanwhile go in one write; a rollback meanwhile makes the write
        it raced a no-op). ``_saved`` is the version on disk."""
        async with self._save_lock:
            while (table := self.table) is not self.store.table:
                base, entries, self._unsaved = self.store.table, self._unsaved, []
                await asyncio.to_thread(self.store.write, table, base, entries)
            self._saved = table.version

    def _advance_commit(self) -> None:
        if not self.ready and self.table.leader != self.ctx.node_id:
            return
        held = dict(self._match)
        held[self.ctx.node_id] = self._saved
        config = self.config()
        need = votes.majority(len(config))
        versions = sorted((held.get(m, 0) for m in config), reverse=True)
        commit = min(versions[need - 1] if len(versions) >= need else 0, self.table.version)
        if commit > self.commit:
            self.commit = commit
            self._commit_to(commit)
        for version, future in list(self._waiters):
            if version <= self.commit and not future.done():
                future.set_result(True)
        self._waiters = [(v, f) for v, f in self._waiters if not f.done()]

    def _commit_to(self, version: int) -> None:
        """``version`` is committed: its table's voters are the configuration from now on
        (a configuration that changed may commit at once what waited on the old one)."""
        table = self.table if version >= self.table.version else self._after.get(version)
        self._after = {v: t for v, t in self._after.items() if v > version}
        if (
            table is None
            or table.epoch != self.table.epoch
            or table.version <= self.committed.version
        ):
            return
        changed = table.voters != self.committed.voters
        self.committed = table
        if changed:
            self._advance_commit()

    async def _wait_commit(self, version: int, timeout: float) -> bool:
        if version <= self.commit:
            return True
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((version, future))
        try:
            return await asyncio.wait_for(future, timeout)
        except (asyncio.TimeoutError, Unavailable):
            return False

    def _fail_waiters(self, exc: Exception) -> None:
        for _, future in self._waiters:
            if not future.done():
                future.set_exception(exc)
        self._waiters = []

    # --- shipping to followers ------------------------------------------------------------

    def _push_all(self) -> None:
        for peer in self.ctx.members.alive_peers():
            self.push(peer.node_id)

    def push(self, node_id: str, have: tuple[int, int] | None = None) -> None:
        """Bring ``node_id`` up to date (``have``: the (term, version) it reported)."""
        if node_id in self._pushing or self.table.leader != self.ctx.node_id:
            return
        if have is not None and have[0] > self.table.term:  # a newer term leads: this one is over
            if self.ready:
                log.warning(
                    "node %s holds term %d, newer than ours (%d); leading again",
                    node_id,
                    have[0],
                    self.table.term,
                )
                self.ready = False
                self.reason = f"node {node_id} holds a newer term ({have[0]})"
                self._fail_waiters(Unavailable("the leader changed; retry", code="not_leader"))
                self.start_takeover()
            return
        if have is not None:
            self._match[node_id] = max(
                self._match.get(node_id, 0), have[1] if self._same(*have) else 0
            )
            self._advance_commit()
        if self._match.get(node_id, -1) >= self.table.version:
            return
        self._pushing.add(node_id)
        self.ctx.spawn(self._push(node_id, have), f"push:{node_id}")

    def _same(self, term: int, version: int) -> bool:
        """Whether a follower at (term, version) holds this leader's history up to it."""
        if version == 0:
            return True
        if (term, version) == self.table.key:
            return True
        entry = self._entry(version)
        return entry is not None and entry.term == term

    def _entry(self, version: int) -> ev.Entry | None:
        if not self._log or not self._log[0].version <= version <= self._log[-1].version:
            return None
        return self._log[version - self._log[0].version]

    async def _push(self, node_id: str, have: tuple[int, int] | None) -> None:
        again = False
        """Send more at once: the follower took this and is still behind, or asked for the
        whole table (a refusal waits for the next heartbeat: no busy loop)."""
        try:
            endpoint = self.ctx.endpoint_of(node_id)
            base = self._match.get(node_id)
            if base is None and have is not None and self._same(*have):
                base = have[1]
            msg = self._delta(base) if base is not None else None
            if msg is None:
                msg = TablePush(
                    node_id=self.ctx.node_id,
                    term=self.table.term,
                    table=self.table.to_dict(),
                    commit=self.commit,
                )
                self.stats["snapshots"] += 1
            else:
                self.stats["deltas"] += 1
                self.stats["events"] += len(msg.entries)
            self.stats["bytes_sent"] += _size(msg)
            reply = await self.ctx.call_endpoint(endpoint, msg, rpc_timeout(self.ctx) * 4)
            if isinstance(reply, TableAck):
                if reply.ok:
                    self._match[node_id] = max(self._match.get(node_id, 0), reply.version)
                    again = True
                elif reply.term > self.table.term:
                    log.warning(
                        "node %s is at term %d, newer than ours; leading again", node_id, reply.term
                    )
                    self.ready = False
                    self.start_takeover()
                else:
                    again = node_id in self._match and reply.reason == "need the whole table"
                    self._match.pop(node_id, None)  # it needs the whole table next time
        except (RpcError, RpcTimeout, Unavailable, OSError) as exc:
            log.debug("table push to %s failed: %s", node_id, exc)
        finally:
            self._pushing.discard(node_id)
        self._advance_commit()
        if (
            again
            and self._match.get(node_id, -1) < self.table.version
            and self.ready
            and self.ctx.is_alive(node_id)
        ):
            self.push(node_id)

    def _delta(self, base: int) -> TableEvents | None:
        """The entries after ``base`` (None when the log no longer holds them all)."""
        prev = self._entry(base) if base else None
        if base and prev is None and base != self.table.version:
            return None
        if self._log and base + 1 < self._log[0].version:
            return None
        entries = [e for e in self._log if e.version > base][:MAX_EVENTS_PER_PUSH]
        if base < self.table.version and not entries:
            return None
        return TableEvents(
            leader=self.ctx.node_id,
            term=self.table.term,
            epoch=self.table.epoch,
            prev_version=base,
            prev_term=prev.term if prev is not None else (self.table.term if base else 0),
            entries=[ev.entry_to_data(e) for e in entries],
            commit=self.commit,
        )

    # --- the requests this node answers ------------------------------------------------------

    def on_vote_request(self, msg: LeadRequest) -> LeadVote:
        return self.election.on_vote_request(msg)

    def on_fetch(self, msg: TableFetch) -> TablePush:
        return self.follower.on_fetch(msg)

    async def on_events(self, msg: TableEvents, sender: str) -> TableAck:
        return await self.follower.on_events(msg, sender)

    async def on_table(self, msg: TablePush, sender: str) -> TableAck:
        return await self.follower.on_table(msg, sender)

    def fetch_from(self, source: str) -> None:
        self.follower.fetch_from(source)

    async def persist_follower(self, commit: int) -> None:
        """A follower saves what its leader sent; it reasons with the latest configuration
        there (Raft's followers do), so its status and its next election count those voters."""
        self.committed, self._after = self.table, {}
        if self.table is not self.store.table:  # a table of another term at one version, too
            await self._write_table()
        self.commit = min(max(self.commit, commit), self.table.version)

    def set_aside(self, table: JobTable, why: str) -> None:
        aside = store.set_aside(self.table_file, table)
        log.warning("kept this node's table of %d job(s) as %s: %s", len(table.jobs), aside, why)

    def require_ready(self) -> None:
        if not self.ready:
            raise Unavailable(
                f"node {self.ctx.node_id} is not leading: {self.reason}", code="not_ready"
            )


def _size(msg: Any) -> int:
    from swarmp2p.wire.messages import encode

    try:
        return len(encode(msg))
    except Exception:
        return 0


def check_job_id(job_id: str) -> str:
    """A job id a user or peer chose: one safe path component."""
    import re

    if not re.fullmatch(ev.ID_PATTERN, job_id):
        raise UserError(
            f"job id {job_id!r} must be 1-128 of [A-Za-z0-9_-], starting with a letter or digit",
            code="bad_field",
        )
    return job_id


__all__ = ["Replication", "check_job_id"]
