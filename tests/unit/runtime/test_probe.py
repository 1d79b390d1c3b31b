"""The speed probe's rate (runtime/probe.py): a passing load on the machine is kept out of a
CPU's measured speed; a quota still shows."""

from __future__ import annotations

import pytest

from swarmp2p.runtime.probe import rate


def test_a_probe_that_got_its_whole_share_is_rated_on_its_wall_time():
    assert rate(10e9, 1.0, 1.0, 1.0) == pytest.approx(10e9)
    assert rate(10e9, 1.0, 0.35, 0.35) == pytest.approx(10e9)  # a quota: slow on the wall clock


def test_a_probe_others_took_cpu_from_is_rated_on_the_cpu_time_it_got():
    # a 1-CPU node that got 0.6 s of its second: 6 GFLOP in 0.6 CPU seconds at 1 CPU's pace
    assert rate(6e9, 1.0, 0.6, 1.0) == pytest.approx(10e9)
    # a 0.35-CPU node that got 0.2 CPU seconds: as if it had had its 0.35
    assert rate(2e9, 1.0, 0.2, 0.35) == pytest.approx(2e9 / (0.2 / 0.35))


def test_more_cpu_time_than_the_share_never_speeds_it_up():
    assert rate(10e9, 1.0, 1.9, 1.0) == pytest.approx(10e9)  # spinning threads, an odd count


@pytest.mark.parametrize("cpus", [None, 0.0])
def test_without_a_share_or_on_a_gpu_the_wall_time_rates_it(cpus):
    assert rate(10e9, 2.0, 0.01, cpus) == pytest.approx(5e9)
