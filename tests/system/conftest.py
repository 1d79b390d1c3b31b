"""Fixtures for the system tests: hosts with their own network and disk (``hosts.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hosts import Lab, cannot_make_namespaces


@pytest.fixture
def netns_lab(tmp_path):
    """A factory: ``netns_lab(n)`` builds ``n`` hosts on a fresh bridge; all torn down after."""
    reason = cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    lab = Lab(tmp_path)
    try:
        yield lab.build
    finally:
        lab.teardown()


@pytest.fixture
def netns_lab_of(tmp_path):
    """Like ``netns_lab``, but yields the Lab itself (``build``, ``cut``, ``heal``)."""
    reason = cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    lab = Lab(tmp_path)
    try:
        yield lab
    finally:
        lab.teardown()
