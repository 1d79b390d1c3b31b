"""The swarm token never in a command line; `swarm down` signals only its own daemon.

Real daemons: `swarm up` daemonising, the demo's LocalSwarm, a foreground `swarm up`.
"""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest
from swarm_harness import ROOT, NodeProc, free_port, swarm_env, wait_until

from swarmp2p.client.control import read_token
from swarmp2p.net.security import SwarmSecret
from swarmp2p.node import api
from swarmp2p.node.state import StateDir


def _swarm(*args: str, stdin: str | None = None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarmp2p", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=swarm_env(env),
        cwd=ROOT,
        timeout=60,
    )


def _cmdlines_holding(secret: str) -> list[str]:
    """Every process's command line that holds ``secret`` (as any part of any argument)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if secret.encode() in argv:
                shown = argv.replace(b"\0", b" ")[:200]
                found.append(f"{proc.name}: {shown!r}")
    return found


def _solo_args(state: Path, node_id: str) -> list[str]:
    return [
        "--state-dir",
        str(state),
        "--port",
        str(free_port()),
        "--interface",
        "127.0.0.1",
        "--no-mdns",
        "--node-id",
        node_id,
    ]


def test_a_token_in_argv_is_refused_before_anything_is_written(tmp_path):
    token = SwarmSecret.generate().token
    state = tmp_path / "state"
    out = _swarm("up", *_solo_args(state, "solo"), "--token", token)
    assert out.returncode != 0
    assert "readable by every local user" in out.stderr and "SWARM_TOKEN" in out.stderr
    assert "--token-file" in out.stderr and "--token -" in out.stderr
    assert token not in out.stderr + out.stdout  # the error does not echo it either
    assert not state.exists()


def test_read_token_ways(tmp_path):
    token = SwarmSecret.generate().token
    file = tmp_path / "token"
    file.write_text(token + "\n")
    file.chmod(0o600)
    assert read_token(None, str(file), {}) == token
    assert read_token(None, None, {"SWARM_TOKEN": f" {token}\n"}) == token
    assert read_token(None, None, {}) is None
    file.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        read_token(None, str(file), {})
    with pytest.raises(ValueError, match="given twice"):
        read_token("-", None, {"SWARM_TOKEN": token})
    with pytest.raises(ValueError, match="no such file"):
        read_token(None, str(tmp_path / "none"), {})
    with pytest.raises(ValueError, match="only '-'"):
        read_token(token, None, {"SWARM_TOKEN": token})  # argv is named first


@pytest.mark.slow
def test_no_daemon_has_the_token_in_its_command_line(tmp_path):
    """`swarm up --token -` (daemonised) and the demo's LocalSwarm: while they run, no
    process's /proc/PID/cmdline holds either token, nor the daemonised one's environment."""
    from swarmp2p.demo import LocalSwarm

    secret = SwarmSecret.generate()
    state = StateDir(root=tmp_path / "solo")
    out = _swarm("up", *_solo_args(state.root, "solo"), "--token", "-", stdin=secret.token + "\n")
    assert out.returncode == 0, out.stderr
    try:
        assert secret.token not in out.stdout + out.stderr
        s = api.request(state.api_socket, "status")
        assert s["swarm_id"] == secret.swarm_id
        pid = s["pid"]
        assert secret.token.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
        with LocalSwarm(nodes=2, root=tmp_path / "demo", die_with_demo=False) as local:
            local.start()
            for token in (secret.token, local.token):
                assert _cmdlines_holding(token) == []
            joined = _swarm("token", "--state-dir", str(local.leader.state_dir))
            assert joined.stdout.strip() == local.token  # they did get the token
    finally:
        down = _swarm("down", "--state-dir", str(state.root))
        assert down.returncode == 0, down.stderr


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "120"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(5)


def _stamp(pid: int) -> str:
    start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{pid} {start} {boot}\n"


@pytest.mark.parametrize("forged", [False, True], ids=["stale-pid", "forged-stamp"])
def test_down_never_signals_a_process_that_is_not_its_daemon(tmp_path, sleeper, forged):
    """A pid file naming an unrelated live process (left by a crash, or written by someone
    who copied its start time): `swarm down` says no daemon runs, removes the pid file, and
    the process lives on."""
    state = StateDir(root=tmp_path / "s").ensure()
    state.pid_file.write_text(_stamp(sleeper.pid) if forged else f"{sleeper.pid}\n")
    out = _swarm("down", "--state-dir", str(state.root))
    assert out.returncode != 0
    assert "no swarm daemon is running" in out.stderr and "not a swarm daemon" in out.stderr
    assert sleeper.poll() is None
    assert not state.pid_file.exists()


@pytest.mark.slow
def test_down_never_signals_the_daemon_of_another_state_dir(tmp_path):
    """This state dir's pid file names a real, live swarm daemon -- of another state dir."""
    other = NodeProc(tmp_path / "other", _solo_args(tmp_path / "other", "other")[2:]).start()
    try:
        other.wait_up()
        state = StateDir(root=tmp_path / "mine").ensure()
        state.pid_file.write_text(_stamp(other.proc.pid))
        out = _swarm("down", "--state-dir", str(state.root))
        assert out.returncode != 0 and "daemon of another state dir" in out.stderr
        assert other.running() and other.status()["node_id"] == "other"
        # its own state dir's `swarm down` does stop it: the stamp it wrote matches
        assert stat.S_IMODE(other.state.pid_file.stat().st_mode) == 0o600
        other.state.api_socket.rename(tmp_path / "hidden.sock")  # the API does not answer
        out = _swarm("down", "--state-dir", str(other.state.root))
        assert out.returncode == 0, out.stderr
        wait_until(lambda: not other.running(), 10, "the daemon to stop")
    finally:
        other.stop()
