"""``decide_serving``: what the issuing node does next, a pure function of the table's served
models, who is alive, what it runs and the clock (a table test per rule); and the standby
copies of a served trained model."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import serve_plan, serving

from swarmp2p.node.serving import decide as dc
from swarmp2p.node.table import events as ev

RUNNING = dc.Local(running=True, busy=False)


def decide(table, alive="abc", local=None, now=100.0, **kw):
    args = {
        "me": "a",
        "alive": frozenset(alive),
        "local": {"s1": RUNNING} if local is None else local,
        "now": now,
        "grace_s": 10.0,
        "restore_from": 0.0,
        "restore_until": 1000.0,
        "max_crash_rebuilds": 3,
        **kw,
    }
    return dc.decide_serving(table.served, **args)


def test_a_healthy_ring_needs_nothing():
    assert decide(serving().table) == []


def test_a_lost_stage_node_is_marked_lost_and_the_ring_re_placed():
    assert decide(serving().table, alive="ac") == [
        dc.MarkLost(serve_id="s1", attempt=1, stage=1, node_id="b"),
        dc.Replan(serve_id="s1"),
    ]


def test_a_stage_already_lost_is_not_marked_again_and_a_rebuild_in_flight_waits():
    log = serving()
    log(ev.ServeStageLost(serve_id="s1", attempt=1, stage=1, node_id="b", at=3.0))
    assert decide(log.table, alive="ac") == [dc.Replan(serve_id="s1")]
    busy = {"s1": dc.Local(running=True, busy=True)}
    assert decide(log.table, alive="ac", local=busy) == []


def test_a_crashed_worker_on_a_live_node_re_places_until_it_crashed_too_often():
    log = serving()
    log(ev.ServeStageLost(serve_id="s1", attempt=1, stage=1, node_id="b", crashed=True, at=3.0))
    assert decide(log.table) == [dc.Replan(serve_id="s1")]
    assert decide(log.table, max_crash_rebuilds=0) == [
        dc.GiveUp(
            serve_id="s1",
            reason="stage worker(s) died 1 times; last: stage 1's worker ended on node b; "
            "re-placing",
        )
    ]


def test_degraded_retries_each_round_and_fails_open_requests_after_the_grace():
    log = serving()
    log(
        ev.ServeStageLost(serve_id="s1", attempt=1, stage=1, node_id="b", at=3.0),
        ev.ServeDegraded(serve_id="s1", attempt=2, reason="fits nowhere", at=50.0),
    )
    assert decide(log.table, alive="ac", now=55.0) == [dc.Replan(serve_id="s1")]
    assert decide(log.table, alive="ac", now=61.0) == [
        dc.FailOpen(serve_id="s1", reason="fits nowhere"),
        dc.Replan(serve_id="s1"),
    ]


def test_a_failed_model_fails_the_requests_sent_since_and_is_never_rebuilt():
    log = serving()
    log(ev.ServeFailed(serve_id="s1", reason="gave up", at=3.0))
    assert decide(log.table, alive="a") == [dc.FailOpen(serve_id="s1", reason="gave up")]
    assert decide(log.table, alive="a", local={}) == []


def test_after_a_restart_the_model_is_opened_again_once_peers_met_and_given_up_late():
    table = serving(nodes=("a", "b")).table
    assert decide(table, local={}, now=5.0, restore_from=10.0) == []
    assert decide(table, local={}, now=20.0, restore_from=10.0) == [
        dc.Restore(serve_id="s1", stop_attempt=1, stop_nodes=("a", "b"))
    ]
    waiting = {"s1": dc.Local(running=False, busy=False, retry_at=30.0)}
    assert decide(table, local=waiting, now=25.0) == []
    assert decide(table, local=waiting, now=30.0)[0].__class__ is dc.Restore
    assert decide(table, local={}, now=2000.0) == [
        dc.GiveUp(
            serve_id="s1",
            reason="gave up serving it again after a restart: no ring could be placed",
        )
    ]


def test_only_the_models_this_node_issues_are_decided():
    table = serving(issuer="b", nodes=("a", "b")).table
    assert decide(table, alive="a", local={}) == []


def test_standby_copies_go_where_a_shard_has_one_live_holder():
    alive = frozenset("abc")
    assert dc.standby_copies([["a"], ["b", "c"], ["x"], ["b"]], alive) == [
        dc.StandbyCopy(stage=0, target="b", sources=("a",)),
        dc.StandbyCopy(stage=3, target="c", sources=("b",)),
    ]
    assert dc.standby_copies([["a"]], frozenset("a")) == []  # nowhere else to copy to


def test_the_plan_builder_places_one_stage_per_node():
    assert [s.node_id for s in serve_plan("a", "b", "c").stages] == ["a", "b", "c"]
