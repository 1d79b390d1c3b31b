"""One call from a job's data settings to training and validation windows."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from swarmp2p.data.sources import DEFAULT_TEXT_FIELD, load_splits
from swarmp2p.data.windows import TokenWindows, tokenize_rows, tokens_needed


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class PreparedData:
    """A source's training windows and its held-out validation windows."""

    train: TokenWindows
    """Windows over the training rows, cut at what the schedule needs (it wraps around after)."""
    validation: TokenWindows | None
    """Windows over the validation rows; None when the source holds none back or they do not
    fill one window — the job then evaluates nothing rather than score on training data."""
    train_rows: int
    """Rows in the training split."""
    validation_rows: int
    """Rows in the validation split (0 for a source of fewer than 20 rows)."""

    def eval_batches(self, batch_size: int, limit: int) -> int:
        """How many whole validation batches to score: at most `limit`, 0 when there are none.

        Batch `i` is `validation.batch(i, batch_size, seed=None)`: in order, never wrapping.
        """
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"limit must be a non-negative integer, got {limit!r}")
        tokens_needed(steps=1, batch_size=batch_size, seq_len=1)  # validates batch_size
        if self.validation is None:
            return 0
        return min(limit, self.validation.num_windows // batch_size)


def prepare_data(
    source: str | os.PathLike[str],
    tokenizer: Any,
    *,
    seq_len: int,
    steps: int,
    batch_size: int,
    text_field: str = DEFAULT_TEXT_FIELD,
    eval_batches: int | None = None,
    eos_id: int | None = None,
) -> PreparedData:
    """Load, split, tokenise: the training stream holds `tokens_needed(steps, batch_size,
    seq_len)` tokens when the source has them; validation holds `eval_batches` batches' worth
    (all of it when None)."""
    if eval_batches is not None and (
        not isinstance(eval_batches, int) or isinstance(eval_batches, bool) or eval_batches < 0
    ):
        raise ValueError(
            f"eval_batches must be a non-negative integer or None, got {eval_batches!r}"
        )
    splits = load_splits(source, text_field=text_field)
    needed = tokens_needed(steps=steps, batch_size=batch_size, seq_len=seq_len)
    train = TokenWindows.from_rows(
        splits.train, tokenizer, seq_len=seq_len, eos_id=eos_id, max_tokens=needed
    )
    validation = None
    if splits.validation and eval_batches != 0:
        cap = (
            None
            if eval_batches is None
            else tokens_needed(steps=eval_batches, batch_size=batch_size, seq_len=seq_len)
        )
        stream = tokenize_rows(splits.validation, tokenizer, eos_id=eos_id, max_tokens=cap)
        if len(stream) >= seq_len + 1:
            validation = TokenWindows(tokens=stream, seq_len=seq_len)
    return PreparedData(
        train=train,
        validation=validation,
        train_rows=len(splits.train),
        validation_rows=len(splits.validation),
    )
