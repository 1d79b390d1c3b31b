"""Who may send which control request: a table of requests, senders and verdicts (issue 15)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import founded, job, running

from swarmp2p.node import messages as m
from swarmp2p.node.cluster import join as jn
from swarmp2p.node.cluster.authz import Sender, refusal, serve_exit_refusal, serve_refusal

TABLE = running(nodes=("a", "b")).table  # a leads; j1 attempt 1 runs stage 0 on a, 1 on b
MEMBER_B = Sender(node_id="b", member=True)
JOINER = Sender(node_id="n", member=False)
LEADER = Sender(node_id="a", member=True)


def _hb(node_id):
    return m.Heartbeat(node_id=node_id, term=1, version=1, leader="a")


def _start(leader):
    return m.StageStart(
        job_id="j1",
        attempt=1,
        stage=0,
        job=job(),
        cluster=[],
        plan="{}",
        next="",
        resume_step=0,
        snapshot_nodes=[],
        leader=leader,
    )


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


# --- a served model's stages take commands from its issuer or the leader (issue 24) --------


def _serve_start(issuer):
    from swarmp2p.plan import from_config
    from swarmp2p.plan.serve import ServeInputs

    shape = from_config(
        {
            "model_type": "llama",
            "vocab_size": 128,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    return m.ServeStageStart(
        serve_id="s1",
        attempt=2,
        stage=0,
        inputs=ServeInputs(shape=shape),
        plan="{}",
        model="/m",
        issuer=issuer,
    )


STOP = m.ServeStageStop(serve_id="s1", attempt=1, stage=-1)
CONNECT = m.ServeStageConnect(serve_id="s1", attempt=1, stage=0, next="tcp://127.0.0.1:9")
LEADERS = {"a"}


@pytest.mark.parametrize(
    ("msg", "sender", "issuer", "claimants", "why"),
    [
        (STOP, "i", "i", (), ""),  # the issuer stops its own stage
        (STOP, "a", "i", (), ""),  # so may the leader
        (
            STOP,
            "b",
            "i",
            (),
            "serve.stage_stop for serve s1: only its issuing node i or the leader (a) may "
            "send it; node b is neither",
        ),
        (STOP, "b", None, (), ""),  # nothing of s1 runs there: nothing to stop
        (CONNECT, "i", "i", (), ""),
        (CONNECT, "a", "i", (), ""),
        (CONNECT, "b", "i", (), "serve.stage_connect for serve s1: only its issuing node i"),
        (CONNECT, "b", "b", ("i",), ""),  # a heartbeat's claim does not make an issuer
        (_serve_start("i"), "i", "i", (), ""),  # another stage, or a rebuilt ring's
        (_serve_start("i"), "i", None, (), ""),  # its first stage there
        (_serve_start("i"), "i", None, ("i",), ""),
        (
            _serve_start("b"),
            "b",
            "i",
            (),
            "serve.stage_start for serve s1: it is issued by node i, not by node b",
        ),
        (_serve_start("a"), "a", "i", (), "issued by node i, not by node a"),  # the leader too
        (_serve_start("b"), "b", None, ("i",), "issued by node i, not by node b"),
        (_serve_start("b"), "b", None, ("b", "i"), ""),  # two claim it: the first start wins
        (m.ServeShardHold(stage=0, shard={}), "b", "i", (), ""),  # not a stage command
    ],
)
def test_serve_refusal(msg, sender, issuer, claimants, why):
    got = serve_refusal(msg, sender, issuer, LEADERS, frozenset(claimants))
    assert (got == "") if not why else (why in got), got


def test_serve_refusal_names_no_leader_when_none_is_known():
    got = serve_refusal(STOP, "b", "i", {""})
    assert "only its issuing node i or the leader (none) may send it" in got


def _exit(node_id, stage=1):
    return m.ServeStageExit(serve_id="s1", attempt=1, stage=stage, node_id=node_id, message="x")


@pytest.mark.parametrize(
    ("msg", "nodes", "why"),
    [
        (_exit("b"), ["a", "b"], ""),
        (_exit("a"), ["a", "b"], "serve.stage_exit: stage 1 of serve s1 does not run on node a"),
        (_exit("m", stage=5), ["a", "b"], "stage 5 of serve s1 does not run on node m"),
        (_exit("m", stage=-1), ["a", "b"], "stage -1 of serve s1 does not run on node m"),
        (_exit("m"), None, ""),  # not about the live ring: ignored, nothing changes
    ],
)
def test_serve_exit_refusal(msg, nodes, why):
    got = serve_exit_refusal(msg, nodes)
    assert (got == "") if not why else (why in got), got


def test_a_serve_stage_command_from_a_non_member_is_refused_before_any_record_is_read():
    assert "not a member" in refusal(STOP, JOINER, TABLE, view_leader="a")
    assert "not a member" in refusal(CONNECT, JOINER, TABLE, view_leader="a")
    assert "claims issuer 'i'" in refusal(_serve_start("i"), MEMBER_B, TABLE, view_leader="a")
