"""Training jobs as data: overrides, planning and the plan check, worker specs, progress."""

from __future__ import annotations

import json

import pytest

from swarmp2p.node import jobs, jobtable, registry
from swarmp2p.node.jobtable import JobEvent, JobTable
from swarmp2p.plan import CAPABILITIES, Plan, parse_job

GIB = 1 << 30


def _node(node_id, devices=None, caps=CAPABILITIES):
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
    d = {"kind": "cuda", "index": index, "name": "A5000", "memory_total": 24 * GIB,
         "memory_free": 24 * GIB, "compute_capability": cc}  # fmt: skip
    if fake:
        d["fake"] = True
    return d


JOB = {
    "name": "t",
    "model": {"pretrained": "embedded", "lora": {"enabled": True, "r": 4}},
    "split": {"stages": 2, "mode": "equal"},
    "data": {"source": "random"},
    "train": {"steps": 5, "batch_size": 4, "seq_len": 16, "micro_batches": 2,
              "checkpoint_every": 2, "eval_batches": 1},
}  # fmt: skip


def _canonical(data=JOB):
    return parse_job(json.loads(json.dumps(data))).to_dict()


@pytest.mark.parametrize(
    ("flags", "path", "value"),
    [
        ({"steps": 7}, ("train", "steps"), 7),
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
    assert [r["node_id"] for r in cluster] == ["a", "b"]
    plan = jobs.compute_plan(_canonical(), cluster)
    assert isinstance(plan, Plan)
    assert [s.node_id for s in plan.stages] == ["a", "b"]
    again = jobs.check_plan(_canonical(), cluster, plan.to_json(), node_id="b")
    assert again.to_json() == plan.to_json()
    tampered = plan.to_json().replace('"layers":[0,', '"layers":[1,')
    with pytest.raises(jobs.PlanMismatch, match="node b computes a different plan"):
        jobs.check_plan(_canonical(), cluster, tampered, node_id="b")
    # version skew: a peer whose software lacks a feature the leader's plan enables
    older = frozenset(CAPABILITIES - {"wire-v2"})
    with pytest.raises(jobs.PlanMismatch, match="same swarmp2p version"):
        jobs.check_plan(_canonical(), cluster, plan.to_json(), node_id="b", capabilities=older)


def test_features_need_every_assigned_peer():
    older = frozenset(CAPABILITIES - {"wire-v2"})
    cluster = jobs.cluster_records([_node("a"), _node("b", caps=older)])
    plan = jobs.compute_plan(_canonical(), cluster)
    assert isinstance(plan, Plan) and "wire-v2" not in plan.features
    full = jobs.compute_plan(_canonical(), jobs.cluster_records([_node("a"), _node("b")]))
    assert "wire-v2" in full.features


def test_a_node_without_the_runtime_is_not_planned_on_and_is_named():
    records = [_node("a"), _node("b", caps=frozenset())]
    assert [r["node_id"] for r in jobs.cluster_records(records)] == ["a"]
    blocked = jobs.compute_plan(_canonical(), jobs.cluster_records(records))
    assert blocked.status == "blocked"
    reason = jobs.blocked_note(blocked.reason, records)
    assert reason.startswith(blocked.reason) and "no torch runtime): host-b" in reason
    assert jobs.blocked_note("r", [_node("a")]) == "r"


def test_a_dtype_no_device_runs_is_blocked_with_the_reason_then_placed_on_a_gpu_node():
    job = _canonical({**JOB, "model": {**JOB["model"], "dtype": "float16"}})
    blocked = jobs.compute_plan(job, jobs.cluster_records([_node("a"), _node("b")]))
    assert blocked.status == "blocked" and "float16" in blocked.reason
    gpu_node = _node("c", [_gpu(0, fake=True), _gpu(1, fake=True), _node("x")["devices"][0]])
    cluster = jobs.cluster_records([_node("a"), gpu_node])
    assert all("fake" not in d for r in cluster for d in r["devices"])  # planner inputs
    plan = jobs.compute_plan(job, cluster)
    assert isinstance(plan, Plan) and {s.node_id for s in plan.stages} == {"c"}
    stage = plan.to_dict()["stages"][0]
    assert jobs.device_for(stage, gpu_node) == ("cpu", None)  # a fake GPU runs on the CPU
    real = _node("c", [_gpu(0), _gpu(1)])
    assert jobs.device_for({"devices": ["cuda:1"]}, real) == ("cuda:0", "1")
    assert jobs.device_for({"devices": ["cpu"]}, real) == ("cpu", None)


def _record(n=3, attempt=1):
    return {"plan": {"stages": [{} for _ in range(n)]}, "attempt": attempt}


def test_progress_folds_loss_from_the_last_stage_and_traffic_per_boundary():
    record = _record()
    step = {"event": "step", "step": 0, "loss": 4.5, "tokens_per_s": 100.0, "step_s": 0.5,
            "act_bytes": 1_000_000, "grad_bytes": 2_000_000}  # fmt: skip
    first = jobs.fold_event(record, {**step, "stage": 0})
    assert "step" not in first
    assert first["metrics"]["boundaries"] == {"0": {"act_mb_s": 2.0, "grad_mb_s": 0.0}}
    record = {**record, **first}
    middle = jobs.fold_event(record, {**step, "stage": 1})
    assert middle["metrics"]["boundaries"] == {
        "0": {"act_mb_s": 2.0, "grad_mb_s": 4.0},  # stage 1 sends gradients back over 0
        "1": {"act_mb_s": 2.0, "grad_mb_s": 0.0},
    }
    record = {**record, **middle}
    last = jobs.fold_event(record, {**step, "stage": 2, "act_bytes": 0})
    assert last["step"] == 1 and last["metrics"]["loss"] == 4.5
    assert last["metrics"]["losses"] == [[1, 0, 4.5]]
    assert set(last["metrics"]["boundaries"]) == {"0", "1"}
    assert last["metrics"]["boundaries"]["1"]["grad_mb_s"] == 4.0
    ev = {"event": "eval", "pass": "base", "loss": 4.0, "perplexity": 54.6, "top1": 0.1,
          "tokens": 64}  # fmt: skip
    assert jobs.fold_event(record, {**ev, "stage": 1}) == {}
    assert jobs.fold_event(record, {**ev, "stage": 2})["evaluation"]["base"]["tokens"] == 64


def test_resume_step_is_the_newest_every_stage_has_on_a_live_node():
    record = _record()
    assert jobs.resume_step(record) == 0
    snaps = {}
    for stage, node in ((0, "a"), (1, "b"), (2, "c")):
        for step in (10, 20):
            snaps = jobs.add_snapshot(snaps, stage, step, node)
    snaps = jobs.add_snapshot(snaps, 0, 30, "a")  # stage 0 ran ahead
    record["snapshots"] = snaps
    assert jobs.resume_step(record) == 20
    assert jobs.resume_step(record, copies=2) == 0  # no copy anywhere yet
    for stage, copy in ((0, "b"), (1, "c"), (2, "a")):
        snaps = jobs.add_snapshot(snaps, stage, 10, copy)
    record["snapshots"] = snaps
    assert jobs.resume_step(record, copies=2) == 10
    assert jobs.resume_step(record, alive={"a", "b"}) == 10  # c's stage-2 step 20 is gone
    assert jobs.snapshot_holders(record, 2, 10) == ["c", "a"]
    for step in (40, 50, 60, 70):
        snaps = jobs.add_snapshot(snaps, 0, step, "a")
    assert sorted(snaps["0"]["steps"], key=int) == ["40", "50", "60", "70"]  # the newest kept
    assert jobs.add_snapshot(snaps, 0, 70, "a") == snaps  # a holder is listed once


def test_exit_messages_name_the_signal():
    assert jobs.exit_message(-9) == "killed by SIGKILL"
    assert jobs.exit_message(1) == "exited with code 1"
    tail = [f"line {i}" for i in range(100)]
    assert (
        jobs.failure(stage=1, node="b", message="m", stderr_tail=tail)["stderr_tail"]
        == tail[-jobs.STDERR_TAIL_LINES :]
    )


def test_job_view_has_the_issue_shape():
    table = JobTable()
    rec = jobs.job_record(parse_job(_canonical()), submitted_by="cli", submitted_at=1.0)
    table = jobtable.apply(table, JobEvent(version=1, kind="submit", job_id="j1", record=rec))
    table = jobtable.apply(
        table, JobEvent(version=2, kind="update", job_id="j1", state="resuming", record={})
    )
    view = jobs.job_view(jobtable._thaw(table.jobs["j1"]))
    assert view["state"] == "RESUMING" and view["steps"] == 5 and view["name"] == "t"
    assert set(view) >= {"id", "name", "state", "step", "steps", "plan", "metrics",
                         "evaluation", "reason", "error", "model"}  # fmt: skip
    assert view["plan"]["stages"] == []


def test_model_ids_are_unique_and_the_registry_lists_completed_models():
    assert registry.unique_model_id("my job", []) == "my-job"
    assert registry.unique_model_id("t", ["t", "t-2"]) == "t-3"
    cluster = jobs.cluster_records([_node("a"), _node("b")])
    plan = jobs.compute_plan(_canonical(), cluster).to_dict()
    record = {"job": _canonical(), "plan": plan, "evaluation": {"trained": {"loss": 1.0}},
              "shards": {"1": {"node": "b", "folder": "export/stage-1",
                               "manifest": {"files": {"model.safetensors": "0" * 64}}}}}  # fmt: skip
    entry = registry.model_entry("t", "j1", record)
    assert entry["base"] == "embedded" and entry["manifest"]["lora"]["r"] == 4
    assert [s["node"] for s in entry["manifest"]["stages"]] == ["a", "b"]
    assert entry["manifest"]["stages"][1]["files"] == {"model.safetensors": "0" * 64}
    table = {"j1": {"record": {"model": entry}}, "j2": {"record": {}}}
    assert [m["id"] for m in registry.models(table)] == ["t"]
    with pytest.raises(ValueError, match="no model 'u' in the registry \\(known: t\\)"):
        registry.find_model(table, "u")
    # a copy of a shard is listed after the node that trained it, once
    assert [registry.holders(s) for s in entry["manifest"]["stages"]] == [["a"], ["b"]]
    copied = registry.add_copy(entry, 1, "c")
    assert [registry.holders(s) for s in copied["manifest"]["stages"]] == [["a"], ["b", "c"]]
    assert entry["manifest"]["stages"][1].get("copies") is None  # the entry itself is unchanged
    assert registry.add_copy(copied, 1, "c") is None and registry.add_copy(copied, 1, "b") is None
    with pytest.raises(ValueError, match="has no stage 2"):
        registry.add_copy(entry, 2, "c")


@pytest.mark.parametrize(
    "file",
    ["../secret", "/etc/passwd", "export/../../secret", "a/..", "..", "snap shots/x", ""],
)
def test_peers_read_only_files_inside_a_job_folder(file):
    from swarmp2p.net.rpc import RpcError
    from swarmp2p.node.stages import _safe

    with pytest.raises(RpcError, match="must be a relative path inside the job folder"):
        _safe(file)


@pytest.mark.parametrize(
    "file", ["stage-0.log", "export/stage-1/manifest.json", "snapshots/stage-2/step-00000010.pt"]
)
def test_job_folder_files_are_readable(file):
    from swarmp2p.node.stages import _safe

    assert _safe(file) == file


def test_a_daemon_declares_the_runtime_features_only_where_torch_is_importable(monkeypatch):
    import importlib.util

    from swarmp2p.node.daemon import runtime_capabilities

    assert runtime_capabilities() == sorted(CAPABILITIES)  # torch is installed here
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    assert runtime_capabilities() == []
