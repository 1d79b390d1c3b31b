"""Snapshots re-sliced by global block index: a run snapshotted on 3 stages and resumed on 2
(other cuts) goes on exactly as the uninterrupted 3-stage run."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from test_snapshot import _train  # noqa: E402
from train_models import build_model, stage_copies, token_batches  # noqa: E402

from swarmp2p.plan.worker_spec import StageTraining  # noqa: E402
from swarmp2p.runtime.torch.train.bundle import build_bundle  # noqa: E402
from swarmp2p.runtime.torch.train.compression import compressor_from_spec  # noqa: E402
from swarmp2p.runtime.torch.train.reslice import Source, reslice  # noqa: E402
from swarmp2p.runtime.torch.train.snapshot import load_snapshot, save_snapshot, snapshot_path  # noqa: E402
from swarmp2p.runtime.torch.train.steps import make_optimizer  # noqa: E402

pytestmark = pytest.mark.torch


def _bundles(model, cuts, mode="full"):
    n = len(cuts) + 1
    out = []
    for i, (stage, _) in enumerate(stage_copies(model, cuts)):
        recv = compressor_from_spec("none", 32, i - 1) if i > 0 else None
        send = compressor_from_spec("none", 32, i) if i < n - 1 else None
        out.append(
            build_bundle(
                stage,
                index=i,
                n_stages=n,
                recv_compressor=recv,
                send_compressor=send,
                finetune_mode=mode,
            )
        )
    return out


def _by_global_name(bundles, cuts):
    """Every trained parameter under its whole-model block index."""
    starts = [0, *cuts]
    out = {}
    for b, start in zip(bundles, starts):
        for name, p in b.stage.named_parameters():
            parts = name.split(".")
            if parts[0] == "blocks":
                parts[1] = str(start + int(parts[1]))
            out[".".join(parts)] = p.detach().clone()
    return out


def test_a_run_resliced_onto_other_cuts_goes_on_as_the_uninterrupted_one(tmp_path):
    model = build_model("llama")
    batches = token_batches(4, 4, 9)
    settings = StageTraining.of(steps=4, micro_batches=2, lr=1e-3)
    old_cuts, new_cuts = [1, 3], [2]

    whole = _bundles(model, old_cuts)
    straight = _train(whole, [make_optimizer(b, settings) for b in whole], settings, batches, 0)

    first = _bundles(model, old_cuts)
    first_opts = [make_optimizer(b, settings) for b in first]
    half = StageTraining.of(steps=2, micro_batches=2, lr=1e-3)

    def snap(i):
        def on_step(m):
            if m.step + 1 == 2:
                save_snapshot(tmp_path / "old", first[i], first_opts[i], step=2)

        return on_step

    _train(first, first_opts, half, batches, 0, on_step=snap)
    ranges = [(0, 1), (1, 3), (3, 4)]
    sources = [
        Source(
            path=snapshot_path(tmp_path / "old", i, 2), start=a, end=b, first=i == 0, last=i == 2
        )
        for i, (a, b) in enumerate(ranges)
    ]
    resumed = _bundles(model, new_cuts)
    opts = [make_optimizer(b, settings) for b in resumed]
    for j in range(2):
        out = snapshot_path(tmp_path / "new", j, 2)
        if j == 0:  # the tool a stage's node runs, in its own process
            args = [str(out), "0", "0", "2", "1", "0", "0"]
            args += [f"{s.path}:{s.start}:{s.end}:{int(s.first)}:{int(s.last)}" for s in sources]
            done = subprocess.run(
                [sys.executable, "-m", "swarmp2p.runtime.torch.train.reslice", *args],
                capture_output=True,
                text=True,
            )
            assert done.returncode == 0, done.stderr
        else:
            out.parent.mkdir(parents=True)
            torch.save(reslice(sources, stage=1, start=2, end=4, first=False, last=True), out)
        assert load_snapshot(out, resumed[j], opts[j]) == 2
    rest = _train(resumed, opts, half, batches, 2)

    assert [m.step for m in rest[0]] == [2, 3]
    for got, want in zip(rest[-1], straight[-1][2:]):
        assert got.loss == pytest.approx(want.loss, abs=1e-6)
    after, reference = _by_global_name(resumed, new_cuts), _by_global_name(whole, old_cuts)
    assert after.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(after[name], tensor, rtol=1e-5, atol=1e-6)


def test_a_learned_boundary_is_never_resliced(tmp_path):
    model = build_model("llama", layers=2)
    (s0, _), _ = stage_copies(model, [1])
    learned = {"method": "learned_bottleneck", "learned_dim": 16, "code_bits": 8}
    a = build_bundle(s0, index=0, n_stages=2, send_compressor=compressor_from_spec(learned, 32, 0))
    path = save_snapshot(
        tmp_path, a, make_optimizer(a, StageTraining.of(steps=1, micro_batches=1)), step=1
    )
    with pytest.raises(ValueError, match="learned boundary"):
        reslice(
            [Source(path=path, start=0, end=1, first=True, last=False)],
            stage=0,
            start=0,
            end=2,
            first=True,
            last=True,
        )
