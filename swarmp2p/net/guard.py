"""A cap on live connections per source address of a listening ZeroMQ socket (asyncio).

libzmq accepts every TCP connection and holds its file descriptor until the handshake ends,
and ZAP never sees a client that connects and says nothing: 1,100 such idle connections
exhausted a daemon's descriptors (issue 15). The handshake timeout
(``Timings.zmq_handshake_ivl_ms``) bounds how long each stays; this guard bounds how
many one source holds. It reads the socket's monitor: ``EVENT_ACCEPTED`` carries the new
connection's descriptor, from which it reads the peer's address and counts it;
``EVENT_DISCONNECTED`` (same descriptor) uncounts it. A connection past the cap is shut down
at once (libzmq reads EOF and closes it). Refusals and accept failures (``EMFILE``...) are
counted and logged at most once per ``Timings.refusals_log_every_s``.

A monitor event is read after the fact, so the descriptor may by then belong to a newer
connection: the guard counts whatever peer the descriptor names when it reads it (the
newer connection's own events follow and keep the count right), and it shuts down only a TCP
connection accepted on its own port.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from swarmp2p._tasks import cancel_all
from swarmp2p.timings import TIMINGS

log = logging.getLogger(__name__)

MAX_PER_SOURCE = 64
"""Live connections one address may hold on a listening port. A peer daemon holds one to each
control port, and each `swarm` command or file pull briefly one more; 64 leaves room for a
host running many workers and the CLI, while a flood from one host stays small."""
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPT_FAILED


def default_max_total() -> int:
    """Half the open-file limit: the other half stays for peers, workers, files and the API."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(MAX_PER_SOURCE, soft // 2)


def admit(live: Mapping[str, int], source: str, *, per_source: int, total: int) -> str:
    """Whether one more connection from ``source`` may stay, given the ``live`` count per
    source: "" to admit, else the cap it would break."""
    if live.get(source, 0) >= per_source:
        return "per_source"
    if sum(live.values()) >= total:
        return "total"
    return ""


@dataclass
class GuardStats:
    """Counts since the guard started (``live``: now)."""

    live: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    accept_errors: Counter[str] = field(default_factory=Counter)


class ConnectionGuard:
    """Watches ``sock`` (bound to TCP ``port``) and caps its live connections per source."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        *,
        port: int,
        what: str,
        per_source: int = MAX_PER_SOURCE,
        total: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_source < 1:
            raise ValueError(f"per_source cap must be >= 1, got {per_source}")
        self._sock = sock
        self._port = port
        self._what = what
        self._per_source = per_source
        self._total = default_max_total() if total is None else total
        self._clock = clock
        self._fds: dict[int, str] = {}
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.stats = GuardStats()
        self._window_refused: Counter[str] = Counter()
        self._window_errors: Counter[str] = Counter()
        self._logged_at = -TIMINGS.refusals_log_every_s

    async def start(self) -> None:
        """Start reading the socket's monitor (call once the socket is bound)."""
        self._monitor = self._sock.get_monitor_socket(_EVENTS)
        self._task = asyncio.create_task(self._watch(), name=f"guard:{self._what}")

    async def close(self) -> None:
        await cancel_all(self._task)
        self._task = None
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._monitor.close(0)
            self._monitor = None
        self._flush_log(force=True)

    async def _watch(self) -> None:
        assert self._monitor is not None
        while True:
            if await self._monitor.poll(int(TIMINGS.refusals_log_every_s * 1000)):
                event = parse_monitor_message(await self._monitor.recv_multipart())
                self.on_event(int(event["event"]), int(event["value"]))
            self._flush_log()

    def on_event(self, event: int, value: int) -> None:
        """One monitor event: ``value`` is the descriptor (accepted, disconnected) or errno."""
        if event == zmq.EVENT_ACCEPTED:
            self._accepted(value)
        elif event == zmq.EVENT_DISCONNECTED:
            source = self._fds.pop(value, None)
            if source is not None:
                self.stats.live[source] -= 1
                if self.stats.live[source] <= 0:
                    del self.stats.live[source]
        elif event == zmq.EVENT_ACCEPT_FAILED:
            name = errno.errorcode.get(value, str(value))
            self.stats.accept_errors[name] += 1
            self._window_errors[name] += 1

    def _accepted(self, fd: int) -> None:
        try:
            conn = socket.socket(fileno=os.dup(fd))
        except OSError:  # already closed: its DISCONNECTED event follows
            return
        with conn:  # closes our duplicate only; libzmq keeps its own descriptor
            try:
                if conn.type != socket.SOCK_STREAM or conn.getsockname()[1] != self._port:
                    return  # the descriptor was reused for something else
                source = str(conn.getpeername()[0])
            except (OSError, IndexError):
                return
            if self._fds.get(fd) is not None:  # a reused descriptor whose close we missed
                self.on_event(zmq.EVENT_DISCONNECTED, fd)
            why = admit(self.stats.live, source, per_source=self._per_source, total=self._total)
            if why:
                self.stats.refused[source] += 1
                self._window_refused[source] += 1
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                return
            self._fds[fd] = source
            self.stats.live[source] += 1

    def _flush_log(self, force: bool = False) -> None:
        if not (self._window_refused or self._window_errors):
            return
        now = self._clock()
        if not force and now - self._logged_at < TIMINGS.refusals_log_every_s:
            return
        parts = []
        if self._window_refused:
            top = ", ".join(f"{n} from {s}" for s, n in self._window_refused.most_common(3))
            parts.append(
                f"refused {sum(self._window_refused.values())} connection(s) past the cap of "
                f"{self._per_source} per source / {self._total} in all ({top})"
            )
        if self._window_errors:
            errs = ", ".join(f"{n} x {e}" for e, n in self._window_errors.most_common())
            parts.append(f"accept failed {errs} (raise `ulimit -n`?)")
        since = "" if self._logged_at < 0 else f" in the last {now - self._logged_at:.0f} s"
        log.warning("%s: %s%s", self._what, "; ".join(parts), since)
        self._window_refused.clear()
        self._window_errors.clear()
        self._logged_at = now


__all__ = ["MAX_PER_SOURCE", "ConnectionGuard", "GuardStats", "admit"]
