"""Snapshots: atomic files, weights_only loading, and a resumed run equal to an uninterrupted one."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_pipeline import CUTS  # noqa: E402
from train_models import build_model, run_threads, stage_copies, token_batches  # noqa: E402

from swarmp2p.net import InProcLink  # noqa: E402
from swarmp2p.plan import stage_schedule  # noqa: E402
from swarmp2p.plan.worker_spec import StageTraining  # noqa: E402
from swarmp2p.runtime.torch.train.boundary import Channel  # noqa: E402
from swarmp2p.runtime.torch.train.bundle import build_bundle  # noqa: E402
from swarmp2p.runtime.torch.train.compression import compressor_from_spec  # noqa: E402
from swarmp2p.runtime.torch.train.snapshot import (  # noqa: E402
    latest_snapshot,
    load_snapshot,
    save_snapshot,
)
from swarmp2p.runtime.torch.train.steps import make_optimizer, train_stage  # noqa: E402

pytestmark = pytest.mark.torch
LEARNED = {"method": "learned_bottleneck", "learned_dim": 16, "code_bits": 8}


def _bundles(model, n):
    out = []
    for i, (stage, _) in enumerate(stage_copies(model, CUTS[n])):
        recv = compressor_from_spec(LEARNED, 32, i - 1) if i > 0 else None
        send = compressor_from_spec(LEARNED, 32, i) if i < n - 1 else None
        out.append(
            build_bundle(stage, index=i, n_stages=n, recv_compressor=recv, send_compressor=send)
        )
    return out


def _train(bundles, optimizers, settings, batches, start, on_step=None):
    n = len(bundles)
    links = [InProcLink.pair() for _ in range(n - 1)]

    def target(i):
        return train_stage(
            bundles[i],
            settings,
            stage_schedule("1f1b", i, n, settings.micro_batches),
            prev=Channel(links[i - 1][1], timeout=30) if i > 0 else None,
            next=Channel(links[i][0], timeout=30) if i < n - 1 else None,
            batches=iter(batches[start:]) if i == 0 else None,
            optimizer=optimizers[i],
            start_step=start,
            on_step=on_step and on_step(i),
        )

    return run_threads([lambda i=i: target(i) for i in range(n)])


def test_resumed_run_equals_uninterrupted(tmp_path):
    model = build_model("llama")
    batches = token_batches(4, 4, 9)
    settings = StageTraining.of(steps=4, micro_batches=2, lr=1e-3)

    whole = _bundles(model, 3)
    whole_opts = [make_optimizer(b, settings) for b in whole]
    straight = _train(whole, whole_opts, settings, batches, 0)

    first = _bundles(model, 3)
    first_opts = [make_optimizer(b, settings) for b in first]
    half = StageTraining.of(steps=2, micro_batches=2, lr=1e-3)

    def snap(i):
        def on_step(m):
            if m.step + 1 == 2:
                save_snapshot(tmp_path, first[i], first_opts[i], step=2)

        return on_step

    _train(first, first_opts, half, batches, 0, on_step=snap)
    # a fresh process's view: new bundles, new optimizers, state from the snapshots only
    resumed = _bundles(model, 3)
    resumed_opts = [make_optimizer(b, settings) for b in resumed]
    for i, b in enumerate(resumed):
        path = latest_snapshot(tmp_path, i)
        assert path is not None and path.name == "step-00000002.pt"
        assert load_snapshot(path, b, resumed_opts[i]) == 2
    rest = _train(resumed, resumed_opts, half, batches, 2)

    assert [m.step for m in rest[0]] == [2, 3]
    assert [m.loss for m in rest[2]] == [m.loss for m in straight[2][2:]]
    for a, b in zip(whole, resumed):
        for pa, pb in zip(a.trainable_parameters, b.trainable_parameters):
            assert torch.equal(pa, pb)
    assert not list(tmp_path.rglob("*.tmp"))


def test_snapshot_of_another_configuration_is_refused(tmp_path):
    model = build_model("llama", layers=2)
    settings = StageTraining.of(steps=1, micro_batches=1)
    (s0, _), (s1, _) = stage_copies(model, [1])
    a = build_bundle(s0, index=0, n_stages=2, send_compressor=compressor_from_spec(LEARNED, 32, 0))
    path = save_snapshot(tmp_path, a, make_optimizer(a, settings), step=1)
    (t0, _), _ = stage_copies(model, [1])
    b = build_bundle(t0, index=0, n_stages=2, send_compressor=compressor_from_spec("none", 32, 0))
    with pytest.raises(ValueError, match="does not fit this stage"):
        load_snapshot(path, b, make_optimizer(b, settings))
    c = build_bundle(s1, index=1, n_stages=2, recv_compressor=compressor_from_spec(LEARNED, 32, 0))
    with pytest.raises(ValueError, match="is of stage 0, not 1"):
        load_snapshot(path, c, make_optimizer(c, settings))
