"""Attacks against real daemons: the integration harness starts them (tests/integration); a
malicious member is the project's own client code with the swarm's token, sending what a
well-behaved node never would."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from swarm_harness import NodeProc, free_port

from swarmp2p.net import SwarmSecret


@pytest.fixture(scope="module")
def victim(tmp_path_factory):
    """One real daemon (node "v", its dashboard on a free port) and its token."""
    token = SwarmSecret.generate().token
    root = tmp_path_factory.mktemp("victim")
    port = free_port()
    args = ["--node-id", "v", "--name", "v", "--port", str(port), "--interface", "127.0.0.1"]
    env = {"SWARM_TOKEN": token, "SWARM_DASHBOARD_PORT": "0"}
    node = NodeProc(root / "v", [*args, "--no-mdns"], env=env).start()
    try:
        node.wait_up()
        node.token = token
        node.endpoint = f"tcp://127.0.0.1:{port}"
        yield node
    finally:
        node.stop()
