"""Micro-batch schedules: the op list each stage runs per step, and the pipeline bubble.

GPipe (Huang et al., 2019) runs every forward, then every backward. 1F1B (PipeDream-Flush,
Narayanan et al., 2021) runs N-i-1 warm-up forwards on stage i of N, then one forward and one
backward in turn, then the remaining backwards, so stage i holds at most N-i micro-batches'
activations. Both answer micro-batches in ascending order on every link.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    """One step of a stage's schedule: a forward or backward of one micro-batch."""

    kind: str
    """"F" or "B"."""
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


def stage_schedule(kind: str, stage: int, n_stages: int, micro_batches: int) -> list[Op]:
    """The ops stage `stage` of `n_stages` runs for one step of `micro_batches` micro-batches."""
    _check(kind, stage, n_stages, micro_batches)
    m = micro_batches
    if kind == "gpipe":
        return [Op(kind="F", micro=j) for j in range(m)] + [Op(kind="B", micro=j) for j in range(m)]
    warmup = min(n_stages - stage - 1, m)
    ops = [Op(kind="F", micro=j) for j in range(warmup)]
    for j in range(m - warmup):
        ops.append(Op(kind="F", micro=warmup + j))
        ops.append(Op(kind="B", micro=j))
    ops.extend(Op(kind="B", micro=j) for j in range(m - warmup, m))
    return ops


def in_flight(kind: str, stage: int, n_stages: int, micro_batches: int) -> int:
    """The most micro-batches whose activations stage `stage` holds at once."""
    _check(kind, stage, n_stages, micro_batches)
    if kind == "gpipe":
        return micro_batches
    return min(n_stages - stage, micro_batches)


def bubble_fraction(n_stages: int, micro_batches: int) -> float:
    """The idle share of a synchronous pipeline step: (N-1) / (M+N-1)."""
    if n_stages < 1 or micro_batches < 1:
        raise ValueError(
            f"n_stages and micro_batches must be >= 1, got {n_stages} and {micro_batches}"
        )
    return (n_stages - 1) / (micro_batches + n_stages - 1)


def ops_text(ops: list[Op]) -> str:
    """["F0", "B0"] as "F0 B0"."""
    return " ".join(str(op) for op in ops)
