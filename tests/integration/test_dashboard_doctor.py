"""`swarm doctor` and `swarm dashboard` against real daemons on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from swarm_harness import ROOT, agreed_on, free_port, swarm_env, wait_until

from swarmp2p.net.security import SwarmSecret

TOKEN = SwarmSecret.generate().token
pytestmark = pytest.mark.slow


def _swarm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarmp2p", *args],
        capture_output=True,
        text=True,
        env=swarm_env(),
        cwd=ROOT,
        timeout=120,
    )


def _doctor(state_dir) -> tuple[int, dict]:
    out = _swarm("doctor", "--json", "--no-worker", "--state-dir", str(state_dir))
    assert out.returncode in (0, 1), out.stderr
    result = json.loads(out.stdout)
    return out.returncode, {c["name"]: c for c in result["checks"]}


def test_doctor_sees_peers_skew_and_a_dead_port(loopback_swarm):
    loopback_swarm.reserve("a", "b")
    port = free_port()
    a = loopback_swarm.node("a", token=TOKEN, env={"SWARM_DASHBOARD_PORT": str(port)}).start()
    b = loopback_swarm.node("b", token=TOKEN, env={"SWARM_DASHBOARD_PORT": "off"}).start()
    a.wait_up()
    b.wait_up()
    wait_until(lambda: agreed_on([a, b], "a", 2), 30, "two nodes agreeing on leader a")
    wait_until(
        lambda: all(p.get("clock_skew_s") is not None for p in a.status()["peers"][1:]),
        10,
        "a heartbeat round trip measuring b's clock",
    )

    out = _swarm("dashboard", "--state-dir", str(a.state.root))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(f"http://127.0.0.1:{port}/?key="), out.stdout
    off = _swarm("dashboard", "--state-dir", str(b.state.root))
    assert off.returncode == 1 and "serves no dashboard: off" in off.stderr

    code, checks = _doctor(a.state.root)
    assert checks["peer control ports"]["status"] == "PASS", checks
    assert f"b at 127.0.0.1:{loopback_swarm.ports['b']}" in checks["peer control ports"]["detail"]
    skew = checks["clock skew"]
    assert skew["status"] == "PASS" and skew["detail"].startswith("b "), skew  # one clock here
    assert checks["multicast (mDNS)"]["status"] == "WARN"  # the daemon uses loopback only

    b.kill()
    code, checks = _doctor(a.state.root)
    ports = checks["peer control ports"]
    assert code == 1 and ports["status"] == "FAIL", ports
    assert f"ufw allow {loopback_swarm.ports['b']}/tcp" in ports["fix"]
