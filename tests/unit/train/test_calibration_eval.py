"""Calibration and held-out evaluation through a pipeline of stages (threads, in-process links)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from train_models import build_model, run_threads, stage_copies, token_batches  # noqa: E402

from swarmp2p.net import InProcLink  # noqa: E402
from swarmp2p.runtime.torch.train.boundary import Channel  # noqa: E402
from swarmp2p.runtime.torch.train.bundle import build_bundle  # noqa: E402
from swarmp2p.runtime.torch.train.calibration import calibrate_stage  # noqa: E402
from swarmp2p.runtime.torch.train.compression import compressor_from_spec  # noqa: E402
from swarmp2p.runtime.torch.train.evaluation import evaluate_stage, score_logits  # noqa: E402

pytestmark = pytest.mark.torch
LEARNED = {"method": "learned_bottleneck", "learned_dim": 16, "code_bits": 8}


def _pipeline(model, cuts, specs):
    n = len(cuts) + 1
    links = [InProcLink.pair() for _ in range(n - 1)]
    bundles = []
    for i, (stage, _) in enumerate(stage_copies(model, cuts)):
        recv = compressor_from_spec(specs[i - 1], 32, i - 1) if i > 0 else None
        send = compressor_from_spec(specs[i], 32, i) if i < n - 1 else None
        bundles.append(
            build_bundle(stage, index=i, n_stages=n, recv_compressor=recv, send_compressor=send)
        )
    chans = [
        (
            Channel(links[i - 1][1], timeout=30) if i > 0 else None,
            Channel(links[i][0], timeout=30) if i < n - 1 else None,
        )
        for i in range(n)
    ]
    return bundles, chans


def _run_all(bundles, chans, fn):
    return run_threads([lambda i=i: fn(bundles[i], *chans[i]) for i in range(len(bundles))])


@pytest.fixture(scope="module")
def model():
    return build_model("llama")


def test_evaluation_equals_the_whole_model_and_every_stage_reports_it(model):
    bundles, chans = _pipeline(model, [1, 3], ["none", "none"])
    batches = token_batches(3, 2, 12, seed=5)
    results = _run_all(
        bundles,
        chans,
        lambda b, p, n: evaluate_stage(
            b,
            "base",
            prev=p,
            next=n,
            batches=batches if b.index == 0 else None,
            through_compressors=False,
        ),
    )
    loss_sum, hits, tokens = 0.0, 0, 0
    with torch.no_grad():
        for t in batches:
            s, h, k = score_logits(model(t[:, :-1]).logits, t[:, 1:])
            loss_sum, hits, tokens = loss_sum + s, hits + h, tokens + k
    assert tokens == 3 * 2 * 12
    for r in results:
        assert r == results[0]
        assert r.tokens == tokens and r.loss == pytest.approx(loss_sum / tokens, abs=1e-5)
        assert r.top1 == hits / tokens and r.perplexity == pytest.approx(math.exp(r.loss))


def test_an_empty_pass_scores_nothing_and_nobody_waits(model):
    bundles, chans = _pipeline(model, [2], ["none"])
    results = _run_all(
        bundles, chans, lambda b, p, n: evaluate_stage(b, "trained", prev=p, next=n, batches=[])
    )
    assert all(r.tokens == 0 and math.isnan(r.loss) for r in results)


def _boundary_error(bundles, i, held_out):
    """Relative squared error of boundary i on stage i's real outputs."""
    with torch.no_grad():
        x = held_out[0][:, :-1]
        for b in bundles[: i + 1]:
            x = b.stage(x)  # raw hidden states, every earlier boundary bypassed
        x_hat = bundles[i + 1].receive(bundles[i].send(x))
        return float((x_hat - x).pow(2).sum() / (x - x.mean((0, 1))).pow(2).sum())


def test_calibration_makes_both_halves_one_projection(model):
    bundles, chans = _pipeline(model, [1, 3], [LEARNED, LEARNED])
    data = token_batches(8, 4, 16, seed=1)
    held_out = token_batches(1, 8, 16, seed=2)
    random_start = [_boundary_error(bundles, i, held_out) for i in range(2)]
    seen = _run_all(
        bundles,
        chans,
        lambda b, p, n: calibrate_stage(
            b,
            learned=[True, True],
            prev=p,
            next=n,
            batches=iter(data) if b.index == 0 else None,
            calibration_tokens=256,
        ),
    )
    assert seen == [256, 256, 0]  # 4 batches of 4 x 16 tokens; the last stage runs nothing
    for i in range(2):
        sender, receiver = bundles[i].send_compressor, bundles[i + 1].recv_compressor
        assert torch.equal(receiver.up.weight, sender.down.weight.T)
        torch.testing.assert_close(
            sender.down.bias, -(receiver.up.bias @ receiver.up.weight), atol=1e-5, rtol=0
        )
        calibrated = _boundary_error(bundles, i, held_out)
        # half the width of a random model's (nearly isotropic) hidden state: PCA keeps the
        # larger half of its variance; the random start keeps nothing
        assert calibrated < 0.6 and calibrated < random_start[i] / 2, (calibrated, random_start)
    results = _run_all(
        bundles,
        chans,
        lambda b, p, n: evaluate_stage(
            b, "calibrated_boundary", prev=p, next=n, batches=held_out if b.index == 0 else None
        ),
    )
    assert results[0].tokens == 8 * 16 and results[0] == results[2]


def test_calibration_with_only_the_last_boundary_learned(model):
    bundles, chans = _pipeline(model, [1, 3], ["fixed_int8", LEARNED])
    data = token_batches(2, 4, 16, seed=1)
    seen = _run_all(
        bundles,
        chans,
        lambda b, p, n: calibrate_stage(
            b,
            learned=[False, True],
            prev=p,
            next=n,
            batches=iter(data) if b.index == 0 else None,
            calibration_tokens=64,
        ),
    )
    assert seen == [64, 64, 0]
    assert torch.equal(
        bundles[2].recv_compressor.up.weight, bundles[1].send_compressor.down.weight.T
    )
