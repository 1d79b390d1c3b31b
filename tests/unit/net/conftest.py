"""Fixtures for the net tests."""

from __future__ import annotations

import pytest

from swarmp2p.net.links import stop_zero_copy_collector


@pytest.fixture(autouse=True)
def _stop_zmq_gc():
    """Zero-copy sends start pyzmq's collector thread; stop it so the leak check sees none."""
    yield
    assert stop_zero_copy_collector(), "a zero-copy send buffer was never released"
