"""Training one pipeline stage: run the schedule's ops on its bundle (``bundle``) step after step.

A stage of an N-stage pipeline (any N >= 1; one stage embeds, runs every block and scores)
runs between up to two channels. Per step it splits
the batch into M micro-batches and runs its op list (``plan.schedule``):

- ``F m``: the first stage embeds micro-batch m's ids; the others receive its payload and labels
  from the stage before and run the receiver. Then the blocks; the last stage computes the
  micro-batch's chunked float32 loss scaled by 1/M; the others run the sender and send the
  payload on through a ``PipelineBoundary``.
- ``B m``: the last stage backpropagates the loss; the others wait for the next stage's reply and
  backpropagate its gradient. A stage with a stage before it answers with the loss and the
  gradient of what it received.
- ``W m`` (the zero-bubble schedules): the weight gradients micro-batch m's ``B`` deferred
  (``weight_grad``); a list with W ops defers them in every B, so its B sends the gradient
  before the weight products run.

One AdamW step per step: the accumulated gradient equals the full batch's (reference,
"Micro-batched schedules"). A float16 or bfloat16 stage steps float32 master copies; a float16
pipeline scales the loss and skips a step that overflowed on any stage; a non-finite loss or
gradient nothing can fix fails the step with ``NonFiniteError`` (``precision``). A stage that
fails tells its neighbours (an ``abort`` control message) so they stop at once with its reason.
"""

from __future__ import annotations

import itertools
import math
import resource
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from swarmp2p.plan.worker_spec import StageTraining
from swarmp2p.runtime.torch.train.boundary import (
    ACT,
    GRAD,
    Channel,
    SentMicroBatch,
    send_through,
    tell_neighbours,
)
from swarmp2p.runtime.torch.train.bundle import StageBundle, dense_gradients, set_recompute
from swarmp2p.runtime.torch.train.loss import chunked_head_loss
from swarmp2p.runtime.torch.train.precision import (
    LossScaler,
    NonFiniteError,
    StageOptimizer,
    StepHealth,
    Verdict,
    agree,
    any_non_finite,
    decide,
    make_loss_scaler,
)
from swarmp2p.runtime.torch.train.replicas.sync import ReplicaSync
from swarmp2p.runtime.torch.train.weight_grad import WeightGradStore, split_linears
from swarmp2p.workers.events import StepDone

_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each bundle's deferred weight products, made the first time it runs a list with W ops."""


def make_optimizer(bundle: StageBundle, settings: StageTraining) -> StageOptimizer:
    """AdamW over exactly the bundle's trainable parameters (float32 master copies of the half
    precision ones)."""
    if not bundle.trainable_parameters:
        raise ValueError(f"stage {bundle.index} has no trainable parameters to optimise")
    return StageOptimizer(
        bundle.trainable_parameters,
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
    )


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _op(op: Any) -> tuple[str, int]:
    if isinstance(op, tuple):
        return op[0], op[1]
    return op.kind, op.micro


def split_batch(
    tokens: torch.Tensor, micro_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, labels) per micro-batch of a ``[B, T + 1]`` token batch (labels are the ids shifted)."""
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        raise ValueError(f"a batch is [batch, seq_len + 1] token ids, got {tuple(tokens.shape)}")
    if tokens.shape[0] % micro_batches:
        raise ValueError(
            f"batch size {tokens.shape[0]} does not divide into {micro_batches} micro-batches"
        )
    return [(mb[:, :-1], mb[:, 1:]) for mb in tokens.chunk(micro_batches, dim=0)]


class _Step:
    """The in-flight state of one step on one stage."""

    def __init__(self, scale: float) -> None:
        self.inputs: dict[int, torch.Tensor] = {}
        self.sent: dict[int, SentMicroBatch] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.loss_values: dict[int, float] = {}
        self.tokens = 0
        self.scale = scale
        """The loss scale of this step's backward (1.0 without loss scaling)."""
        self.backward_next: set[int] = set()
        """Micro-batches whose backward is the next op after their forward (1F1B's last stage)."""


def run_step(
    bundle: StageBundle,
    settings: StageTraining,
    optimizer: StageOptimizer | None,
    ops: Sequence[Any],
    *,
    step: int,
    prev: Channel | None,
    next: Channel | None,
    tokens: torch.Tensor | None = None,
    scaler: LossScaler | None = None,
    replicas: ReplicaSync | None = None,
) -> StepDone:
    """One training step of one stage: the op list, the verdict, then one optimizer step (or
    none, when a float16 gradient overflowed somewhere). ``scaler``: a float16 pipeline's loss
    scale, the same on every stage. ``replicas``: this stage's ring among the job's replicas
    (step mode averages the gradients before the verdict, DiLoCo runs its outer step after
    every ``every``-th optimizer step). Raises ``NonFiniteError`` when the step cannot be
    fixed."""
    m = settings.micro_batches
    sync_bytes0 = replicas.bytes_sent if replicas is not None else 0
    sync_s0 = replicas.sync_s if replicas is not None else 0.0
    started = time.perf_counter()
    act0 = next.sent_bytes[ACT] if next is not None else 0
    grad0 = prev.sent_bytes[GRAD] if prev is not None else 0
    micro_inputs = split_batch(tokens.to(bundle.device), m) if bundle.is_first else None
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    state = _Step(scaler.scale if scaler is not None else 1.0)
    if bundle.is_last:
        kinds = [_op(op) for op in ops]
        state.backward_next = {
            mi for (k, mi), after in itertools.pairwise(kinds) if k == "F" and after == ("B", mi)
        }
    store = _weight_store(bundle) if any(_op(op)[0] == "W" for op in ops) else None
    if store is not None:
        store.clear()
    bundle.stage.train()
    spent = {"F": 0.0, "B": 0.0, "W": 0.0}
    wait0 = _waited(prev, next)
    for op in ops:
        kind, micro = _op(op)
        began, waited = time.perf_counter(), _waited(prev, next)
        if kind == "F":
            _forward(bundle, settings, state, step, micro, prev, next, micro_inputs)
        elif kind == "B":
            _backward(bundle, state, step, micro, prev, store)
        elif kind == "W" and store is not None:
            store.apply(micro)
        else:
            raise ValueError(f"unknown schedule op {kind!r}; ops are F, B and W")
        spent[kind] += time.perf_counter() - began - (_waited(prev, next) - waited)
    if len(state.loss_values) != m:
        raise ValueError(f"the op list answered {len(state.loss_values)} of {m} micro-batches")
    if store is not None and store.pending():
        raise ValueError(f"the op list ran no W for micro-batch(es) {store.pending()}")
    began, waited = time.perf_counter(), _waited(prev, next)
    verdict = _verdict(bundle, settings, optimizer, scaler, state, step, prev, next, replicas)
    if verdict.failure is not None:
        failed = bundle.index if verdict.failed_stage is None else verdict.failed_stage
        raise NonFiniteError(stage=failed, step=step, reason=verdict.failure)
    if optimizer is not None:
        if verdict.skip:
            optimizer.zero_grad()
        else:
            optimizer.step()
        if replicas is not None and replicas.after_step(optimizer.masters, step):
            optimizer.masters_to_params()
    if scaler is not None:
        scaler.adopt(verdict)
    ended = time.perf_counter()
    optimizer_s = ended - began - (_waited(prev, next) - waited)
    elapsed = ended - started
    return StepDone(
        step=step,
        loss=sum(state.loss_values.values()),
        tokens=state.tokens,
        tokens_per_s=state.tokens / elapsed if elapsed > 0 else 0.0,
        act_bytes=(next.sent_bytes[ACT] - act0) if next is not None else 0,
        grad_bytes=(prev.sent_bytes[GRAD] - grad0) if prev is not None else 0,
        step_s=elapsed,
        peak_memory_bytes=_peak_memory(bundle.device),
        loss_scale=state.scale if scaler is not None else None,
        skipped=verdict.skip,
        forward_s=spent["F"],
        backward_s=spent["B"] + spent["W"],
        optimizer_s=optimizer_s,
        wait_s=_waited(prev, next) - wait0,
        at=time.time(),
        sync_bytes=(replicas.bytes_sent - sync_bytes0) if replicas is not None else 0,
        sync_s=(replicas.sync_s - sync_s0) if replicas is not None else 0.0,
    )


def _waited(prev: Channel | None, next: Channel | None) -> float:
    """Seconds both links have spent blocked so far."""
    return (prev.wait_s if prev is not None else 0.0) + (next.wait_s if next is not None else 0.0)


def _verdict(bundle, settings, optimizer, scaler, state, step, prev, next, replicas) -> Verdict:
    """What this stage found in the step, and what every stage does with it. With replicas in
    step mode the gradients are averaged first (unscaled, float32), so the overflow check and
    the verdict see the average: a replica's non-finite gradient makes every replica's
    non-finite, and all of them skip (or fail) together."""
    dense_gradients(bundle.trainable_parameters)
    health = StepHealth()
    if bundle.is_last:
        bad = [v for v in state.loss_values.values() if not math.isfinite(v)]
        if bad:
            why = f"the loss is {bad[0]}; lower train.lr or check the data"
            if bundle.dtype == torch.float16:
                why += " (float16 activations may overflow: bfloat16 or float32 would not)"
            health = StepHealth(fatal=why, stage=bundle.index)
    if settings.inject_nan_step is not None and step >= settings.inject_nan_step:
        _inject_nan(bundle)
    if optimizer is not None:
        finite = optimizer.gradients_finite(state.scale)
        if replicas is not None and replicas.mode == "step":
            grads = optimizer.gradients()
            replicas.average_gradients(grads, step)
            finite = not any_non_finite(grads)
        if not finite:
            health = StepHealth(overflow=True, fatal=health.fatal, stage=bundle.index)
    if scaler is None:  # nothing to agree on: no step is skipped, a failure is this stage's own
        return decide(health, None)
    return agree(health, scaler, step=step, prev=prev, next=next)


def _inject_nan(bundle: StageBundle) -> None:
    for p in bundle.trainable_parameters:
        if p.grad is not None:
            p.grad.view(-1)[0] = math.nan
            return
    raise ValueError(f"train.inject_nan_step: stage {bundle.index} has no gradient to put a NaN in")


def _forward(bundle, settings, state, step, micro, prev, next, micro_inputs) -> None:
    if bundle.is_first:
        x, labels = micro_inputs[micro]
        hidden_in = x
    else:
        payload, labels = prev.recv_activation(step, micro)
        x = bundle.adopt(payload)
        if x.is_floating_point():
            x.requires_grad_(True)
        state.inputs[micro] = x
        hidden_in = bundle.receive(x)
    state.tokens += labels.numel()
    if bundle.is_last:
        hidden = bundle.stage(hidden_in, hidden_only=True)
        loss = chunked_head_loss(
            bundle.stage.logits,
            hidden,
            labels,
            settings.loss_chunk_tokens,
            backward_next=micro in state.backward_next,
        )
        state.losses[micro] = loss / settings.micro_batches
        return
    out = bundle.stage(hidden_in)
    state.sent[micro] = send_through(
        next, bundle.send(out), step=step, micro=micro, labels=labels, codec=bundle.send_codec
    )


def _weight_store(bundle: StageBundle) -> WeightGradStore:
    store = _STORES.get(bundle)
    if store is None:
        store = _STORES[bundle] = WeightGradStore()
        split_linears(bundle.stage.blocks, store)
    return store


def _backward(bundle, state, step, micro, prev, store=None) -> None:
    if bundle.is_last:
        loss = state.losses.pop(micro)
        if loss.requires_grad:
            scaled = loss * state.scale if state.scale != 1.0 else loss
            _run_backward(store, micro, scaled.backward)
        value = float(loss.detach())
    else:
        sent = state.sent.pop(micro)
        _run_backward(store, micro, sent.backward)
        value = sent.loss
    state.loss_values[micro] = value
    if prev is not None:
        x = state.inputs.pop(micro)
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        prev.send_reply(step, micro, grad, value)


def _run_backward(store, micro, backward) -> None:
    """B: the whole backward, or (a split schedule) its input part, the weights' queued."""
    if store is None:
        backward()
    else:
        store.collect(micro, backward)


def train_stage(
    bundle: StageBundle,
    settings: StageTraining,
    ops: Sequence[Any],
    *,
    prev: Channel | None = None,
    next: Channel | None = None,
    batches: Iterator[torch.Tensor] | None = None,
    optimizer: StageOptimizer | None = None,
    start_step: int = 0,
    on_step: Callable[[StepDone], None] | None = None,
    scaler: LossScaler | None = None,
    replicas: ReplicaSync | None = None,
) -> list[StepDone]:
    """Run ``settings.steps`` steps (from ``start_step``) of one stage; return each step's metrics.

    ``ops`` is this stage's op list for one step (``plan.schedule.stage_schedule``: items with
    ``kind`` "F"/"B"/"W" and ``micro``, or ``(kind, micro)`` tuples). The first stage takes one
    ``[B, T + 1]`` token batch per step from ``batches``. A float16 stage scales its loss with
    ``scaler`` (made from ``settings.loss_scale`` when not given; pass the one a snapshot
    restored). ``replicas``: this stage's ring among the job's replicas (``replicas.sync``):
    replica 0's trained weights are copied into every replica first, and DiLoCo syncs after the
    last step as well as every ``every`` steps. A step that fails tells
    the neighbours before the error propagates.
    """
    if bundle.is_first != (prev is None) or bundle.is_last != (next is None):
        raise ValueError(
            f"stage {bundle.index} of {bundle.n_stages}: a prev channel exactly when not first, "
            "a next channel exactly when not last"
        )
    if bundle.is_first and batches is None:
        raise ValueError("the first stage needs batches")
    if optimizer is None and bundle.trainable_parameters:
        optimizer = make_optimizer(bundle, settings)
    if scaler is None:
        scaler = make_loss_scaler(bundle.dtype, settings.loss_scale)
    set_recompute(bundle.stage, settings.recompute)
    if replicas is not None and optimizer is not None:
        replicas.align(optimizer.masters, start_step, end=start_step + settings.steps)
        optimizer.masters_to_params()
    metrics = []
    for step in range(start_step, start_step + settings.steps):
        try:
            tokens = next_batch(batches, step) if bundle.is_first else None
            result = run_step(
                bundle,
                settings,
                optimizer,
                ops,
                step=step,
                prev=prev,
                next=next,
                tokens=tokens,
                scaler=scaler,
                replicas=replicas,
            )
        except Exception as exc:
            tell_neighbours(exc, stage=bundle.index, step=step, prev=prev, next=next)
            raise
        metrics.append(result)
        if on_step is not None:
            on_step(result)
    return metrics


def next_batch(batches: Iterator[torch.Tensor], step: int) -> torch.Tensor:
    """The next batch, with a clear error when the data runs out."""
    try:
        return next(batches)
    except StopIteration:
        raise ValueError(
            f"the training data ran out at step {step}; give more data or fewer steps"
        ) from None
