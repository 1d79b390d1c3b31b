"""What `swarm up` is told: the node's configuration and its timing defaults; logging setup."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from swarmp2p.node.state import StateDir

DEFAULT_PORT = 7737
HEARTBEAT_S = 0.5
FAILURE_TIMEOUT_S = 3.0
FORGET_AFTER_S = 60.0
"""How long a dead (not cleanly stopped) peer stays listed with ``alive: false``."""
SUBMIT_TIMEOUT_S = 10.0


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeConfig:
    """Everything `swarm up` was told; timings are seconds."""

    state_dir: Path
    name: str = ""
    """Human name; the host name when empty."""
    node_id: str | None = None
    """Set (and save) the node id; None keeps the saved one or makes one."""
    port: int = DEFAULT_PORT
    interface: str | None = None
    """Pin one interface (name or IPv4); None: every non-container interface."""
    peers: tuple[str, ...] = ()
    """Static peers ``HOST:PORT`` (networks without multicast)."""
    mdns: bool = True
    heartbeat_s: float = HEARTBEAT_S
    failure_timeout_s: float = FAILURE_TIMEOUT_S
    forget_after_s: float = FORGET_AFTER_S

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port {self.port} is not in 0..65535")
        if not 0 < self.heartbeat_s < self.failure_timeout_s:
            raise ValueError(
                f"heartbeat interval {self.heartbeat_s} s must be > 0 and below the failure "
                f"timeout {self.failure_timeout_s} s"
            )
        for peer in self.peers:
            parse_peer(peer)


def parse_peer(text: str) -> str:
    """``HOST:PORT`` -> ``tcp://HOST:PORT``; ValueError saying what is expected."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--peer {text!r} is not HOST:PORT (e.g. 192.168.1.20:{DEFAULT_PORT})")
    return f"tcp://{host}:{int(port)}"


LOG_ENV = "SWARM_LOG"
"""Where a daemon logs: ``file`` (daemon.log in the state dir), ``stderr`` or ``both``."""
LOG_CHOICES = ("file", "stderr", "both")


def log_destinations(
    foreground: bool, env: Mapping[str, str] | None = None, stderr_fd: int = 2
) -> tuple[bool, bool]:
    """``(daemon.log, stderr)``: SWARM_LOG when set; else stderr alone when stderr is systemd's
    journal (JOURNAL_STREAM names its device:inode, systemd.exec(5)), which keeps and rotates
    it, so nothing is written twice; else daemon.log, and stderr too in the foreground."""
    env = os.environ if env is None else env
    choice = env.get(LOG_ENV, "").strip().lower()
    if choice:
        if choice not in LOG_CHOICES:
            raise ValueError(f"{LOG_ENV}={choice!r} is not one of {', '.join(LOG_CHOICES)}")
        return choice != "stderr", choice != "file"
    journal = env.get("JOURNAL_STREAM", "")
    if journal:
        try:
            st = os.fstat(stderr_fd)
            if journal == f"{st.st_dev}:{st.st_ino}":
                return False, True
        except OSError:
            pass
    return True, foreground


def setup_logging(state: StateDir, foreground: bool) -> None:
    """Log to ``daemon.log`` in the state dir and/or stderr (`log_destinations`)."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    to_file, to_stderr = log_destinations(foreground)
    handlers: list[logging.Handler] = []
    if to_file:
        handlers.append(logging.FileHandler(state.log_file))
    if to_stderr:
        handlers.append(logging.StreamHandler())
    for handler in handlers:
        handler.setFormatter(fmt)
        root.addHandler(handler)
    logging.getLogger("zeroconf").setLevel(logging.WARNING)
