"""Replicas on the daemon side (issue 29): the messages, table events and records name the
replica, a one-replica job's bytes stay as they were, the job completes when every replica's
stages are done, other replicas' reports make no progress of their own, metrics per replica,
and a report is accepted only from the node the replica's stage runs on."""

from __future__ import annotations

import msgpack
import pytest
from _tables import SHAPE, cluster, founded, job, key, running

from swarmp2p.node import decide, views
from swarmp2p.node.cluster import authz
from swarmp2p.node.messages import StageReady, StageReport, StageStart
from swarmp2p.node.table import events as ev
from swarmp2p.node.table import jobtable
from swarmp2p.node.training import jobs
from swarmp2p.node.training.launch import slots
from swarmp2p.node.training.metrics import MetricsStore
from swarmp2p.plan import CAPABILITIES, Plan
from swarmp2p.plan.placer import REPLICAS_CAPABILITY
from swarmp2p.wire.messages import decode, encode
from swarmp2p.workers.events import Done, Exited, SnapshotSaved, StepDone

NODES = ("a", "b", "c", "d")
CAPS = CAPABILITIES | {REPLICAS_CAPABILITY}


def _replicated(nodes=NODES):
    import dataclasses

    base = job(sync={"mode": "step"})
    the_job = dataclasses.replace(base, split=dataclasses.replace(base.split, replicas=2))
    records = [dataclasses.replace(n, capabilities=CAPS) for n in cluster(*nodes)]
    plan = jobs.compute_plan(the_job, records, shape=SHAPE, capabilities=CAPS)
    assert isinstance(plan, Plan) and plan.n_replicas == 2, plan
    return the_job, plan, records


def _placed():
    the_job, plan, records = _replicated()
    log = founded(*NODES)
    log(
        ev.JobSubmitted(job_id="j1", job=the_job, submitted_by="cli", at=1.0),
        ev.JobPlaced(
            job_id="j1", attempt=1, plan=plan, cluster=tuple(records), placed_by="a", at=2.0
        ),
        ev.JobRunning(job_id="j1", attempt=1, at=3.0),
    )
    return log, plan


def test_one_replica_messages_and_events_keep_their_bytes_and_replicas_travel():
    body = {"node_id": "b", "job_id": "j1", "attempt": 1, "stage": 1, "events": []}
    one = msgpack.unpackb(encode(StageReport(**body)))
    assert set(one) == {"v", "t", "id", *body}  # no replica key at all
    two = StageReport(**body, replica=1)
    assert msgpack.unpackb(encode(two))["replica"] == 1 and decode(encode(two)) == two
    ready = StageReady(job_id="j1", attempt=1, stage=0, host="h", port=0)
    assert set(msgpack.unpackb(encode(ready))) == {"v", "t", "id", "job_id", "attempt", "stage",
                                                   "host", "port"}  # fmt: skip
    ringed = StageReady(job_id="j1", attempt=1, stage=0, host="h", port=0, ring_next_port=7)
    assert decode(encode(ringed)).ring_next_port == 7
    done = ev.StageFinished(job_id="j1", attempt=1, stage=1, at=5.0)
    assert ev.event_to_data(done) == {
        "event": "stage_finished",
        "job_id": "j1",
        "attempt": 1,
        "stage": 1,
        "at": 5.0,
    }
    other = ev.StageFinished(job_id="j1", attempt=1, stage=1, at=5.0, replica=1)
    assert ev.event_from_data(ev.event_to_data(other)) == other


def test_a_replicated_job_completes_when_every_replicas_last_stage_is_done():
    log, _ = _placed()
    assert set(log.table.jobs["j1"].stage_nodes) == set(NODES)
    for r, i in [(0, 0), (0, 1), (1, 1)]:
        log(ev.StageFinished(job_id="j1", attempt=1, stage=i, at=6.0, replica=r))
        assert log.table.jobs["j1"].state == "running"
    with pytest.raises(ValueError, match="no stage 0 of replica 2"):
        log(ev.StageFinished(job_id="j1", attempt=1, stage=0, at=6.0, replica=2))
    log(ev.StageFinished(job_id="j1", attempt=1, stage=0, at=7.0, replica=1))
    entry = log.table.jobs["j1"]
    assert entry.state == "completed" and entry.done_stages == (0, 1, 2, 3)


def test_a_one_replica_job_completes_as_before():
    log = running("j1", ("a", "b"))
    log(ev.StageFinished(job_id="j1", attempt=1, stage=1, at=6.0))
    log(ev.StageFinished(job_id="j1", attempt=1, stage=0, at=6.0))
    entry = log.table.jobs["j1"]
    assert entry.state == "completed" and entry.done_stages == (0, 1)
    assert '"replica":' not in jobtable.encode(log.table)  # the table JSON of before


def _step(step, **kw):
    base = {"loss": 2.0, "tokens": 64, "tokens_per_s": 100.0, "act_bytes": 0, "grad_bytes": 0,
            "step_s": 0.5, "peak_memory_bytes": 0}  # fmt: skip
    return StepDone(step=step, **{**base, **kw})


def test_another_replicas_report_makes_only_its_ends_not_progress_or_snapshots():
    log, _ = _placed()
    entry = log.table.jobs["j1"]
    reported = [
        _step(9),
        SnapshotSaved(step=10, path="/x"),
        Done(steps=10),
        Exited(code=0, stderr_tail=()),
    ]
    got = decide.fold_report(entry, attempt=1, stage=1, node_id="d", events=reported, now=8.0,
                             progress_due=True, replica=1)  # fmt: skip
    assert got == [ev.StageFinished(job_id="j1", attempt=1, stage=1, at=8.0, replica=1)]
    mine = decide.fold_report(entry, attempt=1, stage=1, node_id="b", events=reported, now=8.0,
                              progress_due=True)  # fmt: skip
    assert [type(e) for e in mine] == [ev.SnapshotHeld, ev.StepsReported, ev.StageFinished]
    failed = decide.fold_report(entry, attempt=1, stage=0, node_id="c", now=8.0,
                                events=[Exited(code=1, stderr_tail=("boom",), error="ring")],
                                progress_due=False, replica=1)  # fmt: skip
    assert len(failed) == 1 and failed[0].message.startswith("replica 1: ring")


def test_reports_are_taken_only_from_the_node_the_replicas_stage_runs_on():
    log, plan = _placed()
    owner = plan.replica_stages(1)[0].node_id
    other = plan.stages[0].node_id
    for who, replica, ok in [(owner, 1, True), (other, 1, False), (other, 0, True),
                             (owner, 0, False), (owner, 2, False)]:  # fmt: skip
        msg = StageReport(node_id=who, job_id="j1", attempt=1, stage=0, events=[], replica=replica)
        why = authz.refusal(msg, authz.Sender(node_id=who, member=True), log.table, "a")
        assert (why == "") == ok, (who, replica, why)


def test_metrics_and_the_job_view_list_every_replica_with_its_tokens_and_sync():
    log, plan = _placed()
    store = MetricsStore()
    for r, rate in ((0, 100.0), (1, 80.0)):
        for i in (0, 1):
            store.fold("j1", attempt=1, stage=i, n_stages=2, replica=r, n_replicas=2,
                       events=[_step(0, tokens_per_s=rate, sync_bytes=1000 + i, sync_s=0.01)])  # fmt: skip
    metrics = store.get("j1")
    assert metrics["tokens_per_s"] == 180.0  # the replicas together
    assert metrics["stages"]["1"]["sync_bytes"] == 1001  # replica 0's, as one pipeline's
    assert metrics["replicas"]["1"]["stages"]["0"]["sync_bytes"] == 1000
    log(ev.StageFinished(job_id="j1", attempt=1, stage=1, at=6.0, replica=1))
    view = views.job_view(log.table.jobs["j1"], metrics)
    replicas = view["plan"]["replicas"]
    assert [r["replica"] for r in replicas] == [0, 1] and view["plan"]["sync"]["mode"] == "step"
    assert [r["tokens_per_s"] for r in replicas] == [100.0, 80.0]
    assert [s["node"] for s in replicas[1]["stages"]] == [s.node_id for s in plan.replica_stages(1)]
    assert [s["done"] for r in replicas for s in r["stages"]] == [False, False, False, True]
    one = views.job_view(running("j2", ("a", "b")).table.jobs["j2"], {})
    assert "replicas" not in one["plan"] and "sync" not in one["plan"]


def test_the_leader_starts_replica_0_first_and_each_replica_last_stage_first():
    log, plan = _placed()
    order = slots(log.table.jobs["j1"])
    assert [(r, i) for r, i, _ in order] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [n for *_, n in order] == [s.node_id for r in range(2) for s in plan.replica_stages(r)]


def test_a_stage_start_carries_the_replica_and_its_ring_ends():
    log, plan = _placed()
    entry = log.table.jobs["j1"]
    msg = StageStart(job_id="j1", attempt=1, stage=0, job=entry.job, cluster=entry.cluster,
                     plan=plan, next="tcp://h:1", resume_step=0, snapshot_nodes=[], leader="a",
                     replica=1, ring_next="tcp://h:2", ring_prev="tcp://h:3")  # fmt: skip
    assert decode(encode(msg)) == msg
    zero = StageStart(job_id="j1", attempt=1, stage=0, job=entry.job, cluster=entry.cluster,
                      plan=plan, next="", resume_step=0, snapshot_nodes=[], leader="a")  # fmt: skip
    assert not {"replica", "ring_next", "ring_prev"} & set(msgpack.unpackb(encode(zero)))
    assert key("a")  # the members' keys the ring is admitted with are the table's


def test_swarm_train_and_jobs_show_print_every_replicas_stages():
    import io

    from rich.console import Console

    from swarmp2p.cli._jobs import _print_replicas, plan_table

    log, plan = _placed()
    store = MetricsStore()
    for r in (0, 1):
        for i in (0, 1):
            store.fold("j1", attempt=1, stage=i, n_stages=2, replica=r, n_replicas=2,
                       events=[_step(0, sync_bytes=4096, sync_s=0.02)])  # fmt: skip
    log(ev.StageFinished(job_id="j1", attempt=1, stage=0, at=6.0, replica=1))
    view = views.job_view(log.table.jobs["j1"], store.get("j1"))
    out = io.StringIO()
    console = Console(file=out, width=120, color_system=None)
    console.print(plan_table(view))
    _print_replicas(console, view["plan"])
    text = out.getvalue()
    assert "2 replicas" in text and "1 (replica 1)" in text, text
    assert "2 replicas, synced step" in text and "replica 1: step 1, 100 tok/s" in text, text
    assert text.count("sync 4096 B in 0.02 s") == 4 and text.count("(done)") == 1, text
    node = plan.replica_stages(1)[0].node_id
    assert f"stage 0 on {node}" in text, text
