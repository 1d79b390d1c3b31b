"""Micro-batch schedules: the op list each stage runs per step, what it holds, and its price.

GPipe (Huang et al., 2019) runs every forward, then every backward. 1F1B (PipeDream-Flush,
Narayanan et al., 2021) runs N-i-1 warm-up forwards on stage i of N, then one forward and one
backward in turn, then the remaining backwards, so stage i holds at most N-i micro-batches'
activations. Their ``B`` is the whole backward.

The zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) split each
backward into ``B``, the gradient of the stage's input, which the stage before waits for, and
``W``, its weight gradients, which nobody waits for, and fill the pipeline's idle time with
``W``. ``zb-h1`` lets every stage hold as many micro-batches as 1F1B's first stage does (N: the
pipeline's peak is 1F1B's), ``zb-h2`` 2N-1 (about twice the memory, no bubble when F, B and W
cost the same). Their op lists are the paper's greedy list schedule at unit costs: a free stage
runs the next ``B`` whose gradient has arrived, else the next ``F`` whose input has arrived while
it holds fewer than its cap, else its oldest pending ``W``. Every schedule answers micro-batches
in ascending order on every link, and a micro-batch's activations are held from its ``F`` to its
``W`` (to its ``B`` when there is no ``W``).

``price`` runs any schedule's op lists against per-op costs (seconds, or FLOPs at equal speed):
the step it predicts and its bubble, so the planner can choose.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2")
SPLIT_BACKWARD = frozenset({"zb-h1", "zb-h2"})
"""The schedules whose backward is split into B (input gradient) and W (weight gradients)."""
PREFERENCE = ("1f1b", "zb-h1", "zb-h2")
"""What ``auto`` prices, in its order among schedules priced the same: the least memory first
(GPipe is never faster than 1F1B and holds more: only a job that names it runs it)."""
ZERO_BUBBLE_CAPABILITY = "zero-bubble"
"""What a node declares when its runtime runs split-backward (B/W) op lists."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    """One step of a stage's schedule: a forward, an (input) backward or a weight pass of one
    micro-batch."""

    kind: str
    """"F", "B" or "W"."""
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}"


def _check(kind: str, stage: int, n_stages: int, micro_batches: int) -> None:
    if kind not in SCHEDULES:
        raise ValueError(f"schedule: must be one of {', '.join(SCHEDULES)}, got {kind!r}")
    if n_stages < 1:
        raise ValueError(f"n_stages: must be >= 1, got {n_stages}")
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage: must be in [0, {n_stages}), got {stage}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches: must be >= 1, got {micro_batches}")


def zero_bubble_cap(kind: str, n_stages: int, micro_batches: int) -> int:
    """The most micro-batches a zero-bubble stage holds (from F to W)."""
    per = {"zb-h1": n_stages, "zb-h2": 2 * n_stages - 1}[kind]
    return min(per, micro_batches)


def stage_schedule(kind: str, stage: int, n_stages: int, micro_batches: int) -> list[Op]:
    """The ops stage `stage` of `n_stages` runs for one step of `micro_batches` micro-batches."""
    _check(kind, stage, n_stages, micro_batches)
    m = micro_batches
    if kind == "gpipe":
        return [Op(kind="F", micro=j) for j in range(m)] + [Op(kind="B", micro=j) for j in range(m)]
    if kind in SPLIT_BACKWARD:
        return list(_zero_bubble(n_stages, m, zero_bubble_cap(kind, n_stages, m))[stage])
    warmup = min(n_stages - stage - 1, m)
    ops = [Op(kind="F", micro=j) for j in range(warmup)]
    for j in range(m - warmup):
        ops.append(Op(kind="F", micro=warmup + j))
        ops.append(Op(kind="B", micro=j))
    ops.extend(Op(kind="B", micro=j) for j in range(m - warmup, m))
    return ops


@functools.lru_cache(maxsize=64)
def _zero_bubble(n: int, m: int, cap: int) -> tuple[tuple[Op, ...], ...]:
    """Every stage's op list: the greedy list schedule at unit op costs (module docstring)."""
    ops: list[list[Op]] = [[] for _ in range(n)]
    f_end = [[-1] * m for _ in range(n)]  # the tick each op ends (-1: not run yet)
    b_end = [[-1] * m for _ in range(n)]
    nf, nb, nw = [0] * n, [0] * n, [0] * n
    t = 0
    while any(w < m for w in nw):
        for i in range(n):  # one tick: each stage sees only what ended by t
            if nb[i] < nf[i]:
                j = nb[i]
                ready = f_end[i][j] if i == n - 1 else b_end[i + 1][j]
                if 0 <= ready <= t:
                    ops[i].append(Op(kind="B", micro=j))
                    b_end[i][j], nb[i] = t + 1, j + 1
                    continue
            if nf[i] < m and nf[i] - nw[i] < cap:
                j = nf[i]
                ready = 0 if i == 0 else f_end[i - 1][j]
                if 0 <= ready <= t:
                    ops[i].append(Op(kind="F", micro=j))
                    f_end[i][j], nf[i] = t + 1, j + 1
                    continue
            if nw[i] < nb[i]:
                ops[i].append(Op(kind="W", micro=nw[i]))
                nw[i] += 1
        t += 1
    return tuple(tuple(o) for o in ops)


def in_flight(kind: str, stage: int, n_stages: int, micro_batches: int) -> int:
    """The most micro-batches whose activations stage `stage` holds at once (F to W, or to B
    when the schedule has no W)."""
    _check(kind, stage, n_stages, micro_batches)
    if kind in SPLIT_BACKWARD:
        cap = zero_bubble_cap(kind, n_stages, micro_batches)
        return held_peak(_zero_bubble(n_stages, micro_batches, cap)[stage])
    return held_peak(stage_schedule(kind, stage, n_stages, micro_batches))


def held_peak(ops: Sequence[Op]) -> int:
    """The most micro-batches an op list holds at once."""
    split = any(op.kind == "W" for op in ops)
    live = peak = 0
    for op in ops:
        if op.kind == "F":
            live += 1
            peak = max(peak, live)
        elif op.kind == ("W" if split else "B"):
            live -= 1
    return peak


def loss_held(kind: str, n_stages: int, micro_batches: int) -> int:
    """The most losses the last stage holds between a micro-batch's F and its B (1 when every
    B follows its F at once: the chunked loss then need not recompute the head)."""
    ops = stage_schedule(kind, n_stages - 1, n_stages, micro_batches)
    live = peak = 0
    for op in ops:
        live += {"F": 1, "B": -1}.get(op.kind, 0)
        peak = max(peak, live)
    return peak


def bubble_fraction(n_stages: int, micro_batches: int) -> float:
    """The idle share of a synchronous pipeline step: (N-1) / (M+N-1)."""
    if n_stages < 1 or micro_batches < 1:
        raise ValueError(
            f"n_stages and micro_batches must be >= 1, got {n_stages} and {micro_batches}"
        )
    return (n_stages - 1) / (micro_batches + n_stages - 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class OpCosts:
    """One stage's cost per micro-batch of each op, and of sending (seconds, or any unit)."""

    forward: float
    input_grad: float
    """B of a split backward: the gradient of the stage's input (and what cannot be deferred)."""
    weight_grad: float = 0.0
    """W: the weight gradients a split backward defers (a whole backward is B + W)."""
    send_forward: float = 0.0
    """Its activations reaching the next stage."""
    send_backward: float = 0.0
    """Its input gradient reaching the stage before."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulePrice:
    """What a schedule's op lists predict for one step."""

    kind: str
    step: float
    """From the first op to the last (the optimizer step is not in it)."""
    bubble: float
    """The stages' mean idle share of ``step``."""


def price(kind: str, costs: Sequence[OpCosts], micro_batches: int) -> SchedulePrice:
    """Run `kind`'s op lists against per-stage op costs: the step and its bubble. Raises
    ValueError when the op lists cannot complete (a dependency cycle)."""
    n = len(costs)
    lists = [stage_schedule(kind, i, n, micro_batches) for i in range(n)]
    return SchedulePrice(kind=kind, **_simulate(lists, costs))


def _simulate(lists: Sequence[Sequence[Op]], costs: Sequence[OpCosts]) -> dict[str, float]:
    n = len(lists)
    split = [any(op.kind == "W" for op in ops) for ops in lists]
    done: dict[tuple[int, str, int], float] = {}
    free, at, busy = [0.0] * n, [0] * n, [0.0] * n
    todo = list(range(n))  # stages that may run their next op now
    while todo:
        i = todo.pop()
        ops, c = lists[i], costs[i]
        while at[i] < len(ops):
            op = ops[at[i]]
            if op.kind == "F":
                dep = (
                    0.0
                    if i == 0
                    else _after(done, (i - 1, "F", op.micro), costs[i - 1].send_forward)
                )
                dur = c.forward
            elif op.kind == "B":
                dep = (
                    _after(done, (i, "F", op.micro), 0.0)
                    if i == n - 1
                    else _after(done, (i + 1, "B", op.micro), costs[i + 1].send_backward)
                )
                dur = c.input_grad + (0.0 if split[i] else c.weight_grad)
            else:
                dep = _after(done, (i, "B", op.micro), 0.0)
                dur = c.weight_grad
            if dep is None:
                break
            free[i] = max(free[i], dep) + dur
            busy[i] += dur
            done[(i, op.kind, op.micro)] = free[i]
            at[i] += 1
            wakes = i + 1 if op.kind == "F" else i - 1 if op.kind == "B" else -1
            if 0 <= wakes < n and wakes not in todo:
                todo.append(wakes)
    stuck = [str(lists[i][at[i]]) for i in range(n) if at[i] < len(lists[i])]
    if stuck:
        raise ValueError(f"the op lists deadlock: stages wait on {', '.join(stuck)}")
    step = max(free) if free else 0.0
    idle = 1.0 - sum(busy) / (n * step) if step > 0 else 0.0
    return {"step": step, "bubble": max(0.0, idle)}


def _after(done: dict, key: tuple[int, str, int], latency: float) -> float | None:
    end = done.get(key)
    return None if end is None else end + latency


def ops_text(ops: list[Op]) -> str:
    """["F0", "B0"] as "F0 B0"."""
    return " ".join(str(op) for op in ops)
