"""Served models in the job table: every serving event through the same pure ``apply``, a
table test per transition (applies, or refuses naming why), replay, and the API key kept out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import Log, founded, serve_plan, serving

from swarmp2p.node.cluster.authz import serve_note_refusal
from swarmp2p.node.table import events as ev
from swarmp2p.node.table.jobtable import JobTable, load, save
from swarmp2p.plan.serve import ServeRequest
from swarmp2p.schema import SchemaError

REQUEST = ServeRequest(model="/models/tiny", name="tiny", stages=2, port=8080)


def lost(stage=1, node="b", attempt=1, crashed=False):
    return ev.ServeStageLost(
        serve_id="s1", attempt=attempt, stage=stage, node_id=node, crashed=crashed, at=3.0
    )


def placed(attempt=2, nodes=("a", "c"), failover=True, replayed=0):
    return ev.ServePlaced(
        serve_id="s1",
        attempt=attempt,
        plan=serve_plan(*nodes),
        endpoints=tuple(f"tcp://{n}:5000" for n in nodes),
        url="http://127.0.0.1:8080",
        failover=failover,
        replayed=replayed,
        at=4.0,
    )


def test_requested_and_placed_serve_with_the_rings_placement():
    t = serving().table
    s = t.served["s1"]
    assert (s.state, s.issuer, s.name, s.attempt, s.live_attempt) == ("serving", "a", "tiny", 1, 1)
    assert s.stage_nodes == ("a", "b") and s.url == "http://127.0.0.1:8080"
    assert (s.failovers, s.reason, s.version) == (0, "", t.version)


def test_a_lost_stage_then_a_new_ring_is_one_failover_with_its_replayed_sessions():
    log = serving(nodes=("a", "b"))
    t = log(lost())
    s = t.served["s1"]
    assert (s.state, s.lost, s.crash_rebuilds) == ("replacing", (1,), 0)
    assert s.reason == "a stage node was lost (b); re-placing"
    s = log(placed(replayed=2)).served["s1"]
    assert (s.state, s.failovers, s.replayed, s.live_attempt) == ("serving", 1, 2, 2)
    assert s.stage_nodes == ("a", "c") and s.lost == () and s.reason == ""


def test_a_crashed_worker_counts_once_per_ring():
    log = serving()
    log(lost(crashed=True), lost(stage=0, node="a", crashed=True))
    s = log.table.served["s1"]
    assert (s.crash_rebuilds, s.lost) == (1, (0, 1))
    assert s.reason.startswith("stage 1's worker ended on node b")
    s = log(
        placed(),
        ev.ServeStageLost(serve_id="s1", attempt=2, stage=0, node_id="a", crashed=True, at=5.0),
    ).served["s1"]
    assert s.crash_rebuilds == 2  # it accumulates over failovers


def test_degraded_keeps_when_it_first_failed_and_a_later_ring_clears_it():
    log = serving()
    log(lost())
    log(ev.ServeDegraded(serve_id="s1", attempt=2, reason="fits nowhere", at=10.0))
    s = log(ev.ServeDegraded(serve_id="s1", attempt=3, reason="still nowhere", at=20.0)).served[
        "s1"
    ]
    assert (s.state, s.reason, s.degraded_since, s.attempt, s.live_attempt) == (
        "degraded",
        "still nowhere",
        10.0,
        3,
        1,
    )
    s = log(placed(attempt=4)).served["s1"]
    assert (s.state, s.degraded_since, s.failovers) == ("serving", None, 1)


def test_failed_then_stopped_leaves_the_table():
    log = serving()
    s = log(ev.ServeFailed(serve_id="s1", reason="workers died 4 times", at=5.0)).served["s1"]
    assert (s.state, s.reason) == ("failed", "workers died 4 times")
    assert log(ev.ServeStopped(serve_id="s1", at=6.0)).served == {}


def test_a_placement_after_a_restart_is_not_a_failover():
    log = serving()
    s = log(placed(nodes=("a", "b"), failover=False)).served["s1"]
    assert (s.failovers, s.live_attempt) == (0, 2)


@pytest.mark.parametrize(
    ("events", "why"),
    [
        (
            [ev.ServeRequested(serve_id="s1", issuer="a", request=REQUEST, at=5.0)],
            "already in the table",
        ),
        (
            [ev.ServeRequested(serve_id="s2", issuer="a", request=REQUEST, at=5.0)],
            "serves 'tiny' already",
        ),
        ([ev.ServeStopped(serve_id="s9", at=5.0)], "'s9' is not in the table; it cannot stop"),
        ([placed(attempt=1)], "ring attempt 1 does not follow 1"),
        ([placed(failover=True)], "lost no stage of a live ring"),
        ([lost(attempt=2)], "the live one is 1"),
        ([lost(stage=5)], "has no stage 5"),
        ([lost(node="c")], "stage 1 runs on b, not c"),
        (
            [
                ev.ServeDegraded(serve_id="s1", attempt=2, reason="x", at=5.0),
                ev.ServeDegraded(serve_id="s1", attempt=1, reason="x", at=6.0),
            ],
            "attempt 1 is older than 2",
        ),
        (
            [
                ev.ServeFailed(serve_id="s1", reason="x", at=5.0),
                ev.ServeFailed(serve_id="s1", reason="y", at=6.0),
            ],
            "failed already",
        ),
        ([ev.ServeFailed(serve_id="s1", reason="x", at=5.0), lost()], "is failed; it has no ring"),
        (
            [ev.ServeFailed(serve_id="s1", reason="x", at=5.0), placed(failover=False)],
            "failed; stop it",
        ),
        (
            [
                ev.ServeFailed(serve_id="s1", reason="x", at=5.0),
                ev.ServeDegraded(serve_id="s1", attempt=2, reason="x", at=6.0),
            ],
            "it is not retried",
        ),
    ],
)
def test_an_event_that_does_not_follow_is_refused_naming_why(events, why):
    log = serving()
    *before, last = events
    log(*before)
    table = log.table
    with pytest.raises(ValueError, match=why):
        log(last)
    assert log.table is table  # nothing changed


def test_events_replayed_give_the_same_table_and_it_survives_json_and_disk(tmp_path):
    events = [
        ev.ServeRequested(
            serve_id="s1", issuer="a", request=REQUEST, api_key_sha256="ab" * 32, at=1.0
        ),
        placed(attempt=1, nodes=("a", "b"), failover=False),
        lost(),
        ev.ServeDegraded(serve_id="s1", attempt=2, reason="fits nowhere", at=5.0),
        placed(attempt=3, replayed=1),
        ev.ServeRequested(serve_id="s2", issuer="b", request=REQUEST, at=6.0),
        ev.ServeFailed(serve_id="s1", reason="gave up", at=7.0),
    ]
    first = founded("a", "b", "c")(*events)
    wire = [ev.event_from_data(json.loads(json.dumps(ev.event_to_data(e)))) for e in events]
    again = founded("a", "b", "c")(*wire)
    assert again == first and again.to_dict() == first.to_dict()
    assert JobTable.from_dict(json.loads(json.dumps(first.to_dict()))) == first
    save(tmp_path / "table.json", first)
    assert load(tmp_path / "table.json") == first
    assert (first.served["s1"].state, first.served["s1"].failovers) == ("failed", 1)


def test_the_api_key_never_enters_the_table():
    with pytest.raises(ValueError, match="API key never enters the table"):
        ev.ServeRequested(
            serve_id="s1", issuer="a", request=ServeRequest(model="m", api_key="k3y"), at=1.0
        )
    data = ev.event_to_data(ev.ServeRequested(serve_id="s1", issuer="a", request=REQUEST, at=1.0))
    data["request"]["api_key"] = "k3y"
    with pytest.raises(SchemaError, match="API key never enters"):
        ev.event_from_data(data)
    data["request"]["api_key"] = None
    data["api_key_sha256"] = "not-a-digest"
    with pytest.raises(SchemaError, match="api_key_sha256"):
        ev.event_from_data(data)


def test_only_the_issuer_speaks_for_its_served_model():
    table = serving(issuer="a", nodes=("a", "b")).table
    assert serve_note_refusal(table, lost(), "a") == ""
    assert "issued by node a, not by node b" in serve_note_refusal(table, lost(), "b")
    ask = ev.ServeRequested(serve_id="s3", issuer="a", request=REQUEST, at=1.0)
    assert "issued by node a, not by node b" in serve_note_refusal(table, ask, "b")
    other = ev.JobCancelled(job_id="j1", reason="x", at=1.0)
    assert "not a serving event" in serve_note_refusal(table, other, "a")


def test_a_table_without_served_models_still_loads():
    data = Log().table.to_dict()
    del data["served"]
    assert JobTable.from_dict(data).served == {}
