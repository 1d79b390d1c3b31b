"""Learning from the run: a stage slowed mid-job (a cgroup CPU quota on its worker) makes the
leader re-balance the split at the next snapshot; the job resumes on the new cuts and
completes, and its history says why."""

from __future__ import annotations

import json

import pytest
import swarm_harness
from cpu_quota import CpuQuota, why_not
from swarm_harness import dump, swarm, wait_until, worker_pids

from swarmp2p.net.security import SwarmSecret
from swarmp2p.node import api

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.alone]  # it times CPU shares

ENV = {"OMP_NUM_THREADS": "1", "SWARM_SPEED_PROBE": "on"}  # they share this machine's cores


@pytest.fixture
def quota():
    reason = why_not()
    if reason:
        pytest.skip(reason)
    made: list[CpuQuota] = []

    def make(name: str, cpus: float) -> CpuQuota:
        made.append(CpuQuota(f"swarmp2p-test-{name}-{SwarmSecret.generate().swarm_id[:6]}", cpus))
        return made[-1]

    yield make
    for q in made:
        q.remove()


STEPS = 48
"""Room for the slowed stage's 20 measured steps and a snapshot after them (every 8), even
when the quota lands a dozen steps in: a faster step (the fused AdamW, the one-pass head) had
the window end past the last snapshot of a 32-step job, so no re-balance was due."""


def _job(model):
    return {
        "name": "rebalance",
        "model": {"pretrained": str(model)},  # a full fine-tune, the default speed split
        "split": {"stages": 2},
        "data": {"source": "random"},
        "train": {
            "steps": STEPS,
            "batch_size": 4,
            "seq_len": 32,
            "micro_batches": 2,
            "lr": 1e-4,
            "eval_batches": 0,
            "checkpoint_every": 8,
            "recompute": False,
        },
    }


def _job_view(node, job_id):
    return api.request(node.state.api_socket, "job", timeout=5.0, job_id=job_id)


def _measured(node) -> bool:
    """Every live node's CPU advertises a measured speed."""
    peers = node.status()["peers"]
    return len(peers) == 2 and all(d.get("speed") for p in peers for d in p["devices"])


def test_a_stage_slowed_mid_run_is_rebalanced_at_the_next_snapshot(loopback_swarm, tmp_path, quota):
    model = swarm_harness.tiny_llama(
        tmp_path / "model", vocab=128, layers=8, hidden=128, max_positions=64, shard_size="200KB"
    )
    a, b = loopback_swarm.start("ab", token=SwarmSecret.generate().token, env=ENV)
    try:
        wait_until(lambda: _measured(a), 120, "both nodes to measure their speed")
    except AssertionError:
        raise AssertionError(dump([a, b])) from None
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(_job(model)))
    out = swarm(b, "train", str(job_file), "--detach", "--json")
    assert out.returncode == 0, out.stderr
    job_id = json.loads(out.stdout)["job_id"]
    try:
        first = wait_until(
            lambda: (v := _job_view(a, job_id))["state"] == "RUNNING" and v["step"] >= 1 and v,
            120,
            "the job to run",
        )
        before = [s["layers"] for s in first["plan"]["stages"]]
        assert first["plan"]["stages"][1]["predicted_s"] > 0  # measured speeds: seconds
        slow = quota("b", 0.2)
        for pid in worker_pids(b):  # b's stage from now on runs on a fifth of a CPU
            slow.add(pid)
        done = wait_until(
            lambda: (v := _job_view(a, job_id))["state"] in ("COMPLETED", "FAILED") and v,
            300,
            "the job to end",
            interval=0.5,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump([a, b])}") from None
    assert done["state"] == "COMPLETED", json.dumps(done, indent=1)[:3000]
    assert slow.throttled_us() > 0  # the quota did slow it
    reasons = [h["reason"] for h in done["history"] if h.get("reason")]
    assert len(reasons) == 1 and reasons[0].startswith("re-balanced: stage 1 ran"), reasons
    assert done["rebalances"] == 1 and done["attempt"] == 2 and done["step"] == STEPS
    after = [s["layers"] for s in done["plan"]["stages"]]
    held = lambda layers: layers[1][1] - layers[1][0]  # noqa: E731
    assert held(after) < held(before), (before, after)  # the slowed stage holds fewer layers
    show = swarm(a, "jobs", "show", job_id)
    assert "re-balanced: stage 1" in show.stdout and "predicted" in show.stdout, show.stdout
