"""The job table: events through one pure apply, atomic checksummed persistence, newest."""

from __future__ import annotations

import json
import os

import pytest

from swarmp2p.node.jobtable import JobEvent, JobTable, apply, load, newest, save


def _replay(events):
    table = JobTable()
    for event in events:
        table = apply(table, event)
    return table


EVENTS = [
    JobEvent(version=1, kind="lead", leader="a"),
    JobEvent(version=2, kind="submit", job_id="j1", record={"model": "m", "steps": 3}),
    JobEvent(version=3, kind="submit", job_id="j2", record={"model": "n"}),
    JobEvent(version=4, kind="update", job_id="j1", state="running", record={"step": 1}),
    JobEvent(version=5, kind="remove", job_id="j2"),
    JobEvent(version=6, kind="lead", leader="b"),
]


def test_replay_builds_the_table():
    table = _replay(EVENTS)
    assert (table.term, table.version, table.leader) == (2, 6, "b")
    assert list(table.jobs) == ["j1"]
    assert dict(table.jobs["j1"]) == {
        "job_id": "j1",
        "state": "running",
        "version": 4,
        "record": {"model": "m", "steps": 3, "step": 1},
    }


def test_apply_is_pure():
    before = _replay(EVENTS[:2])
    snapshot = before.to_dict()
    apply(before, EVENTS[2])
    assert before.to_dict() == snapshot
    with pytest.raises(TypeError):
        before.jobs["x"] = {}


@pytest.mark.parametrize(
    ("prefix", "event", "message"),
    [
        (0, JobEvent(version=2, kind="lead", leader="a"), "does not follow table version 0"),
        (2, JobEvent(version=3, kind="submit", job_id="j1"), "already in the table"),
        (2, JobEvent(version=3, kind="update", job_id="zz"), "not in the table; cannot update"),
        (2, JobEvent(version=3, kind="remove", job_id="zz"), "not in the table; cannot remove"),
    ],
)
def test_bad_events_are_refused(prefix, event, message):
    with pytest.raises(ValueError, match=message):
        apply(_replay(EVENTS[:prefix]), event)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "drop", "job_id": "j"}, "kind 'drop'"),
        ({"kind": "lead"}, "needs the leader"),
        ({"kind": "submit"}, "needs a job_id"),
        ({"kind": "update", "job_id": "j", "state": "flying"}, "job state 'flying'"),
    ],
)
def test_bad_event_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        JobEvent(version=1, **fields)


def test_newest_orders_by_term_then_version():
    old_leader_unreplicated = JobTable(term=1, version=9)
    new_leader = JobTable(term=2, version=5)
    same_term_newer = JobTable(term=2, version=6)
    assert newest([old_leader_unreplicated, new_leader]) is new_leader
    assert newest([new_leader, same_term_newer, old_leader_unreplicated]) is same_term_newer
    assert newest([]) == JobTable()


def test_save_load_roundtrip(tmp_path):
    table = _replay(EVENTS)
    path = tmp_path / "jobs.json"
    save(path, table)
    assert load(path) == table
    assert load(path).to_dict() == table.to_dict()
    assert [p.name for p in tmp_path.iterdir()] == ["jobs.json"]  # no temp left behind


def test_load_missing_is_empty(tmp_path):
    assert load(tmp_path / "none.json") == JobTable()


def test_corruption_is_detected(tmp_path):
    path = tmp_path / "jobs.json"
    save(path, _replay(EVENTS))
    outer = json.loads(path.read_text())
    outer["table"] = outer["table"].replace('"running"', '"failed"')
    path.write_text(json.dumps(outer))
    with pytest.raises(ValueError, match="fails its sha256 checksum"):
        load(path)
    path.write_text("{truncated")
    with pytest.raises(ValueError, match="is not a saved table"):
        load(path)


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "jobs.json"
    save(path, _replay(EVENTS[:2]))

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        save(path, _replay(EVENTS))
    monkeypatch.undo()
    assert load(path).version == 2
    assert [p.name for p in tmp_path.iterdir()] == ["jobs.json"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "must be an object"),
        ({"format": 9}, "format 9"),
        ({"format": 1, "term": -1, "version": 0, "jobs": {}}, "term must be"),
        ({"format": 1, "term": 0, "version": True, "jobs": {}}, "version must be"),
        ({"format": 1, "term": 0, "version": 0, "jobs": []}, "jobs must be an object"),
        ({"format": 1, "term": 0, "version": 0, "jobs": {"j": {"state": "?"}}}, "state '\\?'"),
    ],
)
def test_from_dict_validates(data, message):
    with pytest.raises(ValueError, match=message):
        JobTable.from_dict(data)
