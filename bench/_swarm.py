"""Loopback daemons for the benchmarks: real ``swarm up --foreground`` processes on 127.0.0.1
(static peers, no mDNS, one state dir each), driven through the real CLI.

    with LoopbackSwarm("ab", tmp, env=env) as sw:
        sw.wait(lambda: len(sw.status("a")["peers"]) == 2, 60, "the swarm")
        out = sw.cli("b", "train", "job.json", "--detach", "--json")

``prefixes`` puts a command in front of a node's daemon (a cgroup CPU quota, say): its probe
and stage workers are its children and inherit it. ``api`` asks a daemon through its local API
socket from this process: a poll then costs no new Python process (a ``swarm ... --json`` is
about 0.3 s of CPU, which a benchmark polling every 0.5 s takes from the stages it times).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """``predicate()``'s first truthy value; a daemon not answering yet counts as falsy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (RuntimeError, ValueError, KeyError):
            value = None
        if value:
            return value
        time.sleep(interval)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


class LoopbackSwarm:
    """Daemons named by ``names`` (one letter each is fine), started on enter, stopped on exit."""

    def __init__(
        self,
        names: Iterable[str],
        tmp: Path,
        *,
        env: Mapping[str, str],
        prefixes: Mapping[str, Sequence[str]] | None = None,
        heartbeat: float = 0.2,
        failure_timeout: float = 2.0,
    ) -> None:
        self.names = list(names)
        self.tmp = tmp
        self.env = dict(env)
        self.prefixes = dict(prefixes or {})
        self.ports = {n: free_port() for n in self.names}
        self.extra = ["--heartbeat", str(heartbeat), "--failure-timeout", str(failure_timeout)]
        self.procs: list[subprocess.Popen] = []

    def state(self, name: str) -> Path:
        return self.tmp / name

    def __enter__(self) -> LoopbackSwarm:
        try:
            for n in self.names:
                peers = [
                    a
                    for p in self.names
                    if p != n
                    for a in ("--peer", f"127.0.0.1:{self.ports[p]}")
                ]
                cmd = [
                    *self.prefixes.get(n, ()),
                    sys.executable,
                    "-m",
                    "swarmp2p",
                    "up",
                    "--foreground",
                    "--state-dir",
                    str(self.state(n)),
                    "--node-id",
                    n,
                    "--port",
                    str(self.ports[n]),
                    "--interface",
                    "127.0.0.1",
                    "--no-mdns",
                    *self.extra,
                    *peers,
                ]
                with open(self.tmp / f"{n}.log", "wb") as log:
                    self.procs.append(
                        subprocess.Popen(
                            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT
                        )
                    )
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def cli(self, name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """``swarm ARGS`` against node ``name``'s daemon."""
        return subprocess.run(
            [sys.executable, "-m", "swarmp2p", *args, "--state-dir", str(self.state(name))],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            cwd=ROOT,
        )

    def api(self, name: str, op: str, **fields: Any) -> Any:
        """One local-API request to node ``name``'s daemon (``swarmp2p.node.api``)."""
        from swarmp2p.node import api
        from swarmp2p.node.state import StateDir

        try:
            return api.request(
                StateDir(root=self.state(name)).api_socket, op, timeout=30.0, **fields
            )
        except (OSError, api.ApiError) as exc:
            raise RuntimeError(str(exc)) from exc

    def status(self, name: str) -> dict:
        return self.api(name, "status")

    def ready(self, name: str) -> bool:
        """Every node is listed by ``name`` and it knows its leader."""
        status = self.status(name)
        return bool(status["leader_ready"]) and len(status["peers"]) == len(self.names)

    def log_tail(self, chars: int = 4000) -> str:
        return "\n".join(
            f"--- {n}.log ---\n{(self.tmp / f'{n}.log').read_text(errors='replace')[-chars:]}"
            for n in self.names
        )
