"""Who may send which control request: a table of requests, senders and verdicts (issue 15)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import founded, job, running

from swarmp2p.node import join as jn
from swarmp2p.node import messages as m
from swarmp2p.node.authz import Sender, refusal

TABLE = running(nodes=("a", "b")).table  # a leads; j1 attempt 1 runs stage 0 on a, 1 on b
MEMBER_B = Sender(node_id="b", member=True)
JOINER = Sender(node_id="n", member=False)
LEADER = Sender(node_id="a", member=True)


def _hb(node_id):
    return m.Heartbeat(node_id=node_id, term=1, version=1, leader="a")


def _start(leader):
    return m.StageStart(
        job_id="j1", attempt=1, stage=0, job=job(), cluster=[], plan="{}", next="",
        resume_step=0, snapshot_nodes=[], leader=leader,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("msg", "sender", "why"),
    [
        (_hb("b"), MEMBER_B, ""),
        (_hb("a"), MEMBER_B, "claims node_id 'a', but it comes from node b"),
        (_hb("n"), JOINER, ""),  # a joiner says hello and beats before it is listed
        (m.Leave(node_id="a"), MEMBER_B, "claims node_id 'a'"),
        (m.Leave(node_id="b"), MEMBER_B, ""),
        (m.LeadRequest(candidate="a", term=9), MEMBER_B, "claims candidate 'a'"),
        (m.LeadRequest(candidate="b", term=9), MEMBER_B, ""),  # replication says no
        (m.LeadRequest(candidate="n", term=9), JOINER, "not a member"),
        (
            m.TableEvents(leader="a", term=9, prev_version=0, prev_term=0, entries=[]),
            MEMBER_B,
            "claims leader 'a'",
        ),
        (m.TablePush(node_id="n", term=9, table={}), JOINER, "not a member"),
        (m.StageReport(node_id="b", job_id="j1", attempt=1, stage=1, events=[]), MEMBER_B, ""),
        (
            m.StageReport(node_id="b", job_id="j1", attempt=1, stage=0, events=[]),
            MEMBER_B,
            "stage 0 of job j1 does not run on node b",
        ),
        (
            m.StageReport(node_id="a", job_id="j1", attempt=1, stage=0, events=[]),
            MEMBER_B,
            "claims node_id 'a'",
        ),
        (_start("a"), LEADER, ""),
        (_start("a"), MEMBER_B, "claims leader 'a'"),
        (_start("b"), MEMBER_B, "only the leader gives job.stage_start"),
        (m.StageStop(job_id="j1", attempt=1), MEMBER_B, "only the leader"),
        (m.ShardRead(job_id="j1", file="x", offset=0, size=1), MEMBER_B, ""),
        (m.ShardRead(job_id="j1", file="x", offset=0, size=1), JOINER, "not a member"),
        (m.JobCancel(job_id="j1"), JOINER, "not a member"),
        (jn.SecretPush(token="t", swarm_id="0" * 16), MEMBER_B, "only the leader"),
        (jn.SecretFetch(), JOINER, "not a member"),
        (jn.MemberRemove(node_id="a"), MEMBER_B, ""),  # any member may ask; the leader decides
        (m.ShardCopy(job_id="j1", stage=0, node_id="a"), MEMBER_B, "claims node_id 'a'"),
    ],
)
def test_refusal(msg, sender, why):
    got = refusal(msg, sender, TABLE, view_leader="a")
    assert (got == "") if not why else (why in got), got


def test_before_a_swarm_is_founded_its_first_votes_and_table_come_from_non_members():
    empty = founded("a").table.__class__()
    vote = m.LeadRequest(candidate="n", term=1)
    assert refusal(vote, JOINER, empty, view_leader="n") == ""
    assert "not a member" in refusal(vote, JOINER, TABLE, view_leader="n")
