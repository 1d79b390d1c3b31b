"""The job table: every event through one pure apply (a table test per transition), atomic
checksummed persistence."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import Log, cluster, founded, job, key, plan, running

from swarmp2p.node.table import events as ev
from swarmp2p.node.table.jobtable import JobTable, apply, load, save
from swarmp2p.schema import SchemaError


def test_a_whole_life_replays_to_the_same_table():
    log = running()
    t = log(
        ev.StepsReported(job_id="j1", attempt=1, step=2, loss=4.5, at=4.0),
        ev.SnapshotHeld(job_id="j1", stage=0, step=2, node_id="a"),
        ev.SnapshotHeld(job_id="j1", stage=0, step=2, node_id="b"),
        ev.EvaluationReported(
            job_id="j1", name="trained", loss=3.0, perplexity=20.1, top1=0.2, tokens=64
        ),
        ev.StageExported(
            job_id="j1",
            attempt=1,
            stage=1,
            node_id="b",
            folder="export/stage-1",
            manifest={"files": {"w.safetensors": "0" * 64}},
        ),
        ev.StageFinished(job_id="j1", attempt=1, stage=0, at=5.0),
    )
    assert t.jobs["j1"].state == "running" and t.jobs["j1"].done_stages == (0,)
    t = log(ev.StageFinished(job_id="j1", attempt=1, stage=1, at=6.0))
    entry = t.jobs["j1"]
    assert entry.state == "completed" and entry.step == 10  # every step, by the job's count
    assert [h.state for h in entry.history] == ["pending", "placed", "running", "completed"]
    assert entry.snapshots == {"0": {"2": ("a", "b")}} and entry.loss == 4.5
    assert entry.evaluation["trained"]["tokens"] == 64 and entry.shards["1"].node == "b"
    assert (t.term, t.version, t.leader, entry.version) == (1, t.version, "a", t.version)
    assert JobTable.from_dict(json.loads(json.dumps(t.to_dict()))) == t


def test_apply_is_pure():
    log = running()
    before = log.table
    snapshot = before.to_dict()
    log(ev.JobCancelled(job_id="j1", reason="user", at=9.0))
    assert before.to_dict() == snapshot and before.jobs["j1"].state == "running"
    assert log.table.jobs["j1"].state == "cancelled"


def test_a_lost_node_resumes_on_a_new_attempt_from_a_snapshot():
    log = running()
    log(ev.JobResuming(job_id="j1", reason="node(s) b lost", at=5.0))
    assert log.table.jobs["j1"].state == "resuming"
    t = log(
        ev.JobPlaced(
            job_id="j1",
            attempt=2,
            plan=plan(("a", "c")),
            cluster=tuple(cluster("a", "c")),
            resume_step=2,
            placed_by="a",
            at=6.0,
        )
    )
    entry = t.jobs["j1"]
    assert (entry.state, entry.attempt, entry.resume_step, entry.reason) == ("resuming", 2, 2, None)
    assert entry.stage_nodes == ("a", "c")
    t = log(ev.StepsReported(job_id="j1", attempt=2, step=3, loss=1.0, at=7.0))
    assert t.jobs["j1"].state == "running"  # the first step of the new attempt


def test_a_rebalanced_job_says_why_in_its_history_and_keeps_the_speeds_it_measured():
    log = running()
    speeds = {"a": {"cpu:0": 1.5e10}, "b": {"cpu:0": 4.5e10}}
    why = "stage 0 ran 1.8x its predicted time for 20 steps: cuts [2] from [3]"
    t = log(
        ev.JobRebalanced(job_id="j1", attempt=1, reason=why, dtype="float32", speeds=speeds, at=5.0)
    )
    entry = t.jobs["j1"]
    assert (entry.state, entry.reason, entry.rebalances) == ("resuming", why, 1)
    assert entry.learned == speeds and entry.learned_dtype == "float32"
    assert (entry.history[-1].state, entry.history[-1].reason) == ("resuming", why)
    t = log(
        ev.JobPlaced(
            job_id="j1",
            attempt=2,
            plan=plan(),
            cluster=tuple(cluster("a", "b")),
            resume_step=4,
            placed_by="a",
            at=6.0,
        )
    )
    assert t.jobs["j1"].learned == speeds and t.jobs["j1"].rebalances == 1  # kept: later plans
    with pytest.raises(ValueError, match="only a running job is re-balanced"):
        log(ev.JobRebalanced(job_id="j1", attempt=2, reason="", dtype="float32", speeds={}, at=7.0))
    with pytest.raises(ValueError, match="the current one is 2"):
        log(ev.JobRebalanced(job_id="j1", attempt=1, reason="", dtype="float32", speeds={}, at=7.0))
    assert JobTable.from_dict(t.to_dict()) == t  # persisted and replicated as it is


def test_a_blocked_job_waits_with_its_reason_and_a_failure_is_kept():
    log = founded("a")
    log(ev.JobSubmitted(job_id="j1", job=job(), submitted_by="cli", at=1.0))
    t = log(ev.JobPending(job_id="j1", reason="placed 0 of 2 required workers", at=2.0))
    assert t.jobs["j1"].state == "pending" and t.jobs["j1"].reason.startswith("placed 0")
    t = log(
        ev.JobFailed(
            job_id="j1",
            attempt=0,
            stage=-1,
            node_id="a",
            message="no model",
            stderr_tail=("x",),
            at=3.0,
        )
    )
    assert t.jobs["j1"].state == "failed" and t.jobs["j1"].error.message == "no model"


def test_members_join_and_leave():
    log = founded("b", "a")
    assert [m.node_id for m in log.table.members] == ["a", "b"] and log.table.majority() == 2
    t = log(ev.MemberJoined(node_id="c", key=key("c")))
    assert t.majority() == 2 and t.member_ids == {"a", "b", "c"}
    assert t.member("c").key == key("c")
    t = log(ev.MemberLeft(node_id="a", reason="stopped"))
    # stopped cleanly: still listed with its key (nobody else takes the id), no longer a voter
    assert t.member_ids == {"a", "b", "c"} and t.voters == {"b", "c"} and not t.revoked
    assert t.member("a").down and t.majority() == 2
    with pytest.raises(ValueError, match="another key"):
        log(ev.MemberJoined(node_id="a", key=key("x")))  # a squatter under its id
    with pytest.raises(ValueError, match="down already"):
        log(ev.MemberLeft(node_id="a"))
    t = log(ev.MemberJoined(node_id="a", key=key("a")))  # its own key: it counts again
    assert t.voters == {"a", "b", "c"} and not t.member("a").down
    with pytest.raises(ValueError, match="a member already"):
        log(ev.MemberJoined(node_id="a", key=key("a")))


def test_a_removed_member_is_revoked_and_its_key_never_listed_again():
    log = founded("a", "b", "c")
    t = log(ev.MemberRemoved(node_id="c", key=key("c"), reason="stolen laptop"))
    assert t.member_ids == {"a", "b"} and t.revoked == (key("c"),)
    with pytest.raises(ValueError, match="revoked"):
        log(ev.MemberJoined(node_id="c", key=key("c")))
    with pytest.raises(ValueError, match="revoked"):
        log(ev.MemberJoined(node_id="d", key=key("c")))  # under another id neither
    with pytest.raises(ValueError, match="removed already"):
        log(ev.MemberRemoved(node_id="c", key=key("c")))
    with pytest.raises(ValueError, match="free again only after"):
        log(ev.MemberJoined(node_id="c", key=key("c2")))  # its id, under a new key: not yet
    t = log(ev.AdmissionChanged(swarm_id="0123456789abcdef", key=key("new-secret")))
    assert t.removed == () and t.revoked == (key("c"),)  # rotated: the id is free, the key not
    t = log(ev.MemberJoined(node_id="c", key=key("c2")))
    assert t.member("c").key == key("c2")
    with pytest.raises(ValueError, match="is not"):
        log(ev.MemberRemoved(node_id="b", key=key("a")))  # b's key is b's
    with pytest.raises(ValueError, match="member a's"):
        log(ev.MemberJoined(node_id="e", key=key("a")))  # one key, one node
    t = log(ev.MemberRemoved(node_id="x", key=key("x")))  # joined, never listed: revoked too
    assert t.revoked == (key("c"), key("x"))


def test_the_admission_key_follows_the_secret():
    from swarmp2p.net.security import SwarmSecret

    first, second = SwarmSecret.generate(), SwarmSecret.generate()
    log = founded("a")
    t = log(ev.AdmissionChanged(swarm_id=first.swarm_id, key=first.admission_key))
    assert (t.swarm_id, t.admission) == (first.swarm_id, first.admission_key)
    t = log(ev.AdmissionChanged(swarm_id=second.swarm_id, key=second.admission_key))
    assert t.admission == second.admission_key


def test_snapshots_keep_the_newest_four_per_stage():
    log = running()
    for step in (2, 4, 6, 8, 10):
        log(ev.SnapshotHeld(job_id="j1", stage=1, step=step, node_id="b"))
    assert sorted(log.table.jobs["j1"].snapshots["1"], key=int) == ["4", "6", "8", "10"]


def test_a_model_registers_once_under_a_free_id_and_lists_its_copies():
    log = running()
    log(
        ev.StageFinished(job_id="j1", attempt=1, stage=0, at=5.0),
        ev.StageFinished(job_id="j1", attempt=1, stage=1, at=5.0),
    )
    model = {
        "id": "t",
        "job_id": "j1",
        "manifest": {"stages": [{"stage": 0, "node": "a"}, {"stage": 1, "node": "b"}]},
    }
    t = log(ev.ModelRegistered(job_id="j1", model=model))
    t = log(ev.ShardCopied(job_id="j1", stage=1, node_id="c"))
    assert t.jobs["j1"].model["manifest"]["stages"][1]["copies"] == ["c"]


def _after(log: Log, *events):
    return lambda: log(*events)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda log: log(ev.JobSubmitted(job_id="j1", job=job(), submitted_by="x", at=0.0)),
            "already in the table",
        ),
        (
            lambda log: log(ev.JobRunning(job_id="zz", attempt=1, at=0.0)),
            "'zz' is not in the table",
        ),
        (lambda log: log(ev.JobRunning(job_id="j1", attempt=2, at=0.0)), "the current one is 1"),
        (
            lambda log: log(ev.StepsReported(job_id="j1", attempt=3, step=1, at=0.0)),
            "the current one is 1",
        ),
        (
            lambda log: log(
                ev.JobPlaced(job_id="j1", attempt=3, plan=plan(), cluster=(), placed_by="a", at=0.0)
            ),
            "does not follow 1",
        ),
        (
            lambda log: log(
                ev.JobCancelled(job_id="j1", reason="", at=0.0),
                ev.JobFailed(job_id="j1", attempt=1, stage=0, node_id="a", message="m", at=0.0),
            ),
            "cancelled; it cannot fail",
        ),
        (
            lambda log: log(ev.ModelRegistered(job_id="j1", model={"id": "t"})),
            "only a completed job",
        ),
        (lambda log: log(ev.MemberJoined(node_id="a", key=key("a"))), "a member already"),
        (lambda log: log(ev.MemberLeft(node_id="zz")), "not a member"),
        (lambda log: log(ev.ShardCopied(job_id="j1", stage=0, node_id="c")), "registered no model"),
    ],
)
def test_events_that_do_not_follow_are_refused(make, message):
    log = running()
    with pytest.raises(ValueError, match=message):
        make(log)


def test_versions_and_terms_must_follow():
    t = running().table
    event = ev.JobCancelled(job_id="j1", reason="", at=0.0)
    with pytest.raises(ValueError, match="does not follow table version"):
        apply(t, ev.Entry(version=t.version + 2, term=1, event=event))
    with pytest.raises(ValueError, match="of term 1 after term 2"):
        apply(replace(t, term=2), ev.Entry(version=t.version + 1, term=1, event=event))
    with pytest.raises(SchemaError, match="version"):
        ev.entry_from_data({"version": 2**64 - 1, "term": 1, "event": ev.event_to_data(event)})


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"event": "job_cancelled", "job_id": "..", "reason": "", "at": 0.0}, "job_id"),
        ({"event": "job_cancelled", "job_id": "j1", "reason": "", "at": float("nan")}, "at"),
        (
            {"event": "snapshot_held", "job_id": "j1", "stage": 0, "step": 1, "node_id": "b\n"},
            "node_id",
        ),
        ({"event": "nope"}, ""),
    ],
)
def test_events_from_the_wire_are_validated(data, path):
    with pytest.raises(SchemaError) as info:
        ev.event_from_data(data)
    assert any(e.path == path for e in info.value.errors) or not path


def test_save_load_roundtrip_and_corruption(tmp_path):
    t = running().table
    path = tmp_path / "jobs.json"
    save(path, t)
    assert load(path) == t
    assert load(tmp_path / "none.json") == JobTable()
    text = path.read_text()
    path.write_text(text.replace("running", "runnin", 1))
    with pytest.raises(ValueError, match="fails its sha256 checksum"):
        load(path)
    path.write_text("{nope")
    with pytest.raises(ValueError, match="not a saved table"):
        load(path)


@pytest.mark.parametrize("old", [1, 2])
def test_an_older_format_is_kept_aside_not_lost(tmp_path, old):
    """Format 2 listed members without keys: such a node joins its swarm again (issue 15)."""
    import hashlib

    path = tmp_path / "jobs.json"
    members = [{"node_id": "a", "name": "a"}]
    body = json.dumps(
        {"format": old, "term": 3, "version": 9, "leader": "a", "jobs": {}, "members": members}
    )
    path.write_text(
        json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "table": body})
    )
    assert load(path) == JobTable()
    assert (tmp_path / f"jobs.json.format-{old}").read_text().count(f'"format\\": {old}') == 1
    assert not path.exists()


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "jobs.json"
    save(path, founded("a").table)
    old = path.read_text()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        save(path, running().table)
    assert path.read_text() == old
