"""GPipe, 1F1B and zero-bubble op lists, what they hold, their price, and the bubble fraction."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmp2p.plan import Op, bubble_fraction, in_flight, stage_schedule
from swarmp2p.plan.schedule import SCHEDULES, OpCosts, held_peak, loss_held, ops_text, price


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
        ("zb-h1", 0, 2, 4, "F0 F1 B0 W0 B1 F2 W1 F3 B2 W2 B3 W3"),
        ("zb-h1", 1, 2, 4, "F0 B0 F1 B1 W0 W1 F2 B2 F3 B3 W2 W3"),
        ("zb-h1", 0, 1, 2, "F0 B0 W0 F1 B1 W1"),
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


@given(kind=st.sampled_from(SCHEDULES), n=st.integers(1, 6), m=st.integers(1, 12))
def test_every_op_list_runs_each_op_once_in_order_within_its_memory(kind, n, m):
    """Counts, dependencies (the op lists complete together: ``price`` finds no deadlock),
    ascending micro-batches on every link, and the activations held never above the plan's
    price (``in_flight``)."""
    split = kind.startswith("zb")
    for i in range(n):
        ops = stage_schedule(kind, i, n, m)
        for k in ("F", "B", "W") if split else ("F", "B"):
            assert [op.micro for op in ops if op.kind == k] == list(range(m)), (kind, i, k)
        assert len(ops) == (3 if split else 2) * m
        seen: set[str] = set()
        for op in ops:  # on the stage: B after its F, W after its B
            need = {"F": None, "B": f"F{op.micro}", "W": f"B{op.micro}"}[op.kind]
            assert need is None or need in seen, (kind, i, ops_text(ops))
            seen.add(str(op))
        assert held_peak(ops) == in_flight(kind, i, n, m)
        cap = {"gpipe": m, "1f1b": min(n - i, m), "zb-h1": min(n, m), "zb-h2": min(2 * n - 1, m)}
        assert in_flight(kind, i, n, m) <= cap[kind]
    unit = [OpCosts(forward=1, input_grad=1, weight_grad=1)] * n
    assert price(kind, unit, m).step >= 3 * m  # a stage's own work is a lower bound


@pytest.mark.parametrize(
    ("kind", "n", "m", "step", "bubble"),
    [
        ("1f1b", 2, 4, 15, 0.2),  # (M + N - 1)(F + B + W)
        ("zb-h1", 2, 4, 13, 1 / 13),  # 3M + (N - 1)(F + B - W): the paper's ZB-H1
        ("zb-h1", 2, 8, 25, 1 / 25),
        ("zb-h1", 4, 4, 15, 0.2),
        ("gpipe", 4, 8, 33, 9 / 33),
    ],
)
def test_price_at_unit_costs(kind, n, m, step, bubble):
    got = price(kind, [OpCosts(forward=1, input_grad=1, weight_grad=1)] * n, m)
    assert got.step == pytest.approx(step) and got.bubble == pytest.approx(bubble)


def test_price_counts_sends_and_a_slow_stage():
    fast, slow = (
        OpCosts(forward=1, input_grad=1, weight_grad=1),
        OpCosts(forward=2, input_grad=2, weight_grad=2),
    )
    even = price("1f1b", [fast, fast], 4).step
    assert price("1f1b", [fast, slow], 4).step > even
    sends = OpCosts(forward=1, input_grad=1, weight_grad=1, send_forward=0.5, send_backward=0.5)
    assert price("1f1b", [sends, sends], 4).step >= even + 1.0  # at least one round trip
    # without weight gradients to defer (a frozen base) zero-bubble gains nothing over 1F1B
    frozen = OpCosts(forward=1, input_grad=2, weight_grad=0)
    assert price("zb-h1", [frozen] * 2, 4).step >= price("1f1b", [frozen] * 2, 4).step


def test_the_last_stage_runs_each_backward_right_after_its_forward():
    assert [loss_held(k, 3, 4) for k in SCHEDULES] == [4, 1, 1, 1]


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
