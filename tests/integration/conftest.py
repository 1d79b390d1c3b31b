"""Fixtures: a factory of real daemons on 127.0.0.1 (static peers, no mDNS), all stopped after."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the suite imports test modules with --import-mode=importlib: make the harness importable
sys.path.insert(0, str(Path(__file__).resolve().parent))

from swarm_harness import NodeProc, agreed_on, free_port, wait_until


class LoopbackSwarm:
    """Starts daemons on 127.0.0.1 with known ports, each given the others as --peer."""

    def __init__(self, tmp_path) -> None:
        self.tmp_path = tmp_path
        self.nodes: list[NodeProc] = []
        self.ports: dict[str, int] = {}

    def reserve(self, *node_ids: str) -> None:
        """Pick the control ports of ``node_ids`` up front, so each can list the others."""
        for node_id in node_ids:
            self.ports.setdefault(node_id, free_port())

    def node(
        self, node_id: str, *, token: str | None = None, peers=None, env=None, port=None, mdns=False
    ) -> NodeProc:
        port = self.ports.setdefault(node_id, port or free_port())
        if peers is None:
            peers = [f"127.0.0.1:{p}" for n, p in self.ports.items() if n != node_id]
        args = ["--node-id", node_id, "--name", f"host-{node_id}", "--port", str(port)]
        args += ["--interface", "127.0.0.1"] + ([] if mdns else ["--no-mdns"])
        if token:  # in the environment, never in argv
            env = {**(env or {}), "SWARM_TOKEN": token}
        for peer in peers:
            args += ["--peer", peer]
        node = NodeProc(self.tmp_path / node_id, args, env=env)
        self.nodes.append(node)
        return node

    def start(self, ids: str, *, token: str, env=None) -> list[NodeProc]:
        """Daemons ``ids`` (one letter each) that all know each other, up, and agreed on the
        first as leader."""
        self.reserve(*ids)
        nodes = [self.node(n, token=token, env=env).start() for n in ids]
        for node in nodes:
            node.wait_up()
        wait_until(lambda: agreed_on(nodes, ids[0], len(ids)), 30, f"{ids} agreeing on a leader")
        wait_until(lambda: nodes[0].status()["leader_ready"], 30, f"leader {ids[0]} ready")
        return nodes

    def stop_all(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture
def loopback_swarm(tmp_path):
    swarm = LoopbackSwarm(tmp_path)
    try:
        yield swarm
    finally:
        swarm.stop_all()
