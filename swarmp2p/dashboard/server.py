"""The dashboard's HTTP server: one page and one JSON endpoint, inside the daemon's loop.

It binds 127.0.0.1 only and answers only requests whose ``Host`` names a loopback host, so a
web page elsewhere cannot read it through DNS rebinding. ``/api/state`` also needs the user's
key: every local user can reach 127.0.0.1, and the swarm's state is the user's alone (the
local API is a 0600 unix socket). The URL `swarm dashboard` prints carries the key once
(``/?key=...``); the server answers it with an HttpOnly, SameSite=Strict cookie and a
redirect to ``/``, so the key leaves the address bar. `swarm dashboard --open` starts a
browser with a one-time link instead (``/?open=...``: a ticket made from the key, good once
and for ``Timings.dashboard_ticket_s``), since a browser's command line is visible to every
local user (``ps``) and a browser started that way keeps it for its whole life. The key lives 0600 in the state dir
(``dashboard.key``); delete it and restart to change it. To watch a remote node, forward the
port: ``ssh -L 7738:127.0.0.1:7738 HOST``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from swarmp2p._ratelog import HttpLog
from swarmp2p.dashboard.page import PAGE
from swarmp2p.dashboard.view import dashboard_view
from swarmp2p.timings import TIMINGS

DEFAULT_DASHBOARD_PORT = 7738
DASHBOARD_PORT_ENV = "SWARM_DASHBOARD_PORT"
"""``off`` disables the dashboard, ``0`` picks a free port, else the port (default 7738)."""
HOST = "127.0.0.1"
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})
_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'"
)

KEY_BYTES = 32
_KEY_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")

log = logging.getLogger("swarmp2p.dashboard")

StatusSource = Callable[[], Mapping[str, Any]]
"""Returns ``Daemon.status()``: the swarm as this node sees it."""


def parse_dashboard_port(text: str | None) -> int | None:
    """The dashboard port from ``SWARM_DASHBOARD_PORT``: None for ``off``, 0 for any free port;
    unset or empty gives the default. ValueError naming the value otherwise."""
    if text is None or not text.strip():
        return DEFAULT_DASHBOARD_PORT
    text = text.strip().lower()
    if text in ("off", "no", "none", "false"):
        return None
    if not text.isdigit() or not 0 <= int(text) < 65536:
        raise ValueError(
            f"{DASHBOARD_PORT_ENV}={text!r} is not a port in 0..65535 or 'off'; "
            f"e.g. {DASHBOARD_PORT_ENV}={DEFAULT_DASHBOARD_PORT} (0: any free port)"
        )
    return int(text)


def _host_name(host_header: str) -> str:
    if host_header.startswith("["):
        return host_header.split("]", 1)[0] + "]"
    return host_header.rsplit(":", 1)[0] if ":" in host_header else host_header


def _ticket_mac(key: str, stamp: str) -> str:
    return hmac.new(
        key.encode(), f"swarmp2p-dashboard-open:{stamp}".encode(), hashlib.sha256
    ).hexdigest()


def open_url(url: str, *, now: float) -> str:
    """The one-time link for a browser started on ``url`` (the address with its key, as
    `swarm dashboard` prints it): ``/?open=STAMP.MAC``, the key itself left out (a browser's
    argv is public). ValueError when ``url`` carries no key."""
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(url)
    key = parse_qs(parts.query).get("key", [""])[0]
    if not key:
        raise ValueError("the dashboard's URL carries no key")
    stamp = str(int(now))
    return f"{parts.scheme}://{parts.netloc}/?open={stamp}.{_ticket_mac(key, stamp)}"


def dashboard_key(path: Path | None) -> str:
    """The dashboard key saved 0600 at ``path`` (made there if absent, unreadable, malformed
    or readable by others); a fresh one, not saved, when ``path`` is None."""
    from swarmp2p._atomic import write_atomic

    if path is not None:
        try:
            key = path.read_text(encoding="ascii").strip()
            private = not stat.S_IMODE(path.stat().st_mode) & 0o077
            if private and len(key) >= 32 and set(key) <= _KEY_CHARS:
                return key
        except (OSError, UnicodeDecodeError):
            pass
    key = secrets.token_urlsafe(KEY_BYTES)
    if path is not None:
        write_atomic(path, key + "\n", mode=0o600)
    return key


class DashboardServer:
    """Serves ``/`` (the page) and ``/api/state`` (``dashboard_view`` of ``source()``, only to
    a browser holding the key)."""

    def __init__(
        self,
        source: StatusSource,
        *,
        port: int = DEFAULT_DASHBOARD_PORT,
        clock: Callable[[], float] = time.time,
        key: str | None = None,
    ) -> None:
        self._source = source
        self._clock = clock
        self._want_port = port
        self._runner: web.AppRunner | None = None
        self._key = key or secrets.token_urlsafe(KEY_BYTES)
        self._used: dict[str, float] = {}  # one-time links already taken -> when they expire
        self.port = 0

    @property
    def address(self) -> str:
        """The page's address, without the key (for logs)."""
        return f"http://{HOST}:{self.port}/"

    @property
    def url(self) -> str:
        """The address with the key: what `swarm dashboard` prints, for its user only."""
        return f"{self.address}?key={self._key}"

    @property
    def cookie(self) -> str:
        """Per port: cookies are not, and two daemons on one machine have two keys."""
        return f"swarmp2p_dashboard_{self.port}"

    def _has_key(self, request: web.Request) -> bool:
        got = request.cookies.get(self.cookie, "")
        return hmac.compare_digest(got.encode(), self._key.encode())

    async def start(self) -> None:
        """Bind and serve; OSError if the port is taken."""
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self._page)
        app.router.add_get("/api/state", self._state)
        # a malformed request is one line, rate-limited (not aiohttp's traceback each)
        runner = web.AppRunner(
            app, access_log=None, handle_signals=False, logger=HttpLog(log, "dashboard")
        )
        await runner.setup()
        site = web.TCPSite(runner, HOST, self._want_port, reuse_address=False)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        if _host_name(request.headers.get("Host", "")) not in _LOOPBACK_HOSTS:
            return web.Response(
                status=403, text="the swarm dashboard answers only on 127.0.0.1 or localhost\n"
            )
        response = await handler(request)
        response.headers.update(_HEADERS)
        return response

    def _take_ticket(self, ticket: str) -> bool:
        """True, once, for a one-time link made from this key less than ``Timings.dashboard_ticket_s`` ago."""
        now = self._clock()
        self._used = {t: until for t, until in self._used.items() if until > now}
        stamp, _, mac = ticket.partition(".")
        if not stamp.isdigit() or ticket in self._used:
            return False
        if (
            not -5 <= now - int(stamp) <= TIMINGS.dashboard_ticket_s
        ):  # 5 s: the CLI's clock read first
            return False
        if not hmac.compare_digest(mac.encode(), _ticket_mac(self._key, stamp).encode()):
            return False
        self._used[ticket] = int(stamp) + TIMINGS.dashboard_ticket_s + 5
        return True

    async def _page(self, request: web.Request) -> web.StreamResponse:
        key, ticket = request.query.get("key"), request.query.get("open")
        if ticket is not None and not self._take_ticket(ticket):
            return web.Response(status=403, text=_USED_TICKET)
        if key is not None or ticket is not None:
            if key is not None and not hmac.compare_digest(key.encode(), self._key.encode()):
                return web.Response(status=403, text=_WRONG_KEY)
            # the key moves into a cookie and out of the address bar (and the history)
            response = web.Response(status=303, headers={"Location": "/"})
            response.set_cookie(self.cookie, self._key, path="/", httponly=True, samesite="Strict")
            return response
        return web.Response(
            text=PAGE,
            content_type="text/html",
            charset="utf-8",
            headers={"Content-Security-Policy": _CSP},
        )

    async def _state(self, request: web.Request) -> web.Response:
        if not self._has_key(request):
            return web.json_response({"error": _WRONG_KEY.strip()}, status=401)
        view = dashboard_view(self._source(), now=self._clock())
        return web.Response(text=json.dumps(view), content_type="application/json")


_WRONG_KEY = (
    "this dashboard shows a user's swarm to that user only: open the URL `swarm dashboard` "
    "prints (it carries the key once), or run `swarm dashboard --open`\n"
)
_USED_TICKET = (
    f"this one-time link to the dashboard was used already or is older than {TIMINGS.dashboard_ticket_s} s: "
    "run `swarm dashboard --open` again (or open the URL `swarm dashboard` prints)\n"
)


async def start_dashboard(
    source: StatusSource, env: Mapping[str, str], *, key_file: Path | None = None
) -> tuple[DashboardServer | None, str]:
    """Start the daemon's dashboard as ``env`` says, its key kept in ``key_file`` (0600);
    ``(server, "")``, or ``(None, why)`` when it is off or its port is taken -- the daemon runs
    on without it and says why in status."""
    try:
        port = parse_dashboard_port(env.get(DASHBOARD_PORT_ENV))
    except ValueError as exc:
        log.warning("no dashboard: %s", exc)
        return None, str(exc)
    if port is None:
        return None, f"off ({DASHBOARD_PORT_ENV}=off)"
    try:
        key = dashboard_key(key_file)
    except OSError as exc:
        why = f"cannot save its key in {key_file}: {exc.strerror or exc}"
        log.warning("no dashboard: %s", why)
        return None, why
    server = DashboardServer(source, port=port, key=key)
    try:
        await server.start()
    except OSError as exc:
        why = (
            f"port {port} on {HOST} is taken ({exc.strerror or exc}); set {DASHBOARD_PORT_ENV} "
            "to a free port, 0 for any, or off"
        )
        log.warning("no dashboard: %s", why)
        return None, why
    log.info("dashboard at %s (its key: `swarm dashboard`)", server.address)
    return server, ""
