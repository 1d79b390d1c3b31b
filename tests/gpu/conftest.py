"""The GPU suite (``pytest -m gpu tests/gpu``): skipped without CUDA, run on the GPU machine by
``bench/gpu_check.sh``. The loopback daemons are the integration tests' (``loopback_swarm``,
``swarm_harness``), loaded from ``tests/integration`` so both suites start them one way."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _gpu, with --import-mode=importlib

_spec = importlib.util.spec_from_file_location("_integration_fixtures", INTEGRATION / "conftest.py")
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)  # puts tests/integration on sys.path: swarm_harness

loopback_swarm = _fixtures.loopback_swarm


@pytest.fixture(scope="module")
def gpu_swarm(tmp_path_factory):
    """Daemons a and b on 127.0.0.1 sharing this machine's GPU (each stage worker gets it
    through ``CUDA_VISIBLE_DEVICES``), a leading, for a whole module."""
    from swarmp2p.net.security import SwarmSecret

    swarm = _fixtures.LoopbackSwarm(tmp_path_factory.mktemp("gpu-swarm"))
    try:
        yield swarm.start("ab", token=SwarmSecret.generate().token)
    finally:
        swarm.stop_all()
