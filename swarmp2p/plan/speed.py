"""Predicted step times: each stage's compute at its device's measured training speed, the bytes
it sends over the link, and the schedule's bubble. Pure, standard library only.

A device's speed is the training throughput ``swarmp2p.runtime.probe`` measured on it for one
dtype, in FLOP/s counted the planner's way: 6 FLOPs per parameter and token, forward 2 and
backward 4 (Kaplan et al. 2020). The rules:

- a stage's compute is the ``cost`` split's FLOPs for its layers (the head on the last stage,
  AdamW's update over what trains), plus another forward of its blocks under recompute and of
  the head when the chunked loss recomputes it (several chunks a micro-batch, or several
  micro-batches in flight on the last stage, as GPipe holds), at its device's speed;
- its link time is the bytes it sends per step (activations and labels forward, gradients back
  at the compute dtype) at the slower of the two nodes' link speeds, none between two stages
  of one node, none when a speed is unknown;
- the pipeline's step is ``(M - 1) / M`` of the slowest stage plus ``1 / M`` of the sum of all:
  the slowest stage paces the M micro-batches, the others fill and drain the pipeline.

The ``speed`` split (the default) minimises the slowest stage's time under every memory limit,
so the slow device gets fewer layers. It needs a speed for the job's dtype on every device it
uses; without one it splits by free memory (``weighted``) and the plan says which device lacks
a measurement (``swarm doctor --bench`` on that node takes one).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from swarmp2p.plan.hardware import DTYPE_BYTES, Device, Node
from swarmp2p.plan.memory import DEFAULT_LOSS_CHUNK_TOKENS
from swarmp2p.plan.schedule import OpCosts
from swarmp2p.schema import field

FLOPS_PER_PARAM_TOKEN = 6
"""Forward 2 + backward 4 (Kaplan et al. 2020): how the probe counts and the planner prices."""
RECOMPUTE_FLOPS_PER_PARAM_TOKEN = 2
"""A recomputed forward."""
LABEL_BYTES = 8
"""The int64 label of each token travels forward with the activations."""
_DIGITS = 6
"""Significant digits kept in a plan (peers compare plans byte for byte)."""


def _round(x: float) -> float:
    return float(f"{x:.{_DIGITS}g}")


def device_speed(device: Device, dtype: str) -> float | None:
    """The device's measured training FLOP/s in ``dtype``; None when never measured."""
    return device.speed.get(dtype)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageTime:
    """One stage's predicted share of a step."""

    flops: float = field(ge=0)
    """FLOPs per step."""
    sent_bytes: int = field(ge=0)
    """Bytes it sends per step over its boundaries."""
    speed: float | None = None
    """Its device's measured FLOP/s in the job's dtype (None: not measured)."""
    compute_s: float | None = None
    """``flops / speed`` (None without a speed)."""
    link_s: float = field(default=0.0, ge=0)
    """``sent_bytes`` over the link (0: one node, or the link speed is unknown)."""
    step_s: float | None = dataclass_field(init=False)
    """``compute_s + link_s`` (derived)."""

    def __post_init__(self) -> None:
        step = None if self.compute_s is None else _round(self.compute_s + self.link_s)
        object.__setattr__(self, "step_s", step)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedTiming:
    """A plan's predicted step: per stage, the pipeline's, and its bottleneck."""

    measured: bool
    """Every stage's device has a measured speed: the times are seconds."""
    stages: tuple[StageTime, ...]
    step_s: float | None = None
    """The pipeline's step, bubble included (None unless measured)."""
    bottleneck: int = field(default=0, ge=0)
    """The slowest stage (by time when measured, else by FLOPs)."""
    unmeasured: tuple[str, ...] = ()
    """The devices without a speed for the dtype, as "node device"."""


def pipeline_step_s(stage_s: Sequence[float], micro_batches: int) -> float:
    """A synchronous pipeline's step: the slowest stage paces the micro-batches, the rest fill
    and drain it: ``((M - 1) max + sum) / M``."""
    if not stage_s or micro_batches < 1:
        raise ValueError(
            f"need stage times and micro_batches >= 1, got {list(stage_s)} and {micro_batches}"
        )
    return ((micro_batches - 1) * max(stage_s) + sum(stage_s)) / micro_batches


def link_speed(a: Node, b: Node) -> float | None:
    """Bytes/s between two nodes' stages: None within one node (free) or when either link speed
    is unknown (not priced)."""
    if a.node_id == b.node_id or not a.link_speed or not b.link_speed:
        return None
    return float(min(a.link_speed, b.link_speed))


def ring_sync_bytes(payload_bytes: int, replicas: int) -> int:
    """Bytes each member of a ring all-reduce sends: ``2 (N - 1) / N`` of the payload
    (reduce-scatter, then all-gather; Patarasuk and Yuan 2009)."""
    if replicas < 2:
        return 0
    return 2 * (replicas - 1) * payload_bytes // replicas


def sync_bytes(params: int, replicas: int, bits: int) -> int:
    """Bytes each member sends to sync ``params`` once, ``bits`` wide: float32 by the ring
    all-reduce (``ring_sync_bytes``); int8 codes and bfloat16 cannot be summed in their own
    width on the way, so they go round whole (an all-gather: ``N - 1`` payloads each,
    ``runtime/torch/train/replicas/sync.py``), the same bytes as the ring at N = 2."""
    if replicas < 2:
        return 0
    payload = params * bits // 8
    return ring_sync_bytes(payload, replicas) if bits == 32 else (replicas - 1) * payload


def sync_s(params: int, replicas: int, bits: int, every: int, nodes: Sequence[Node]) -> float:
    """A stage's seconds per step spent averaging ``params`` over its ``replicas`` (on
    ``nodes``), ``bits`` wide, once every ``every`` steps: its ``sync_bytes`` at the slowest
    link among them; 0 when a link speed is unknown or the replicas share one node."""
    speeds = [link_speed(a, b) for a, b in itertools.pairwise(nodes)]
    if not speeds or any(s is None for s in speeds):
        return 0.0
    sent = sync_bytes(params, replicas, bits)
    return sent / min(s for s in speeds if s is not None) / every


class StageClock:
    """Prices any layer range of one placement in time (O(1) a range).

    ``placer`` is placement's placer: ``devices`` ((node, device) per stage), ``n``,
    ``compute_cost(i, start, end)``, ``shape``, ``pricer`` (its ``pricing.dtype`` and
    ``workload``), ``compression`` (one per boundary) and ``wire_v2``.
    """

    def __init__(self, placer: Any) -> None:
        self.placer = placer
        self.n = placer.n
        shape, workload = placer.shape, placer.pricer.workload
        self.dtype = placer.pricer.pricing.dtype
        self.tokens = workload.batch_size * workload.seq_len
        self.micro_batches = workload.micro_batches
        self.micro_tokens = workload.micro_tokens
        self.wire_v2 = placer.wire_v2
        self.recompute = workload.recompute
        self._active = [0]
        for p in shape.layer_active_params:
            self._active.append(self._active[-1] + p)
        self._head = shape.head_compute_params
        self.head_again = (
            placer.losses_held > 1 or workload.micro_tokens > DEFAULT_LOSS_CHUNK_TOKENS
        )
        """Whether the chunked loss runs the head again in backward (``chunked_head_loss``:
        not for one chunk whose backward comes next, as on 1F1B's last stage)."""
        self.speeds = [device_speed(d, self.dtype) for _, d in placer.devices]
        self.unmeasured = tuple(
            f"{node.name} {dev.label}"
            for (node, dev), s in zip(placer.devices, self.speeds)
            if s is None
        )
        self.measured = not self.unmeasured
        self.sent = [self._sent_bytes(i, shape.hidden) for i in range(self.n)]
        self.link_s = [self._link_s(i) for i in range(self.n)]

    def _forward_bytes(self, i: int) -> int:
        """Boundary i's activation frames (one a micro-batch, laid out as the wire encodes them:
        ``Compression.frame_bytes``) and the labels."""
        c, hidden = self.placer.compression[i], self.placer.shape.hidden
        frame = c.frame_bytes(self.micro_tokens, hidden, self.dtype, self.wire_v2)
        return self.micro_batches * frame + self.tokens * LABEL_BYTES

    def _backward_bytes(self, i: int) -> int:
        """The gradient of what stage i received over boundary i - 1, at the compute dtype (a
        learned bottleneck's is its code width wide)."""
        width = self.placer.compression[i - 1].payload_width(self.placer.shape.hidden)
        return self.tokens * width * DTYPE_BYTES[self.dtype]

    def _sent_bytes(self, i: int, hidden: int) -> int:
        out = 0
        if i < self.n - 1:  # activations (as the boundary's codec sends them) and labels
            out += self._forward_bytes(i)
        if i > 0:  # the gradient of what it received, at the compute dtype
            out += self._backward_bytes(i)
        return out

    def _link_s(self, i: int) -> float:
        devices, total = self.placer.devices, 0.0
        nxt = (i + 1,) if i < self.n - 1 else ()
        prev = (i - 1,) if i > 0 else ()
        for j in (*nxt, *prev):
            speed = link_speed(devices[i][0], devices[j][0])
            if speed is None:
                continue
            total += (self._forward_bytes(i) if j > i else self._backward_bytes(i)) / speed
        return total

    def flops(self, i: int, start: int, end: int) -> float:
        """Stage i's FLOPs per step over layers [start, end)."""
        cost = self.placer.compute_cost(i, start, end)
        again = 0
        if self.recompute:
            again += self._active[end] - self._active[start]
        if i == self.n - 1 and self.head_again:
            again += self._head
        return cost + float(RECOMPUTE_FLOPS_PER_PARAM_TOKEN * self.tokens * again)

    def time(self, i: int, start: int, end: int) -> float:
        """Stage i's predicted seconds per step (its FLOPs when speeds are not all measured:
        then devices count as equally fast)."""
        if not self.measured:
            return self.flops(i, start, end)
        return self.flops(i, start, end) / self.speeds[i] + self.link_s[i]

    def op_costs(self, ranges: Sequence[tuple[int, int]]) -> tuple[OpCosts, ...]:
        """Each stage's cost per micro-batch of F, B and W and of its sends, in seconds (FLOPs at
        equal speeds, no links, unless every speed is measured): F is 2 of the 6 FLOPs per
        parameter and token, W the weight gradients of its blocks when they train in full (2;
        adapters' are negligible), B the rest of the backward (a frozen base's input gradient,
        the head's, a recompute); the optimizer's update runs after the op list."""
        m, out = self.micro_batches, []
        for i, (a, b) in enumerate(ranges):
            blocks = self._active[b] - self._active[a]
            head = self._head if i == self.n - 1 else 0
            forward = 2.0 * self.tokens * (blocks + head)
            weights = 2.0 * self.tokens * blocks if self.placer.update_trained else 0.0
            update = self.placer.compute_cost(i, a, b) - 3 * forward
            backward = self.flops(i, a, b) - forward - weights - update
            rate = self.speeds[i] if self.measured else 1.0
            send = [0.0, 0.0]
            if self.measured:
                for j, at in ((i + 1, 0), (i - 1, 1)):
                    if 0 <= j < self.n:
                        speed = link_speed(self.placer.devices[i][0], self.placer.devices[j][0])
                        sent = self._forward_bytes(i) if at == 0 else self._backward_bytes(i)
                        send[at] = sent / speed / m if speed else 0.0
            out.append(
                OpCosts(
                    forward=forward / rate / m,
                    input_grad=backward / rate / m,
                    weight_grad=weights / rate / m,
                    send_forward=send[0],
                    send_backward=send[1],
                )
            )
        return tuple(out)

    def timing(self, ranges: Sequence[tuple[int, int]], micro_batches: int) -> PlannedTiming:
        """The predicted timing of a split."""
        stages = []
        for i, (a, b) in enumerate(ranges):
            flops = self.flops(i, a, b)
            speed = self.speeds[i]
            stages.append(
                StageTime(
                    flops=_round(flops),
                    sent_bytes=self.sent[i],
                    speed=speed,
                    compute_s=_round(flops / speed) if speed else None,
                    link_s=_round(self.link_s[i]),
                )
            )
        costs = [self.time(i, a, b) for i, (a, b) in enumerate(ranges)]
        bottleneck = max(range(len(costs)), key=lambda i: (costs[i], -i))
        step = _round(pipeline_step_s(costs, micro_batches)) if self.measured else None
        return PlannedTiming(
            measured=self.measured,
            stages=tuple(stages),
            step_s=step,
            bottleneck=bottleneck,
            unmeasured=self.unmeasured,
        )


def learned_speeds(
    timing: PlannedTiming, measured_compute_s: Sequence[float]
) -> tuple[float | None, ...]:
    """Each stage device's speed as the run measured it: its planned FLOPs over its measured
    compute seconds per step (None where nothing usable was measured)."""
    out: list[float | None] = []
    for stage, secs in zip(timing.stages, measured_compute_s):
        ok = isinstance(secs, (int, float)) and math.isfinite(secs) and secs > 0
        out.append(_round(stage.flops / secs) if ok and stage.flops > 0 else None)
    return tuple(out)


__all__ = [
    "FLOPS_PER_PARAM_TOKEN",
    "PlannedTiming",
    "StageClock",
    "StageTime",
    "device_speed",
    "learned_speeds",
    "link_speed",
    "pipeline_step_s",
]
