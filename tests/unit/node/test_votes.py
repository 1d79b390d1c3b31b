"""The pure rules of a term (``node/table/votes.py``), table by table: no sockets, no loop."""

from __future__ import annotations

import pytest
import zmq

from swarmp2p.net.rpc import RpcTimeout
from swarmp2p.node.messages import LeadRequest, LeadVote
from swarmp2p.node.table import events as ev
from swarmp2p.node.table import votes
from swarmp2p.node.table.jobtable import JobTable, Member

KEY = zmq.curve_keypair()[0].decode()


def table(*voters: str, down=(), term=2, version=5, epoch="e1") -> JobTable:
    members = tuple(Member(node_id=n, key=KEY, down=n in down) for n in (*voters, *down))
    return JobTable(epoch=epoch, term=term, version=version, leader="", members=members)


def vote(node_id, granted=True, *, term=2, version=5, epoch="e1", members=3, reason=""):
    return LeadVote(
        node_id=node_id,
        granted=granted,
        reason=reason,
        term=term,
        version=version,
        epoch=epoch,
        members=members,
    )


@pytest.mark.parametrize(
    ("voters", "need"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (0, 1)], ids=str
)
def test_a_majority_is_more_than_half(voters, need):
    assert votes.majority(voters) == need


@pytest.mark.parametrize(
    ("term", "voted", "leader", "refusal"),
    [
        (3, (2, "a"), "a", ""),  # a newer term, the view's leader
        (2, (2, "a"), "a", ""),  # the term it voted in, for the same candidate again
        (2, (2, "b"), "a", "term 2 is not newer than 2"),  # one vote per term
        (1, (0, ""), "a", "term 1 is not newer than 2"),  # older than the table's own term
        (3, (2, "a"), "b", "this node's view says b should lead"),
    ],
)
def test_a_member_votes_once_per_term_and_only_for_its_views_leader(term, voted, leader, refusal):
    ask = LeadRequest(candidate="a", term=term)
    got = votes.vote_refusal(ask, newest=max(2, voted[0]), voted=voted, view_leader=leader)
    assert got == refusal


def test_a_node_without_a_majority_in_view_does_not_stand():
    t = table("a", "b", "c")
    assert votes.stand_refusal(t, t.voters, {"a", "b"}, met=True, held={}) == ""
    why = votes.stand_refusal(t, t.voters, {"a"}, met=True, held={})
    assert why == "no quorum: this node sees 1 of 3 voting member(s) (a)"


@pytest.mark.parametrize(
    ("met", "held", "says"),
    [
        (False, {"b": 0}, ""),  # nobody holds a table: a founding
        (True, {"b": 0}, "it never founds a history of its own"),
        (False, {"b": 4, "c": 0}, "b hold(s) the swarm's"),
        (True, {"c": 3, "b": 4}, "b, c hold(s) the swarm's"),
    ],
)
def test_an_empty_table_never_founds_beside_a_held_one(met, held, says):
    empty = JobTable()
    why = votes.stand_refusal(empty, frozenset({"a"}), {"a", *held}, met=met, held=held)
    assert (says in why) if says else why == ""


def test_the_tally_counts_only_replies_from_the_voter_they_name():
    t = table("a", "b", "c", "d", "e")
    replies = {
        "b": vote("b"),
        "c": vote("c", False, term=4, version=9, reason="term 3 is not newer than 4"),
        "d": vote("x"),  # a reply naming another voter counts for nobody
        "e": RpcTimeout("no answer"),
    }
    count = votes.tally(3, t, replies)
    assert list(count.votes) == ["b"]
    assert count.refusals == ["c: term 3 is not newer than 4"]
    assert count.ahead == [(4, 9, "c")]
    assert count.newer_term == 4
    assert count.founded == ["b", "c"]
    assert votes.defeat("a", t.voters, count).startswith("no quorum: 2 of 5 member(s) voted for a")
    assert votes.defeat("a", frozenset({"a", "b", "c"}), count) == ""


def test_a_new_leader_continues_from_the_newest_table_of_the_shared_history():
    mine = table("a", "b", "c", term=2, version=5)
    granted = {
        "b": vote("b", term=2, version=7),
        "c": vote("c", term=9, version=99, epoch="other"),  # one voter of another history
    }
    assert votes.newest_holder("a", mine, granted) == (2, 7, "b")
    assert votes.newest_holder("a", mine, {"b": vote("b", term=2, version=5)})[2] == "a"
    # most voters hold another history: it wins (this node's table is set aside)
    other = {n: vote(n, term=1, version=3, epoch="other") for n in ("b", "c")}
    assert votes.newest_holder("a", mine, other) == (1, 3, "c")


def test_a_founding_counts_the_voters_without_a_table_and_lists_their_keys():
    granted = {"b": vote("b", members=0, version=0), "c": vote("c", members=3)}
    members = votes.electorate("a", JobTable(), granted)
    assert members == {"a", "b"}
    assert votes.electorate("a", table("a", "c"), granted) == {"a", "c"}
    events = votes.founding_events(
        members,
        {"a": "host-a"},
        swarm_id="s1",
        admission_key=KEY,
        key_of=lambda n: KEY if n == "a" else None,
    )
    assert [type(e) for e in events] == [ev.AdmissionChanged, ev.MemberJoined]
    assert events[1].node_id == "a" and events[1].name == "host-a"
    assert votes.acked({"b": vote("b", term=2, version=7), "c": vote("c", term=1)}, 2) == {
        "b": 7,
        "c": 0,
    }


def test_the_quorum_report_says_why_a_side_accepts_no_jobs():
    t = table("a", "b", "c", down=("d",))
    cut = votes.quorum_report(
        t, t.voters, {"a"}, me="a", leader="a", reason="", commit=4, dropped=[]
    )
    assert (cut["ok"], cut["majority"], cut["reachable"], cut["down"]) == (False, 2, ["a"], ["d"])
    assert cut["reason"].startswith("this node sees 1 of 3 voting member(s) (a); the swarm")
    ok = votes.quorum_report(
        t, t.voters, {"a", "b"}, me="a", leader="a", reason="waiting", commit=4, dropped=[]
    )
    assert ok["ok"] and ok["reason"] == "waiting"
    newcomer = votes.quorum_report(
        t, t.voters, {"a", "b", "z"}, me="z", leader="a", reason="", commit=4, dropped=[]
    )
    assert "not a member yet" in newcomer["reason"]
