"""`swarm up` without --foreground daemonises, returns once the API answers; `swarm down` stops it."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from swarm_harness import ROOT, free_port, swarm_env, wait_until

from swarmp2p.node import api
from swarmp2p.node.state import StateDir

pytestmark = pytest.mark.slow


def _swarm(*args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "swarmp2p", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=swarm_env(),
        cwd=ROOT,
        timeout=60,
    )
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.fixture
def state(tmp_path):
    state = StateDir(root=tmp_path / "state")
    yield state
    pid = state.read_pid()
    if pid is not None:  # the test failed before `swarm down`
        os.kill(pid, signal.SIGKILL)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_up_creates_a_swarm_daemonises_and_down_stops_it(state):
    common = ["--state-dir", str(state.root)]
    port = free_port()
    out = _swarm(
        "up",
        *common,
        "--port",
        str(port),
        "--interface",
        "127.0.0.1",
        "--no-mdns",
        "--node-id",
        "solo",
    )
    assert "node solo" in out.stdout and "created a new swarm" in out.stdout
    join = out.stdout.strip().splitlines()[-1].strip()
    assert join.startswith("swarm up --token -") and "swarm1-" not in out.stdout
    assert _swarm("token", *common).stdout.strip().startswith("swarm1-")

    pid = state.read_pid()
    assert pid is not None and pid != os.getpid()
    assert stat.S_IMODE(state.root.stat().st_mode) == 0o700
    for path in (state.secret_file, state.api_socket, state.node_id_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    s = api.request(state.api_socket, "status")
    assert s["node_id"] == "solo" and s["port"] == port and s["pid"] == pid

    again = _swarm("up", *common, "--port", str(port))  # up twice: it is up, exit 0
    assert "node solo (" in again.stdout and f"already: pid {pid}" in again.stdout
    twice = _swarm("up", *common, "--foreground", check=False)  # a second foreground one: no
    assert twice.returncode == 2 and "already runs" in twice.stderr, twice.stderr
    assert "Traceback" not in twice.stderr

    out = _swarm("down", *common)
    assert f"pid {pid}" in out.stdout
    wait_until(lambda: _gone(pid), 5, "the daemon to exit")
    assert not state.pid_file.exists() and not state.api_socket.exists()
    assert "stopped" in state.log_file.read_text()
    assert "solo" in state.log_file.read_text()

    refused = _swarm("down", *common, check=False)
    assert refused.returncode != 0 and "no swarm daemon is running" in refused.stderr


def test_token_for_another_swarm_is_refused_on_existing_state(state):
    from swarmp2p.net.security import SwarmSecret

    state.ensure()
    SwarmSecret.generate().save(state.secret_file)
    other = SwarmSecret.generate()
    out = _swarm(
        "up", "--state-dir", str(state.root), "--token", "-", check=False, stdin=other.token
    )
    assert out.returncode != 0 and "already belongs to swarm" in out.stderr
    bad = _swarm(
        "up", "--state-dir", str(state.root), "--token", "-", check=False, stdin="swarm1-nope"
    )
    assert bad.returncode != 0 and "token" in bad.stderr.lower()


def test_sigterm_stops_a_foreground_daemon_cleanly(tmp_path):
    state = StateDir(root=tmp_path / "s")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "swarmp2p",
            "up",
            "--foreground",
            "--state-dir",
            str(state.root),
            "--port",
            "0",
            "--interface",
            "127.0.0.1",
            "--no-mdns",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=swarm_env(),
        cwd=ROOT,
    )
    try:
        wait_until(lambda: api.request(state.api_socket, "status", timeout=1), 30, "the daemon")
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert time.monotonic() - start < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err = proc.stderr.read().decode()
        proc.stderr.close()
    assert "created swarm" in err and "stopped" in err
    assert not state.api_socket.exists() and not state.pid_file.exists()


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--interface", "eth-none"], {}, "--interface 'eth-none' matches no interface"),
        (["--node-id", "Bad Id"], {}, "node id 'Bad Id' is not valid"),
        (["--peer", "nohost"], {}, "--peer 'nohost' is not HOST:PORT"),
        ([], {"SWARM_FAKE_DEVICES": "oops"}, "SWARM_FAKE_DEVICES item 0 'oops'"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path, args, env, message):
    state_dir = tmp_path / "never"
    out = subprocess.run(
        [sys.executable, "-m", "swarmp2p", "up", "--state-dir", str(state_dir), *args],
        capture_output=True,
        text=True,
        env=swarm_env(env),
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode != 0 and message in out.stderr, out.stderr
    assert not state_dir.exists()


@pytest.mark.parametrize("foreground", [False, True], ids=["background", "foreground"])
@pytest.mark.parametrize("taken", ["control", "join"])
def test_a_port_in_use_is_named_with_the_flag_that_moves_it(tmp_path, taken, foreground):
    import socket

    port = free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port + (2 if taken == "join" else 0)))
    holder.listen()
    state_dir = tmp_path / "s"
    try:
        out = _swarm(
            "up",
            "--state-dir",
            str(state_dir),
            "--port",
            str(port),
            "--interface",
            "127.0.0.1",
            "--no-mdns",
            *(["--foreground"] if foreground else []),
            check=False,
        )
    finally:
        holder.close()
    busy = port + (2 if taken == "join" else 0)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"port {busy} is in use by another process" in out.stderr, out.stderr
    assert "--port" in out.stderr and "Traceback" not in out.stderr
    assert StateDir(root=state_dir).read_pid() is None


def test_a_taken_dashboard_port_is_said_at_start_and_the_node_runs_without_it(state):
    """`swarm up` with SWARM_DASHBOARD_PORT taken: the node starts (the dashboard is not the
    swarm), and the start says why there is no dashboard and what moves it; no traceback."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    try:
        out = subprocess.run(
            [
                *(sys.executable, "-m", "swarmp2p", "up", "--state-dir", str(state.root)),
                *("--port", str(free_port()), "--interface", "127.0.0.1", "--no-mdns"),
            ],
            capture_output=True,
            text=True,
            env=swarm_env({"SWARM_DASHBOARD_PORT": str(taken)}),
            cwd=ROOT,
            timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"no dashboard: port {taken} on 127.0.0.1 is taken" in out.stderr, out.stderr
        assert "SWARM_DASHBOARD_PORT" in out.stderr and "Traceback" not in out.stderr
        status = _swarm("status", "--state-dir", str(state.root), "--json")
        assert f"port {taken}" in json.loads(status.stdout)["dashboard_note"]
    finally:
        holder.close()
        _swarm("down", "--state-dir", str(state.root), check=False)


def test_a_port_taken_between_the_check_and_the_bind_stops_the_daemon_naming_it(
    tmp_path, monkeypatch
):
    """The race the start-up check cannot close: the daemon's own bind names the port too,
    and daemon.log says it before `stopped` (the background `swarm up` reads it there)."""
    import asyncio
    import socket

    from swarmp2p.errors import UserError
    from swarmp2p.net import rpc
    from swarmp2p.net.security import SwarmSecret
    from swarmp2p.node.config import NodeConfig, setup_logging
    from swarmp2p.node.daemon import Daemon

    monkeypatch.setattr(rpc, "TIMINGS", replace(rpc.TIMINGS, rpc_rebind_s=0.2))
    port = free_port()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    state = StateDir(root=tmp_path / "s").ensure()
    config = NodeConfig(state_dir=state.root, port=port, interface="127.0.0.1", mdns=False)
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    setup_logging(state, foreground=False)
    try:
        with pytest.raises(UserError, match=f"port {port} is in use .*--port"):
            asyncio.run(Daemon(config, SwarmSecret.generate()).run())
    finally:
        holder.close()
        for handler in set(root.handlers) - set(handlers):
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
    log = state.log_file.read_text()
    assert f"cannot start: port {port} is in use" in log
