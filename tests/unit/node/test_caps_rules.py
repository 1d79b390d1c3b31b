"""Caps with clear refusals (issue 24, item 5): unfinished jobs per swarm and per submitting
node, waiting jobs planned again only when their inputs change, and every pulled file sized
before a byte is written. Pure parts, and pulls through an in-memory reader."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from swarmp2p.timings import TIMINGS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import founded, job, running

from swarmp2p.errors import UserError
from swarmp2p.node import decide
from swarmp2p.node.records import NodeRecord
from swarmp2p.node.serving import model_files
from swarmp2p.node.table import events as ev
from swarmp2p.node.training.stages import SNAPSHOT_SLACK, listed_snapshot, snapshot_limit


def _submitted(log, job_id, by):
    log(ev.JobSubmitted(job_id=job_id, job=job(), submitted_by=by, at=1.0))


def test_submitted_by_names_the_authenticated_node_whatever_the_client_says():
    assert decide.submitted_by("cli", "m1") == "cli@m1"
    assert decide.submitted_by("", "m1") == "cli@m1"
    assert decide.submitted_by("me@victim", "m1") == "mevictim@m1"  # no "@" of its own
    assert decide.submitter_of("cli@m1") == "m1"
    assert decide.submitter_of("cli") == ""  # recorded by an older leader


def test_the_per_node_cap_counts_only_that_nodes_unfinished_jobs():
    log = founded("a", "b")
    for i in range(3):
        _submitted(log, f"m{i}", "cli@mallory")
    _submitted(log, "b0", "cli@b")
    assert decide.waiting_refusal(log.table, "b", per_swarm=10, per_node=3) == ""
    why = decide.waiting_refusal(log.table, "mallory", per_swarm=10, per_node=3)
    assert "node mallory already has 3 unfinished jobs" in why
    assert "--max-waiting-per-node" in why and "swarm jobs cancel" in why
    log(ev.JobCancelled(job_id="m0", reason="x", at=2.0))  # a finished job no longer counts
    assert decide.waiting_refusal(log.table, "mallory", per_swarm=10, per_node=3) == ""


def test_the_swarm_cap_counts_every_unfinished_job():
    log = running()  # j1 runs: unfinished too
    _submitted(log, "m0", "cli@mallory")
    why = decide.waiting_refusal(log.table, "c", per_swarm=2, per_node=10)
    assert why.startswith("the swarm already holds 2 unfinished jobs, its cap of 2")
    assert "--max-waiting-jobs" in why
    assert decide.waiting_refusal(log.table, "c", per_swarm=3, per_node=10) == ""


def _records(free_gib: float, disk_gib: float = 100):
    cpu = {"kind": "cpu", "index": 0, "name": "cpu", "memory_total": 64 * 2**30}
    node = {
        "node_id": "a",
        "name": "a",
        "ram": 64 * 2**30,
        "disk_free": int(disk_gib * 2**30),
        "devices": [{**cpu, "memory_free": int(free_gib * 2**30)}],
    }
    return [NodeRecord.from_data(node, "")]


def test_a_blocked_job_is_planned_again_only_when_its_inputs_change_or_in_time():
    log = founded("a")
    _submitted(log, "j1", "cli@a")
    entry = log.table.jobs["j1"]
    inputs = decide.placement_inputs(entry, {"a"}, _records(4.0))
    assert decide.plan_again(None, inputs, 0.0)
    last = (inputs, 100.0)
    # free memory wobbling within its GiB: the same inputs
    assert decide.placement_inputs(entry, {"a"}, _records(4.3)) == inputs
    assert not decide.plan_again(last, inputs, 100.0 + TIMINGS.plan_again_s - 1)
    assert decide.plan_again(last, inputs, 100.0 + TIMINGS.plan_again_s)
    for changed in (
        decide.placement_inputs(entry, {"a"}, _records(5.0)),  # a GiB more free
        decide.placement_inputs(entry, {"a", "b"}, _records(4.0)),  # a node came
        decide.placement_inputs(entry, {"a"}, _records(4.0, disk_gib=1)),
    ):
        assert changed != inputs and decide.plan_again(last, changed, 101.0)
    log(ev.JobPending(job_id="j1", reason="no room", at=2.0))  # the job itself changed
    assert decide.placement_inputs(log.table.jobs["j1"], {"a"}, _records(4.0)) != inputs


@pytest.mark.parametrize(
    ("total", "kw", "message"),
    [
        (2**30, {"size": 1000}, "offers 1073741824 bytes, but the table lists 1000"),
        (2**30, {"limit": 2**20}, "over the 1048576 bytes such a file may have"),
        (2**30, {"room": 2**29}, "do not fit the 536870912 bytes free"),
        (-1, {}, "reports a size of -1 bytes"),
    ],
)
def test_check_size_refuses_with_what_is_wrong(total, kw, message):
    args = {"size": None, "limit": None, "room": 2**40, **kw}
    with pytest.raises(ValueError, match=message):
        model_files.check_size("f.bin", total, **args)


def test_check_size_counts_only_the_bytes_still_missing():
    model_files.check_size("f", 100, size=100, limit=None, room=10, have=95)


def _offering(total: int, asked: list):
    async def read(file, offset, size):
        asked.append((file, offset, size))
        return b"x" * min(size, total - offset), total

    return read


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"sha256": "0" * 64, "size": 4096}, "the table lists 4096"),
        ({"sha256": None}, "over the 16777216 bytes"),  # nothing listed: a small file's cap
        ({"sha256": None, "limit": 1 << 20}, "over the 1048576 bytes"),
    ],
)
def test_a_pull_of_the_wrong_size_writes_nothing(tmp_path, kw, message):
    dest = tmp_path / "jobs" / "j1" / "f.bin"
    asked: list = []
    sha = kw.pop("sha256")
    with pytest.raises(ValueError, match=message):
        asyncio.run(
            model_files.pull_file(_offering(2**30, asked), "f.bin", dest, sha, 1 << 20, **kw)
        )
    assert len(asked) == 1  # the first chunk only: its total is the offer
    assert not (tmp_path / "jobs").exists()


def test_a_pull_past_the_free_disk_writes_nothing(tmp_path):
    room = model_files.disk_room(tmp_path)
    dest = tmp_path / "new" / "f.bin"
    with pytest.raises(ValueError, match="do not fit"):
        asyncio.run(
            model_files.pull_file(
                _offering(room + 1, []), "f.bin", dest, None, 1 << 20, limit=room * 2
            )
        )
    assert not dest.parent.exists()


def test_a_source_that_changes_size_midway_leaves_no_file(tmp_path):
    sizes = iter([3 << 20, 3 << 20, 5 << 20])

    async def read(file, offset, size):
        return b"x" * size, next(sizes)

    dest = tmp_path / "f.bin"
    with pytest.raises(ValueError, match="changed size"):
        asyncio.run(model_files.pull_file(read, "f.bin", dest, None, 1 << 20, limit=8 << 20))
    assert list(tmp_path.iterdir()) == []


def test_a_pull_of_the_listed_size_arrives(tmp_path):
    dest = tmp_path / "d" / "f.bin"
    asyncio.run(
        model_files.pull_file(_offering(3 << 20, []), "f.bin", dest, None, 1 << 20, size=3 << 20)
    )
    assert dest.stat().st_size == 3 << 20


SNAP = "snapshots/cuts-3/stage-1/step-00000020.pt"


def test_a_file_pull_must_name_a_snapshot_the_table_lists():
    log = running()
    with pytest.raises(UserError, match="no job 'ghost' in the table") as info:
        listed_snapshot(log.table, "ghost", SNAP)
    assert info.value.code == "no_job"
    with pytest.raises(UserError, match="is not a snapshot of job j1") as info:
        listed_snapshot(log.table, "j1", "stage-0.log")
    assert info.value.code == "bad_field"
    with pytest.raises(UserError, match="lists no snapshot of stage 1 at step 20") as info:
        listed_snapshot(log.table, "j1", SNAP)
    assert info.value.code == "not_listed"
    log(ev.SnapshotHeld(job_id="j1", stage=1, step=20, node_id="b"))
    plan = log.table.jobs["j1"].plan
    assert listed_snapshot(log.table, "j1", SNAP) == snapshot_limit(plan)
    parts = sum(s.memory.weights + s.memory.trainable_state for s in plan.stages)
    assert snapshot_limit(plan) == parts + SNAPSHOT_SLACK
