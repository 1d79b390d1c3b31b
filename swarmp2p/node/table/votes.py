"""The rules of a term, pure: what a majority is, who a member votes for, what a candidate's
replies add up to, which table a new leader continues from, and whom a founding lists. Plain
data in, plain data out; ``election.py`` carries them out, ``replication.py`` counts commits
with them. Who *should* lead (the lowest live node id that may) is ``node.cluster.election``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from swarmp2p.node.messages import LeadRequest, LeadVote
from swarmp2p.node.table import events as ev
from swarmp2p.node.table.jobtable import JobTable


def majority(voters: int) -> int:
    """How many of ``voters`` voting members make a majority."""
    return voters // 2 + 1


def sees_majority(config: frozenset[str], live: Collection[str]) -> bool:
    """Whether the ``live`` nodes hold a majority of the configuration's voters."""
    return len(config & set(live)) >= majority(len(config))


def sees(config: frozenset[str], live: Collection[str]) -> str:
    """'this node sees N of M voting member(s) (ids)': the view against the configuration."""
    reachable = sorted(config & set(live))
    return (
        f"this node sees {len(reachable)} of {len(config)} voting member(s) "
        f"({', '.join(reachable) or 'none'})"
    )


def quorum_report(
    table: JobTable,
    config: frozenset[str],
    live: Collection[str],
    *,
    me: str,
    leader: str,
    reason: str,
    commit: int,
    dropped: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """What `swarm status` says about the majority, from this node's view (``reason``: why
    this node, leading in its view, is not ready yet)."""
    voters = sorted(config) if table.members else []
    reachable = [m for m in voters if m in live]
    need = majority(len(voters))
    ok = not voters or len(reachable) >= need
    why = ""
    if not ok:
        why = (
            f"{sees(frozenset(voters), reachable)}; the swarm accepts new jobs only on a side "
            f"that sees {need}; stages already running keep running"
        )
    elif table.members and me not in table.member_ids:
        why = "this node is not a member yet: the leader lists it once it has met it"
    elif leader == me:
        why = reason
    return {
        "members": sorted(table.member_ids),
        "voters": voters,
        "down": sorted(m.node_id for m in table.members if m.down),
        "reachable": reachable,
        "majority": need,
        "ok": ok,
        "commit": commit,
        "reason": why,
        "dropped": list(dropped),
    }


def vote_refusal(
    request: LeadRequest, *, newest: int, voted: tuple[int, str], view_leader: str
) -> str:
    """Why a member refuses ``request`` its vote ("" grants it): one vote per term, only in a
    term newer than any it knows (``newest``; the one it voted in again for the same
    candidate), and only for the node its own view says should lead."""
    voted_term, voted_for = voted
    if request.term <= newest and not (
        request.term == voted_term and voted_for == request.candidate
    ):
        return f"term {request.term} is not newer than {newest}"
    if view_leader != request.candidate:
        return f"this node's view says {view_leader} should lead"
    return ""


def stand_refusal(
    table: JobTable,
    config: frozenset[str],
    live: Collection[str],
    *,
    met: bool,
    held: Mapping[str, int],
) -> str:
    """Why this node does not ask for votes in a new term ("" when it does): its view holds
    no majority (no term spent on a lost cause), or it holds no table while it has met the
    swarm's (``met``) or sees peers that hold one (``held``: node id -> version)."""
    if table.members and not sees_majority(config, live):
        return f"no quorum: {sees(config, live)}"
    if table.version:
        return ""
    holders = sorted(n for n, v in held.items() if v > 0)
    if met and not holders:
        return (
            "this node joined a swarm that holds a table and holds none itself: it "
            "waits for that swarm's members (it never founds a history of its own)"
        )
    if holders:
        return waits_to_be_listed(holders)
    return ""


def waits_to_be_listed(holders: Sequence[str]) -> str:
    return (
        f"this node holds no table and {', '.join(holders)} hold(s) the swarm's: it "
        "waits to be listed by the swarm's leader"
    )


@dataclass(frozen=True, slots=True)
class Tally:
    """A candidate's replies in one term."""

    votes: dict[str, LeadVote]
    """The granted votes, by voter."""
    refusals: list[str]
    """'voter: reason' of each refusal, in the order asked."""
    ahead: list[tuple[int, int, str]]
    """(term, version, voter) of refusing voters that hold a newer table of this history."""
    newer_term: int
    """The newest term at or above the one asked that a refusal named (0: none did)."""
    founded: list[str]
    """Voters that say they hold a table, granted or not."""


def tally(term: int, table: JobTable, replies: Mapping[str, object]) -> Tally:
    """Count the replies (voter -> its reply, or the exception its call raised) to this
    node's request for votes in ``term``; ``table``: the one this node holds. A reply counts
    only from the voter it names."""
    votes: dict[str, LeadVote] = {}
    refusals: list[str] = []
    ahead: list[tuple[int, int, str]] = []
    founded: list[str] = []
    newer = 0
    for voter, reply in replies.items():
        if not isinstance(reply, LeadVote) or reply.node_id != voter:
            continue
        if reply.members or reply.version:
            founded.append(voter)
        if reply.granted:
            votes[voter] = reply
            continue
        refusals.append(f"{voter}: {reply.reason}")
        if reply.epoch == table.epoch and (reply.term, reply.version) > table.key:
            ahead.append((reply.term, reply.version, voter))
        if reply.term >= term:  # a newer term is about: the next request starts above it
            newer = max(newer, reply.term)
    return Tally(votes, refusals, ahead, newer, sorted(founded))


def newest_holder(me: str, table: JobTable, votes: Mapping[str, LeadVote]) -> tuple[int, int, str]:
    """(term, version, holder) of the newest table among this node's and its voters' (of the
    history most of them share): the one a new leader continues from. ``holder`` is ``me``
    when it is this node's own table."""
    epochs = collections.Counter([table.epoch, *(v.epoch for v in votes.values())])
    best_epoch = max(epochs, key=lambda e: (bool(e), epochs[e]))
    candidates = [(v.term, v.version, n) for n, v in votes.items() if v.epoch == best_epoch]
    if table.epoch == best_epoch:
        candidates.append((*table.key, me))
    if not candidates:
        return (*table.key, me)
    term, version, holder = max(candidates)
    if (best_epoch, (term, version)) == (table.epoch, table.key):
        return (term, version, me)
    return term, version, holder


def electorate(me: str, base: JobTable, votes: Mapping[str, LeadVote]) -> frozenset[str]:
    """The members a new term's majority is counted over: the voters of the table it
    continues, or, founding a swarm, this node and every voter that holds no table."""
    if base.members:
        return base.voters
    return frozenset({me, *(n for n, v in votes.items() if v.members == 0)})


def defeat(me: str, members: frozenset[str], count: Tally) -> str:
    """Why ``count`` does not elect ``me`` over ``members`` ("" when it does)."""
    granted = {me, *count.votes} & members
    need = majority(len(members))
    if len(granted) >= need:
        return ""
    return (
        f"no quorum: {len(granted)} of {len(members)} member(s) voted for {me} (needs "
        f"{need}); reachable: {', '.join(sorted(granted))}"
        + (f"; refused by {'; '.join(count.refusals)}" if count.refusals else "")
    )


def founding_events(
    members: Collection[str],
    names: Mapping[str, str],
    *,
    swarm_id: str,
    admission_key: str,
    key_of: Callable[[str], str | None],
) -> list[ev.Event]:
    """A founding's first entries after ``LeaderElected``: the swarm's admission and every
    founding member whose key this node holds, with its name."""
    events: list[ev.Event] = [ev.AdmissionChanged(swarm_id=swarm_id, key=admission_key)]
    for n in sorted(members):
        key = key_of(n)
        if key is not None:
            events.append(ev.MemberJoined(node_id=n, name=names.get(n, ""), key=key))
    return events


def acked(votes: Mapping[str, LeadVote], term: int) -> dict[str, int]:
    """Voter -> the version a new leader counts it as holding: the one it voted with when it
    is of the term the leader continues (an entry of another term may differ), else none."""
    return {n: (v.version if v.term == term else 0) for n, v in votes.items()}


__all__ = [
    "Tally",
    "acked",
    "defeat",
    "electorate",
    "founding_events",
    "majority",
    "newest_holder",
    "quorum_report",
    "sees",
    "sees_majority",
    "stand_refusal",
    "tally",
    "vote_refusal",
    "waits_to_be_listed",
]
