"""GPipe and 1F1B op lists, and the bubble fraction."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmp2p.plan import Op, bubble_fraction, in_flight, stage_schedule
from swarmp2p.plan.schedule import ops_text


@pytest.mark.parametrize(
    ("kind", "stage", "n", "m", "text"),
    [
        ("gpipe", 0, 2, 3, "F0 F1 F2 B0 B1 B2"),
        ("1f1b", 0, 2, 3, "F0 F1 B0 F2 B1 B2"),
        ("1f1b", 1, 2, 3, "F0 B0 F1 B1 F2 B2"),
        ("1f1b", 0, 4, 4, "F0 F1 F2 F3 B0 B1 B2 B3"),
        ("1f1b", 1, 4, 4, "F0 F1 F2 B0 F3 B1 B2 B3"),
        ("1f1b", 0, 4, 2, "F0 F1 B0 B1"),
        ("1f1b", 0, 1, 2, "F0 B0 F1 B1"),
    ],
)
def test_schedules(kind, stage, n, m, text):
    assert ops_text(stage_schedule(kind, stage, n, m)) == text


def test_op_is_a_frozen_record():
    op = Op(kind="F", micro=2)
    assert str(op) == "F2"
    with pytest.raises(AttributeError):
        op.micro = 3  # type: ignore[misc]


@given(
    kind=st.sampled_from(["gpipe", "1f1b"]),
    n=st.integers(1, 8),
    m=st.integers(1, 16),
    data=st.data(),
)
def test_schedule_properties(kind, n, m, data):
    stage = data.draw(st.integers(0, n - 1))
    ops = stage_schedule(kind, stage, n, m)
    forwards = [op.micro for op in ops if op.kind == "F"]
    backwards = [op.micro for op in ops if op.kind == "B"]
    assert forwards == list(range(m)) and backwards == list(range(m))
    live, peak = 0, 0
    for op in ops:
        live += 1 if op.kind == "F" else -1
        peak = max(peak, live)
        assert live >= 0  # a backward never precedes its forward
    assert peak == in_flight(kind, stage, n, m)
    if kind == "1f1b":
        warmup = next(i for i, op in enumerate(ops) if op.kind == "B") - 1
        assert warmup == min(n - stage - 1, m - 1) or m <= n - stage - 1


@pytest.mark.parametrize(
    ("n", "m", "f"), [(1, 4, 0.0), (2, 4, 0.2), (4, 4, 3 / 7), (4, 32, 3 / 35)]
)
def test_bubble_fraction(n, m, f):
    assert bubble_fraction(n, m) == pytest.approx(f)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [(("zb", 0, 2, 2), "schedule"), (("1f1b", 2, 2, 2), "stage"), (("gpipe", 0, 2, 0), "micro")],
)
def test_schedule_rejects(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        stage_schedule(*args)
