"""Live memory on a real host: a served model and a training job on the same (fake) GPUs. The
job's placement counts the memory the served model's stage holds; it waits, naming the
device, until that model stops, then runs."""

from __future__ import annotations

import json

import pytest
from hosts import HOME
from swarm_harness import agreed_on, dump, swarm, wait_until
from test_swarm_serve_loopback import tiny_llama_with_tokenizer

from swarmp2p.net.security import SwarmSecret
from swarmp2p.plan import model_shape, parse_job
from swarmp2p.plan.placement import DEVICE_RESERVE

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.torch]

MODEL = f"{HOME}/models/tiny"
SESSIONS, CONTEXT = 64, 512
JOB = {
    "name": "beside",
    "model": {"pretrained": MODEL, "dtype": "float32", "lora": {"enabled": True, "r": 4}},
    "split": {"stages": 2, "mode": "equal"},
    "data": {"source": "random"},
    "train": {"steps": 2, "batch_size": 2, "seq_len": 8, "micro_batches": 1, "eval_batches": 0},
}


def _gpus(size: int) -> str:
    """Two fake GPUs of ``size`` bytes each (SWARM_FAKE_DEVICES, JSON form)."""
    return json.dumps([{"name": "FAKE", "memory_total": size, "compute_capability": "8.6"}] * 2)


def _prices(folder) -> tuple[int, int]:
    """(the job's largest stage, the served model's one stage) in bytes, as planned."""
    from swarmp2p.node.training.jobs import compute_plan
    from swarmp2p.plan.hardware import Node
    from swarmp2p.plan.serve import plan_serve

    shape = model_shape.from_folder(folder)
    big = json.loads(_gpus(2**40))
    record = {
        "node_id": "a",
        "name": "a",
        "ram": 2**36,
        "disk_free": 2**40,
        "devices": [
            {**d, "kind": "cuda", "index": i, "memory_free": d["memory_total"]}
            for i, d in enumerate(big)
        ],
    }
    plan = compute_plan(parse_job(JOB), [Node.from_dict(record)], shape=shape)
    job = max(s.memory.peak for s in plan.stages)
    serve = plan_serve(
        shape,
        [Node.from_dict(record)],
        stages=1,
        max_sessions=SESSIONS,
        max_context=CONTEXT,
        dtype="float32",
    )
    return job, serve.stages[0].memory.peak


def test_a_job_beside_a_served_model_counts_its_memory(netns_lab, tmp_path):
    tiny = tiny_llama_with_tokenizer(tmp_path / "tiny")
    job_peak, serve_peak = _prices(tiny)
    assert serve_peak > job_peak / 2
    # each alone fits a GPU; the job's stage beside the served model's does not
    size = DEVICE_RESERVE["cuda"] + serve_peak + job_peak // 2
    (host,) = netns_lab(1)
    a = host.swarm_up(
        "a",
        SwarmSecret.generate().token,
        env={"SWARM_FAKE_DEVICES": _gpus(size), "OMP_NUM_THREADS": "1"},
    )
    a.start()
    host.put(tiny, MODEL)
    try:
        wait_until(lambda: agreed_on([a], "a", 1) and a.status()["leader_ready"], 30, "a to lead")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump([a])}") from None

    # float32 as priced above (the fake Ampere GPUs would otherwise serve bfloat16)
    served = swarm(
        a,
        "serve",
        MODEL,
        "--name",
        "tiny",
        "--stages",
        "1",
        "--port",
        "8080",
        "--max-sessions",
        str(SESSIONS),
        "--max-context",
        str(CONTEXT),
        "--dtype",
        "float32",
        "--json",
    )
    assert served.returncode == 0, served.stderr + dump([a])
    (stage,) = json.loads(served.stdout)["stages"]
    gpu = stage["devices"][0]
    wait_until(lambda: a.status()["peers"][0], 5, "status")

    job_file = host.write(f"{HOME}/job.json", json.dumps(JOB))
    out = swarm(a, "train", job_file, "--detach", "--json")
    assert out.returncode == 0, out.stderr
    job_id = json.loads(out.stdout)["job_id"]
    try:
        view = wait_until(
            lambda: (
                (j := next(x for x in a.status()["jobs"] if x["job_id"] == job_id))["state"]
                == "pending"
                and j["record"].get("reason")
                and j
            ),
            30,
            "the job to wait",
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump([a])}") from None
    reason = view["record"]["reason"]
    assert f"GPU {gpu.split(':')[1]}" in reason and "needs" in reason, reason
    assert a.status()["jobs"][0]["record"].get("plan") is None  # nothing started

    stopped = swarm(a, "serve", "--stop", "tiny")
    assert stopped.returncode == 0, stopped.stderr + dump([a])
    done = wait_until(
        lambda: (
            (j := next(x for x in a.status()["jobs"] if x["job_id"] == job_id))["state"]
            in ("completed", "failed")
            and j
        ),
        180,
        "the job to run once the served model stopped",
    )
    told = {k: v for k, v in done["record"].items() if k not in ("job", "plan", "losses")}
    assert done["state"] == "completed", json.dumps(told, indent=1)[:6000] + dump([a])
    devices = [s["devices"][0] for s in done["record"]["plan"]["stages"]]
    assert sorted(devices) == ["cuda:0", "cuda:1"]
