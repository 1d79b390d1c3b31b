"""Half-precision training: float32 master copies, the loss scale every stage agrees on, the
failure of a non-finite step, one-stage pipelines, and a frozen backbone stored in float16.

Stages run as threads over in-process links; the worker-process runs are in
tests/integration/test_train_half_precision.py.
"""

from __future__ import annotations

import copy
import threading
import weakref

import pytest

torch = pytest.importorskip("torch")

from test_pipeline import CUTS, _reference  # noqa: E402
from train_models import build_model, stage_copies, token_batches  # noqa: E402

from swarmp2p.net import InProcLink  # noqa: E402
from swarmp2p.plan import stage_schedule  # noqa: E402
from swarmp2p.plan.worker_spec import StageTraining  # noqa: E402
from swarmp2p.runtime.torch import build_stage  # noqa: E402
from swarmp2p.runtime.torch.train.boundary import Channel, PipelineAborted  # noqa: E402
from swarmp2p.runtime.torch.train.bundle import build_bundle  # noqa: E402
from swarmp2p.runtime.torch.train.compression import NoCompression  # noqa: E402
from swarmp2p.runtime.torch.train.precision import (  # noqa: E402
    GROWTH_INTERVAL,
    INIT_LOSS_SCALE,
    MIN_LOSS_SCALE,
    LossScaler,
    NonFiniteError,
    StageOptimizer,
    StepHealth,
    decide,
    fused_adamw,
    next_loss_scale,
)
from swarmp2p.runtime.torch.train.snapshot import load_snapshot, save_snapshot  # noqa: E402
from swarmp2p.runtime.torch.train.steps import make_optimizer, train_stage  # noqa: E402

pytestmark = pytest.mark.torch


# --- the rules, as tables ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scale", "good", "overflow", "expected"),
    [
        (2.0**16, 0, True, (2.0**15, 0)),
        (2.0**16, 17, True, (2.0**15, 0)),
        (2.0**16, 0, False, (2.0**16, 1)),
        (2.0**16, GROWTH_INTERVAL - 2, False, (2.0**16, GROWTH_INTERVAL - 1)),
        (2.0**16, GROWTH_INTERVAL - 1, False, (2.0**17, 0)),
    ],
)
def test_the_loss_scale_halves_on_overflow_and_doubles_after_a_run_of_good_steps(
    scale, good, overflow, expected
):
    assert next_loss_scale(scale, good, overflow) == expected


def _scaler(scale=INIT_LOSS_SCALE, good=0):
    return LossScaler(scale=scale, good_steps=good)


@pytest.mark.parametrize(
    ("health", "scaler", "skip", "failure", "scale"),
    [
        (StepHealth(), _scaler(), False, None, INIT_LOSS_SCALE),
        (StepHealth(overflow=True, stage=2), _scaler(), True, None, INIT_LOSS_SCALE / 2),
        (StepHealth(overflow=True, stage=2), _scaler(2.0), True, None, 1.0),
        (StepHealth(overflow=True, stage=2), _scaler(MIN_LOSS_SCALE), True, "minimum loss", None),
        (StepHealth(fatal="the loss is nan", stage=3), _scaler(), True, "the loss is nan", None),
        (StepHealth(), None, False, None, None),
        (StepHealth(overflow=True, stage=1), None, True, "only float16 scales its loss", None),
        (StepHealth(fatal="the loss is inf", stage=1), None, True, "the loss is inf", None),
    ],
)
def test_the_verdict_table(health, scaler, skip, failure, scale):
    verdict = decide(health, scaler)
    assert verdict.skip == skip
    if failure is None:
        assert verdict.failure is None and verdict.scale == scale
    else:
        assert failure in verdict.failure and verdict.failed_stage == health.stage


def test_merged_findings_name_the_fatal_stage_first_then_the_one_nearest_the_last():
    ok, over1 = StepHealth(), StepHealth(overflow=True, stage=1)
    over2 = StepHealth(overflow=True, stage=2)
    fatal0 = StepHealth(fatal="nan loss", stage=0)
    assert ok.merge(ok) == ok
    assert over1.merge(over2) == StepHealth(overflow=True, stage=2)
    assert over1.merge(ok) == over1 and ok.merge(over2) == over2
    assert fatal0.merge(over2) == StepHealth(overflow=True, fatal="nan loss", stage=0)
    assert over1.merge(StepHealth(fatal="x", stage=2)).stage == 2
    assert StepHealth.from_fields(fatal0.fields()) == fatal0


# --- master copies ---------------------------------------------------------------------------------


def test_half_parameters_step_through_float32_master_copies():
    torch.manual_seed(0)
    half = torch.nn.Parameter(torch.randn(4, 3).half())
    single = torch.nn.Parameter(torch.randn(3))
    opt = StageOptimizer([half, single], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    assert opt.masters[0].dtype == torch.float32 and opt.masters[1] is single  # no copy in fp32
    half.grad = torch.full_like(half, 2.0**-20)  # below float16's eps-sized steps
    single.grad = torch.ones_like(single)
    assert opt.gradients_finite(scale=None)
    assert half.grad is None and opt.masters[0].grad.dtype == torch.float32
    before = opt.masters[0].detach().clone()
    opt.step()
    state = opt.optimizer.state[opt.masters[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert torch.all(opt.masters[0] < before)  # a 1e-3 step on every weight, in float32
    assert torch.equal(half.detach(), opt.masters[0].detach().half())
    half.grad = torch.full_like(half, 4.0)
    assert opt.gradients_finite(scale=4.0) and torch.all(opt.masters[0].grad == 1.0)  # unscaled
    half.grad = torch.full_like(half, 1.0)
    half.grad[0, 0] = float("inf")
    assert not opt.gradients_finite(scale=2.0)


def test_float32_masters_step_in_the_fused_kernel_and_equal_the_unfused_adamw():
    """The CPU's fused AdamW gives the unfused one's weights; a state saved by the unfused one
    (an older snapshot) resumes in the fused kernel."""
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ours = StageOptimizer(a, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    plain = torch.optim.AdamW(b, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    assert ours.optimizer.param_groups[0]["fused"] is True and not plain.param_groups[0]["fused"]
    for i in range(5):
        if i == 3:  # resume from the unfused optimizer's state
            ours.load_state_dict(copy.deepcopy(plain.state_dict()))  # as read from a snapshot
            assert ours.optimizer.param_groups[0]["fused"] is True
        grads = [torch.randn_like(p) for p in a]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        plain.step()
    for p, q in zip(a, b):
        assert torch.allclose(p, q, atol=1e-6, rtol=0)
    half = StageOptimizer(
        [torch.nn.Parameter(torch.randn(3).half())],
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
    )
    assert half.optimizer.param_groups[0]["fused"] is True  # its master is float32
    assert not fused_adamw([torch.zeros(2, dtype=torch.float64)])


@pytest.mark.slow  # float16 matmuls are emulated on the CPU: ~0.5 s per tiny LoRA step
def test_float16_lora_stays_finite_with_master_copies_and_goes_nan_without():
    """The DESIGN pitfall: AdamW in float16 divides 0 by eps = 0 on a zero-initialised LoRA B."""
    from swarmp2p.plan.job import LoraConfig
    from swarmp2p.runtime.torch.model.lora import apply_lora

    def one_stage(model):
        stage = build_stage(model, 0, 4)
        apply_lora(stage, LoraConfig(r=4, alpha=8, dropout=0.0))
        return build_bundle(stage.half(), index=0, n_stages=1, finetune_mode="lora")

    batches = token_batches(2, 4, 9)
    settings = StageTraining.of(steps=2, lr=1e-2, micro_batches=1)
    ops = stage_schedule("1f1b", 0, 1, 1)
    model = build_model("llama")
    bundle = one_stage(copy.deepcopy(model))
    assert bundle.dtype == torch.float16
    metrics = train_stage(bundle, settings, ops, batches=iter(batches))
    assert all(torch.isfinite(p).all() for p in bundle.trainable_parameters)
    assert metrics[0].loss_scale == INIT_LOSS_SCALE
    plain = one_stage(model)
    adamw = torch.optim.AdamW(plain.trainable_parameters, lr=1e-2)
    for tokens in batches[:1]:  # one step: lora_A's update is 0 / (0 + 0)
        loss = torch.nn.functional.cross_entropy(
            plain.stage(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten()
        )
        (loss * INIT_LOSS_SCALE).backward()
        for p in plain.trainable_parameters:
            p.grad /= INIT_LOSS_SCALE
        adamw.step()
        adamw.zero_grad()
    assert not all(torch.isfinite(p).all() for p in plain.trainable_parameters)


# --- pipelines of threads -----------------------------------------------------------------------------


def _bundles(model, n, dtype=torch.float32, mode="full"):
    model = copy.deepcopy(model).to(dtype)
    cuts = CUTS.get(n, [])
    return [
        build_bundle(
            stage,
            index=i,
            n_stages=n,
            recv_compressor=NoCompression() if i > 0 else None,
            send_compressor=NoCompression() if i < n - 1 else None,
            finetune_mode=mode,
        )
        for i, (stage, _) in enumerate(stage_copies(model, cuts))
    ]


def _train(
    bundles,
    settings,
    batches,
    *,
    per_stage=None,
    start=0,
    optimizers=None,
    scalers=None,
    schedule="1f1b",
):
    """Train the stages as threads; per stage its metrics, or the exception it raised."""
    n = len(bundles)
    links = [InProcLink.pair() for _ in range(n - 1)]
    out: list = [None] * n

    def target(i):
        try:
            out[i] = train_stage(
                bundles[i],
                (per_stage or {}).get(i, settings),
                stage_schedule(schedule, i, n, settings.micro_batches),
                prev=Channel(links[i - 1][1], timeout=30) if i > 0 else None,
                next=Channel(links[i][0], timeout=30) if i < n - 1 else None,
                batches=iter(batches[start:]) if i == 0 else None,
                optimizer=optimizers[i] if optimizers else None,
                scaler=scalers[i] if scalers else None,
                start_step=start,
            )
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_one_stage_trains_exactly_like_a_single_process():
    model = build_model("llama")
    settings = StageTraining.of(steps=2, micro_batches=2, lr=1e-3, loss_chunk_tokens=7)
    batches = token_batches(2, 4, 9)
    ref_losses, _, ref_params = _reference(model, batches, settings)
    whole = copy.deepcopy(model)
    bundle = build_bundle(build_stage(whole, 0, 4), index=0, n_stages=1)
    assert bundle.is_first and bundle.is_last
    assert bundle.stage.embed.sparse  # its gradient sums sparse rows, made dense once a step
    (metrics,) = _train([bundle], settings, batches)
    assert [m.loss for m in metrics] == pytest.approx(ref_losses, abs=1e-5)
    assert all(m.loss_scale is None and not m.skipped for m in metrics)
    for name, p in whole.named_parameters():  # the stage trained the model's own modules
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-h2"])
def test_an_overflow_skips_the_step_on_every_stage_and_lowers_every_scale(schedule):
    model = build_model("llama")
    bundles = _bundles(model, 3, torch.float16)
    before = [[p.detach().clone() for p in b.trainable_parameters] for b in bundles]
    settings = StageTraining.of(steps=3, micro_batches=2, lr=1e-3, loss_scale=2.0**40)
    results = _train(bundles, settings, token_batches(3, 4, 9), schedule=schedule)
    for stage_metrics in results:
        assert not isinstance(stage_metrics, Exception), stage_metrics
        assert [m.skipped for m in stage_metrics][:2] == [True, True]
        assert [m.loss_scale for m in stage_metrics][:2] == [2.0**40, 2.0**39]
    assert len({tuple(m.skipped for m in r) for r in results}) == 1  # every stage agrees
    assert len({tuple(m.loss_scale for m in r) for r in results}) == 1
    skipped_all = all(m.skipped for m in results[0])
    for b, old in zip(bundles, before):  # nothing stepped on the gradients thrown away
        same = all(torch.equal(p.detach(), q) for p, q in zip(b.trainable_parameters, old))
        assert same == skipped_all


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_injected_nan_fails_every_stage_naming_the_stage_and_step(dtype):
    model = build_model("llama")
    bundles = _bundles(model, 3, dtype)
    scale = 4.0 if dtype == torch.float16 else None  # float16 first skips: 4, 2, then fails at 1
    settings = StageTraining.of(steps=8, micro_batches=2, lr=1e-3, loss_scale=scale)
    poisoned = StageTraining.of(
        steps=8, micro_batches=2, lr=1e-3, loss_scale=scale, inject_nan_step=1
    )
    results = _train(bundles, settings, token_batches(8, 4, 9), per_stage={1: poisoned})
    fail_step = 3 if dtype == torch.float16 else 1
    assert isinstance(results[1], NonFiniteError), results[1]
    assert (results[1].stage, results[1].step) == (1, fail_step)
    assert str(results[1]).startswith(f"stage 1, step {fail_step}: ")
    for other in (results[0], results[2]):
        # float16 agrees on the verdict; otherwise stage 1 tells its neighbours
        assert isinstance(other, (NonFiniteError, PipelineAborted)), other
        assert (other.stage, other.step) == (1, fail_step)
    for b in bundles:
        assert all(torch.isfinite(p).all() for p in b.trainable_parameters)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-h2"])
def test_a_resumed_float16_run_equals_the_uninterrupted_one(tmp_path, schedule):
    """The snapshot holds the float32 master copies and the loss scale: rebuilding the masters
    from the float16 weights, or restarting at the default scale, would change the run."""
    model = build_model("llama")
    batches = token_batches(4, 4, 9)
    settings = StageTraining.of(steps=4, micro_batches=2, lr=1e-3, loss_scale=2.0**10)
    whole = _bundles(model, 2, torch.float16)
    full = _train(whole, settings, batches, schedule=schedule)

    half = StageTraining.of(steps=2, micro_batches=2, lr=1e-3, loss_scale=2.0**10)
    first = _bundles(model, 2, torch.float16)
    opts = [make_optimizer(b, half) for b in first]
    scalers = [LossScaler(scale=2.0**10) for _ in first]
    _train(first, half, batches, optimizers=opts, scalers=scalers, schedule=schedule)
    for i, b in enumerate(first):
        save_snapshot(tmp_path, b, opts[i], step=2, scaler=scalers[i])

    resumed = _bundles(model, 2, torch.float16)
    opts = [make_optimizer(b, half) for b in resumed]
    scalers = [LossScaler() for _ in resumed]
    for i, b in enumerate(resumed):
        path = tmp_path / f"stage-{i}" / "step-00000002.pt"
        assert load_snapshot(path, b, opts[i], scaler=scalers[i]) == 2
        assert (scalers[i].scale, scalers[i].good_steps) == (2.0**10, 2)
    again = _train(
        resumed, half, batches, start=2, optimizers=opts, scalers=scalers, schedule=schedule
    )
    assert [m.loss for m in again[1]] == [m.loss for m in full[1]][2:]
    for a, b in zip(whole, resumed):
        for p, q in zip(a.trainable_parameters, b.trainable_parameters):
            assert torch.equal(p, q)


# --- a frozen backbone stored in float16 -----------------------------------------------------------


class LiveTensorBytes:
    """Peak bytes of live CPU tensor storages: the ones given at the start, plus every storage an
    op creates while the mode is on (freed ones leave the count when they die)."""

    def __init__(self, tensors) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.weak import WeakIdKeyDictionary

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_flatten(out)[0]:
                    tracker.track(t)
                return out

        self._sizes = WeakIdKeyDictionary()
        self.current = self.peak = 0
        self.mode = _Mode()
        for t in tensors:
            self.track(t)

    def track(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return
        storage = t.untyped_storage()
        if storage in self._sizes:
            return
        n = storage.nbytes()
        self._sizes[storage] = n
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, n)

    def _free(self, n: int) -> None:
        self.current -= n


@pytest.mark.slow
def test_a_float16_backbone_halves_the_stage_peak_and_keeps_the_loss(tmp_path):
    """``weight_dtype`` through the stage runner's own build: the stage's peak tensor memory
    while training (weights, adapters, optimizer state, activations, the transient upcast of one
    weight) is <= 0.6x the float32 run's, and the losses agree to float16 round-off."""
    import transformers as tf

    from swarmp2p.plan import load_model_shape, parse_job
    from swarmp2p.plan.worker_spec import local_plan, worker_spec
    from swarmp2p.runtime.torch.train.stage_runner import build_from_spec, train_batch

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    runs = {}
    for weight_dtype in (None, "float16"):
        job = parse_job(
            {
                "model": {
                    "pretrained": str(tmp_path),
                    "weight_dtype": weight_dtype,
                    "lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0},
                },
                "data": {"source": "random"},
                "split": {"stages": 1},
                "train": {"steps": 3, "batch_size": 1, "seq_len": 8, "lr": 1e-2},
            }
        )
        plan = local_plan(job, load_model_shape(str(tmp_path)))
        spec = worker_spec(job, plan, 0, token="t")
        assert spec.weight_dtype == weight_dtype
        bundle, vocab, _ = build_from_spec(spec)
        settings = StageTraining.of(steps=3, lr=1e-2, micro_batches=1)
        held = [*bundle.stage.parameters(), *bundle.stage.buffers()]
        memory = LiveTensorBytes(held)
        weights = memory.current
        with memory.mode:
            metrics = train_stage(
                bundle,
                settings,
                stage_schedule("1f1b", 0, 1, 1),
                batches=(train_batch(spec, s, vocab) for s in range(3)),
            )
        runs[weight_dtype] = (weights, memory.peak, [m.loss for m in metrics])
    (w32, peak32, loss32), (w16, peak16, loss16) = runs[None], runs["float16"]
    assert w16 < 0.52 * w32  # the Linear and Embedding weights are most of the stage
    assert peak16 <= 0.6 * peak32, (peak16, peak32)
    # every weight is rounded to float16 (relative error <= 2**-11): the loss moves by less
    # than twice that
    assert loss16 == pytest.approx(loss32, rel=2**-10)
    assert loss16 != loss32  # the weights really were rounded
