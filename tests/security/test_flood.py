"""An unauthenticated connection flood: the daemon keeps answering, keeps its peers and its
descriptors, and its log stays small (issue 15, item 6)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import zmq
from swarm_harness import NodeProc, agreed_on, free_port, swarm_env, wait_until

from swarmp2p.net import auth
from swarmp2p.net.auth import AsyncSecureContext
from swarmp2p.net.guard import MAX_PER_SOURCE, ConnectionGuard, admit
from swarmp2p.net.rpc import RpcServer
from swarmp2p.net.security import SwarmSecret
from swarmp2p.node.config import (
    ResourceErrorFilter,
    raise_open_file_limit,
    setup_logging,
)
from swarmp2p.node.state import StateDir
from swarmp2p.timings import TIMINGS

FLOOD = 1100
"""Idle TCP connections, as in the attack that exhausted a daemon (issue 15)."""


@pytest.mark.parametrize(
    ("live", "source", "per_source", "total", "why"),
    [
        ({}, "10.0.0.1", 2, 10, ""),
        ({"10.0.0.1": 1}, "10.0.0.1", 2, 10, ""),
        ({"10.0.0.1": 2}, "10.0.0.1", 2, 10, "per_source"),
        ({"10.0.0.1": 2}, "10.0.0.2", 2, 10, ""),
        ({"a": 2, "b": 2, "c": 1}, "d", 2, 5, "total"),
        ({"a": 2, "b": 2}, "a", 2, 5, "per_source"),
    ],
)
def test_admit(live, source, per_source, total, why):
    assert admit(live, source, per_source=per_source, total=total) == why


def _raw_connections(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        socks.append(s)
    return socks


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        while True:  # the server's greeting may come first
            if s.recv(65536) == b"":
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_the_guard_caps_live_connections_per_source_and_forgets_closed_ones():
    async def main() -> None:
        async def handler(msg, peer):
            return msg

        ctx = AsyncSecureContext()
        server = RpcServer(ctx, SwarmSecret.generate(), "127.0.0.1", 0, handler, max_per_source=8)
        await server.start()
        socks = _raw_connections(server.port, 20)
        try:
            guard = server.guard
            for _ in range(100):
                if sum(guard.stats.refused.values()) >= 12:
                    break
                await asyncio.sleep(0.02)
            assert guard.stats.live == {"127.0.0.1": 8}
            assert guard.stats.refused == {"127.0.0.1": 12}
            await asyncio.sleep(0.1)
            assert sum(_closed_by_peer(s) for s in socks) == 12
        finally:
            for s in socks:
                s.close()
        for _ in range(100):
            if not guard.stats.live:
                break
            await asyncio.sleep(0.02)
        assert guard.stats.live == {}  # closed connections are uncounted
        await server.close()
        ctx.destroy(0)

    asyncio.run(main())


def test_accept_failures_are_counted_not_fatal():
    guard = ConnectionGuard(None, port=1, what="test port")  # type: ignore[arg-type]
    for _ in range(5):
        guard.on_event(zmq.EVENT_ACCEPT_FAILED, errno.EMFILE)
    guard.on_event(zmq.EVENT_DISCONNECTED, 12345)  # a descriptor it never counted
    assert guard.stats.accept_errors == {"EMFILE": 5} and guard.stats.live == {}


def test_an_idle_connection_is_closed_after_the_handshake_timeout(monkeypatch):
    monkeypatch.setattr(auth, "TIMINGS", replace(auth.TIMINGS, zmq_handshake_ivl_ms=300))

    async def main() -> None:
        async def handler(msg, peer):
            return msg

        ctx = AsyncSecureContext()
        server = RpcServer(ctx, SwarmSecret.generate(), "127.0.0.1", 0, handler)
        await server.start()
        assert server._sock.getsockopt(zmq.HANDSHAKE_IVL) == 300
        (idle,) = _raw_connections(server.port, 1)
        try:
            await asyncio.sleep(0.1)
            assert not _closed_by_peer(idle)
            start = time.monotonic()
            while not _closed_by_peer(idle) and time.monotonic() - start < 5:
                await asyncio.sleep(0.05)
            assert _closed_by_peer(idle)
            for _ in range(100):
                if not server.guard.stats.live:
                    break
                await asyncio.sleep(0.02)
            assert server.guard.stats.live == {}
        finally:
            idle.close()
            await server.close()
            ctx.destroy(0)

    asyncio.run(main())


def test_resource_errors_are_rate_limited_without_tracebacks():
    now = [1000.0]
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    limit = ResourceErrorFilter(clock=lambda: now[0])
    handlers = [Collect(), Collect()]  # one filter shared by the file and stderr handlers
    logger = logging.getLogger("test.flood.asyncio")
    logger.propagate = False
    for h in handlers:
        h.addFilter(limit)
        logger.addHandler(h)
    try:
        emfile = OSError(errno.EMFILE, "Too many open files")
        for _ in range(1000):
            try:
                raise emfile
            except OSError:
                logger.error("socket.accept() out of system resource\nsocket: <...>", exc_info=True)
        logger.warning("an ordinary line")
        now[0] += TIMINGS.resource_errors_every_s
        try:
            raise RuntimeError("task failed") from emfile
        except RuntimeError:
            logger.exception("task takeover failed")
    finally:
        for h in handlers:
            logger.removeHandler(h)
    assert len(lines) == 2 * 3, lines  # each of 3 lines once per handler
    assert lines[0] == lines[1]
    assert lines[0].startswith("socket.accept() out of system resource (EMFILE")
    assert "Traceback" not in "".join(lines)
    assert lines[2] == "an ordinary line"
    assert "999 more in the last 10 s" in lines[4]


def test_daemon_log_rotates(tmp_path):
    state = StateDir(root=tmp_path).ensure()
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    setup_logging(state, foreground=False, max_bytes=4096)
    added = [h for h in root.handlers if h not in before]
    try:
        log = logging.getLogger("swarmp2p.test.rotate")
        for i in range(1000):
            log.warning("line %d %s", i, "x" * 100)
    finally:
        for h in added:
            root.removeHandler(h)
            h.close()
        root.setLevel(level)
    logs = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("daemon.log"))
    assert logs == ["daemon.log", "daemon.log.1", "daemon.log.2", "daemon.log.3"]
    assert all((tmp_path / n).stat().st_size <= 4096 + 200 for n in logs)


def test_raise_open_file_limit_goes_to_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 256)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        before, after = raise_open_file_limit()
        assert before == low
        assert after == resource.getrlimit(resource.RLIMIT_NOFILE)[0] > low
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _soft_nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no 'Max open files' in /proc/PID/limits")


@pytest.fixture
def enough_descriptors():
    """This test process holds the flood's sockets: raise its own soft limit for them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FLOOD + 512
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the hard open-file limit {hard} is below the {need} this test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
@pytest.mark.alone  # it times the daemon under a flood
def test_a_flood_of_idle_connections_leaves_the_daemon_serving(tmp_path, enough_descriptors):
    """Daemon a starts at the common soft limit of 1024 descriptors (hard 4096); 1,100 idle
    unauthenticated connections hit its control port. `swarm status` answers in < 1 s, the
    daemon keeps its peer and holds few descriptors, and its log grows by a line or two."""
    token = SwarmSecret.generate().token
    ports = {"a": free_port(), "b": free_port()}
    nodes = []
    limits = ["sh", "-c", 'ulimit -Sn 1024 && ulimit -Hn 4096 && exec "$@"', "sh"]
    for n in "ab":
        args = ["--node-id", n, "--name", n, "--port", str(ports[n]), "--interface", "127.0.0.1"]
        args += ["--no-mdns", "--peer", f"127.0.0.1:{ports['b' if n == 'a' else 'a']}"]
        env = {"SWARM_TOKEN": token, "SWARM_DASHBOARD_PORT": "off"}
        nodes.append(NodeProc(tmp_path / n, args, env=env, prefix=limits if n == "a" else ()))
    a, b = nodes
    socks: list[socket.socket] = []
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_up()
        wait_until(lambda: agreed_on(nodes, "a", 2), 30, "a and b to agree")
        wait_until(lambda: a.status()["leader_ready"], 30, "a to lead")
        assert _soft_nofile(a.proc.pid) == 4096  # raised from 1024 at start
        log_before = a.state.log_file.stat().st_size

        socks = _raw_connections(ports["a"], FLOOD)
        wait_until(lambda: "refused" in a.state.log_file.read_text()[log_before:], 10, "the guard")
        took = []
        for _ in range(10):
            start = time.monotonic()
            s = a.status(timeout=5.0)
            took.append(time.monotonic() - start)
            time.sleep(0.1)
        start = time.monotonic()
        cli = subprocess.run(
            [sys.executable, "-m", "swarmp2p", "status", "--state-dir", str(a.state.root)],
            capture_output=True,
            text=True,
            env=swarm_env(),
            timeout=60,
        )
        cli_s = time.monotonic() - start
        # the kernel holds what the listen backlog cannot take (SYN-ACK retries): count only
        # that the daemon shut most connections down at once
        closed = wait_until(
            lambda: (n := sum(_closed_by_peer(s) for s in socks)) >= FLOOD // 2 and n,
            30,  # 1,100 monitor events; slower while another test shares the cores
            "the daemon to shut down the connections past the cap",
        )
        fds = len(os.listdir(f"/proc/{a.proc.pid}/fd"))
        print(
            f"flood of {FLOOD}: status max {max(took) * 1000:.1f} ms, swarm status CLI "
            f"{cli_s:.2f} s, daemon fds {fds}, closed by the daemon {closed}"
        )
        assert max(took) < 1.0, took
        assert cli.returncode == 0 and "leader  a" in cli.stdout, cli.stderr
        assert fds < 4 * MAX_PER_SOURCE, fds
        assert sum(p["alive"] for p in s["peers"]) == 2 and s["leader"] == "a"
        assert sum(p["alive"] for p in b.status()["peers"]) == 2
        grown = a.state.log_file.read_text()[log_before:]
        assert len(grown) < 4096 and "Traceback" not in grown, grown
    finally:
        for s in socks:
            s.close()
        for node in nodes:
            node.stop()
