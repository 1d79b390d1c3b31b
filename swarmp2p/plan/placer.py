"""The split search every plan shares: device slots in pipeline order, memory prices per
stage, and the equal / weighted / cost-balanced splits. Pure, standard library only.

Training (``placement.plan_job``) and serving (``serve.plan_serve``) differ only in what they
hand a :class:`Placer`: a pricer for their workload (trainable state and activations, or the
KV cache) and a compute model (6 FLOPs per active parameter and token to train, 2 to serve).

- ``equal``: the same number of layers on every stage (``SplitSpec.even``).
- ``weighted``: layers in proportion to each device's free memory; failing that, the split
  needing the smallest share of any device's free memory.
- ``cost``: the split minimising the most expensive stage's compute (the head's
  vocab x hidden matmul on the last stage: SmolLM2's head costs about 8 of its 30 layers;
  DESIGN.md, "Pitfalls"), every stage still fitting its device.
- ``speed``: the ``cost`` search over each stage's predicted step time (``plan/speed.py``:
  its FLOPs at its device's measured training speed plus the bytes it sends over the link);
  ``weighted`` when a device has no measured speed. It prices a training step (batch x
  sequence tokens, gradients sent back), so training uses it (its default); serving does not.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from swarmp2p.plan import speed as _speed
from swarmp2p.plan.hardware import Device, Node, resolve_dtype
from swarmp2p.plan.job import Job
from swarmp2p.plan.memory import Pricing, StageMemory, StagePricer, trained_params
from swarmp2p.plan.model_shape import ModelShape
from swarmp2p.plan.quantization import GB
from swarmp2p.plan.result import Blocked, Plan, PlannedReplica
from swarmp2p.plan.split import Compression, SplitSpec

DEVICE_RESERVE = {"cuda": 512 * 2**20, "mps": 512 * 2**20, "cpu": 2**30}
"""Bytes of a device's free memory kept back: the CUDA context, or the OS and the daemon."""

TRAIN_FLOPS_PER_PARAM_TOKEN = 6  # forward 2 + backward 4 (Kaplan et al. 2020)
SERVE_FLOPS_PER_PARAM_TOKEN = 2  # forward only (Kaplan et al. 2020)
_ADAMW_FLOPS_PER_PARAM = 12
_BISECT_STEPS = 48

Placed = tuple[Node, Device]
PipelinePlanner = Callable[
    [Job, Sequence[Node], frozenset[str], ModelShape, Sequence[int] | None], "Plan | Blocked"
]
"""Placement's one-pipeline planner, as ``plan_replicas`` calls it for each replica."""

REPLICAS_CAPABILITY = "replicas"
"""What a node declares once its stages sync replicas (``train.sync``)."""
REPLICAS_PAY = 1.2
"""``split.replicas`` "auto" takes more replicas only where they are predicted this much faster
in tokens/s than one pipeline on the same devices: a prediction errs by more than a few percent,
and every replica is one more set of machines a sync waits for."""


BOTTLENECK_CAPABILITY = "calibrated-bottleneck"
"""What a node declares when it runs a learned bottleneck's calibrated halves (training
calibrates them; serving loads them from the trained shards)."""


def bottleneck_needs(n_stages: int, compression: Sequence[Compression]) -> dict[str, str]:
    """The capability a ring of ``n_stages`` with these boundaries needs of every node that
    holds one of its stages (training and serving alike), with why."""
    if n_stages > 1 and any(c.is_learned for c in compression):
        return {BOTTLENECK_CAPABILITY: "the learned bottleneck is calibrated on both sides"}
    return {}


def lacking_capabilities(
    nodes: Sequence[Node], needs: dict[str, str], own: frozenset[str]
) -> list[str]:
    """One line per node and needed capability it (or the planning peer, ``own``) lacks:
    ``"<node> lacks <cap> (<why>); update swarmp2p there"``, nodes in node-id order."""
    unique = sorted({nd.node_id: nd for nd in nodes}.values(), key=lambda x: x.node_id)
    return [
        f"{nd.name} lacks {cap} ({why}); update swarmp2p there"
        for nd in unique
        for cap, why in sorted(needs.items())
        if cap not in nd.capabilities or cap not in own
    ]


def gb(n: float) -> str:
    """Bytes as the "GB" (2**30 bytes) every message prints, one decimal."""
    return f"{n / GB:.1f}"


def usable_memory(device: Device) -> int:
    """Free memory a stage may take: memory_free less DEVICE_RESERVE."""
    return max(device.memory_free - DEVICE_RESERVE[device.kind], 0)


def candidate_devices(cluster: Sequence[Node]) -> list[Placed]:
    """Every device a stage may use, in pipeline order: GPUs when any exist, else CPUs."""
    nodes = sorted(cluster, key=lambda n: n.node_id)
    pairs = [(n, d) for n in nodes for d in sorted(n.devices, key=lambda d: (d.kind, d.index))]
    gpus = [(n, d) for n, d in pairs if d.is_gpu]
    return gpus or pairs


def torch_device(device: Device) -> str:
    """The torch device string of ``device`` on its node: "cpu", "cuda:1"."""
    return "cpu" if device.kind == "cpu" else f"{device.kind}:{device.index}"


def device_key(node: Node, device: Device) -> tuple[str, str, int]:
    """One physical device: (node id, kind, index)."""
    return (node.node_id, device.kind, device.index)


def min_max_partition(
    n_layers: int,
    n_stages: int,
    cost: Callable[[int, int, int], float],
    fits: Callable[[int, int, int], bool] | None = None,
) -> tuple[tuple[int, int], ...] | None:
    """Contiguous ranges, one per stage, minimising the largest `cost(stage, start, end)`.

    `cost` and `fits` must be monotone in the range (a sub-range never costs more and always
    fits when the range does). Bisection on the bound with a greedy check: each stage takes as
    many layers as the bound and `fits` allow, leaving one per remaining stage. None when no
    split satisfies `fits`.
    """
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"stages: must be between 1 and {n_layers}, got {n_stages}")

    def greedy(bound: float) -> tuple[tuple[int, int], ...] | None:
        ranges, start = [], 0
        for i in range(n_stages):
            max_end = n_layers - (n_stages - 1 - i)
            end = max_end if i == n_stages - 1 else start + 1
            if cost(i, start, end) > bound or (fits is not None and not fits(i, start, end)):
                return None
            while (
                end < max_end
                and cost(i, start, end + 1) <= bound
                and (fits is None or fits(i, start, end + 1))
            ):
                end += 1
            ranges.append((start, end))
            start = end
        return tuple(ranges)

    hi = max(cost(i, 0, n_layers) for i in range(n_stages))
    best = greedy(hi)
    if best is None:
        return None
    lo = 0.0
    for _ in range(_BISECT_STEPS):
        if hi - lo <= abs(hi) * 1e-9:
            break
        mid = (lo + hi) / 2
        found = greedy(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    return best


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitAttempt:
    ranges: tuple[tuple[int, int], ...] | None
    prices: tuple[StageMemory, ...]
    """Prices of `ranges`, or of the closest split found when it does not fit."""
    tried: tuple[tuple[int, int], ...]


class Placer:
    """Prices and splits one workload over one ordered list of device slots (training or
    serving: ``pricer`` and the compute model are what differ).

    A device may hold several consecutive slots (a serving ring with more stages than devices):
    while a split is searched each of its stages may take an equal share of its usable memory,
    and a finished split must fit every device with its stages together.
    """

    def __init__(
        self,
        shape: ModelShape,
        devices: list[Placed],
        pricer: StagePricer,
        *,
        mode: str,
        compression: tuple[Compression, ...] = (),
        in_flight: Sequence[int] | None = None,
        losses_held: int | None = None,
        tokens: int = 1,
        flops_per_param_token: int = TRAIN_FLOPS_PER_PARAM_TOKEN,
        update_trained: bool = False,
        attention_scores: Sequence[bool] | None = None,
        wire_v2: bool = True,
    ) -> None:
        """``attention_scores``: per device slot, whether its card holds the seq x seq
        attention scores (None: the pricer's workload decides for every slot).
        ``losses_held``: the most losses the last stage holds between a forward and its
        backward (``schedule.loss_held``; None: its ``in_flight``)."""
        self.shape, self.devices, self.pricer, self.mode = shape, devices, pricer, mode
        self.scores = list(attention_scores) if attention_scores is not None else None
        self.wire_v2 = wire_v2
        """Whether a quantized boundary crosses as its codes (every node declares wire-v2)."""
        self.n = len(devices)
        self.compression = compression
        self.flight = list(in_flight) if in_flight is not None else [1] * self.n
        self.losses_held = self.flight[-1] if losses_held is None else losses_held
        self.update_trained = update_trained
        self._tokens, self._flops, self._update = tokens, flops_per_param_token, update_trained
        keys = [device_key(node, dev) for node, dev in devices]
        self.usable = {k: usable_memory(dev) for k, (_, dev) in zip(keys, devices)}
        self._keys = keys
        self.free = [self.usable[k] // keys.count(k) for k in keys]
        self._active = [0]
        for p in shape.layer_active_params:
            self._active.append(self._active[-1] + p)
        self._params = [0]
        for p in shape.layer_params:
            self._params.append(self._params[-1] + p)
        self._clock: _speed.StageClock | None = None

    def price(self, i: int, start: int, end: int) -> StageMemory:
        return self.pricer.price(
            start,
            end,
            first=i == 0,
            last=i == self.n - 1,
            in_flight=self.flight[i],
            receive=self.compression[i - 1] if i > 0 and self.compression else None,
            send=self.compression[i] if i < self.n - 1 and self.compression else None,
            scores=self.scores[i] if self.scores is not None else None,
        )

    def fits(self, i: int, start: int, end: int) -> bool:
        return self.price(i, start, end).peak <= self.free[i]

    def memory_share(self, i: int, start: int, end: int) -> float:
        peak = self.price(i, start, end).peak
        return peak / self.free[i] if self.free[i] else float("inf") if peak else 0.0

    def compute_cost(self, i: int, start: int, end: int) -> float:
        """FLOPs of one step on stage i: every active parameter per token, the head's matmul
        on the last stage, and the optimizer's update over what trains in full."""
        active = self._active[end] - self._active[start]
        if i == self.n - 1:
            active += self.shape.head_compute_params
        cost = float(self._flops * self._tokens * active)
        if self._update:
            trained = self._params[end] - self._params[start]
            trained += self.pricer.held_outer_params(i == 0, i == self.n - 1)
            cost += _ADAMW_FLOPS_PER_PARAM * trained
        return cost

    def proportional(self) -> tuple[tuple[int, int], ...]:
        """Layer parameters in proportion to each device's free memory (>= 1 layer each)."""
        L, n = self.shape.n_layers, self.n
        total_free = sum(self.free) or n
        shares = self.free if sum(self.free) else [1] * n
        total = self._params[L]
        ranges, start, acc = [], 0, 0
        for i in range(n - 1):
            acc += shares[i]
            target = total * acc / total_free
            hi = L - (n - 1 - i)
            end = min(range(start + 1, hi + 1), key=lambda k: (abs(self._params[k] - target), k))
            ranges.append((start, end))
            start = end
        ranges.append((start, L))
        return tuple(ranges)

    @property
    def clock(self) -> _speed.StageClock:
        """Predicted stage times of this placement (``plan/speed.py``; a training step)."""
        if self._clock is None:
            self._clock = _speed.StageClock(self)
        return self._clock

    def overfull(
        self, ranges: tuple[tuple[int, int], ...], prices: Sequence[StageMemory] | None = None
    ) -> dict[tuple[str, str, int], int]:
        """Devices whose stages together need more than their usable memory: key -> bytes."""
        prices = prices or [self.price(i, a, b) for i, (a, b) in enumerate(ranges)]
        need: dict[tuple[str, str, int], int] = {}
        for key, price in zip(self._keys, prices):
            need[key] = need.get(key, 0) + price.peak
        return {k: v for k, v in need.items() if v > self.usable[k]}

    def all_fit(self, ranges: tuple[tuple[int, int], ...]) -> bool:
        return not self.overfull(ranges)

    def split(self, cuts: tuple[int, ...] | None = None) -> SplitAttempt:
        L, n, mode = self.shape.n_layers, self.n, self.mode
        cost = self.compute_cost
        if mode == "speed" and cuts is None:  # by predicted time; by free memory unless
            # every device's speed is measured
            cost, mode = self.clock.time, "cost" if self.clock.measured else "weighted"
        if cuts is not None or mode == "equal":  # the split is given (a trained model, a
            # resume, a test) or fixed by the mode
            if cuts is None:
                cuts = SplitSpec.even(L, n).boundaries
            found = tuple(itertools.pairwise((0, *cuts, L)))
            prices = tuple(self.price(i, a, b) for i, (a, b) in enumerate(found))
            return SplitAttempt(
                ranges=found if self.all_fit(found) else None, prices=prices, tried=found
            )
        if mode == "cost":
            found = min_max_partition(L, n, cost, self.fits)
        else:
            found = self.proportional()
            if not self.all_fit(found):
                # the split that needs the smallest share of any device's free memory
                found = min_max_partition(L, n, self.memory_share)
                if found is not None and not self.all_fit(found):
                    found = None
        # when nothing fits, report the split closest to fitting
        tried = found or min_max_partition(L, n, self.memory_share)
        assert tried is not None  # without `fits` there is always a split
        prices = tuple(self.price(i, a, b) for i, (a, b) in enumerate(tried))
        return SplitAttempt(ranges=found, prices=prices, tried=tried)


def select_devices(devices: list[Placed], n: int) -> list[Placed]:
    """The n devices with the most free memory, kept in pipeline order."""
    if n >= len(devices):
        return list(devices)
    ranked = sorted(range(len(devices)), key=lambda i: (-devices[i][1].memory_free, i))
    keep = set(ranked[:n])
    return [p for i, p in enumerate(devices) if i in keep]


def device_attempts(selected: list[Placed], auto: bool) -> list[list[Placed]]:
    """The device sets to try in turn: ``selected``, then (auto stages: as many as fit) fewer,
    dropping the device with the least free memory, one by one."""
    attempts = [list(selected)]
    rest = list(selected)
    while auto and len(rest) > 1:
        drop = min(range(len(rest)), key=lambda i: (rest[i][1].memory_free, -i))
        rest = rest[:drop] + rest[drop + 1 :]
        attempts.append(rest)
    return attempts


def replica_groups(
    devices: list[Placed], replicas: int, stages: int, dtype: str
) -> list[list[Placed]]:
    """``replicas`` groups of ``stages`` devices each, as alike as can be: the ``replicas x
    stages`` roomiest devices ranked by measured speed in ``dtype`` (then free memory) and
    dealt out snake-wise (0 1 1 0 ...), so no replica gets every fast device; each group
    in pipeline order."""
    chosen = select_devices(devices, replicas * stages)
    rank = sorted(
        range(len(chosen)),
        key=lambda i: (
            -(chosen[i][1].speed.get(dtype) or 0.0),
            -chosen[i][1].memory_free,
            i,
        ),
    )
    groups: list[list[int]] = [[] for _ in range(replicas)]
    for k, i in enumerate(rank):
        turn, at = divmod(k, replicas)
        groups[at if turn % 2 == 0 else replicas - 1 - at].append(i)
    return [[chosen[i] for i in sorted(g)] for g in groups]


# --- replicas: N copies of one split, each on its own devices ----------------------------------


def plan_replicas(
    job: Job,
    cluster: Sequence[Node],
    own: frozenset[str],
    shape: ModelShape,
    cuts: Sequence[int] | None,
    plan_pipeline: PipelinePlanner,
) -> Plan | Blocked:
    """``split.replicas`` N (or "auto": the count predicted fastest, if it pays), each replica
    planned by ``plan_pipeline`` (placement's one-pipeline planner) on its own devices."""
    capable = all(REPLICAS_CAPABILITY in n.capabilities for n in cluster)
    if job.split.replicas == "auto" and not (capable and REPLICAS_CAPABILITY in own):
        return plan_pipeline(job, cluster, own, shape, cuts)  # one pipeline, as before replicas
    if job.split.replicas != "auto":
        lacking = lacking_capabilities(
            list(cluster), {REPLICAS_CAPABILITY: f"split.replicas {job.split.replicas}"}, own
        )
        if lacking:
            return Blocked(
                reason=f"placed 0 of {job.split.replicas} replicas; "
                f"{len(lacking)} node(s) cannot sync replicas:\n"
                + "\n".join(lacking)
                + "\nor set split.replicas 1",
                required=int(job.split.replicas),
            )
        n = int(job.split.replicas)
        return _replicated(job, cluster, own, shape, cuts, n, plan_pipeline)[0]
    one = plan_pipeline(job, cluster, own, shape, cuts)
    if not isinstance(one, Plan) or one.timing is None or one.timing.step_s is None:
        return one  # unmeasured: nothing tells whether replicas pay
    tokens = job.train.batch_size * job.train.seq_len
    base = tokens / one.timing.step_s
    best, best_rate = one, base
    for n in range(2, len(candidate_devices(cluster)) + 1):
        plan, step_s = _replicated(job, cluster, own, shape, cuts, n, plan_pipeline)
        if isinstance(plan, Plan) and step_s and n * tokens / step_s > best_rate:
            best, best_rate = plan, n * tokens / step_s
    if best is one or best_rate < REPLICAS_PAY * base:
        return one
    stages = len(best.stages)
    note = (
        f"{best.n_replicas} replicas x {stages} stages: predicted {best_rate:.6g} tokens/s "
        f"against {base:.6g} for one pipeline of {len(one.stages)} stages"
    )
    return replace(best, notes=(*best.notes, note))


def _replicated(
    job: Job,
    cluster: Sequence[Node],
    own: frozenset[str],
    shape: ModelShape,
    cuts: Sequence[int] | None,
    n: int,
    plan_pipeline: PipelinePlanner,
) -> tuple[Plan | Blocked, float | None]:
    """N replicas of one split on their own devices, and the predicted seconds of a step of all
    of them, sync included (None without measured speeds). Every replica is split on its own
    first; the split shared is the one whose slowest replica is fastest on it."""
    candidates = candidate_devices(cluster)
    dtype = resolve_dtype(candidates, job.model.dtype)
    if cuts is not None:
        stages = len(cuts) + 1
    elif len(job.split.compression) > 1:
        stages = len(job.split.compression) + 1
    elif job.split.stages != "auto":
        stages = int(job.split.stages)
    else:
        stages = min(len(candidates) // n, shape.n_layers)
    usable = [p for p in candidates if p not in dtype.excluded]
    if stages < 1 or n * stages > len(usable):
        names = ", ".join(f"{nd.name} {d.label}" for nd, d in usable)
        return Blocked(
            reason=f"placed 0 of {n} replicas; split.replicas {n} x {max(stages, 1)} stages "
            f"needs {n * max(stages, 1)} devices running {dtype.dtype}, the cluster has "
            f"{len(usable)}: {names or 'none'}; add nodes or lower split.replicas",
            dtype=dtype.dtype,
            required=n * max(stages, 1),
            placed=len(usable),
        ), None
    one = replace(
        job,
        model=replace(job.model, dtype=dtype.dtype),
        split=replace(job.split, stages=stages, replicas=1),
    )
    groups = [_cluster_of(g) for g in replica_groups(usable, n, stages, dtype.dtype)]

    def on_all(split_cuts: Sequence[int] | None) -> list[Plan | Blocked]:
        first = plan_pipeline(one, groups[0], own, shape, split_cuts)
        if not isinstance(first, Plan):
            return [first]
        same = replace(one, train=replace(one.train, schedule=first.schedule.kind))
        fixed = split_cuts or [s.layer_start for s in first.stages[1:]]
        return [first] + [plan_pipeline(same, g, own, shape, fixed) for g in groups[1:]]

    if cuts is not None:
        options = [tuple(cuts)]
    else:
        alone = [plan_pipeline(one, g, own, shape, None) for g in groups]
        options = sorted(
            {tuple(s.layer_start for s in p.stages[1:]) for p in alone if isinstance(p, Plan)}
        )
        if not options:
            return _replica_blocked(alone, n), None
    tried = [on_all(c) for c in options]
    fitting = [t for t in tried if all(isinstance(p, Plan) for p in t)]
    if not fitting:
        return _replica_blocked(tried[0], n), None
    plans: list[Plan] = min(fitting, key=lambda t: _slowest(t) or 0.0)  # type: ignore[assignment]
    sync = _sync_s(job, shape, plans, {nd.node_id: nd for nd in cluster})
    step = _slowest(plans)
    plan = plans[0]
    idle = len(usable) - n * stages
    notes = [f"{n} replicas x {stages} stages, synced {_sync_text(job)}"]
    if step is not None:
        notes.append(f"predicted sync {sync:.3g} s/step on top of the slowest replica's {step:.6g}")
    if idle:
        notes.append(
            f"{idle} device(s) left idle: {n} replicas of {stages} stages use {n * stages}"
        )
    replicas = tuple(
        PlannedReplica(index=r, stages=p.stages, timing=p.timing)
        for r, p in enumerate(plans[1:], start=1)
    )
    plan = replace(plan, replicas=replicas, notes=(*plan.notes, *notes))
    return plan, (None if step is None else step + sync)


def _sync_text(job: Job) -> str:
    s = job.train.sync
    if s.mode == "step":
        return "every step (float32 gradients)"
    return (
        f"by DiLoCo every {s.inner_steps} steps (outer lr {s.lr:g}, momentum {s.momentum:g}, "
        f"{s.wire_bits}-bit changes)"
    )


def _cluster_of(group: list[Placed]) -> list[Node]:
    """The nodes of one replica, each holding only the devices the replica uses."""
    by_node: dict[str, list] = {}
    nodes: dict[str, Node] = {}
    for node, dev in group:
        by_node.setdefault(node.node_id, []).append(dev)
        nodes[node.node_id] = node
    return [replace(nodes[k], devices=tuple(v)) for k, v in by_node.items()]


def _slowest(plans: Sequence[Plan]) -> float | None:
    steps = [p.timing.step_s if p.timing else None for p in plans]
    return None if any(s is None for s in steps) else max(steps)  # type: ignore[type-var]


def _sync_s(job: Job, shape: ModelShape, plans: Sequence[Plan], nodes: dict[str, Node]) -> float:
    """Seconds a step spends syncing: the slowest stage's ring (stages sync side by side)."""
    sync = job.train.sync
    pricing = Pricing(
        dtype=plans[0].dtype,
        finetune_mode=job.finetune_mode,
        lora_r=job.model.lora.r,
        lora_targets=job.model.lora.target_modules,
    )
    worst = 0.0
    for i, stage in enumerate(plans[0].stages):
        a, b = stage.layers
        params = trained_params(
            shape, pricing, a, b, first=i == 0, last=i == len(plans[0].stages) - 1
        )
        peers = [nodes[p.stages[i].node_id] for p in plans]
        worst = max(
            worst, _speed.sync_s(params, len(plans), sync.wire_bits, sync.inner_steps, peers)
        )
    return worst


def _replica_blocked(plans: Sequence[Plan | Blocked], n: int) -> Blocked:
    blocked = [(r, p) for r, p in enumerate(plans) if isinstance(p, Blocked)]
    r, first = blocked[0]
    return Blocked(
        reason=f"replica {r} of {n}: {first.reason}",
        dtype=first.dtype,
        required=first.required,
        placed=first.placed,
    )


__all__ = [
    "DEVICE_RESERVE",
    "REPLICAS_CAPABILITY",
    "SERVE_FLOPS_PER_PARAM_TOKEN",
    "TRAIN_FLOPS_PER_PARAM_TOKEN",
    "Placed",
    "Placer",
    "SplitAttempt",
    "candidate_devices",
    "device_attempts",
    "device_key",
    "gb",
    "min_max_partition",
    "plan_replicas",
    "replica_groups",
    "select_devices",
    "torch_device",
    "usable_memory",
]
