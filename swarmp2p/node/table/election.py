"""A term's election, carried out: this node's vote (on disk), its takeover when its view
names it leader, and its answer to another's request for votes. The rules are ``votes.py``'s;
the table it continues and writes is the replication's (``Replicated``). No torch.

- **Election.** The leader is the lowest live node id in a node's view; it leads only once a
  majority of the table's members voted for it in a new term (``node.lead_request``). A member
  votes once per term, and only for the node its own view says should lead. The candidate then
  continues from the newest table among its voters: every committed version is held by a
  majority, and any two majorities meet, so nothing committed is lost. Its first event,
  ``LeaderElected``, commits like any other; until then it is not ready.
- **Who may lead** (``node.cluster.election.eligible_leader``): a member of the table, never a
  node that holds no table while another does; a node with an empty table never founds a
  swarm while it sees a peer that holds one (or, having met the swarm's, ever: ``met``).
- **Minority.** A node whose view holds fewer than a majority of the voters asks for no votes
  (no term spent on a lost cause) and says why.

Brand-new swarm: when no table has members yet, the first leader founds it with itself and
every live peer that voted with an empty table.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from swarmp2p.errors import Unavailable
from swarmp2p.net.rpc import RpcError, RpcTimeout
from swarmp2p.node.messages import LeadRequest, LeadVote
from swarmp2p.node.table import events as ev
from swarmp2p.node.table import store, votes
from swarmp2p.node.table.jobtable import JobTable
from swarmp2p.schema import SchemaError

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext

log = logging.getLogger("swarmp2p.node.table.election")


def rpc_timeout(ctx: NodeContext) -> float:
    """Seconds to wait for a peer's answer to a vote or a table request."""
    return max(ctx.config.heartbeat_s * 2, 0.2)


class Replicated(Protocol):
    """What an election needs of the replicated table it continues (``Replication``)."""

    table: JobTable
    ready: bool
    reason: str
    """Why this node is not ready (``why_not_ready``)."""
    write_lock: asyncio.Lock

    def config(self) -> frozenset[str]: ...
    def note_view(self) -> None: ...
    def lost_lead(self) -> None: ...
    def fetch_from(self, source: str) -> None: ...
    def set_aside(self, table: JobTable, why: str) -> None: ...
    async def fetch_table(self, node_id: str) -> JobTable | None: ...
    async def lead(
        self, base: JobTable, term: int, events: list[ev.Event], acked: dict[str, int]
    ) -> None: ...


class Election:
    """This node's vote and its candidacy; ``rep`` holds the table it continues and writes."""

    def __init__(self, ctx: NodeContext, rep: Replicated, vote_file: Path) -> None:
        self.ctx, self.rep, self.vote_file = ctx, rep, vote_file
        self.voted_term, self.voted_for, self.met = store.load_vote(vote_file)
        """``met``: this node has seen a peer that holds the swarm's table (it joined a swarm,
        it did not start one): it never founds a history of its own, even cut off."""
        self.takeover: asyncio.Task | None = None
        """The running (or last) takeover."""

    def newest_term(self) -> int:
        """The newest term this node knows: its table's, or one it voted in since."""
        return max(self.rep.table.term, self.voted_term)

    # --- the vote on disk -----------------------------------------------------------------

    def _vote(self, term: int, candidate: str) -> None:
        self.voted_term, self.voted_for = term, candidate
        self._save()

    def _save(self) -> None:
        store.save_vote(self.vote_file, self.voted_term, self.voted_for, self.met)

    def note_held(self, held: dict[str, int]) -> None:
        """Remember (on disk) that a peer holds the swarm's table (``held``: node id ->
        version, from the heartbeats)."""
        if not self.met and any(v > 0 for v in held.values()):
            self.met = True
            self._save()

    # --- another's request ----------------------------------------------------------------

    def on_vote_request(self, msg: LeadRequest) -> LeadVote:
        table = self.rep.table
        reason = votes.vote_refusal(
            msg,
            newest=self.newest_term(),
            voted=(self.voted_term, self.voted_for),
            view_leader=self.ctx.leader,
        )
        if not reason:
            self._vote(msg.term, msg.candidate)
            if self.rep.ready and self.ctx.node_id != msg.candidate:
                self.rep.lost_lead()
        return LeadVote(
            node_id=self.ctx.node_id,
            granted=not reason,
            reason=reason,
            term=table.term,
            version=table.version,
            epoch=table.epoch,
            members=len(table.members),
        )

    # --- this node's candidacy ------------------------------------------------------------

    def start(self) -> asyncio.Task:
        """Take over as leader (this node's view names it) unless a takeover is running."""
        if self.takeover is None or self.takeover.done():
            self.takeover = self.ctx.spawn(self._take_over(), "takeover")
        return self.takeover

    async def _take_over(self) -> None:
        grace = self.ctx.started_at + self.ctx.config.failure_timeout_s - self.ctx.clock()
        if grace > 0:  # a restarted node first meets its swarm, never leads from a stale table
            self.rep.reason = "meeting the swarm before leading"
            await asyncio.sleep(grace)
        if self.ctx.leader != self.ctx.node_id or self.rep.ready:
            return
        async with self.rep.write_lock:
            await self.elect()

    async def elect(self, again: bool = True) -> None:
        """Ask the live peers for their votes in a new term (``again``: once more, above the
        newest term a refusal named, as a node that sat out a partition is behind). The
        caller holds the table's write lock."""
        me, table = self.ctx.node_id, self.rep.table
        if not table.version:
            self.rep.note_view()
        refusal = votes.stand_refusal(
            table,
            self.rep.config(),
            self.ctx.live_nodes(),
            met=self.met,
            held=self.ctx.members.held_view(),
        )
        if refusal:
            self.rep.reason = refusal
            return
        term = self.newest_term() + 1
        self._vote(term, me)
        peers = list(self.ctx.members.alive_peers())
        ask = LeadRequest(candidate=me, term=term)
        replies = await asyncio.gather(
            *(self.ctx.call_endpoint(p.endpoint, ask, rpc_timeout(self.ctx)) for p in peers),
            return_exceptions=True,
        )
        count = votes.tally(term, self.rep.table, {p.node_id: r for p, r in zip(peers, replies)})
        if count.newer_term:
            self.voted_term = max(self.voted_term, count.newer_term)
        if self.ctx.leader != me:
            return
        base = await self._newest_of(count.votes)
        if base is None:
            return
        founding = not base.members
        if founding and count.founded:  # granted or not: never a new history beside a held one
            self.rep.reason = votes.waits_to_be_listed(count.founded)
            return
        members = votes.electorate(me, base, count.votes)
        lost = votes.defeat(me, members, count)
        if lost:
            self.rep.reason = lost
            log.info("cannot lead yet: %s", lost)
            if count.ahead:  # they follow a leader this node's older table may not list
                self.rep.fetch_from(max(count.ahead)[2])
            if count.newer_term and again and self.ctx.leader == me:
                await self.elect(again=False)
            return
        events: list[ev.Event] = [ev.LeaderElected(leader=me, epoch=base.epoch or _epoch())]
        if founding:
            names = {p.node_id: p.name for p in peers}
            names[me] = self.ctx.me.name
            events += votes.founding_events(
                members,
                names,
                swarm_id=self.ctx.secret.swarm_id,
                admission_key=self.ctx.secret.admission_key,
                key_of=self.ctx.keyring.key_of,
            )
        await self.rep.lead(base, term, events, votes.acked(count.votes, base.term))

    async def _newest_of(self, granted: dict[str, LeadVote]) -> JobTable | None:
        """The table to continue: the newest among this node's and its voters' (fetched when
        a voter holds a newer one); None, with the reason said, when it cannot be had."""
        term, version, holder = votes.newest_holder(self.ctx.node_id, self.rep.table, granted)
        if holder == self.ctx.node_id:
            return self.rep.table
        try:
            table = await self.rep.fetch_table(holder)
        except (RpcError, RpcTimeout, SchemaError, Unavailable) as exc:
            self.rep.reason = f"could not fetch the newest table from {holder}: {exc}"
            return None
        if table is None or table.key < (term, version):
            self.rep.reason = f"{holder} did not send the table it voted with"
            return None
        if table.epoch != self.rep.table.epoch and self.rep.table.jobs:
            self.rep.set_aside(self.rep.table, "another history won the election")
        return table


def _epoch() -> str:
    """A new history's id (a founding)."""
    return secrets.token_hex(8)


__all__ = ["Election", "Replicated", "rpc_timeout"]
