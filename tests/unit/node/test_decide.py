"""The leader's and every node's decisions: pure functions of the table and a view."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import cluster, founded, job, key, plan, records, running

from swarmp2p.node import decide
from swarmp2p.node.records import NO_HELD, Held, MemoryReport
from swarmp2p.node.table import events as ev
from swarmp2p.plan import Blocked
from swarmp2p.plan.hardware import Speeds
from swarmp2p.schema import to_data
from swarmp2p.workers.events import decode, encode


def view(*alive, me="a", busy=()):
    return decide.LeaderView(
        node_id=me,
        alive=frozenset(alive),
        names={n: f"host-{n}" for n in alive},
        busy=frozenset(busy),
        keys={n: key(n) for n in alive},
    )


def _kinds(actions):
    return [(type(a).__name__, getattr(a, "job_id", getattr(a, "node_id", None))) for a in actions]


@pytest.mark.parametrize(
    ("alive", "busy", "expected"),
    [
        (("a", "b"), (), []),
        (("a", "b", "c"), (), [("MemberJoined", "c")]),
        (("a",), (), [("Recover", "j1")]),  # b, a stage node, is lost
        (("a",), ("j1",), []),  # a task already works on it
    ],
)
def test_leader_actions_for_a_running_job(alive, busy, expected):
    assert _kinds(decide.leader_actions(running().table, view(*alive, busy=busy))) == expected


def test_a_recover_names_the_lost_nodes_and_a_pending_job_is_placed():
    log = running()
    (recover,) = decide.leader_actions(log.table, view("a"))
    assert recover.lost == ("b",)
    log(ev.JobSubmitted(job_id="j2", job=job("u"), submitted_by="cli", at=1.0))
    assert _kinds(decide.leader_actions(log.table, view("a", "b"))) == [("Place", "j2")]


def test_a_job_placed_by_a_dead_leader_is_wired_again():
    log = founded("a", "b")
    log(
        ev.JobSubmitted(job_id="j1", job=job(), submitted_by="cli", at=1.0),
        ev.JobPlaced(
            job_id="j1",
            attempt=1,
            plan=plan(),
            cluster=tuple(cluster("a", "b")),
            placed_by="z",
            at=2.0,
        ),
    )
    (action,) = decide.leader_actions(log.table, view("a", "b"))
    assert isinstance(action, decide.Recover) and action.lost == ()


def test_a_completed_job_is_registered_once():
    log = running()
    log(
        ev.StageFinished(job_id="j1", attempt=1, stage=0, at=5.0),
        ev.StageFinished(job_id="j1", attempt=1, stage=1, at=5.0),
    )
    assert _kinds(decide.leader_actions(log.table, view("a", "b"))) == [("Register", "j1")]
    (event,) = decide.registration(log.table, "j1")
    assert event.model["id"] == "t" and event.model["manifest"]["split"] == [[0, 3], [3, 6]]
    log(event)
    assert decide.leader_actions(log.table, view("a", "b")) == []
    log(ev.JobSubmitted(job_id="j2", job=job("t"), submitted_by="cli", at=1.0))
    assert decide.registration(log.table, "j2") == []  # not completed


def test_placement_waits_once_per_reason_then_places_a_new_attempt():
    log = founded("a")
    log(ev.JobSubmitted(job_id="j1", job=job(), submitted_by="cli", at=1.0))
    blocked = Blocked(reason="placed 1 of 2 required workers")
    args = dict(cluster=cluster("a"), records=records("a"), alive={"a"}, me="a", now=2.0)
    (wait,) = decide.placement(log.table.jobs["j1"], blocked, **args)
    assert isinstance(wait, ev.JobPending) and wait.reason == blocked.reason
    log(wait)
    assert decide.placement(log.table.jobs["j1"], blocked, **args) == []  # said already
    (placed,) = decide.placement(log.table.jobs["j1"], plan(), **args)
    assert isinstance(placed, ev.JobPlaced) and placed.attempt == 1 and placed.resume_step == 0


def _with_cuts(p):
    """``p`` with stage 0 on blocks 0-1 and stage 1 on 2-5 (other cuts than the plan's)."""
    from dataclasses import replace

    stages = list(p.stages)
    stages[0] = replace(stages[0], layers=(0, 2))
    stages[1] = replace(stages[1], layers=(2, 6))
    return replace(p, stages=tuple(stages[:2]), boundaries=p.boundaries[:1])


def _snapshots(log, step=4, holders=("a",)):
    for stage in (0, 1):
        for node in holders:
            log(ev.SnapshotHeld(job_id="j1", stage=stage, step=step, node_id=node))


def test_a_lost_job_is_planned_on_its_snapshots_cuts_first_then_re_split():
    log = running()
    assert decide.plan_tries(log.table.jobs["j1"], {"a", "b"}) == [
        decide.PlanTry(),
        decide.PlanTry(any_count=True),
    ]  # no snapshot: from the job
    _snapshots(log)
    entry = log.table.jobs["j1"]
    step, layout = decide.snapshot_layout(entry, {"a", "c"})
    assert step == 4 and [r.layers for r in layout] == [(0, 3), (3, 6)]
    assert [r.nodes for r in layout] == [("a",), ("a",)]
    assert decide.plan_tries(entry, {"a", "c"}) == [
        decide.PlanTry(cuts=(3,)),
        decide.PlanTry(),
        decide.PlanTry(any_count=True),
    ]
    assert decide.snapshot_layout(entry, {"b", "c"}) == (0, ())  # no live holder


def test_a_resume_on_the_same_cuts_reads_its_snapshots_and_other_cuts_re_slice_them():
    log = running()
    _snapshots(log)
    args = dict(
        cluster=cluster("a", "c"), records=records("a", "c"), alive={"a", "c"}, me="a", now=9.0
    )
    (placed,) = decide.placement(
        log.table.jobs["j1"], plan(("a", "c")), **args, tried=decide.PlanTry(cuts=(3,))
    )
    assert (placed.resume_step, placed.attempt, placed.resplit, placed.cuts) == (4, 2, (), (3,))
    (other,) = decide.placement(log.table.jobs["j1"], _with_cuts(plan(("a", "c"))), **args)
    assert other.resume_step == 4 and other.cuts == ()
    assert other.resplit == (
        ev.SnapshotSlice(stage=0, layers=(0, 3), nodes=("a",)),
        ev.SnapshotSlice(stage=1, layers=(3, 6), nodes=("a",)),
    )
    assert to_data(other)["resplit"][1] == {"stage": 1, "layers": [3, 6], "nodes": ["a"]}
    log(other)  # the re-split attempt forgets the old cuts' snapshots, keeps where they are
    entry = log.table.jobs["j1"]
    assert entry.snapshots == {} and entry.resplit == other.resplit
    assert decide.snapshot_layout(entry, {"a", "c"}) == (4, other.resplit)  # lost again: same


def test_a_learned_boundary_resumes_only_on_its_cuts_and_says_why_it_waits():
    from swarmp2p.plan import parse_job
    from swarmp2p.schema import to_data

    data = to_data(job())
    data["split"]["compression"] = {"method": "learned_bottleneck", "learned_dim": 16}
    learned = parse_job(data)
    log = running(the_job=learned)
    _snapshots(log)
    entry = log.table.jobs["j1"]
    assert decide.plan_tries(entry, {"a", "c"}) == [decide.PlanTry(cuts=(3,))]
    args = dict(cluster=cluster("a"), records=records("a"), alive={"a"}, me="a", now=9.0)
    (wait,) = decide.placement(entry, Blocked(reason="placed 1 of 2 required workers"), **args)
    assert "waiting for a node to return" in wait.reason and "learned boundary" in wait.reason


STEP = {
    "event": "step",
    "step": 3,
    "loss": 2.5,
    "tokens": 64,
    "tokens_per_s": 128.0,
    "act_bytes": 0,
    "grad_bytes": 0,
    "step_s": 0.5,
    "peak_memory_bytes": 0,
}
EVAL = {"event": "eval", "pass": "base", "loss": 3.0, "perplexity": 20.1, "top1": 0.1, "tokens": 8}


def _fold(log, stage, *events, attempt=1, due=False):
    return decide.fold_report(
        log.table.jobs["j1"],
        attempt=attempt,
        stage=stage,
        node_id="ab"[stage],
        events=[decode(e) for e in events],  # as the leader reads a report
        now=10.0,
        progress_due=due,
    )


def test_steps_make_a_progress_sample_only_when_due_or_at_the_end():
    log = running()
    assert _fold(log, 1, STEP) == []
    (sample,) = _fold(log, 1, STEP, due=True)
    assert (sample.step, sample.loss) == (4, 2.5)
    assert _fold(log, 0, STEP, due=True) == []  # the loss is the last stage's
    (last,) = _fold(log, 1, {**STEP, "step": 9})  # the last step is always written
    assert last.step == 10
    assert _fold(log, 1, STEP, attempt=2, due=True) == []  # another attempt's stage


def test_lifecycle_events_of_a_report():
    log = running()
    snap, evaluation, exported, done = _fold(
        log,
        1,
        {
            "event": "snapshot",
            "step": 2,
            "path": "/state/jobs/j1/snapshots/stage-1/step-00000002.pt",
            "file": "snapshots/stage-1/step-00000002.pt",
        },
        encode(dataclasses.replace(decode(EVAL), perplexity=float("inf")), 1),
        {"event": "exported", "manifest": "/m.json", "manifest_data": {"files": {}}},
        {"event": "done", "steps": 10},
    )
    assert isinstance(snap, ev.SnapshotHeld) and (snap.stage, snap.step, snap.node_id) == (
        1,
        2,
        "b",
    )
    assert evaluation.perplexity is None  # inf is no number to store: the wire writes null
    assert isinstance(exported, ev.StageExported) and isinstance(done, ev.StageFinished)
    assert _fold(log, 0, EVAL) == []  # the numbers are the last stage's


def test_a_failed_exit_names_the_stage_node_message_and_tail():
    log = running()
    (failed,) = _fold(
        log, 0, {"event": "exit", "code": -9, "stderr_tail": ["x"] * 100, "error": "boom"}
    )
    assert failed.message == "boom (killed by SIGKILL)" and failed.node_id == "a"
    assert len(failed.stderr_tail) == ev.MAX_TAIL_LINES
    assert _fold(log, 0, {"event": "exit", "code": 0}) == []


def test_stale_workers_are_those_of_an_ended_job_or_an_older_attempt():
    log = running()
    workers = [("j1", 1, 0), ("j1", 0, 0), ("j9", 1, 0)]
    assert decide.stale_workers(log.table, workers) == [("j1", 0, 0)]
    log(ev.JobCancelled(job_id="j1", reason="user", at=5.0))
    assert decide.stale_workers(log.table, workers) == [("j1", 1, 0), ("j1", 0, 0)]


def test_available_memory_leaves_out_other_jobs_stages_and_served_models():
    log = running()  # j1 on a and b
    ra, rb = records("a", "b")
    peak = log.table.jobs["j1"].plan.stages[0].memory.peak
    total = ra.node.devices[0].memory_total
    ra = ra.with_memory(MemoryReport(free={"cpu:0": total - 10}))  # live: a little in use
    rb = rb.with_memory(MemoryReport(held=Held(serve={"cpu:0": 1000}, jobs={"cpu:0": 5})))
    a, b = decide.available_memory([ra, rb], log.table)
    assert a.node.devices[0].memory_free == total - peak  # the smaller of live and promised
    stage1 = log.table.jobs["j1"].plan.stages[1].memory.peak
    assert b.node.devices[0].memory_free == total - stage1 - 1000
    assert b.held == NO_HELD  # promised: counted once
    a, _ = decide.available_memory([ra, rb], log.table, exclude="j1")  # re-placing j1 itself
    assert a.node.devices[0].memory_free == total - 10


# --- re-balancing to the speeds the run measured -----------------------------------------------


def _speed_job(**train):
    data = {
        "name": "s",
        "model": {"pretrained": "/models/tiny"},
        "data": {"source": "random"},
        "split": {"stages": 2},
        "train": {
            "steps": 100,
            "batch_size": 4,
            "seq_len": 16,
            "micro_batches": 2,
            "checkpoint_every": 10,
            **train,
        },
    }
    from swarmp2p.plan import parse_job

    return parse_job(data)


def _compute(entry, slow=(1.0, 1.0), steps=range(2, 22), attempt=1):
    """Each stage's compute per step: its predicted share times ``slow``."""
    predicted = [s.flops for s in entry.plan.timing.stages]
    unit = 0.5 / max(predicted)
    return {
        "attempt": attempt,
        "steps": {
            str(k): {str(i): p * unit * f for i, (p, f) in enumerate(zip(predicted, slow))}
            for k in steps
        },
    }


@pytest.mark.parametrize(
    ("slow", "steps", "due"),
    [
        ((1.0, 1.0), range(2, 22), False),  # as predicted
        ((2.0, 2.0), range(2, 22), False),  # uniformly slower: the split is still right
        ((1.2, 1.0), range(2, 22), False),  # within 25%
        ((1.5, 1.0), range(2, 22), True),  # stage 0 is off
        ((1.0, 1.6), range(2, 22), True),  # stage 1 is off
        ((1.5, 1.0), range(3, 22), False),  # 19 steps only
        ((1.5, 1.0), [*range(2, 12), *range(13, 23)], False),  # not in a row
    ],
)
def test_the_slowest_stage_off_its_prediction_for_20_steps_calls_for_a_rebalance(slow, steps, due):
    entry = running(the_job=_speed_job()).table.jobs["j1"]
    got = decide.rebalance_due(entry, _compute(entry, slow, steps))
    assert (got is not None) == due
    if due:
        slowest = max(range(2), key=lambda i: slow[i])
        assert got.stage == slowest and got.step == max(steps)
        assert got.ratio == pytest.approx(max(slow) / min(slow), rel=1e-3)
        predicted = [s.flops for s in entry.plan.timing.stages]
        learned = [got.speeds[st.node_id]["cpu:0"] for st in entry.plan.stages]
        # a stage's learned speed is its FLOPs over its measured seconds
        assert learned[0] / learned[1] == pytest.approx(slow[1] / slow[0], rel=1e-3)
        assert predicted[0] > 0 and got.dtype == entry.plan.dtype
        assert "stage" in got.reason([3], [2]) and "[2] instead of [3]" in got.reason([3], [2])


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"split": {"stages": 2, "mode": "equal"}}, "an explicit split is the user's"),
        (
            {
                "split": {
                    "stages": 2,
                    "compression": {"method": "learned_bottleneck", "learned_dim": 16},
                }
            },
            "a learned boundary was trained on these cuts",
        ),
        ({"train": {"checkpoint_every": 0}}, "no snapshot to resume from"),
        ({"train": {"steps": 30}}, "the next snapshot (30) is the end"),
    ],
)
def test_no_rebalance_where_it_cannot_or_must_not_happen(changes, why):
    from swarmp2p.plan import parse_job

    data = _speed_job().to_dict()
    for field, value in changes.items():
        data[field] = {**data[field], **value}
    entry = running(the_job=parse_job(data)).table.jobs["j1"]
    assert decide.rebalance_due(entry, _compute(entry, (2.0, 1.0))) is None, why


def test_no_rebalance_from_another_attempts_numbers_or_past_the_limit():
    log = running(the_job=_speed_job())
    entry = log.table.jobs["j1"]
    assert decide.rebalance_due(entry, _compute(entry, (2.0, 1.0), attempt=2)) is None
    assert decide.rebalance_due(entry, None) is None
    from dataclasses import replace

    spent = replace(entry, rebalances=decide.MAX_REBALANCES)
    assert decide.rebalance_due(spent, _compute(entry, (2.0, 1.0))) is None


def test_a_rebalance_waits_for_a_snapshot_taken_after_it_was_called_for():
    log = running(the_job=_speed_job())
    entry = log.table.jobs["j1"]
    due = decide.rebalance_due(entry, _compute(entry, (2.0, 1.0)))
    assert due is not None and due.step == 21
    for stage, node in ((0, "a"), (1, "b")):
        log(ev.SnapshotHeld(job_id="j1", stage=stage, step=20, node_id=node))
    assert decide.rebalance_step(log.table.jobs["j1"], due, {"a", "b"}) == 0  # older than 21
    log(ev.SnapshotHeld(job_id="j1", stage=0, step=30, node_id="a"))
    assert decide.rebalance_step(log.table.jobs["j1"], due, {"a", "b"}) == 0  # stage 1 has none
    log(ev.SnapshotHeld(job_id="j1", stage=1, step=30, node_id="b"))
    entry = log.table.jobs["j1"]
    assert decide.rebalance_step(entry, due, {"a", "b"}) == 30
    assert decide.rebalance_step(entry, due, {"a"}) == 0  # b's copy is on a dead node

    assert decide.rebalanced(entry, due, (3,), (3,), now=9.0) == []  # nothing would change
    (event,) = decide.rebalanced(entry, due, (3,), (2,), now=9.0)
    assert isinstance(event, ev.JobRebalanced) and event.speeds == due.speeds
    t = log(event)
    assert t.jobs["j1"].state == "resuming" and t.jobs["j1"].history[-1].reason == event.reason
    assert decide.rebalance_step(t.jobs["j1"], due, {"a", "b"}) == 0  # it moved on


def test_learned_speeds_replace_the_probes_on_the_devices_measured():
    a, b = cluster("a", "b")
    speed = Speeds.from_data({"float32": 1e12, "bfloat16": 2e12}, "speed")
    a = dataclasses.replace(a, devices=(dataclasses.replace(a.devices[0], speed=speed),))
    out = decide.with_learned_speeds([a, b], {"a": {"cpu:0": 3e9}}, "float32")
    assert out[0].devices[0].speed.to_data() == {"float32": 3e9, "bfloat16": 2e12}
    assert out[1].devices == b.devices
    assert a.devices[0].speed.get("float32") == 1e12  # a copy: records are frozen


def test_one_pause_is_no_rebalance_but_a_stage_throttled_now_and_then_is():
    entry = running(the_job=_speed_job()).table.jobs["j1"]
    paused = _compute(entry)
    paused["steps"]["10"]["0"] *= 10  # one collection, one neighbour's burst
    assert decide.rebalance_due(entry, paused) is None
    throttled = _compute(entry)
    for k in range(2, 22, 3):  # a CPU quota stalls it every third step
        throttled["steps"][str(k)]["0"] *= 3
    due = decide.rebalance_due(entry, throttled)
    assert due is not None and due.stage == 0 and due.ratio > 1.25
