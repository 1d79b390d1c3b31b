"""The held-out rule: the last rows, one in twenty; fewer than 20 rows hold nothing back."""

from __future__ import annotations

import pytest

from swarmp2p.data import HELD_OUT_EVERY, split_rows, validation_start


@pytest.mark.parametrize(
    ("num_rows", "validation"),
    [(0, 0), (1, 0), (19, 0), (20, 1), (39, 1), (40, 2), (100, 5), (101, 5), (1000, 50)],
)
def test_validation_is_the_last_twentieth(num_rows, validation):
    rows = [f"row {i}" for i in range(num_rows)]
    splits = split_rows(rows)
    assert len(splits.validation) == validation
    assert validation_start(num_rows) == num_rows - validation
    # training is every row before the validation rows, in order, and nothing is shared
    assert splits.train + splits.validation == tuple(rows)
    assert not set(splits.train) & set(splits.validation)


def test_the_rule_is_one_in_twenty():
    assert HELD_OUT_EVERY == 20
    assert split_rows([str(i) for i in range(100)]).validation == ("95", "96", "97", "98", "99")


@pytest.mark.parametrize("bad", [-1, 2.0, "3", True, None])
def test_bad_row_counts_are_rejected(bad):
    with pytest.raises(ValueError, match="num_rows must be a non-negative integer"):
        validation_start(bad)
