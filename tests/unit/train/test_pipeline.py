"""N-stage training in one process (stages as threads over in-process links) equals a single
process: loss and every parameter's gradient, GPipe, 1F1B and the zero-bubble schedules (every
schedule x 2, 3, 4 stages x M in {1, 2, 4, 8} for 3 steps, issue 28)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from train_models import (  # noqa: E402
    build_model,
    run_threads,
    stage_copies,
    token_batches,
)

from swarmp2p.net import InProcLink  # noqa: E402
from swarmp2p.plan import stage_schedule  # noqa: E402
from swarmp2p.plan.schedule import SCHEDULES  # noqa: E402
from swarmp2p.plan.worker_spec import StageTraining  # noqa: E402
from swarmp2p.runtime.torch.train.boundary import Channel  # noqa: E402
from swarmp2p.runtime.torch.train.bundle import build_bundle  # noqa: E402
from swarmp2p.runtime.torch.train.compression import compressor_from_spec  # noqa: E402
from swarmp2p.runtime.torch.train.loss import chunked_loss  # noqa: E402
from swarmp2p.runtime.torch.train.steps import train_stage  # noqa: E402

pytestmark = pytest.mark.torch
TOL = 1e-5
CUTS = {2: [2], 3: [1, 3], 4: [1, 2, 3]}


def _reference(model, batches, settings):
    """Single process: loss per step, gradients of the last step, final parameters."""
    import copy

    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
    )
    losses = []
    for tokens in batches[: settings.steps]:
        opt.zero_grad()
        loss = chunked_loss(model(tokens[:, :-1]).logits, tokens[:, 1:], 7)
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads, dict(model.named_parameters())


def _reference_lora(model, batches, settings):
    """Single process training only the adapters: loss per step and final adapter values."""
    import copy

    model = copy.deepcopy(model).train()
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(
        params,
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
    )
    losses = []
    for tokens in batches[: settings.steps]:
        opt.zero_grad()
        loss = chunked_loss(model(tokens[:, :-1]).logits, tokens[:, 1:], 7)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses, {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}


def run_pipeline(model, n, batches, settings, schedule, *options, prepare=None, **named):
    """Train ``n`` stages as threads (``build_pipeline``'s ``options``); return (metrics per
    stage, [(bundle, names)]). ``prepare(bundles)`` runs before the threads start."""
    targets, bundles = build_pipeline(model, n, batches, settings, schedule, *options, **named)
    if prepare is not None:
        prepare([b for b, _ in bundles])
    return run_threads(targets), bundles


def build_pipeline(
    model,
    n,
    batches,
    settings,
    schedule,
    compression="none",
    mode="full",
    wire_v2=True,
    replicas=None,
    on_step=None,
):
    """``n`` stages over in-process links: (one callable per stage that trains it, [(bundle,
    names)]). ``replicas(i)``: stage i's ``ReplicaSync`` (or None); ``on_step(i, bundle,
    step)`` after each of stage i's steps."""
    links = [InProcLink.pair() for _ in range(n - 1)]
    hidden = model.config.get_text_config().hidden_size
    bundles = []
    for i, (stage, names) in enumerate(stage_copies(model, CUTS[n])):
        recv = compressor_from_spec(compression, hidden, i - 1) if i > 0 else None
        send = compressor_from_spec(compression, hidden, i) if i < n - 1 else None
        bundles.append(
            (
                build_bundle(
                    stage,
                    index=i,
                    n_stages=n,
                    recv_compressor=recv,
                    send_compressor=send,
                    finetune_mode=mode,
                    wire_v2=wire_v2,
                ),
                names,
            )
        )

    def target(i):
        bundle = bundles[i][0]
        prev = Channel(links[i - 1][1], timeout=30) if i > 0 else None
        nxt = Channel(links[i][0], timeout=30) if i < n - 1 else None
        ops = stage_schedule(schedule, i, n, settings.micro_batches)
        return train_stage(
            bundle,
            settings,
            ops,
            prev=prev,
            next=nxt,
            batches=iter(batches) if i == 0 else None,
            replicas=replicas(i) if replicas is not None else None,
            on_step=(lambda done: on_step(i, bundle, done.step)) if on_step else None,
        )

    return [lambda i=i: target(i) for i in range(n)], bundles


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = build_model(family)
        return cache[family]

    return get


@pytest.mark.parametrize(
    ("family", "n", "schedule", "m"),
    [
        # the fast rows; the llama grid below (slow) runs every schedule x stages x M
        ("llama", 3, "1f1b", 4),
        ("llama", 3, "zb-h1", 4),
        ("gpt2", 2, "gpipe", 4),
        ("gpt2", 3, "1f1b", 4),
        ("mixtral", 3, "1f1b", 4),
        ("gpt2", 3, "zb-h1", 4),
        ("gpt2", 4, "zb-h2", 2),
    ],
)
def test_pipeline_matches_single_process(models, family, n, schedule, m):
    model = models(family)
    settings = StageTraining.of(steps=2, micro_batches=m, lr=1e-3, loss_chunk_tokens=7)
    batches = token_batches(2, 4, 9)
    ref_losses, ref_grads, ref_params = _reference(model, batches, settings)
    metrics, bundles = run_pipeline(model, n, batches, settings, schedule)
    for stage_metrics in metrics:  # every stage reports the last stage's loss
        assert [s.loss for s in stage_metrics] == pytest.approx(ref_losses, abs=TOL)
    seen = set()
    for bundle, names in bundles:
        for p in bundle.stage.parameters():
            name = names[id(p)]
            seen.add(name)
            torch.testing.assert_close(p.grad, ref_grads[name], atol=TOL, rtol=0, msg=name)
            torch.testing.assert_close(
                p.detach(), ref_params[name].detach(), atol=TOL, rtol=0, msg=name
            )
    assert seen == set(ref_grads)


@pytest.fixture(scope="module")
def grid_run(models):
    """The schedule grid's model, batches and single-process reference (made once): 3 steps
    of batch 8, so every M in {1, 2, 4, 8} divides it."""
    model = models("llama")
    batches = token_batches(3, 8, 9)
    settings = StageTraining.of(
        steps=3, batch_size=8, seq_len=9, micro_batches=1, lr=1e-3, loss_chunk_tokens=7
    )
    return model, batches, _reference(model, batches, settings)


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_trains_as_one_process_for_3_steps(grid_run, schedule, n, m):
    """Issue 28: every schedule x 2, 3, 4 stages x M in {1, 2, 4, 8}: the losses of 3 steps,
    the last step's gradients and the parameters after it equal the single process's."""
    model, batches, (ref_losses, ref_grads, ref_params) = grid_run
    settings = StageTraining.of(
        steps=3, batch_size=8, seq_len=9, micro_batches=m, lr=1e-3, loss_chunk_tokens=7
    )
    metrics, bundles = run_pipeline(model, n, batches, settings, schedule)
    assert [s.loss for s in metrics[-1]] == pytest.approx(ref_losses, abs=TOL)
    seen = set()
    for bundle, names in bundles:
        for p in bundle.stage.parameters():
            name = names[id(p)]
            seen.add(name)
            torch.testing.assert_close(p.grad, ref_grads[name], atol=TOL, rtol=0, msg=name)
            torch.testing.assert_close(
                p.detach(), ref_params[name].detach(), atol=TOL, rtol=0, msg=name
            )
    assert seen == set(ref_grads)


def test_recompute_gives_the_same_gradients(models):
    model = models("llama")
    batches = token_batches(1, 4, 9)
    plain = StageTraining.of(steps=1, micro_batches=2, lr=1e-3)
    _, ref = run_pipeline(model, 2, batches, plain, "1f1b")
    _, rec = run_pipeline(
        model,
        2,
        batches,
        StageTraining.of(steps=1, micro_batches=2, lr=1e-3, recompute=True),
        "1f1b",
    )
    for (a, _), (b, _) in zip(ref, rec):
        for pa, pb in zip(a.stage.parameters(), b.stage.parameters()):
            torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=0)


def test_metrics_count_bytes_and_tokens(models):
    model = models("llama")
    settings = StageTraining.of(steps=1, micro_batches=2, lr=1e-3)
    batches = token_batches(1, 4, 9)
    metrics, _ = run_pipeline(model, 3, batches, settings, "gpipe")
    first, middle, last = (m[0] for m in metrics)
    act = 4 * 9 * 32 * 4  # float32 hidden states of every token
    assert act < first.act_bytes < act + 2 * (4 * 9 * 8 + 400)  # + labels and headers
    assert first.grad_bytes == 0 and last.act_bytes == 0
    assert middle.act_bytes == first.act_bytes
    assert act < last.grad_bytes == middle.grad_bytes
    for m in (first, middle, last):
        assert m.tokens == 36 and m.tokens_per_s > 0 and m.step_s > 0 and m.peak_memory_bytes > 0


def test_each_step_says_where_its_time_went(models):
    """Compute (forward, backward, optimizer) apart from waiting on the links: a stage made
    slow computes longer, and the stage after it waits for it."""
    import time

    model = models("llama")
    settings = StageTraining.of(steps=2, micro_batches=2, lr=1e-3)
    batches = token_batches(2, 4, 9)

    def slow(*_):
        time.sleep(0.05)

    def slow_first_stage(bundles):
        bundles[0].stage.blocks[0].register_forward_hook(slow)

    metrics, _ = run_pipeline(model, 2, batches, settings, "1f1b", prepare=slow_first_stage)
    first, last = metrics[0][-1], metrics[1][-1]
    for m in (first, last):
        parts = m.forward_s + m.backward_s + m.optimizer_s + m.wait_s
        # the parts cover the step but for bookkeeping between ops (more of it under load)
        assert 0.85 * m.step_s - 0.005 <= parts <= m.step_s + 0.005, (parts, m.step_s)
        assert m.at > 0
    assert first.forward_s >= 2 * 0.05  # two micro-batches through the slowed block
    assert last.wait_s > first.wait_s  # the last stage waits for the slow one
    assert last.wait_s >= 0.05


def test_fixed_int8_trains_bit_identically_to_plain_floats(models):
    model = models("llama")
    settings = StageTraining.of(steps=3, micro_batches=2, lr=1e-3)
    batches = token_batches(3, 4, 9)
    plain_metrics, plain = run_pipeline(
        model, 2, batches, settings, "1f1b", compression="fixed_int8"
    )
    # the same compression, but the payload crosses as floats (wire v1) instead of codes
    float_metrics, floats = run_pipeline(
        model, 2, batches, settings, "1f1b", compression="fixed_int8", wire_v2=False
    )
    # per micro-batch: 2 x 9 x 32 float32 values become one-byte codes and one float32 scale
    saved = float_metrics[0][0].act_bytes - plain_metrics[0][0].act_bytes
    assert 2 * (2 * 9 * 32 * 3) - 100 < saved < 2 * (2 * 9 * 32 * 3)
    assert [m.loss for m in plain_metrics[1]] == [m.loss for m in float_metrics[1]]
    for (a, _), (b, _) in zip(plain, floats):
        for pa, pb in zip(a.stage.parameters(), b.stage.parameters()):
            assert torch.equal(pa, pb)
