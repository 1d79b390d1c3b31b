"""Training jobs as data: overrides, planning and the plan check, worker specs, progress."""

from __future__ import annotations

import dataclasses
import json

import pytest

from swarmp2p.node.records import NodeRecord
from swarmp2p.node.table import registry
from swarmp2p.node.training import jobs
from swarmp2p.plan import CAPABILITIES, Plan, parse_job
from swarmp2p.plan.hardware import Speeds
from swarmp2p.workers import exit_message

GIB = 1 << 30


def _node(node_id, devices=None, caps=CAPABILITIES):
    return NodeRecord.from_data(_node_data(node_id, devices, caps), "")


def _node_data(node_id, devices=None, caps=CAPABILITIES):
    return {
        "node_id": node_id,
        "name": f"host-{node_id}",
        "ram": 16 * GIB,
        "disk_free": 100 * GIB,
        "capabilities": sorted(caps),
        "version": "0",
        "devices": devices
        or [
            {
                "kind": "cpu",
                "index": 0,
                "name": "cpu",
                "memory_total": 16 * GIB,
                "memory_free": 12 * GIB,
                "compute_capability": "",
            }
        ],
    }


def _gpu(index, cc="8.6", fake=False):
    d = {
        "kind": "cuda",
        "index": index,
        "name": "A5000",
        "memory_total": 24 * GIB,
        "memory_free": 24 * GIB,
        "compute_capability": cc,
    }
    if fake:
        d["fake"] = True
    return d


JOB = {
    "name": "t",
    "model": {"pretrained": "embedded", "lora": {"enabled": True, "r": 4}},
    "split": {"stages": 2, "mode": "equal"},
    "data": {"source": "random"},
    "train": {
        "steps": 5,
        "batch_size": 4,
        "seq_len": 16,
        "micro_batches": 2,
        "checkpoint_every": 2,
        "eval_batches": 1,
    },
}


def _canonical(data=JOB):
    return parse_job(json.loads(json.dumps(data)))


@pytest.mark.parametrize(
    ("flags", "path", "value"),
    [
        ({"steps": 7}, ("train", "steps"), 7),
        ({"eval_batches": 2}, ("train", "eval_batches"), 2),
        ({"lora": False}, ("model", "lora", "enabled"), False),
        ({"lora_export": "adapters"}, ("model", "lora", "export"), "adapters"),
        ({"stages": "auto"}, ("split", "stages"), "auto"),
        ({"quantization": {"bits": 4}}, ("model", "quantization"), {"bits": 4}),
        ({"dtype": "bfloat16"}, ("model", "dtype"), "bfloat16"),
    ],
)
def test_overrides_set_the_job_field_they_name(flags, path, value):
    out = jobs.apply_overrides(JOB, {**flags, "pretrained": None})
    node = out
    for key in path:
        node = node[key]
    assert node == value
    assert out["model"]["pretrained"] == "embedded"  # None: not given
    assert JOB["train"]["steps"] == 5 and JOB["model"]["lora"]["enabled"]  # input untouched


def test_unknown_override_is_refused():
    with pytest.raises(ValueError, match="unknown override 'stepz'"):
        jobs.apply_overrides(JOB, {"stepz": 3})


def test_every_peer_recomputes_the_same_plan_and_refuses_a_different_one():
    cluster = jobs.cluster_records([_node("b"), _node("a")])
    assert [r.node_id for r in cluster] == ["a", "b"]
    plan = jobs.compute_plan(_canonical(), cluster)
    assert isinstance(plan, Plan)
    assert [s.node_id for s in plan.stages] == ["a", "b"]
    again = jobs.check_plan(_canonical(), cluster, plan, node_id="b")
    assert again.to_json() == plan.to_json()
    tampered = dataclasses.replace(plan, recompute=not plan.recompute)
    with pytest.raises(jobs.PlanMismatch, match="node b computes a different plan"):
        jobs.check_plan(_canonical(), cluster, tampered, node_id="b")
    # version skew: a peer whose software lacks a feature the leader's plan enables
    older = frozenset(CAPABILITIES - {"wire-v2"})
    with pytest.raises(jobs.PlanMismatch, match="same swarmp2p version"):
        jobs.check_plan(_canonical(), cluster, plan, node_id="b", capabilities=older)


def test_features_need_every_assigned_peer():
    older = frozenset(CAPABILITIES - {"wire-v2"})
    cluster = jobs.cluster_records([_node("a"), _node("b", caps=older)])
    plan = jobs.compute_plan(_canonical(), cluster)
    assert isinstance(plan, Plan) and "wire-v2" not in plan.features
    full = jobs.compute_plan(_canonical(), jobs.cluster_records([_node("a"), _node("b")]))
    assert "wire-v2" in full.features


def test_a_node_without_the_runtime_is_not_planned_on_and_is_named():
    records = [_node("a"), _node("b", caps=frozenset())]
    assert [r.node_id for r in jobs.cluster_records(records)] == ["a"]
    blocked = jobs.compute_plan(_canonical(), jobs.cluster_records(records))
    assert blocked.status == "blocked"
    reason = jobs.blocked_note(blocked.reason, records)
    assert reason.startswith(blocked.reason) and "no torch runtime): host-b" in reason
    assert jobs.blocked_note("r", [_node("a")]) == "r"


def test_a_dtype_no_device_runs_is_blocked_with_the_reason_then_placed_on_a_gpu_node():
    job = _canonical({**JOB, "model": {**JOB["model"], "dtype": "float16"}})
    blocked = jobs.compute_plan(job, jobs.cluster_records([_node("a"), _node("b")]))
    assert blocked.status == "blocked" and "float16" in blocked.reason
    gpu_node = _node("c", [_gpu(0, fake=True), _gpu(1, fake=True), _node_data("x")["devices"][0]])
    assert gpu_node.fake == {"cuda:0", "cuda:1"}
    cluster = jobs.cluster_records([_node("a"), gpu_node])
    assert cluster[1] == gpu_node.node  # planner inputs: a fake GPU plans as real
    plan = jobs.compute_plan(job, cluster)
    assert isinstance(plan, Plan) and {s.node_id for s in plan.stages} == {"c"}
    stage = plan.stages[0]
    assert jobs.device_for(stage.devices, gpu_node) == ("cpu", None)  # a fake GPU: the CPU
    real = _node("c", [_gpu(0), _gpu(1)])
    assert jobs.device_for(["cuda:1"], real) == ("cuda:0", "1")
    assert jobs.device_for(["cpu"], real) == ("cpu", None)


_STEP_FIELDS = {
    "event": "step",
    "loss": 1.0,
    "tokens": 0,
    "tokens_per_s": 0.0,
    "act_bytes": 0,
    "grad_bytes": 0,
    "step_s": 0.5,
    "peak_memory_bytes": 0,
}


def _steps(*events):
    """Step events as the leader reads them from a report (the fields a test leaves out
    filled in)."""
    from swarmp2p.workers.events import decode

    return [decode({**_STEP_FIELDS, **e}) for e in events]


def test_metrics_fold_loss_from_the_last_stage_and_traffic_per_boundary():
    from swarmp2p.node.training.metrics import MetricsStore

    store = MetricsStore()
    step = {
        "event": "step",
        "step": 0,
        "loss": 4.5,
        "tokens_per_s": 100.0,
        "step_s": 0.5,
        "act_bytes": 1_000_000,
        "grad_bytes": 2_000_000,
    }
    store.fold("j", attempt=1, stage=0, n_stages=3, events=_steps(step))
    first = store.get("j")
    assert "step" not in first
    assert first["boundaries"] == {"0": {"act_mb_s": 2.0, "grad_mb_s": 0.0}}
    store.fold("j", attempt=1, stage=1, n_stages=3, events=_steps(step))
    assert store.get("j")["boundaries"] == {
        "0": {"act_mb_s": 2.0, "grad_mb_s": 4.0},  # stage 1 sends gradients back over 0
        "1": {"act_mb_s": 2.0, "grad_mb_s": 0.0},
    }
    store.fold("j", attempt=1, stage=2, n_stages=3, events=_steps({**step, "act_bytes": 0}))
    last = store.get("j")
    assert last["step"] == 1 and last["loss"] == 4.5 and last["losses"] == [[1, 0, 4.5, 100.0]]
    assert last["boundaries"]["1"]["grad_mb_s"] == 4.0
    store.fold(
        "j",
        attempt=1,
        stage=2,
        n_stages=3,
        events=_steps(*({**step, "step": s} for s in range(1, 700))),
    )
    assert len(store.get("j")["losses"]) == 500 and store.get("j")["losses"][-1][1] == 699


def test_the_leader_refuses_a_malformed_event_naming_its_field_and_keeps_the_rest(caplog):
    from swarmp2p.node.messages import StageReport
    from swarmp2p.node.training.leader import JobsLeader
    from swarmp2p.workers.events import Done, StepDone

    good = {**_STEP_FIELDS, "step": 4}
    report = StageReport(
        node_id="b",
        job_id="j",
        attempt=1,
        stage=1,
        events=[good, {**good, "loss": "low"}, {"event": "done", "steps": 5}, "junk"],
    )
    with caplog.at_level("WARNING"):
        events = JobsLeader._decoded(report)
    assert [type(e) for e in events] == [StepDone, Done]
    logged = [r.getMessage() for r in caplog.records]
    assert any(
        'invalid worker event "step"' in m and 'loss: must be a number, got "low"' in m
        for m in logged
    )
    assert any("node b reported" in m and "must be an object" in m for m in logged)


def test_metrics_keep_compute_per_stage_and_the_steady_pace():
    from swarmp2p.node.training.metrics import COMPUTE_STEPS, MetricsStore

    store = MetricsStore()

    def step(s, stage, at, **extra):
        event = {
            "event": "step",
            "step": s,
            "tokens": 512,
            "forward_s": 0.1,
            "backward_s": 0.2,
            "optimizer_s": 0.05,
            "wait_s": 0.3,
            "at": at,
            "step_s": 0.65,
            **extra,
        }
        store.fold("j", attempt=1, stage=stage, n_stages=2, events=_steps(event))

    for s in range(6):  # a slow first step, then one step every 0.5 s
        at = 100.0 + (2.0 if s == 0 else 2.0 + 0.5 * s)
        step(s, 0, at, forward_s=0.3)
        step(s, 1, at)
    got = store.get("j")
    assert got["compute"]["steps"]["5"] == {"0": 0.55, "1": 0.35}
    assert got["stages"]["1"]["wait_s"] == 0.3
    # steps 0 and 1 warm up; steps 2..5 (4 x 512 tokens) over the 2 s after step 1 ended
    assert got["steady_tokens_per_s"] == 1024.0
    step(6, 1, 200.0, skipped=True)  # a skipped float16 step computes nothing useful
    assert "6" not in store.get("j")["compute"]["steps"]
    for s in range(7, 7 + COMPUTE_STEPS):
        step(s, 1, 300.0 + s)
    assert len(store.get("j")["compute"]["steps"]) == COMPUTE_STEPS
    store.fold(
        "j",
        attempt=2,
        stage=1,
        n_stages=2,
        events=_steps(
            {
                "event": "step",
                "step": 50,
                "forward_s": 1.0,
                "backward_s": 1.0,
                "optimizer_s": 0.0,
                "at": 1.0,
                "tokens": 1,
            }
        ),
    )
    assert store.get("j")["compute"] == {"attempt": 2, "steps": {"50": {"1": 2.0}}}


def test_resume_step_is_the_newest_every_stage_has_on_a_live_node():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _tables import running

    from swarmp2p.node.table import events as ev

    log = running(nodes=("a", "b"))
    entry = log.table.jobs["j1"]
    assert jobs.resume_step(entry) == 0
    for stage, node in ((0, "a"), (1, "b")):
        for step in (10, 20):
            log(ev.SnapshotHeld(job_id="j1", stage=stage, step=step, node_id=node))
    log(ev.SnapshotHeld(job_id="j1", stage=0, step=30, node_id="a"))  # stage 0 ran ahead
    entry = log.table.jobs["j1"]
    assert jobs.resume_step(entry) == 20
    assert jobs.resume_step(entry, copies=2) == 0  # no copy anywhere yet
    for stage, copy in ((0, "b"), (1, "a")):
        log(ev.SnapshotHeld(job_id="j1", stage=stage, step=10, node_id=copy))
    entry = log.table.jobs["j1"]
    assert jobs.resume_step(entry, copies=2) == 10
    assert jobs.resume_step(entry, alive={"a"}) == 10  # b's stage-1 step 20 is gone
    assert jobs.snapshot_holders(entry, 1, 10) == ["b", "a"]


def test_exit_messages_name_the_signal():
    assert exit_message(-9) == "killed by SIGKILL"
    assert exit_message(1) == "exited with code 1"


def test_job_view_has_the_issue_shape():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _tables import founded, job

    from swarmp2p.node.table import events as ev
    from swarmp2p.node.views import job_view

    log = founded("a")
    log(ev.JobSubmitted(job_id="j1", job=job(), submitted_by="cli", at=1.0))
    log(ev.JobResuming(job_id="j1", reason="node b lost", at=2.0))
    view = job_view(log.table.jobs["j1"], {"loss": 2.0})
    assert view["state"] == "RESUMING" and view["steps"] == 10 and view["name"] == "t"
    assert set(view) >= {
        "id",
        "name",
        "state",
        "step",
        "steps",
        "plan",
        "metrics",
        "evaluation",
        "reason",
        "error",
        "model",
    }
    assert view["plan"]["stages"] == [] and view["metrics"]["loss"] == 2.0
    assert [h["state"] for h in view["history"]] == ["pending", "resuming"]


def test_model_ids_are_unique_and_the_registry_lists_completed_models():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _tables import running

    from swarmp2p.node import decide
    from swarmp2p.node.table import events as ev

    assert registry.unique_model_id("my job", []) == "my-job"
    assert registry.unique_model_id("t", ["t", "t-2"]) == "t-3"
    log = running()
    log(
        ev.EvaluationReported(job_id="j1", name="trained", loss=1.0, tokens=8),
        ev.StageExported(
            job_id="j1",
            attempt=1,
            stage=1,
            node_id="b",
            folder="export/stage-1",
            manifest={"files": {"model.safetensors": "0" * 64}},
        ),
        ev.StageFinished(job_id="j1", attempt=1, stage=0, at=1.0),
        ev.StageFinished(job_id="j1", attempt=1, stage=1, at=1.0),
    )
    log(*decide.registration(log.table, "j1"))
    entry = log.table.jobs["j1"].model
    assert entry["base"] == "/models/tiny" and entry["manifest"]["lora"]["r"] == 4
    assert [s["node"] for s in entry["manifest"]["stages"]] == ["a", "b"]
    assert entry["manifest"]["stages"][1]["files"] == {"model.safetensors": "0" * 64}
    assert [m["id"] for m in registry.models(log.table.jobs)] == ["t"]
    with pytest.raises(ValueError, match="no model 'u' in the registry \\(known: t\\)"):
        registry.find_model(log.table.jobs, "u")


@pytest.mark.parametrize(
    "file",
    ["../secret", "/etc/passwd", "export/../../secret", "a/..", "..", "snap\nshots/x", ""],
)
def test_peers_read_only_files_inside_a_job_folder(file, tmp_path):
    from swarmp2p.errors import UserError
    from swarmp2p.node.training.stages import job_file

    with pytest.raises(UserError, match="is refused"):
        job_file(tmp_path, "j1", file)


@pytest.mark.parametrize(
    "file", ["stage-0.log", "export/stage-1/manifest.json", "snapshots/stage-2/step-00000010.pt"]
)
def test_job_folder_files_are_readable(file, tmp_path):
    from swarmp2p.node.training.stages import job_file

    assert job_file(tmp_path, "j1", file) == tmp_path / "jobs" / "j1" / file


@pytest.mark.parametrize("job_id", ["..", ".", "a/b", "j1\n", "", "x" * 200])
def test_a_job_id_is_one_safe_path_component(job_id, tmp_path):
    from swarmp2p.errors import UserError
    from swarmp2p.node.training.stages import job_dir

    with pytest.raises(UserError, match="job id"):
        job_dir(tmp_path, job_id)


def test_a_daemon_declares_the_runtime_features_only_where_torch_is_importable(monkeypatch):
    import importlib.util

    from swarmp2p.node.daemon import runtime_capabilities

    assert runtime_capabilities() == sorted(CAPABILITIES)  # torch is installed here
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    assert runtime_capabilities() == []


def test_job_view_shows_each_stage_predicted_beside_measured():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _tables import cluster, founded, job

    from swarmp2p.node.table import events as ev
    from swarmp2p.node.views import job_view

    speed = Speeds.from_data({"float32": 1e10}, "speed")
    records = [
        dataclasses.replace(r, devices=(dataclasses.replace(r.devices[0], speed=speed),))
        for r in cluster("a", "b")
    ]
    log = founded("a", "b")
    log(ev.JobSubmitted(job_id="j1", job=job(), submitted_by="cli", at=1.0))
    planned = jobs.compute_plan(job(), records, shape=_shape())
    log(
        ev.JobPlaced(
            job_id="j1", attempt=1, plan=planned, cluster=tuple(records), placed_by="a", at=2.0
        )
    )
    metrics = {
        "stages": {"1": {"forward_s": 0.1, "backward_s": 0.2, "optimizer_s": 0.05, "wait_s": 0.3}}
    }
    view = job_view(log.table.jobs["j1"], metrics)
    first, last = view["plan"]["stages"]
    assert first["predicted_s"] == planned.timing.stages[0].compute_s > 0
    assert first["measured_s"] is None  # stage 0 reported nothing yet
    assert last["measured_s"] == 0.35 and last["wait_s"] == 0.3
    assert view["plan"]["predicted_step_s"] == planned.timing.step_s
    assert view["plan"]["bottleneck"] in (0, 1) and view["rebalances"] == 0


def _shape():
    from _tables import SHAPE

    return SHAPE


def test_a_none_job_is_submitted_without_its_data_file_being_opened(tmp_path):
    """Finetune mode none reads no data: not even the sha256 of its data file at submission."""
    from swarmp2p.errors import UserError
    from swarmp2p.node.training.resolve import resolve

    missing = str(tmp_path / "never-read.jsonl")
    frozen = {"pretrained": "embedded", "freeze_backbone": True}
    none_job = parse_job(
        {
            "name": "q",
            "model": frozen,
            "split": {"stages": 2, "compression": ["fixed_int4"]},
            "data": {"source": missing},
        }
    )
    assert none_job.finetune_mode == "none"
    job, inputs = resolve(none_job, cwd=str(tmp_path), node_id="a")
    assert inputs.data is None and job.data.source == missing  # nothing to ship to stage 0
    lora = {"pretrained": "embedded", "lora": {"enabled": True}}
    trains = parse_job({"name": "t", "model": lora, "data": {"source": missing}})
    with pytest.raises(UserError, match=r"never-read\.jsonl"):
        resolve(trains, cwd=str(tmp_path), node_id="a")  # a job that trains reads it
