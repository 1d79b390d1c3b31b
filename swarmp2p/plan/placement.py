"""Placement of a training job: `plan_job(job, cluster) -> Plan | Blocked`.

Stages follow the nodes in `node_id` order and each node's devices in index order, one stage
per device (several devices on one node each get a stage). GPUs are used when the cluster has
any; a cluster of CPUs only runs on its CPUs. The split is `placer.Placer`'s, shared with
serving:

- `equal`: the same number of layers on every stage.
- `weighted`: by free memory (each stage gets layers in proportion to its free memory,
  embeddings and head priced in).
- `cost`: balances compute per stage: 6 FLOPs per active parameter and token for each layer,
  the head on the last stage, AdamW's update over what trains; every stage must still fit.
- `speed` (the default): minimises the slowest stage's predicted step time (`plan/speed.py`:
  the `cost` FLOPs at each device's measured speed, the bytes it sends over the link); by free
  memory (`weighted`) when a device has no measured speed.

The schedule (`train.schedule`, "auto" by default) is chosen with the split: each schedule the
nodes run is split and priced in turn (its memory per stage, its op lists run against each
stage's per-op costs: `schedule.price`), and the fastest that fits wins, the one holding less
memory on a tie (`schedule.PREFERENCE`). A named schedule is the only one tried.

A stage must fit its device's free memory (less DEVICE_RESERVE); a node's download share
(its stages' layers, the embeddings on the first stage, the head on the last) plus
DISK_HEADROOM must fit its free disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from swarmp2p.plan import model_shape as _model_shape
from swarmp2p.plan.hardware import (
    CAPABILITIES,
    SWARM_SDPA_CAPABILITY,
    Node,
    resolve_dtype,
    training_kernel,
)
from swarmp2p.plan.job import FieldError, Job, JobError
from swarmp2p.plan.memory import Pricing, StagePricer, Workload
from swarmp2p.plan.model_shape import ModelShape
from swarmp2p.plan.placer import (
    DEVICE_RESERVE,
    Placed,
    Placer,
    SplitAttempt,
    bottleneck_needs,
    candidate_devices,
    device_attempts,
    gb,
    lacking_capabilities,
    min_max_partition,
    plan_replicas,
    select_devices,
    torch_device,
    usable_memory,
)
from swarmp2p.plan.result import (
    Blocked,
    Plan,
    PlannedBoundary,
    PlannedSchedule,
    PlannedStage,
    SchedulePrediction,
)
from swarmp2p.plan.schedule import (
    PREFERENCE,
    SPLIT_BACKWARD,
    ZERO_BUBBLE_CAPABILITY,
    OpCosts,
    in_flight,
    loss_held,
    ops_text,
    stage_schedule,
)
from swarmp2p.plan.schedule import price as price_schedule
from swarmp2p.plan.split import Compression

DISK_HEADROOM = 512 * 2**20
"""Bytes a node's disk must keep free beyond its download share (the reference's 512 MB)."""


def _memory_reason(
    job: Job, placer: Placer, attempt: SplitAttempt, dtype: str, recompute: bool
) -> str:
    lines = []
    for i, ((node, dev), (a, b), price) in enumerate(
        zip(placer.devices, attempt.tried, attempt.prices)
    ):
        if price.peak > placer.free[i]:
            lines.append(
                f"{node.name} {dev.label}: stage {i} (layers {a}-{b - 1}) needs {gb(price.peak)} "
                f"GB, {gb(placer.free[i])} GB free"
            )
    hints = ["add a node", "free memory on it"]
    if job.finetune_mode == "full":
        hints.append('train LoRA adapters ({"lora": {"enabled": true}})')
    if job.model.quantization is None or job.model.quantization.bits == 8:
        hints.append('use quantization {"bits": 4}')
    if job.train.recompute is False:
        hints.append('set train.recompute to "auto"')
    placed = placer.n - len(lines)
    return (
        f"placed {placed} of {placer.n} required workers; {len(lines)} stage(s) do not fit their "
        f"device's free memory ({job.split.mode} split, {dtype}"
        f"{', recompute on' if recompute else ''}):\n"
        + "\n".join(lines)
        + "\n"
        + ", or ".join(hints)
    )


def _codec(c: Compression, hidden: int, dtype: str, wire_v2: bool) -> tuple[str, int]:
    """What the plan table says crosses a boundary: the codec the payload is sent with ("raw"
    for plain values) and the bytes of a one-token frame of it (``Compression.bytes_per_token``,
    the wire's own layout)."""
    codec = c.sent_codec(dtype, wire_v2)
    return ("raw" if codec == "none" else codec), c.bytes_per_token(hidden, dtype, wire_v2)


def _required_features(job: Job, n_stages: int, compression: tuple[Compression, ...]) -> dict:
    needs = bottleneck_needs(n_stages, compression)
    if job.model.weight_dtype is not None and job.finetune_mode != "full":
        needs["half-weights"] = "model.weight_dtype stores the frozen backbone narrow"
    if job.train.schedule in SPLIT_BACKWARD:
        needs[ZERO_BUBBLE_CAPABILITY] = f"train.schedule {job.train.schedule} splits the backward"
    return needs


def _schedules(job: Job, features: set[str], n_stages: int) -> tuple[str, ...]:
    """The schedules to price: the one the job names, or (auto) every one the nodes run."""
    if job.train.schedule != "auto":
        return (job.train.schedule,)
    if n_stages == 1:  # no pipeline, no bubble to fill
        return ("1f1b",)
    return tuple(
        k for k in PREFERENCE if k not in SPLIT_BACKWARD or ZERO_BUBBLE_CAPABILITY in features
    )


def _weight_storage(job: Job, dtype: str) -> str:
    q = job.model.quantization
    if q is not None:
        return "int8" if q.bits == 8 else q.quant_type
    if job.model.weight_dtype and job.finetune_mode != "full":
        return job.model.weight_dtype
    return dtype


def _check_against_shape(job: Job, shape: ModelShape, n: int) -> None:
    errors = []
    if n > shape.n_layers:
        errors.append(
            FieldError(
                path="split.stages",
                message=f"{n} stages for a model of {shape.n_layers} layers; use at most "
                f"{shape.n_layers}",
            )
        )
    comp = job.split.compression
    if len(comp) > 1 and len(comp) != n - 1:
        errors.append(
            FieldError(
                path="split.compression",
                message=f"{len(comp)} specs for {n - 1} boundaries ({n} stages); give one spec or "
                f"one per boundary",
            )
        )
    for i, c in enumerate(comp):
        if c.is_learned and c.code_dim(shape.hidden) >= shape.hidden:
            path = "split.compression" + (f"[{i}]" if len(comp) > 1 else "") + ".learned_dim"
            errors.append(
                FieldError(
                    path=path,
                    message=f"must be below the model's hidden size {shape.hidden}, got "
                    f"{c.code_dim(shape.hidden)}",
                )
            )
    if errors:
        raise JobError(errors)


def plan_job(
    job: Job,
    cluster: Sequence[Node],
    capabilities: frozenset[str] | None = None,
    *,
    shape: ModelShape | None = None,
    cuts: Sequence[int] | None = None,
) -> Plan | Blocked:
    """Place `job` on `cluster`: a Plan, or Blocked naming every rejected device or node.

    Pure and deterministic given `shape` (from `job.model.pretrained` when None). `capabilities`
    are the planning peer's own (default: CAPABILITIES). `cuts` fixes the split (each stage's
    first block but the first's): a trained model's, a snapshot's. Raises JobError when the job
    cannot fit this model at all (more stages than layers, cuts out of order).
    """
    own = CAPABILITIES if capabilities is None else frozenset(capabilities)
    if shape is None:
        shape = _model_shape.load(job.model.pretrained)
    if job.split.replicas != 1:  # or "auto": placer.plan_replicas decides
        return plan_replicas(job, cluster, own, shape, cuts, _plan_pipeline)
    return _plan_pipeline(job, cluster, own, shape, cuts)


def _plan_pipeline(
    job: Job,
    cluster: Sequence[Node],
    own: frozenset[str],
    shape: ModelShape,
    cuts: Sequence[int] | None,
) -> Plan | Blocked:
    candidates = candidate_devices(cluster)
    if not candidates:
        return Blocked(
            reason="placed 0 of 1 required workers; no node "
            "advertises a device; start swarm up on a machine with a GPU or CPU"
        )
    per_boundary = len(job.split.compression) > 1  # a list of specs fixes the stage count
    auto = job.split.stages == "auto" and not per_boundary and cuts is None
    if cuts is not None:
        cuts = tuple(cuts)
        if list(cuts) != sorted(set(cuts)) or (
            cuts and not 0 < cuts[0] <= cuts[-1] < shape.n_layers
        ):
            raise JobError(
                [
                    FieldError(
                        path="split",
                        message=f"cuts {list(cuts)} must rise "
                        f"strictly inside 1..{shape.n_layers - 1}",
                    )
                ]
            )
        required = len(cuts) + 1
    elif job.split.stages != "auto":
        required = int(job.split.stages)
    elif per_boundary:
        required = len(job.split.compression) + 1
    else:
        required = min(len(candidates), shape.n_layers)
    _check_against_shape(job, shape, required)

    requested = job.model.dtype
    left_out: list[str] = []
    if requested is not None:
        choice = resolve_dtype(candidates, requested)
        if choice.excluded:
            ok = [p for p in candidates if p not in choice.excluded]
            if not ok or (len(ok) < required and not auto):
                noun = "GPU(s)" if all(d.is_gpu for _, d in choice.excluded) else "device(s)"
                return Blocked(
                    reason=(
                        f"placed {min(len(ok), required)} of {required} required workers; "
                        f"{len(choice.excluded)} {noun} excluded by dtype {requested}:\n"
                        + "\n".join(choice.reason_lines)
                    ),
                    dtype=requested,
                    required=required,
                    placed=min(len(ok), required),
                )
            # the devices that run the dtype take the job; the others are named
            left_out.append(f"left out (dtype {requested}): " + "; ".join(choice.reason_lines))
            candidates = ok
            if auto:
                required = min(len(candidates), shape.n_layers)
    if len(candidates) < required:
        names = ", ".join(f"{n.name} {d.label}" for n, d in candidates)
        return Blocked(
            reason=(
                f"placed {len(candidates)} of {required} required workers; split.stages asks "
                f"for {required} but the cluster has {len(candidates)} usable device(s): "
                f"{names}; add nodes or lower split.stages"
            ),
            dtype=requested,
            required=required,
            placed=len(candidates),
        )
    first_blocked: Blocked | None = None
    while True:
        result, short_disk = _place_on(job, shape, candidates, required, auto, requested, own, cuts)
        if isinstance(result, Plan):
            for note in left_out:
                result = _with_note(result, note)
            return result
        if first_blocked is None:
            first_blocked = result
        # a node short of disk is left out when the others can still run the job
        rest = [p for p in candidates if p[0].node_id not in short_disk]
        if not short_disk or not rest or (not auto and len(rest) < required):
            return first_blocked
        lines = [ln for ln in result.reason.splitlines()[1:-1]]
        left_out.append("left out for lack of disk: " + "; ".join(lines))
        candidates = rest
        if auto:
            required = min(required, len(candidates))


def _place_on(
    job: Job,
    shape: ModelShape,
    candidates: list[Placed],
    required: int,
    auto: bool,
    requested: str | None,
    own: frozenset[str],
    cuts: tuple[int, ...] | None,
) -> tuple[Plan | Blocked, frozenset[str]]:
    """The plan on the ``required`` roomiest candidates (auto: on fewer, dropping the device
    with the least free memory, while memory is what falls short); or Blocked, with the nodes
    short of disk for their download share."""
    selected = select_devices(candidates, required)
    attempts = device_attempts(selected, auto)
    first: tuple[Blocked, frozenset[str]] | None = None
    for devices in attempts:
        dtype = resolve_dtype(devices, requested).dtype  # the best every used device runs
        result, short_of_memory, short_disk = _plan_on(job, shape, devices, dtype, own, cuts)
        if isinstance(result, Plan):
            if len(devices) < len(selected):
                left = [f"{n.name} {d.label}" for n, d in selected if (n, d) not in devices]
                note = "left out for lack of free memory: " + ", ".join(left)
                result = _with_note(result, note)
            return result, frozenset()
        if first is None:
            first = (result, short_disk)
        if not short_of_memory:
            break  # only a memory shortfall can be solved by fewer stages
    assert first is not None
    return first


def _with_note(plan: Plan, note: str) -> Plan:
    return replace(plan, notes=(*plan.notes, note))


def _plan_on(
    job: Job,
    shape: ModelShape,
    devices: list[Placed],
    dtype: str,
    own: frozenset[str],
    cuts: tuple[int, ...] | None = None,
) -> tuple[Plan | Blocked, bool, frozenset[str]]:
    """A plan on exactly these devices, or Blocked, whether memory was what fell short, and
    the nodes short of disk."""
    n = len(devices)
    compression = job.split.compression_for(n) if n > 1 else ()
    features = set(own)
    for node in {node.node_id: node for node, _ in devices}.values():
        features &= node.capabilities
    needs = _required_features(job, n, compression)
    lacking = lacking_capabilities([nd for nd, _ in devices], needs, own)
    if lacking:
        return (
            Blocked(
                reason=(
                    f"placed 0 of {n} required workers; {len(lacking)} capability(ies) missing:\n"
                    + "\n".join(lacking)
                ),
                dtype=dtype,
                required=n,
            ),
            False,
            frozenset(),
        )
    micro = job.train.micro_batches if "microbatch" in features else 1
    long_context = "long-context" in features
    pricing = Pricing(
        dtype=dtype,
        finetune_mode=job.finetune_mode,
        quantization=job.model.quantization,
        weight_dtype=job.model.weight_dtype if "half-weights" in features else None,
        lora_r=job.model.lora.r,
        lora_targets=job.model.lora.target_modules,
    )
    options = {True: (True,), False: (False,), "auto": (False, True)}[job.train.recompute]
    notes: list[str] = []
    grouped = shape.n_kv_heads < shape.n_heads
    kernels = [training_kernel(nd, dev, dtype, grouped, own) for nd, dev in devices]
    # without long-context no card is priced as running an efficient kernel (as before)
    scores = [not long_context or k == "math" for k in kernels]
    math = [f"{nd.name} {dev.label}" for (nd, dev), k in zip(devices, kernels) if k == "math"]
    if long_context and math:
        notes.append(
            "priced with seq x seq attention scores (SDPA's math kernel: no Flash Attention "
            f"there, and no {SWARM_SDPA_CAPABILITY} to expand grouped-query heads): "
            + ", ".join(math)
        )
    blocked: Blocked | None = None
    for recompute in options:
        workload = Workload(
            batch_size=job.train.batch_size,
            seq_len=job.train.seq_len,
            micro_batches=micro,
            recompute=recompute,
            efficient_attention=long_context,
            chunked_loss=long_context,
        )
        tried: list[tuple[str, Placer, SplitAttempt]] = []
        for kind in _schedules(job, features, n):
            placer = Placer(
                shape,
                devices,
                StagePricer(shape, pricing, workload),
                attention_scores=scores,
                mode=job.split.mode,
                compression=compression,
                in_flight=[in_flight(kind, i, n, micro) for i in range(n)],
                losses_held=loss_held(kind, n, micro),
                tokens=job.train.batch_size * job.train.seq_len,
                update_trained=job.finetune_mode == "full",
                wire_v2="wire-v2" in features,
            )
            tried.append((kind, placer, placer.split(cuts)))
        fitting = [(k, p, a) for k, p, a in tried if a.ranges is not None]
        if not fitting:
            _, placer, attempt = tried[0]  # the least memory's shortfall
            blocked = Blocked(
                reason=_memory_reason(job, placer, attempt, dtype, recompute),
                dtype=dtype,
                required=n,
                placed=sum(p.peak <= f for p, f in zip(attempt.prices, placer.free)),
            )
            continue
        predicted = _predictions(tried, micro)
        steps = {p.kind: p.step for p in predicted if p.fits}
        kind, placer, attempt = min(fitting, key=lambda t: steps[t[0]])  # the first on a tie
        if recompute and job.train.recompute == "auto":
            notes.append("recompute turned on: the job fits only with it")
        disk, bad, short = _disk_reason(placer, attempt.ranges)
        if disk:
            return Blocked(reason=disk, dtype=dtype, required=n, placed=n - bad), False, short
        if micro != job.train.micro_batches:
            notes.append("micro_batches 1: not every node declares microbatch")
        schedule = PlannedSchedule(
            kind=kind,
            micro_batches=micro,
            bubble_fraction=round(price_schedule(kind, [_UNIT] * n, micro).bubble, 6),
            requested=job.train.schedule,
            predicted=tuple(_prediction(p, placer.clock.measured) for p in predicted),
        )
        plan = _build_plan(
            job, shape, placer, attempt.ranges, dtype, recompute, features, notes, schedule
        )
        return plan, False, frozenset()
    assert blocked is not None
    return blocked, True, frozenset()


_UNIT = OpCosts(forward=1.0, input_grad=1.0, weight_grad=1.0)
"""Equal op costs: what ``bubble_fraction`` is quoted at."""


@dataclass(frozen=True, slots=True)
class _Priced:
    kind: str
    step: float
    bubble: float
    fits: bool


def _predictions(tried: list, micro: int) -> list[_Priced]:
    """Every schedule tried, priced on its own split (the closest one when it does not fit)."""
    out = []
    for kind, placer, attempt in tried:
        ranges = attempt.ranges if attempt.ranges is not None else attempt.tried
        got = price_schedule(kind, placer.clock.op_costs(ranges), micro)
        step = float(f"{got.step:.6g}")  # as the plan records it: ties go by preference
        out.append(_Priced(kind, step, got.bubble, attempt.ranges is not None))
    return out


def _prediction(p: _Priced, measured: bool) -> SchedulePrediction:
    step = p.step if measured else None
    return SchedulePrediction(kind=p.kind, step_s=step, bubble=round(p.bubble, 6), fits=p.fits)


def _disk_reason(
    placer: Placer, ranges: tuple[tuple[int, int], ...]
) -> tuple[str | None, int, frozenset[str]]:
    share: dict[str, int] = {}
    stages: dict[str, list[int]] = {}
    nodes: dict[str, Node] = {}
    for i, ((node, _), (a, b)) in enumerate(zip(placer.devices, ranges)):
        share[node.node_id] = share.get(node.node_id, 0) + placer.pricer.download_bytes(
            a, b, i == 0, i == placer.n - 1
        )
        stages.setdefault(node.node_id, []).append(i)
        nodes[node.node_id] = node
    lines = [
        f"{nodes[k].name}: stage(s) {', '.join(map(str, stages[k]))} download {gb(share[k])} GB "
        f"and keep {gb(DISK_HEADROOM)} GB free, the disk has {gb(nodes[k].disk_free)} GB free"
        for k in sorted(share)
        if share[k] + DISK_HEADROOM > nodes[k].disk_free
    ]
    if not lines:
        return None, 0, frozenset()
    short = frozenset(k for k in share if share[k] + DISK_HEADROOM > nodes[k].disk_free)
    bad = sum(len(stages[k]) for k in short)
    return (
        (
            f"placed {placer.n - bad} of {placer.n} required workers; {len(lines)} node(s) lack the "
            f"disk for their download share:\n"
            + "\n".join(lines)
            + "\nfree disk space there or add a node"
        ),
        bad,
        short,
    )


def _build_plan(
    job: Job,
    shape: ModelShape,
    placer: Placer,
    ranges: tuple[tuple[int, int], ...],
    dtype: str,
    recompute: bool,
    features: set[str],
    notes: list[str],
    schedule: PlannedSchedule,
) -> Plan:
    n, kind, micro = placer.n, schedule.kind, schedule.micro_batches
    stages = []
    for i, ((node, dev), (a, b)) in enumerate(zip(placer.devices, ranges)):
        files = _model_shape.stage_files(shape, a, b, i == 0, i == n - 1)
        stages.append(
            PlannedStage(
                index=i,
                node_id=node.node_id,
                node=node.name,
                devices=(torch_device(dev),),
                device_labels=(dev.label,),
                device_names=(dev.name,),
                layers=(a, b),
                memory=placer.price(i, a, b),
                device_free=dev.memory_free,
                download=placer.pricer.download_bytes(a, b, i == 0, i == n - 1),
                files=files,
                ops=ops_text(stage_schedule(kind, i, n, micro)),
            )
        )
    wire_v2 = "wire-v2" in features
    boundaries = []
    for i, c in enumerate(placer.compression):
        codec, per_token = _codec(c, shape.hidden, dtype, wire_v2)
        boundaries.append(
            PlannedBoundary(
                index=i,
                compression=replace(c, learned_dim=c.code_dim(shape.hidden)) if c.is_learned else c,
                codec=codec,
                bytes_per_token=per_token,
            )
        )
    return Plan(
        job=job.name,
        model=shape.to_dict(),
        dtype=dtype,
        finetune_mode=job.finetune_mode,
        split_mode=job.split.mode,
        stages=tuple(stages),
        boundaries=tuple(boundaries),
        schedule=schedule,
        recompute=recompute,
        eval_batches=_eval_batches(job, features),
        weight_storage=_weight_storage(job, dtype),
        features=tuple(sorted(features)),
        notes=tuple(notes) + _speed_note(job, placer),
        timing=placer.clock.timing(ranges, micro),
    )


def _eval_batches(job: Job, features) -> int:
    """Held-out batches per pass: the job's, when every node runs pipeline evaluation; 0 for
    a ``none`` job, which reads no data (so both stages run the same, empty, set of passes)."""
    if "pipeline-eval" not in features or job.finetune_mode == "none":
        return 0
    return job.train.eval_batches


def _speed_note(job: Job, placer: Placer) -> tuple[str, ...]:
    if job.split.mode != "speed" or placer.clock.measured:
        return ()
    return (
        "split by free memory: no measured speed on "
        + ", ".join(placer.clock.unmeasured)
        + " (swarm doctor --bench there measures it)",
    )


__all__ = [
    "DEVICE_RESERVE",
    "DISK_HEADROOM",
    "candidate_devices",
    "gb",
    "min_max_partition",
    "plan_job",
    "usable_memory",
]
