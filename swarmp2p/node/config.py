"""What `swarm up` is told: the node's configuration and its timing defaults; logging setup."""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from logging.handlers import RotatingFileHandler
from pathlib import Path

from swarmp2p.errors import UserError
from swarmp2p.node.state import StateDir
from swarmp2p.timings import TIMINGS, Timings

_log = logging.getLogger("swarmp2p.node")

DEFAULT_PORT = 7737
MAX_WAITING_JOBS = 64
"""Jobs not finished yet (pending, placed, running, resuming) the leader holds in all; a
submission past it is refused before anything is written (``--max-waiting-jobs``)."""
MAX_WAITING_PER_SUBMITTER = 16
"""Jobs not finished yet that one node's submissions may hold (``--max-waiting-per-node``):
one member cannot fill the swarm's share alone."""
SUBMIT_BURST = 32


PORT_ROLES = {
    "control": "this node's control port; `swarm up --port N` picks another (0: any free port)",
    "join": "the join port, the control port + 2; `swarm up --port N` moves both",
}


def port_in_use(port: int, role: str) -> UserError:
    """The error for a port another process listens on: which port, what it is, the fix."""
    return UserError(
        f"port {port} is in use by another process: it is {PORT_ROLES[role]} (`ss -ltnp "
        f"'sport = :{port}'` shows who holds it)",
        code="bad_request",
    )


def check_port_free(host: str, port: int, role: str) -> None:
    """UserError (:func:`port_in_use`) when another process listens on ``host:port``; port 0
    (any free port) passes. Bound with SO_REUSEADDR as ZeroMQ binds, so a port a closed
    socket left in TIME_WAIT passes and only a live listener fails."""
    if port == 0:
        return
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise port_in_use(port, role) from None
        raise
    finally:
        sock.close()


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeConfig:
    """Everything `swarm up` was told."""

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
    timings: Timings = TIMINGS
    """Every timing of the daemon (`--heartbeat`, `--failure-timeout` set two); tests pass
    smaller ones."""
    open_swarm: bool = False
    """`swarm up --open`: any machine on the LAN joins without a code (a trusted home LAN only)."""
    max_waiting_jobs: int = MAX_WAITING_JOBS
    """The leader's cap on unfinished jobs in the table (``--max-waiting-jobs``)."""
    max_waiting_per_submitter: int = MAX_WAITING_PER_SUBMITTER
    """The leader's cap on one node's unfinished submissions (``--max-waiting-per-node``)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port {self.port} is not in 0..65535")
        for peer in self.peers:
            parse_peer(peer)
        if self.max_waiting_jobs < 1 or self.max_waiting_per_submitter < 1:
            raise ValueError(
                f"--max-waiting-jobs {self.max_waiting_jobs} and --max-waiting-per-node "
                f"{self.max_waiting_per_submitter} must be at least 1"
            )

    @property
    def heartbeat_s(self) -> float:
        return self.timings.heartbeat_s

    @property
    def failure_timeout_s(self) -> float:
        return self.timings.failure_timeout_s

    @property
    def forget_after_s(self) -> float:
        return self.timings.forget_after_s


def parse_peer(text: str) -> str:
    """``HOST:PORT`` -> ``tcp://HOST:PORT``; ValueError saying what is expected."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--peer {text!r} is not HOST:PORT (e.g. 192.168.1.20:{DEFAULT_PORT})")
    return f"tcp://{host}:{int(port)}"


LOG_MAX_BYTES = 10 << 20
LOG_BACKUPS = 3
"""``daemon.log`` rotates at 10 MB and keeps 3 old files: at most 40 MB, whatever a flood does."""
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
NOFILE_CAP = 1 << 20
"""The soft open-file limit is raised to the hard limit, but not past this (an unlimited hard
limit would make a table of 2**63 descriptors)."""


class ResourceErrorFilter(logging.Filter):
    """Rate-limits records about running out of descriptors (EMFILE, ENFILE, ENOBUFS, ENOMEM):
    asyncio logs a traceback on every failed ``accept()``, about 1 MB/s in a flood."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._last: float | None = None
        self._dropped = 0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        verdict = getattr(record, "_swarm_resource_verdict", None)
        if verdict is not None:  # a second handler sees the record this filter judged
            return verdict
        name = _resource_errno(record)
        if name is None:
            return True
        with self._lock:
            now = self._clock()
            if self._last is not None and now - self._last < TIMINGS.resource_errors_every_s:
                self._dropped += 1
                verdict = False
            else:
                first = record.getMessage().splitlines()[0] if record.getMessage() else ""
                more = (
                    f"; {self._dropped} more in the last {now - self._last:.0f} s"
                    if self._last is not None and self._dropped
                    else ""
                )
                record.msg = f"{first} ({name}: out of descriptors or buffers{more}; `ulimit -n`?)"
                record.args = None
                record.exc_info = record.exc_text = None
                self._last, self._dropped = now, 0
                verdict = True
        record._swarm_resource_verdict = verdict
        return verdict


def _resource_errno(record: logging.LogRecord) -> str | None:
    exc = record.exc_info[1] if record.exc_info else None
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
            return errno.errorcode[exc.errno]
        exc = exc.__cause__ or exc.__context__
    return None


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


def setup_logging(state: StateDir, foreground: bool, *, max_bytes: int = LOG_MAX_BYTES) -> None:
    """Log to ``daemon.log`` in the state dir (rotated past ``max_bytes``, LOG_BACKUPS kept)
    and/or stderr (`log_destinations`); errors about running out of descriptors are
    rate-limited."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    to_file, to_stderr = log_destinations(foreground)
    handlers: list[logging.Handler] = []
    if to_file:
        handlers.append(
            RotatingFileHandler(state.log_file, maxBytes=max_bytes, backupCount=LOG_BACKUPS)
        )
    if to_stderr:
        handlers.append(logging.StreamHandler())
    limit = ResourceErrorFilter()
    for handler in handlers:
        handler.setFormatter(fmt)
        handler.addFilter(limit)
        root.addHandler(handler)
    logging.getLogger("zeroconf").setLevel(logging.WARNING)


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (at most NOFILE_CAP); returns
    ``(before, after)``. Many distributions start processes at 1024, which one flood or a few
    hundred shard files and sockets use up."""
    try:
        import resource
    except ImportError:  # not a Unix
        return (0, 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = NOFILE_CAP if hard == resource.RLIM_INFINITY else min(hard, NOFILE_CAP)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):  # e.g. a cap below the hard limit (fs.nr_open)
            return (soft, soft)
        return (soft, want)
    return (soft, soft)
