"""The held-out rule: a source's validation split is its last rows, one in twenty."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

HELD_OUT_EVERY = 20
"""One row in this many is held out; a source with fewer rows has no validation split.

The reference ("Held-out evaluation of a pipeline job"): the validation split is the last
rows, from `n - n // 20` on, and training is every row before them, so a job is never scored
on what it trained on; a source of fewer than 20 rows evaluates nothing rather than score on
its own training data.
"""


def validation_start(num_rows: int) -> int:
    """The index of the first validation row (`num_rows` when there is no validation split)."""
    if not isinstance(num_rows, int) or isinstance(num_rows, bool) or num_rows < 0:
        raise ValueError(f"num_rows must be a non-negative integer, got {num_rows!r}")
    return num_rows - num_rows // HELD_OUT_EVERY


@dataclass(frozen=True, kw_only=True, slots=True)
class Splits:
    """A source's rows, split into training and held-out validation."""

    train: tuple[str, ...]
    """Every row before the validation rows."""
    validation: tuple[str, ...]
    """The last rows, one in `HELD_OUT_EVERY`; empty for fewer than that many rows."""


def split_rows(rows: Sequence[str]) -> Splits:
    """Split rows by the held-out rule; order is kept."""
    start = validation_start(len(rows))
    return Splits(train=tuple(rows[:start]), validation=tuple(rows[start:]))
