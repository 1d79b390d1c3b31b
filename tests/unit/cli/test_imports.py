"""The CLI's commands that talk to a running daemon (`swarm status`, `peers`, `jobs`, ...) load
the local API client and the printing helpers, none of the daemon: a fresh `swarm status`
starts, asks and prints in a fraction of a second (it took 1.2-1.6 s while ``swarmp2p.node``
imported the whole daemon)."""

from __future__ import annotations

import json
import os
import socketserver
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

CLIENT = {
    "swarmp2p.client",
    "swarmp2p.node",
    "swarmp2p.node.cluster",
    "swarmp2p.node.api",
    "swarmp2p.node.requests",
    "swarmp2p.node.config",
    "swarmp2p.client.control",
    "swarmp2p.node.cluster.election",
    "swarmp2p.client.jobs",
    "swarmp2p.client.relay",
    "swarmp2p.node.state",
}
"""What of ``swarmp2p.node`` and ``swarmp2p.client`` the CLI's client side may load."""
DAEMON = {
    "swarmp2p.node.serving",
    "swarmp2p.node.table",
    "swarmp2p.node.training",
    "swarmp2p.node.cluster.authz",
    "swarmp2p.node.context",
    "swarmp2p.node.training.corpus",
    "swarmp2p.node.daemon",
    "swarmp2p.node.decide",
    "swarmp2p.node.table.events",
    "swarmp2p.node.hardware",
    "swarmp2p.node.records",
    "swarmp2p.node.cluster.heartbeats",
    "swarmp2p.node.cluster.hellos",
    "swarmp2p.node.hub",
    "swarmp2p.node.training.inputs",
    "swarmp2p.node.training.resolve",
    "swarmp2p.node.training.jobs",
    "swarmp2p.node.training.api",
    "swarmp2p.node.training.leader",
    "swarmp2p.node.training.launch",
    "swarmp2p.node.training.snapshots",
    "swarmp2p.node.training.reports",
    "swarmp2p.node.table.jobtable",
    "swarmp2p.node.cluster.join",
    "swarmp2p.node.cluster.api",
    "swarmp2p.node.cluster.membership",
    "swarmp2p.node.messages",
    "swarmp2p.node.training.metrics",
    "swarmp2p.node.serving.model_files",
    "swarmp2p.node.cluster.pairing",
    "swarmp2p.node.table.registry",
    "swarmp2p.node.table.replication",
    "swarmp2p.node.table.election",
    "swarmp2p.node.table.follower",
    "swarmp2p.node.table.votes",
    "swarmp2p.node.table.served",
    "swarmp2p.node.serving.decide",
    "swarmp2p.node.serving.keys",
    "swarmp2p.node.serving.notes",
    "swarmp2p.node.table.store",
    "swarmp2p.node.serving.model",
    "swarmp2p.node.serving.ring",
    "swarmp2p.node.serving.stages",
    "swarmp2p.node.serving.standby",
    "swarmp2p.node.serving.relay",
    "swarmp2p.node.serving.service",
    "swarmp2p.node.speed_probe",
    "swarmp2p.node.training.stages",
    "swarmp2p.node.views",
    "swarmp2p.node.cluster.words",
}
"""The daemon's side of ``swarmp2p.node`` (`swarm up --code` imports pairing when it runs)."""
DAEMON_BESIDE = {"swarmp2p.workers"}
"""The daemon's modules outside ``swarmp2p.node`` (its worker processes)."""
MACHINERY = {
    # the swarm's sockets, RPC and wire codec (zmq, numpy), the dashboard's server, torch
    "swarmp2p.net.auth",
    "swarmp2p.net.links",
    "swarmp2p.net.rpc",
    "swarmp2p.wire.codec",
    "swarmp2p.dashboard.server",
    "aiohttp",
    "zmq",
    "numpy",
    "torch",
    "transformers",
}

SERVED = {
    "model": "tiny",
    "url": "",
    "state": "ready",
    "reason": "",
    "sessions": None,
    "stages": [{"node": "a", "layers": [0, 4]}],
}
FETCH = {"node": "a", "what": "tiny stage 0", "from": "b", "files": [1, 2], "bytes": [5e5, 2e6]}
ME = {
    "node_id": "a",
    "name": "host-a",
    "address": "127.0.0.1:7737",
    "alive": True,
    "is_leader": True,
    "last_seen_s": 0.0,
    "key": "df8a-d1d4-282c-3007",
    "member": True,
    "devices": [
        {"kind": "cpu", "index": 0, "name": "cpu", "memory_total": 2**34, "memory_free": 2**33}
    ],
    "version": "0",
    "capabilities": [],
}
STATUS = {
    "node_id": "a",
    "name": "host-a",
    "key": ME["key"],
    "swarm_id": "9fd0f912ee982658",
    "version": "0",
    "leader": "a",
    "leader_ready": True,
    "term": 1,
    "table_version": 3,
    "quorum": {
        "members": ["a"],
        "voters": ["a"],
        "down": [],
        "reachable": ["a"],
        "majority": 1,
        "ok": True,
        "commit": 3,
        "reason": "",
        "dropped": [],
    },
    "port": 7737,
    "peers": [ME],
    "jobs": [],
    "dashboard": None,
    "dashboard_note": "off",
    "served": [SERVED],
    "fetching": [FETCH],
}
REPLIES = {"status": STATUS, "jobs": [], "models": []}
COMMANDS = [
    ["status"],
    ["status", "--json"],
    ["peers"],
    ["dashboard", "--json"],
    ["jobs"],
    ["models"],
]

_PROBE = r"""
import json, sys
state_dir, commands, modules = json.loads(sys.argv[1])
import importlib
for name in modules:
    importlib.import_module(name)
codes = []
if commands:
    from swarmp2p.cli import main
for args in commands:
    try:
        main([*args, "--state-dir", state_dir])
    except SystemExit as exc:
        codes.append(exc.code)
print(json.dumps({"codes": codes, "modules": sorted(sys.modules)}))
"""


def _probe(state_dir: Path, commands: list[list[str]], modules: list[str]) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps([str(state_dir), commands, modules])],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    *printed, last = out.stdout.strip().splitlines()
    return json.loads(last), "\n".join(printed)


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        op = json.loads(self.rfile.readline())["op"]
        self.wfile.write(json.dumps({"ok": True, "result": REPLIES[op]}).encode() + b"\n")


@pytest.fixture
def fake_daemon(tmp_path):
    """A state dir whose API socket answers ``status``, ``jobs`` and ``models`` as a daemon
    would (a plain socket server: the daemon itself is what the CLI must not import)."""
    from swarmp2p.node.state import StateDir

    state = StateDir(root=tmp_path / "state").ensure()
    server = socketserver.ThreadingUnixStreamServer(str(state.api_socket), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state.root
    finally:
        server.shutdown()
        server.server_close()


def test_every_node_module_is_client_or_daemon():
    """A new module of ``swarmp2p.node`` or ``swarmp2p.client`` is named in CLIENT or DAEMON,
    so this test sees it."""
    files = [p for d in ("node", "client") for p in (ROOT / "swarmp2p" / d).rglob("*.py")]
    names = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in files}
    names = {n.removesuffix(".__init__") for n in names}
    assert names == CLIENT | DAEMON, sorted(names ^ (CLIENT | DAEMON))
    assert not CLIENT & DAEMON


def test_the_cli_and_the_api_client_import_no_daemon(tmp_path):
    result, _ = _probe(
        tmp_path,
        [],
        [
            "swarmp2p.cli",
            "swarmp2p.node.api",
            "swarmp2p.client.control",
            "swarmp2p.client.jobs",
            "swarmp2p.client.relay",
        ],
    )
    loaded = set(result["modules"])
    assert sorted(loaded & (DAEMON | DAEMON_BESIDE)) == []
    assert sorted(loaded & MACHINERY) == []


def test_commands_that_ask_the_daemon_import_none_of_it(fake_daemon):
    result, printed = _probe(fake_daemon, COMMANDS, [])
    assert result["codes"] == [0] * len(COMMANDS), printed
    # what they printed came from the fake daemon (the status table, its served and fetch lines)
    assert "leader  a" in printed and "host-a" in printed
    assert "served  tiny (ready): a [0-3]" in printed
    assert "fetch   a: tiny stage 0 from b: 1/2 files, 0.5/2.0 MB" in printed
    loaded = set(result["modules"])
    assert sorted(loaded & (DAEMON | DAEMON_BESIDE)) == []
    assert sorted(loaded & MACHINERY) == []


def test_swarm_token_reads_the_secret_without_the_sockets(tmp_path):
    """`swarm token` needs net.security (and zmq's z85), not the links, the RPC or the codec."""
    from swarmp2p.net.security import SwarmSecret
    from swarmp2p.node.state import StateDir

    state = StateDir(root=tmp_path / "state").ensure()
    secret = SwarmSecret.generate()
    secret.save(state.secret_file)
    result, printed = _probe(state.root, [["token"]], [])
    assert result["codes"] == [0] and printed == secret.token
    loaded = set(result["modules"])
    assert sorted(loaded & (DAEMON | DAEMON_BESIDE)) == []
    assert sorted(loaded & (MACHINERY - {"zmq"})) == []
