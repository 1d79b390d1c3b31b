"""Replicas of real stage workers (issue 29): 2 replicas x 2 stages as four
``python -m swarmp2p.runtime.worker`` processes, each replica a pipeline over CURVE ZmqLinks,
each stage's replicas a ring over their own CURVE links; trained like one pipeline with twice
the batch, snapshots from replica 0 only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train_pipeline import (  # noqa: E402
    Worker,
    _model,
    _model_from,
    _snapshot_params,
    reference,
    spec_for,
)

pytestmark = [pytest.mark.torch, pytest.mark.slow]
CUTS, STEPS, BATCH = [2], 3, 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    _model("llama").save_pretrained(path, max_shard_size="40KB")
    return path


@pytest.fixture(scope="module")
def secret():
    from swarmp2p.net import SwarmSecret

    return SwarmSecret.generate().token


def _start(folder, token, tmp_path, job):
    """Replica 0's stages last to first (its members bind both ends of each ring), then
    replica 1's, each member dialling replica 0's ring ends for its stage."""
    workers = {}
    for r in range(2):
        nxt = None
        for i in reversed(range(2)):
            ring = {}
            if r == 1:
                up = workers[(0, i)].of("ready")[0]
                ring = {
                    "ring_prev": f"tcp://127.0.0.1:{up['ring_next_port']}",
                    "ring_next": f"tcp://127.0.0.1:{up['ring_prev_port']}",
                }
            spec = spec_for(i, 2, folder, token, CUTS, job, next_port=nxt, replica=r,
                            snapshot_dir=str(tmp_path / f"replica-{r}"), **ring)  # fmt: skip
            workers[(r, i)] = Worker(spec)
            nxt = workers[(r, i)].port()
    return workers


@pytest.mark.parametrize("sync", [{"mode": "step"}, {"mode": "diloco", "every": 2}])
def test_two_replicas_of_worker_stages_train_like_one_pipeline_of_twice_the_batch(
    folder, secret, tmp_path, sync
):
    job = {
        "split": {"replicas": 2},
        "train": {"steps": STEPS, "micro_batches": 2, "checkpoint_every": STEPS, "sync": sync},
    }
    workers = {}
    try:
        workers = _start(folder, secret, tmp_path, job)
        for w in workers.values():
            w.wait()
    finally:
        for w in workers.values():
            w.stop()
    for w in workers.values():
        assert w.proc.returncode == 0, w.describe()
    steps = {k: w.of("step") for k, w in workers.items()}
    assert not (tmp_path / "replica-1").exists()  # replica 0 alone snapshots
    for events in steps.values():
        assert len(events) == STEPS
        for e in events:  # step mode sends every step; DiLoCo at steps 2 and 3 (the last)
            syncs = sync["mode"] == "step" or e["step"] + 1 in (2, STEPS)
            assert (e["sync_bytes"] > 0) == syncs, e
    if sync["mode"] != "step":
        return
    ref_losses, ref_params = reference(folder, STEPS, 2 * BATCH, 9, 3, 1e-3)
    halves = [[e["loss"] for e in steps[(r, 1)]] for r in range(2)]
    assert [(a + b) / 2 for a, b in zip(*halves)] == pytest.approx(ref_losses, abs=1e-5)
    from swarmp2p.runtime.torch import build_stage

    whole = _model_from(folder)
    bounds = [0, *CUTS, 4]
    compared = 0
    for i in range(2):
        stage = build_stage(whole, bounds[i], bounds[i + 1])
        names = {id(p): name for name, p in whole.named_parameters()}
        state = _snapshot_params(tmp_path / "replica-0", i, STEPS, bounds[i])
        for name, p in stage.named_parameters():
            want = ref_params[names[id(p)]]
            torch.testing.assert_close(state[f"stage.{name}"], want, atol=1e-5, rtol=0, msg=name)
            compared += 1
    assert compared == len(ref_params)
