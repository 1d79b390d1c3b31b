"""Replicas synchronised inside the training loop (issue 29): 2 replicas x 2 stages as threads,
each replica a pipeline over in-process links, each stage's replicas a ring over real CURVE
links (``runtime/torch/train/replicas/sync.py`` driven by ``steps.train_stage``)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from test_pipeline import build_pipeline, run_pipeline  # noqa: E402
from train_models import build_model, curve_rings, run_threads, token_batches  # noqa: E402

from swarmp2p.plan.job import LoraConfig, SyncConfig  # noqa: E402
from swarmp2p.plan.speed import ring_sync_bytes, sync_bytes  # noqa: E402
from swarmp2p.plan.worker_spec import StageTraining  # noqa: E402
from swarmp2p.runtime.torch.model.lora import apply_lora  # noqa: E402
from swarmp2p.runtime.torch.train.replicas import OuterStep, ReplicaRing, ReplicaSync, sync_replicas  # noqa: E402

pytestmark = pytest.mark.torch
STAGES, REPLICAS, STEPS = 2, 2, 3
HEADERS = 200
"""Bytes a frame's header may add to its payload."""


def _model(mode: str, seed: int):
    """The tiny llama; in LoRA, adapters with a non-zero B, initialised from ``seed`` (the base
    is the same for every seed)."""
    model = build_model("llama")
    if mode == "lora":
        torch.manual_seed(seed)
        apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    elif seed:  # full: another replica's own random start, which align() must replace
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
    return model


def run_replicas(models, batches, settings, mode, sync, make_sync=ReplicaSync):
    """Train ``len(models)`` replicas of a STAGES-stage pipeline at once, replica r on
    ``batches[r]`` (with ``settings``, or ``settings[r]``); (metrics[r][i], bundles[r],
    trained[(r, i, step)]: the stage's trained parameters after each step, syncs[(r, i)])."""
    if not isinstance(settings, list):
        settings = [settings] * len(models)
    trained, targets, bundles = {}, [], []

    def record(r):
        def on_step(i, bundle, step):
            trained[(r, i, step)] = [p.detach().clone() for p in bundle.trainable_parameters]

        return on_step

    with curve_rings() as rings:
        per_stage = [rings(len(models)) for _ in range(STAGES)]
        syncs = {}
        for r, model in enumerate(models):

            def replicas(i, r=r):
                ring = ReplicaRing(rank=r, size=len(models), to_next=per_stage[i][r][0],
                                   from_prev=per_stage[i][r][1], timeout=60)  # fmt: skip
                syncs[(r, i)] = make_sync(ring, sync)
                return syncs[(r, i)]

            run, built = build_pipeline(
                model, STAGES, batches[r], settings[r], "1f1b", mode=mode, replicas=replicas,
                on_step=record(r),
            )  # fmt: skip
            targets += run
            bundles.append(built)
        flat = run_threads(targets)
    metrics = [flat[r * STAGES : (r + 1) * STAGES] for r in range(len(models))]
    return metrics, bundles, trained, syncs


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_step_mode_trains_like_one_pipeline_with_twice_the_batch(mode):
    settings = StageTraining.of(steps=STEPS, micro_batches=2, lr=1e-3)
    batches = token_batches(STEPS, 8, 9)
    halves = [[b[:4] for b in batches], [b[4:] for b in batches]]
    _, reference = run_pipeline(_model(mode, 0), STAGES, batches, settings, "1f1b", mode=mode)
    metrics, bundles, trained, _ = run_replicas(
        [_model(mode, 0), _model(mode, 1)], halves, settings, mode, SyncConfig(mode="step")
    )
    for i in range(STAGES):
        for step in range(STEPS):  # the replicas bitwise equal after every step
            for a, b in zip(trained[(0, i, step)], trained[(1, i, step)]):
                assert torch.equal(a, b), (mode, i, step)
        want = {name: p for p, name in zip(*_named(reference[i]))}
        for r in range(REPLICAS):
            for p, name in zip(*_named(bundles[r][i])):
                torch.testing.assert_close(p.detach(), want[name].detach(), atol=2e-6, rtol=0,
                                           msg=f"{mode} replica {r} {name}")  # fmt: skip
        trained_values = sum(p.numel() for p in bundles[0][i][0].trainable_parameters)
        payload = ring_sync_bytes(trained_values * 4, REPLICAS)
        for done in metrics[0][i]:  # each step sent the ring's float32 share, timed
            assert payload <= done.sync_bytes < payload + 2 * HEADERS, done
            assert done.sync_s > 0
        _report(f"step {mode}", i, trained_values, metrics[0][i])


def _named(built):
    """A stage's parameters and their names in the whole model."""
    bundle, names = built
    params = list(bundle.stage.parameters())
    return params, [names[id(p)] for p in params]


def _report(what, stage, values, metrics):
    """Per-step sync bytes and seconds (``pytest -s`` shows them)."""
    print(json.dumps({
        "sync": what, "stage": stage, "trained_values": values,
        "bytes_per_step": [m.sync_bytes for m in metrics],
        "sync_ms": [round(m.sync_s * 1e3, 2) for m in metrics],
        "step_ms": [round(m.step_s * 1e3, 2) for m in metrics],
    }))  # fmt: skip


class _Watched(ReplicaSync):
    """A real ReplicaSync that keeps its weights before every outer step (its own inner steps'
    result, by step), and an ``OuterStep`` of its own for the in-process algebra."""

    def align(self, params, step, end=None):
        super().align(params, step, end)
        self.before = {}
        self.shadow = OuterStep(params, lr=self.sync.lr, momentum=self.sync.momentum)

    def after_step(self, params, step):
        if self.due(step):
            self.before[step] = [p.detach().clone() for p in params]
        return super().after_step(params, step)


def test_diloco_h1_lr1_no_momentum_32_bits_gives_the_replicas_mean_through_the_loop():
    settings = StageTraining.of(steps=STEPS, micro_batches=2, lr=1e-2)
    batches = token_batches(STEPS, 8, 9)
    halves = [[b[:4] for b in batches], [b[4:] for b in batches]]
    sync = SyncConfig(mode="diloco", every=1, outer_lr=1.0, outer_momentum=0.0, bits=32)
    metrics, bundles, trained, syncs = run_replicas(
        [_model("full", 0), _model("full", 0)], halves, settings, "full", sync, _Watched
    )
    for i in range(STAGES):
        for step in range(STEPS):  # after each sync: the mean of the replicas' own weights
            locals_ = [syncs[(r, i)].before[step] for r in range(REPLICAS)]
            assert not torch.equal(locals_[0][0], locals_[1][0])  # they did drift apart
            for j, got in enumerate(trained[(0, i, step)]):
                want = torch.stack([loc[j] for loc in locals_]).mean(0)
                torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
            for a, b in zip(trained[(0, i, step)], trained[(1, i, step)]):
                assert torch.equal(a, b), (i, step)  # and the same bits on both
        values = sum(p.numel() for p in bundles[0][i][0].trainable_parameters)
        payload = ring_sync_bytes(values * 4, REPLICAS)
        for done in metrics[0][i]:
            assert payload <= done.sync_bytes < payload + 2 * HEADERS, done
        _report("diloco H=1 32-bit full", i, values, metrics[0][i])


@pytest.mark.parametrize("bits", [8, 16])
def test_diloco_over_the_ring_is_the_in_process_algebra_bit_for_bit(bits):
    """H = 2, the paper's outer lr and momentum, LoRA: every outer step over the CURVE ring
    gives exactly what ``sync_replicas`` computes from the same local weights, and only the
    sync steps send, one code per trained value (and a peak per parameter)."""
    settings = StageTraining.of(steps=4, micro_batches=2, lr=1e-2)
    batches = token_batches(4, 8, 9)
    halves = [[b[:4] for b in batches], [b[4:] for b in batches]]
    sync = SyncConfig(mode="diloco", every=2, bits=bits)
    metrics, bundles, trained, syncs = run_replicas(
        [_model("lora", 0), _model("lora", 0)], halves, settings, "lora", sync, _Watched
    )
    for i in range(STAGES):
        members = [syncs[(r, i)] for r in range(REPLICAS)]
        for step in (1, 3):
            assert not torch.equal(members[0].before[step][0], members[1].before[step][0])
            want = sync_replicas(
                [m.shadow for m in members], [m.before[step] for m in members], bits
            )
            for r in range(REPLICAS):
                for got, w in zip(trained[(r, i, step)], want):
                    assert torch.equal(got, w), (bits, i, step, r)
        values = sum(p.numel() for p in bundles[0][i][0].trainable_parameters)
        n_params = len(bundles[0][i][0].trainable_parameters)
        # what the planner prices (the codes, N - 1 payloads) and a peak per parameter
        codes = sync_bytes(values, REPLICAS, bits) + (REPLICAS - 1) * n_params * 4
        for done in metrics[0][i]:
            if (done.step + 1) % 2:
                assert done.sync_bytes == 0, done
            else:
                assert codes <= done.sync_bytes < codes + 2 * HEADERS, done
        _report(f"diloco H=2 {bits}-bit lora", i, values, metrics[0][i])


@pytest.mark.slow  # float16 matmuls are emulated on the CPU
def test_one_replicas_overflow_skips_the_step_on_every_replica_and_halves_every_scale():
    """Loss scaling sees the averaged gradient: replica 1's NaN from step 1 on makes the
    average non-finite on both replicas, so both skip steps 1 and 2 and halve their scales
    alike (a replica that checked its own gradient alone would step and drift apart)."""
    good = StageTraining.of(steps=STEPS, micro_batches=2, lr=1e-3, loss_scale=256.0)
    bad = StageTraining.of(
        steps=STEPS, micro_batches=2, lr=1e-3, loss_scale=256.0, inject_nan_step=1
    )
    batches = token_batches(STEPS, 8, 9)
    halves = [[b[:4] for b in batches], [b[4:] for b in batches]]
    models = [_model("full", 0).to(torch.float16) for _ in range(REPLICAS)]
    metrics, _, trained, _ = run_replicas(
        models, halves, [good, bad], "full", SyncConfig(mode="step")
    )
    for r in range(REPLICAS):
        for i in range(STAGES):
            assert [m.skipped for m in metrics[r][i]] == [False, True, True], (r, i)
            assert [m.loss_scale for m in metrics[r][i]] == [256.0, 256.0, 128.0], (r, i)
            for step in range(STEPS):
                for a, b in zip(trained[(0, i, step)], trained[(r, i, step)]):
                    assert torch.equal(a, b), (r, i, step)
            for a, b in zip(trained[(r, i, 0)], trained[(r, i, STEPS - 1)]):
                assert torch.equal(a, b)  # nothing stepped on the thrown-away gradients
