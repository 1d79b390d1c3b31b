"""Quorum, votes and deltas between in-process nodes: real Replication objects over a fake
network (every message encoded and decoded as on the wire), no sockets. Partitions are the
network's: a node's view and its reach are cut together (the harness: ``_fakenet.py``)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fakenet import SECRET, lead, settle, submit, swarm

from swarmp2p.errors import Unavailable
from swarmp2p.node import events as ev
from swarmp2p.node import jobtable
from swarmp2p.node.messages import LeadRequest, TableEvents, TablePush


async def _founding(tmp_path):
    nodes = swarm(tmp_path, "a", "b", "c")
    await lead(nodes["a"])
    await settle(nodes.values())
    return nodes


def test_the_first_leader_founds_the_swarm_with_every_live_node(tmp_path):
    async def main():
        nodes = await _founding(tmp_path)
        a = nodes["a"].rep
        assert a.ready and a.table.member_ids == {"a", "b", "c"} and a.table.epoch
        keys = {m.node_id: m.key for m in a.table.members}
        assert keys == {n: nodes[n].ctx.key.public for n in "abc"}  # each with its own key
        assert a.table.admission == SECRET.admission_key
        for n in nodes.values():
            assert n.rep.table == a.table  # every member holds it
        assert a.commit == a.table.version
        await submit(nodes["a"], "j1")
        await settle(nodes.values())
        assert all("j1" in n.rep.table.jobs for n in nodes.values())
        assert nodes["a"].rep.stats["deltas"] >= 1  # events, not tables

    asyncio.run(main())


def test_a_write_commits_on_a_majority_and_not_on_a_minority(tmp_path):
    async def main():
        nodes = await _founding(tmp_path)
        net = nodes["a"].net
        net.partition({"a", "b"}, {"c"})
        await submit(nodes["a"], "j1")  # a and b: 2 of 3
        net.partition({"a"}, {"b", "c"})
        with pytest.raises(Unavailable, match="not yet on a majority"):
            await asyncio.wait_for(submit(nodes["a"], "j2"), 15)
        assert "j2" in nodes["a"].rep.table.jobs and "j2" not in nodes["b"].rep.table.jobs

    asyncio.run(main())


def test_a_partition_elects_the_majority_side_and_heals_to_one_table(tmp_path):
    """Cut {a} from {b, c}: b leads the majority and commits; a, alone, cannot lead or write
    and says why; healed, a leads again from b's table with nothing committed lost."""

    async def main():
        nodes = await _founding(tmp_path)
        a, b, c = (nodes[n] for n in "abc")
        await submit(a, "j1")
        net = a.net
        net.partition({"a"}, {"b", "c"})
        assert not a.rep.ready or a.ctx.leader == "a"
        await lead(b)
        assert b.rep.ready and b.rep.table.term > 1
        await submit(b, "j2")
        a.rep.ready = False  # a's own next election: it sees only itself
        await lead(a)
        assert not a.rep.ready and "no quorum: 1 of 3" in a.rep.why_not_ready()
        quorum = a.rep.quorum()
        assert not quorum["ok"] and "sees 1 of 3 member(s)" in quorum["reason"]
        assert c.rep.quorum()["ok"]
        net.heal()
        b.rep.lost_lead()  # a is the lowest live node again
        await lead(a)
        await settle(nodes.values())
        assert a.rep.ready and a.rep.table.term > b.rep.table.term - 1
        for n in nodes.values():
            assert set(n.rep.table.jobs) == {"j1", "j2"}
            assert n.rep.table.key == a.rep.table.key

    asyncio.run(main())


def test_only_the_leader_of_the_newest_term_writes(tmp_path):
    async def main():
        nodes = await _founding(tmp_path)
        b = nodes["b"].rep
        term, version = b.table.key
        forged = TableEvents(
            leader="c",
            term=term,
            prev_version=version,
            prev_term=term,
            entries=[
                ev.entry_to_data(
                    ev.Entry(version=version + 1, term=term, event=ev.MemberLeft(node_id="a"))
                )
            ],
        )
        ack = await b.on_events(forged, "c")
        assert not ack.ok and "a leads term" in ack.reason and b.table.version == version
        old = TablePush(node_id="a", term=term - 1, table=jobtable.JobTable().to_dict())
        ack = await b.on_table(old, "a")
        assert not ack.ok and "older than" in ack.reason and b.table.version == version
        # a newer term does not make c a writer: b's view says a leads (and a stranger is
        # not even a member); the sender is whoever the request's key is bound to
        newer = TablePush(node_id="c", term=term + 5, table=b.table.to_dict())
        ack = await b.on_table(newer, "c")
        assert not ack.ok and "view says a leads" in ack.reason
        ack = await b.on_table(TablePush(node_id="a", term=term + 5, table=b.table.to_dict()), "zz")  # fmt: skip
        assert not ack.ok and "zz is not a member" in ack.reason and b.table.version == version

    asyncio.run(main())


def test_a_voter_votes_once_per_term_and_only_for_whom_its_view_says(tmp_path):
    async def main():
        nodes = await _founding(tmp_path)
        b = nodes["b"].rep
        term = b.table.term + 1
        assert not b.on_vote_request(LeadRequest(candidate="c", term=term)).granted  # a is lower
        assert b.on_vote_request(LeadRequest(candidate="a", term=term)).granted
        assert b.on_vote_request(LeadRequest(candidate="a", term=term)).granted  # asked again
        vote = b.on_vote_request(LeadRequest(candidate="a", term=term - 1))
        assert not vote.granted and "not newer" in vote.reason

    asyncio.run(main())


def test_a_follower_far_behind_or_of_another_history_gets_the_whole_table(tmp_path):
    async def main():
        nodes = await _founding(tmp_path)
        a, c = nodes["a"], nodes["c"]
        a.net.partition({"a", "b"}, {"c"})
        for i in range(3):
            await submit(a, f"j{i}")
        a.net.heal()
        a.rep.push("c", c.rep.held)
        await settle(nodes.values())
        assert c.rep.table == a.rep.table
        snapshots = a.rep.stats["snapshots"]
        stranger = jobtable.JobTable(epoch="other", term=1, version=3)
        c.rep.table = stranger
        a.rep._match.pop("c", None)
        a.rep.push("c", stranger.key)
        await settle(nodes.values())
        assert a.rep.stats["snapshots"] == snapshots + 1 and c.rep.table == a.rep.table

    asyncio.run(main())
