"""Rate-limited logging: a daemon's refusals of bad requests, and what an aiohttp server logs
through (one line per malformed request). Imports nothing of the package (the daemon, the API
and the dashboard all use it).

:class:`RateLimitedLog` logs at most so many lines a second and counts the rest.

aiohttp logs every request it cannot parse (a bad request line, header or chunk) with
``logger.exception``: a full traceback each. 1,024 junk requests wrote 733 KB of them to a
daemon's log (issue 24). Handed to ``web.AppRunner(app, logger=HttpLog(...))``, this logs such
a request as one warning line (the peer and what was wrong, quoted, cut short), at most
:data:`LINES_PER_S` lines a second and a count of the rest
(:class:`RateLimitedLog`). An error raised inside a handler keeps its
traceback (it is a bug, not the client's bytes), under the same rate.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

_log = logging.getLogger("swarmp2p.node")

LINES_PER_S = 5
"""Lines a second about bad requests, per server."""
DETAIL_CHARS = 120
"""How much of what aiohttp says was wrong makes the line (the client chose those bytes)."""


class RateLimitedLog:
    """Log at most ``per_second`` lines a second to ``logger`` (default ``swarmp2p.node``);
    count and report what was dropped, as ``what`` ("bad requests")."""

    def __init__(
        self,
        per_second: int = 5,
        clock: Callable[[], float] = time.monotonic,
        *,
        logger: logging.Logger | None = None,
        what: str = "bad requests",
    ) -> None:
        self._per_second, self._clock = per_second, clock
        self._log, self._what = logger or _log, what
        self._window, self._count, self._dropped = 0.0, 0, 0

    def flush(self) -> None:
        """Report what was dropped once its one-second window is over."""
        now = self._clock()
        if now - self._window >= 1.0:
            if self._dropped:
                self._log.warning("... %d more %s in the last second", self._dropped, self._what)
            self._window, self._count, self._dropped = now, 0, 0

    def warning(self, fmt: str, *args: Any, **kw: Any) -> None:
        """``logger.warning(fmt, *args, **kw)`` unless this second's lines are used up."""
        self.flush()
        if self._count < self._per_second:
            self._count += 1
            self._log.warning(fmt, *args, **kw)
        else:
            self._dropped += 1


class HttpLog:
    """The ``logger`` of an aiohttp server (the two methods its request handler calls)."""

    def __init__(
        self, log: logging.Logger, what: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log, self._what = log, what
        self._lines = RateLimitedLog(
            LINES_PER_S, clock, logger=log, what=f"malformed {what} requests"
        )

    def exception(self, msg: str, *args: Any, exc_info: Any = True, **kw: Any) -> None:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError):
            peer = args[0] if args else "?"
            lines = str(exc.message).strip().splitlines() or [""]
            detail = lines[0][:DETAIL_CHARS]
            self._lines.warning(
                "%s: malformed HTTP request from %s: %d %r", self._what, peer, exc.code, detail
            )
        else:
            self._lines.warning(msg, *args, exc_info=exc_info, **kw)

    def debug(self, msg: str, *args: Any, exc_info: Any = None, **kw: Any) -> None:
        """Not HTTP at all on a connection's first request (aiohttp's own choice: debug); one
        line without the traceback."""
        if self._log.isEnabledFor(logging.DEBUG):
            exc = exc_info if isinstance(exc_info, BaseException) else None
            self._log.debug(
                "%s: not an HTTP request from %s (%s)",
                self._what,
                args[0] if args else "?",
                type(exc).__name__,
            )


__all__ = ["LINES_PER_S", "HttpLog", "RateLimitedLog"]
