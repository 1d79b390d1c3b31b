"""Quorum, votes and deltas between in-process nodes: real Replication objects over a fake
network (every message encoded and decoded as on the wire), no sockets. Partitions are the
network's: a node's view and its reach are cut together (the harness: ``_fakenet.py``)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fakenet import SECRET, FakeNode, lead, settle, submit, swarm

from swarmp2p.errors import NotApplied, Unavailable
from swarmp2p.node.messages import LeadRequest, TableEvents, TablePush
from swarmp2p.node.table import events as ev
from swarmp2p.node.table import jobtable
from swarmp2p.node.table.store import load_table


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
        a, b = nodes["a"], nodes["b"]
        net = a.net
        net.partition({"a", "b"}, {"c"})
        await submit(a, "j1")  # a and b: 2 of 3
        committed = a.rep.table.version
        # cut before a's view knows: the write is saved on a, and held by no majority
        net.cut = {frozenset(("a", "b")), frozenset(("a", "c"))}
        with pytest.raises(Unavailable, match="not yet on a majority"):
            await asyncio.wait_for(submit(a, "j2"), 15)
        assert "j2" in a.rep.table.jobs and "j2" not in b.rep.table.jobs
        # a's view catches up: a leader without its majority steps down and rolls back
        net.partition({"a"}, {"b", "c"})
        a.rep.check_quorum()
        assert not a.rep.ready and "no majority" in a.rep.why_not_ready()
        assert "j2" not in a.rep.table.jobs and a.rep.table.version == committed
        assert load_table(a.ctx.state.table_file).version == committed  # on disk too
        (dropped,) = a.rep.quorum()["dropped"]
        assert dropped["events"] == ["job_submitted"] and dropped["versions"] == [committed + 1] * 2
        # and a leader that knows it sees no majority refuses at once, writing nothing
        a.rep.ready = True
        with pytest.raises(Unavailable, match="1 of 3 voting member"):
            await submit(a, "j3")
        assert "j3" not in a.rep.table.jobs and not a.rep.ready

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
        assert not a.rep.ready and "no quorum: this node sees 1 of 3" in a.rep.why_not_ready()
        quorum = a.rep.quorum()
        assert not quorum["ok"] and "sees 1 of 3 voting member(s)" in quorum["reason"]
        assert c.rep.quorum()["ok"]
        net.heal()
        b.rep.lost_lead()  # a is the lowest live node again
        await lead(a)
        await settle(nodes.values())
        assert a.rep.ready and a.rep.table.term > b.rep.table.term - 1, a.rep.why_not_ready()
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
        ack = await b.on_table(TablePush(node_id="a", term=term + 5, table=b.table.to_dict()), "zz")
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


def _remove(node: FakeNode, who: str):
    key = node.ctx.keyring.key_of(who)
    return node.rep.append([ev.MemberRemoved(node_id=who, key=key, reason="test")], wait=True)


def test_a_cut_off_leader_cannot_remove_its_way_to_a_majority(tmp_path):
    """The audit's split brain: a, cut off before its view knows, removes b, then c. The first
    removal does not commit: a steps down and rolls it back; the second is refused; healed,
    one history (the majority's), with the job b committed meanwhile, and nobody revoked."""

    async def main():
        nodes = await _founding(tmp_path)
        a, b = nodes["a"], nodes["b"]
        await submit(a, "j1")
        before = a.rep.table
        net = a.net
        net.cut = {frozenset(("a", "b")), frozenset(("a", "c"))}  # a's view still sees them
        removing = asyncio.ensure_future(_remove(a, "b"))
        while not a.rep.table.revoked:  # written, waiting on a majority that will not answer
            await asyncio.sleep(0)
        # what the daemon acts on (it forgets revoked peers) is the committed table's
        assert a.rep.table.revoked and not a.rep.committed.revoked
        with pytest.raises(Unavailable, match=r"did not reach a majority.*nothing changed"):
            await removing
        assert not a.rep.ready and a.rep.table == before and not a.rep.table.revoked
        assert a.rep.quorum()["dropped"][-1]["events"] == ["member_removed"]
        with pytest.raises(Unavailable, match="cannot write"):
            await _remove(a, "c")
        net.partition({"a"}, {"b", "c"})
        await lead(a)  # alone: no term spent, no write
        assert not a.rep.ready and a.rep.table.member_ids == {"a", "b", "c"}
        await lead(b)
        await submit(b, "j2")
        net.heal()
        b.rep.lost_lead()
        await lead(a)
        await settle(nodes.values())
        assert a.rep.ready
        for n in nodes.values():
            assert n.rep.table.key == a.rep.table.key and set(n.rep.table.jobs) == {"j1", "j2"}
            assert n.rep.table.voters == {"a", "b", "c"} and not n.rep.table.revoked

    asyncio.run(main())


def test_one_membership_change_at_a_time_and_counted_over_the_committed_voters(tmp_path):
    async def main():
        nodes = await _founding(tmp_path)
        a, c = nodes["a"], nodes["c"]
        first = asyncio.ensure_future(
            a.rep.append([ev.MemberLeft(node_id="c", reason="stopped")], wait=True)
        )
        await asyncio.sleep(0)
        with pytest.raises(Unavailable, match="membership change is still committing"):
            await _remove(a, "b")
        await first
        assert a.rep.config() == {"a", "b"} and a.rep.table.member("c").down
        # c is down: a and b alone commit, and c's id and key stay listed
        a.net.partition({"a", "b"}, {"c"})
        await submit(a, "j1")
        assert a.rep.table.member("c").key == c.ctx.key.public
        with pytest.raises(Unavailable, match="more than one"):
            await a.rep.append(
                [ev.MemberLeft(node_id="b"), ev.MemberJoined(node_id="c", key=c.ctx.key.public)]
            )

    asyncio.run(main())


def test_a_newcomer_with_an_empty_table_never_leads_a_swarm_that_has_one(tmp_path):
    """The audit's data loss: the members are down but a, a newcomer whose id sorts lower
    joins a's side. It never leads and never founds: a holds the swarm's table."""

    async def main():
        nodes = await _founding(tmp_path)
        a = nodes["a"]
        await submit(a, "j1")
        net = a.net
        newcomer = net.nodes["0new"] = FakeNode(net, "0new", tmp_path)
        net.partition({"a", "0new"}, {"b", "c"})  # b and c are down
        assert newcomer.ctx.leader == "a" and a.ctx.leader == "a"
        await lead(newcomer)
        assert not newcomer.rep.ready and "a leads" in newcomer.rep.why_not_ready()
        await newcomer.rep.election.elect()  # even asked to, it founds nothing beside a's table
        assert not newcomer.rep.ready and newcomer.rep.table.version == 0
        assert "waits to be listed" in newcomer.rep.why_not_ready()
        await lead(a)
        assert not a.rep.ready and set(a.rep.table.jobs) == {"j1"}  # a minority: it waits
        net.heal()
        await lead(a)
        assert a.rep.ready
        version = await a.rep.append(
            [ev.MemberJoined(node_id="0new", key=newcomer.ctx.key.public)], wait=True
        )
        await settle(net.nodes.values())
        assert newcomer.rep.table.version >= version and set(newcomer.rep.table.jobs) == {"j1"}
        net.heal()  # the next heartbeats: 0new says it holds the table now
        assert all(n.ctx.leader == "0new" for n in net.nodes.values())  # a member: lowest

    asyncio.run(main())


def test_an_event_that_does_not_follow_refuses_its_whole_batch_and_writes_nothing(tmp_path):
    """The leader names the event that does not apply (a cancel of a job that is not in the
    table) and writes none of the batch it came in, not even the events before it."""

    async def main():
        nodes = await _founding(tmp_path)
        a = nodes["a"].rep
        await submit(nodes["a"], "j1")
        await settle(nodes.values())
        before, on_disk = a.table, load_table(nodes["a"].ctx.state.table_file)
        cancel = ev.JobCancelled(job_id="j1", reason="by the user", at=2.0)
        ghost = ev.JobCancelled(job_id="nobody", reason="by the user", at=2.0)
        with pytest.raises(
            NotApplied, match="job_cancelled does not follow from table version"
        ) as err:
            await a.append([cancel, ghost], wait=True)
        assert err.value.code == "not_applied" and "nobody" in str(err.value)
        assert a.table is before and a.table.jobs["j1"].state == "pending"
        assert load_table(nodes["a"].ctx.state.table_file) == on_disk
        await settle(nodes.values())
        assert all(n.rep.table.version == before.version for n in nodes.values())
        assert await a.append([cancel], wait=True) == before.version + 1  # alone, it applies

    asyncio.run(main())


def test_leader_and_followers_append_entries_to_their_logs_and_reload_the_same_table(tmp_path):
    """After the founding (whole tables), every write reaches each node's disk as log lines
    of its entries: the snapshot is not rewritten, and a reload equals the table in memory."""

    async def main():
        nodes = await _founding(tmp_path)
        snapshots = {n: node.ctx.state.table_file.read_bytes() for n, node in nodes.items()}
        for i in range(5):
            await submit(nodes["a"], f"j{i}")
        await settle(nodes.values())
        for n, node in nodes.items():
            path = node.ctx.state.table_file
            assert path.read_bytes() == snapshots[n], n
            assert len(path.with_name("jobs.log").read_bytes().splitlines()) >= 1 + 5, n
            assert load_table(path) == node.rep.table and len(node.rep.table.jobs) == 5

    asyncio.run(main())
