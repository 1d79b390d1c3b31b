"""Running one training stage from a parsed worker spec (imports torch): data, build, links,
evaluation, calibration, the steps, snapshots, export. ``swarmp2p.runtime.worker`` parses the
spec and calls ``run_stage``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from swarmp2p.data.split import HELD_OUT_EVERY
from swarmp2p.plan.worker_spec import WorkerSpec, reads_data
from swarmp2p.runtime.stage_links import StageLinks, open_stage_links
from swarmp2p.schema import to_data
from swarmp2p.timings.workers import WORKER_TIMINGS
from swarmp2p.workers.events import (
    Built,
    Calibrated,
    Done,
    Exported,
    Phase,
    Resumed,
    SnapshotSaved,
    WorkerEvent,
)


def train_batch(spec: WorkerSpec, step: int, vocab: int, tokens=None, replica: int | None = None):
    """The ``[batch, seq_len + 1]`` token batch of ``step``: a pure function of the spec and the
    step, so a resumed run reads exactly what the uninterrupted one would. With N replicas
    each step reads N batches' rows and ``replica`` (default: the spec's) takes its share, so
    the replicas together train on what one pipeline with N times the batch would."""
    import torch

    t = spec.train
    n, r = spec.n_replicas, spec.replica if replica is None else replica
    size = t.batch_size * n
    if spec.data.source == "random":
        gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + step)
        rows = torch.randint(0, vocab, (size, t.seq_len + 1), generator=gen)
        return rows[r * t.batch_size : (r + 1) * t.batch_size]
    windows = tokens["train"]
    if len(windows) < size:
        raise ValueError(
            f"data.path {spec.data.path} holds {len(windows)} training windows of "
            f"{t.seq_len + 1} tokens; train.batch_size x {n} replica(s) needs {size}"
        )
    start = (step * size) % (len(windows) - size + 1) + r * t.batch_size
    return windows[start : start + t.batch_size]


def eval_batches(spec: WorkerSpec, vocab: int, tokens=None) -> list:
    """The held-out batches (``train.eval_batches`` of them, fewer if the data has fewer)."""
    import torch

    t = spec.train
    if spec.data.source == "random":
        gen = torch.Generator().manual_seed(spec.seed * 1_000_003 - 1)
        return [
            torch.randint(0, vocab, (t.batch_size, t.seq_len + 1), generator=gen)
            for _ in range(t.eval_batches)
        ]
    held = tokens["held_out"]
    n = min(t.eval_batches, len(held) // t.batch_size)
    return [held[i * t.batch_size : (i + 1) * t.batch_size] for i in range(n)]


def _load_tokens(spec: WorkerSpec):
    """Stage 0's ``{"train", "held_out"}`` windows of ``seq_len + 1`` tokens. A ``corpus`` (a
    text source tokenized by rows) holds out its validation rows: its last rows, one in
    twenty, none of them in a training window. A ``tokens`` .npy has no rows: the last one
    window in twenty is held out. Either way, too little to hold out evaluates nothing."""
    import numpy as np
    import torch

    path = spec.data.path
    w = spec.train.seq_len + 1

    def windows_of(ids, what: str):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"data.path {path!r}: {what} must be a 1-D integer array of token ids")
        return torch.from_numpy(ids[: len(ids) // w * w].astype(np.int64)).reshape(-1, w)

    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        kind = "an .npz corpus" if spec.data.source == "corpus" else "a readable .npy file"
        raise ValueError(f"data.path {path!r} is not {kind}: {exc}") from None
    if spec.data.source == "corpus":
        if not isinstance(loaded, np.lib.npyio.NpzFile) or {*loaded.files} != {
            "train",
            "validation",
        }:
            raise ValueError(
                f"data.path {path!r} is not a tokenized corpus (an .npz of exactly the arrays "
                '"train" and "validation")'
            )
        with loaded:
            train = windows_of(loaded["train"], '"train"')
            held_out = windows_of(loaded["validation"], '"validation"')
        return {"train": train, "held_out": held_out}
    if isinstance(loaded, np.lib.npyio.NpzFile):
        loaded.close()
        raise ValueError(f"data.path {path!r} must be a .npy of token ids, not an .npz")
    windows = windows_of(loaded, "it")
    if len(windows) < HELD_OUT_EVERY:  # too small to hold anything out: evaluate nothing
        return {"train": windows, "held_out": windows[:0]}
    held = max(1, len(windows) // HELD_OUT_EVERY)
    return {"train": windows[:-held], "held_out": windows[-held:]}


def build_from_spec(spec: WorkerSpec):
    """(bundle, vocab size, LoRA info) of the stage ``spec`` assigns: loaded in ``spec.dtype``,
    adapters and compressors attached, the frozen backbone stored in ``spec.weight_dtype``."""
    import torch

    from swarmp2p.runtime.torch import decoder_config, load_spec_stage
    from swarmp2p.runtime.torch.model.lora import apply_lora, resolve_targets
    from swarmp2p.runtime.torch.model.packed import use_onednn
    from swarmp2p.runtime.torch.train.bundle import build_bundle
    from swarmp2p.runtime.torch.train.compression import compressor_from_spec

    torch.manual_seed(spec.seed)  # every stage draws the same LoRA A matrices
    a, b = spec.layers
    stage = load_spec_stage(spec)
    if b - a != len(stage.blocks) or (spec.is_last and b != spec.n_layers):
        raise ValueError(
            f"layers [{a}, {b}) with n_layers {spec.n_layers} do not match the model "
            f"({len(stage.blocks)} blocks loaded)"
        )
    config = decoder_config(stage.config)
    hidden = config.hidden_size
    i = spec.stage
    recv = compressor_from_spec(spec.compression[i - 1], hidden, i - 1) if i > 0 else None
    send = compressor_from_spec(spec.compression[i], hidden, i) if not spec.is_last else None
    fingerprint = None
    if spec.finetune_mode == "lora":
        settings = spec.lora  # the job's record: its defaults are job.json's
        fingerprint = apply_lora(stage, settings)
        targets = resolve_targets(stage, settings)
    else:
        settings, targets = None, ()
    dtype = getattr(torch, spec.dtype)
    for comp in (recv, send):
        if comp is not None:
            comp.to(dtype)
    bundle = build_bundle(
        stage,
        index=i,
        n_stages=spec.n_stages,
        recv_compressor=recv,
        send_compressor=send,
        finetune_mode=spec.finetune_mode,
        block_devices=[spec.device] * len(stage.blocks),
        wire_v2=spec.wire_v2,
        dtype=dtype,
    )
    _store_frozen_weights(spec, bundle)
    use_onednn(bundle.stage)  # its float32 CPU layers (see runtime/torch/model/packed.py)
    lora_info = {"settings": settings, "targets": targets, "fingerprint": fingerprint}
    return bundle, config.vocab_size, lora_info


def _store_frozen_weights(spec: WorkerSpec, bundle) -> int:
    """Apply ``weight_dtype`` to a frozen backbone (after ``build_bundle`` froze it); returns
    how many weights now live in 16 bits. A full fine-tune trains every weight: it keeps them."""
    from swarmp2p.runtime.torch.model.half_storage import apply_half_storage

    if spec.weight_dtype is None or spec.finetune_mode == "full":
        return 0
    if spec.weight_dtype == spec.dtype:
        return 0  # the weights are in that dtype already
    return apply_half_storage(bundle.stage, spec.weight_dtype, compute_dtype=bundle.dtype)


def run_stage(
    spec: WorkerSpec, emit: Callable[[WorkerEvent], None], links: StageLinks | None = None
) -> None:
    """Run one stage of a training job end to end, reporting through ``emit``: over ``links``
    when the caller opened them (the worker does, before it imports torch), else its own;
    closed at the end either way."""
    links = links if links is not None else open_stage_links(spec, emit)
    try:
        _run(spec, emit, links)
    finally:
        links.close()


def _run(spec: WorkerSpec, emit, links: StageLinks) -> None:
    from swarmp2p.runtime.torch.train.boundary import Channel, tell_neighbours

    timeout = spec.link_timeout_s
    prev = Channel(links.prev, timeout=timeout) if links.prev is not None else None
    nxt = Channel(links.next, timeout=timeout) if links.next is not None else None
    replicas = None
    if spec.n_replicas > 1:
        from swarmp2p.runtime.torch.train.replicas import ReplicaRing, ReplicaSync

        ring = ReplicaRing(rank=spec.replica, size=spec.n_replicas, to_next=links.ring_next,
                           from_prev=links.ring_prev, timeout=timeout)  # fmt: skip
        replicas = ReplicaSync(ring, spec.sync)
    try:
        _run_on(spec, emit, prev, nxt, replicas)
    except Exception as exc:  # the neighbours stop now, not at their link timeout
        tell_neighbours(exc, stage=spec.stage, step=None, prev=prev, next=nxt)
        raise


def _run_on(spec: WorkerSpec, emit, prev, nxt, replicas=None) -> None:
    import time

    from swarmp2p.plan.schedule import stage_schedule
    from swarmp2p.plan.split import parse_compression
    from swarmp2p.runtime.torch.train.calibration import calibrate_stage
    from swarmp2p.runtime.torch.train.evaluation import evaluate_stage
    from swarmp2p.runtime.torch.train.precision import make_loss_scaler
    from swarmp2p.runtime.torch.train.snapshot import latest_snapshot, load_snapshot, save_snapshot
    from swarmp2p.runtime.torch.train.steps import make_optimizer, train_stage

    bundle, vocab, lora_info = build_from_spec(spec)
    fingerprint = lora_info["fingerprint"]
    evaluation: dict[str, dict] = {}
    t = spec.train
    reads = reads_data(spec.job)  # a none job reads no data and runs no step
    tokens = (
        _load_tokens(spec) if reads and spec.is_first and spec.data.source != "random" else None
    )
    held_out = eval_batches(spec, vocab, tokens) if reads and spec.is_first else None
    emit(
        Built(
            trainable_parameters=sum(p.numel() for p in bundle.trainable_parameters),
            finetune_mode=spec.finetune_mode,
            lora_fingerprint=fingerprint,
        )
    )

    trains = reads and t.steps > 0
    optimizer = make_optimizer(bundle, t) if trains and bundle.trainable_parameters else None
    scaler = make_loss_scaler(bundle.dtype, t.loss_scale)
    start = 0
    if spec.resume:
        path = latest_snapshot(spec.snapshot_dir, spec.stage)
        if path is None:
            raise ValueError(f"resume: no snapshot of stage {spec.stage} under {spec.snapshot_dir}")
        start = load_snapshot(path, bundle, optimizer, scaler=scaler)
        emit(Resumed(step=start, snapshot=str(path)))

    def evaluate(name: str, through: bool) -> None:
        result = evaluate_stage(
            bundle,
            name,
            prev=prev,
            next=nxt,
            batches=held_out,
            through_compressors=through,
            chunk_tokens=t.loss_chunk_tokens,
        )
        evaluation[name] = {k: _finite(v) for k, v in to_data(result).items() if k != "name"}
        emit(result)

    boundaries = [parse_compression(c, f"compression[{i}]") for i, c in enumerate(spec.compression)]
    learned = [b.is_learned for b in boundaries]
    compressed = any(b.method != "none" for b in boundaries)
    if not spec.resume and reads:
        if t.eval_batches:
            emit(Phase(name="evaluating the base model"))
            evaluate("base", False)
        if any(learned):
            emit(Phase(name="calibrating"))
            seen = calibrate_stage(
                bundle,
                learned=learned,
                prev=prev,
                next=nxt,
                # every replica calibrates on the same rows (replica 0's), so their frozen
                # projections agree
                batches=(train_batch(spec, s, vocab, tokens, 0) for s in range(10**9))
                if spec.is_first
                else None,
                calibration_tokens=t.calibration_tokens,
            )
            emit(Calibrated(tokens=seen))
        if t.eval_batches and compressed:
            emit(Phase(name="evaluating the boundary"))
            evaluate("calibrated_boundary", True)

    def on_step(m) -> None:
        emit(m)
        done = m.step + 1
        snapshots = spec.snapshot_dir and t.checkpoint_every and spec.replica == 0
        if snapshots and done % t.checkpoint_every == 0:  # replica 0 holds the synced weights
            path = save_snapshot(spec.snapshot_dir, bundle, optimizer, step=done, scaler=scaler)
            emit(SnapshotSaved(step=done, path=str(path)))

    steps_left = max(0, t.steps - start)
    if trains and steps_left:
        ops = stage_schedule(t.schedule, spec.stage, spec.n_stages, t.micro_batches)
        batches = (train_batch(spec, s, vocab, tokens) for s in range(start, t.steps))
        train_stage(
            bundle,
            dataclasses.replace(t, steps=steps_left),
            ops,
            prev=prev,
            next=nxt,
            batches=batches if spec.is_first else None,
            optimizer=optimizer,
            start_step=start,
            on_step=on_step,
            scaler=scaler,
            replicas=replicas,
        )
    if t.eval_batches and reads:
        evaluate("trained", True)
    _say_goodbye(prev, nxt, time)
    if spec.export_dir is not None:
        from pathlib import Path

        from swarmp2p.runtime.torch.train.export import export_stage

        manifest = export_stage(
            bundle,
            Path(spec.export_dir) / f"stage-{spec.stage}",
            layers=spec.layers,
            n_layers=spec.n_layers,
            compression=spec.compression,
            lora=lora_info["settings"],
            lora_targets=lora_info["targets"],
            lora_fingerprint=fingerprint,
            evaluation=evaluation,
            base_is_quantized=spec.quantization is not None
            and spec.quantization.get("bits") in (4, 8),
        )
        emit(Exported(manifest=str(manifest)))
    emit(Done(steps=t.steps if trains else 0))


def _finite(value):
    """A number for a JSON manifest: inf and nan become null."""
    import math

    return None if isinstance(value, float) and not math.isfinite(value) else value


def _say_goodbye(prev, nxt, time) -> None:
    """Close the pipeline in order: a stage tells the next it has received everything, then
    waits (briefly) for the stage before to say the same, so no final message is cut off."""
    from swarmp2p.runtime.torch.train.boundary import LinkTimeout

    if nxt is not None:
        nxt.send_control("bye")
        time.sleep(0.05)  # the link drops queued messages on close; let this one leave
    if prev is not None:
        old, prev.timeout = prev.timeout, min(prev.timeout, WORKER_TIMINGS.stage_bye_s)
        try:
            prev.recv_control("bye")
        except LinkTimeout:
            pass  # the stage before finished and closed; nothing of ours is pending
        finally:
            prev.timeout = old
