"""The local API between the CLI and its daemon: JSON lines over a unix socket.

Why a unix socket: it lives in the 0700 state directory and is itself 0600, so the kernel lets
only the user who runs the daemon (and root) open it -- no key is needed, and nothing on it is
ever reachable from the network. Each request is one JSON object ``{"op": ..., ...}`` on one
line; each reply is ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "..."}``.
The request's fields are a typed record (``swarmp2p.node.requests``): the client builds it
(:func:`send`), the server parses it back before the handler runs, naming a bad field.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmp2p.errors import SwarmError, UserError
from swarmp2p.node.requests import ApiRequest, parse_request
from swarmp2p.schema import Data, SchemaError, to_data

if TYPE_CHECKING:  # the daemon's side (ApiServer) imports asyncio itself: the CLI's request()
    # is one blocking socket, and importing asyncio costs `swarm status` 50-70 ms
    import asyncio

MAX_LINE_BYTES = 1 << 20
API_OPS = (
    "status",
    "peers",
    "submit",
    "down",
    # membership (node/cluster/join.py, node/cluster/pairing.py)
    "remove",
    "rotate",
    "invite",
    "bench",
    "live_plan",
    "jobs",
    "job",
    "cancel",
    "logs",
    "models",
    "export",
    # swarm serve (node/serving/service.py)
    "serve",
    "serve_stop",
    "served",
    "serve_endpoint",
    "relay_open",
    "relay_next",
)


class ApiError(SwarmError):
    """The daemon is not running, not answering, or refused the request; ``code`` and
    ``kind`` are the daemon's (``swarmp2p.errors``)."""

    default_code = "failed"


class NoDaemon(ApiError):
    """No daemon listens on the state directory's API socket (`swarm` exits 4, not 1)."""

    default_code = "no_daemon"


ApiHandler = Callable[[Any], Awaitable[Any]]
"""``async handler(request) -> result`` (the op's ``ApiRequest`` record, or the plain fields of
an op that has none); raise ApiError or ValueError to refuse. The result is JSON data."""

_log = logging.getLogger(__name__)


class ApiServer:
    """The daemon's side: a 0600 unix socket at ``path`` answering ``handlers[op]``."""

    def __init__(self, path: Path, handlers: Mapping[str, ApiHandler]) -> None:
        unknown = set(handlers) - set(API_OPS)
        if unknown:
            raise ValueError(f"no such local API op(s) {sorted(unknown)}; known: {list(API_OPS)}")
        self.path = path
        self._handlers = dict(handlers)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        import asyncio

        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The umask is process-wide: change it only around the synchronous bind, never across an
        # await, where another daemon in this process could save and restore it out of order.
        old_umask = os.umask(0o077)  # the socket is never, even briefly, open to others
        try:
            sock.bind(str(self.path))
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old_umask)
        self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=MAX_LINE_BYTES)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        import asyncio

        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import asyncio

        try:
            reply = await self._answer(await reader.readline())
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ValueError,
        ):
            pass
        finally:
            writer.close()

    async def _answer(self, line: bytes) -> dict[str, Data]:
        try:
            try:
                req = json.loads(line)
            except (ValueError, RecursionError) as exc:
                raise UserError(f"bad request: not JSON: {exc}") from None
            op = req.get("op") if isinstance(req, dict) else None
            if not isinstance(op, str) or op not in self._handlers:
                raise UserError(f"bad request: op must be one of {sorted(self._handlers)}")
            try:
                typed = parse_request(op, {k: v for k, v in req.items() if k != "op"})
            except SchemaError as exc:
                raise UserError(str(exc), code="bad_field") from None
            return {"ok": True, "result": await self._handlers[op](req if typed is None else typed)}
        except SwarmError as exc:
            return {"ok": False, "error": exc.message, "code": exc.code, "kind": exc.kind}
        except ValueError as exc:  # a handler's refusal of a bad value (ApiHandler's contract)
            return {"ok": False, "error": str(exc), "code": "bad_request", "kind": "user"}
        except Exception as exc:  # a bug, not the user's mistake: say so, log the traceback
            _log.exception("local API request %r failed", line[:200])
            return {
                "ok": False,
                "error": f"internal error: {type(exc).__name__}: {exc} (see daemon.log)",
                "code": "internal",
                "kind": "internal",
            }


def send(socket_path: Path, req: ApiRequest, *, timeout: float = 10.0) -> Any:
    """Send one typed request to the daemon whose API socket is ``socket_path``; its result."""
    return _send(socket_path, req.OP, to_data(req), timeout)


def request(socket_path: Path, op: str, *, timeout: float = 10.0, **fields: Data) -> Any:
    """Send op ``op`` with ``fields`` (checked as its request record first: SchemaError, a
    ValueError, naming a bad field) to the daemon at ``socket_path``; its result."""
    if op not in API_OPS:
        raise ValueError(f"unknown local API op {op!r}; one of {list(API_OPS)}")
    typed = parse_request(op, fields)
    return _send(socket_path, op, fields if typed is None else to_data(typed), timeout)


def _send(socket_path: Path, op: str, fields: Mapping[str, object], timeout: float) -> Any:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(socket_path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise NoDaemon(
                f"no swarm daemon is running for {socket_path.parent} (start one with `swarm up`)"
            ) from None
        sock.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                raise ApiError(
                    f"the swarm daemon did not answer {op!r} within {timeout:g} s", code="timeout"
                ) from None
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_LINE_BYTES * 16:
                raise ApiError("the swarm daemon's reply is too large")
    finally:
        sock.close()
    if not data:
        raise ApiError(
            f"the swarm daemon closed the connection without answering {op!r}", code="internal"
        )
    reply = json.loads(data)
    if not reply.get("ok"):
        code = reply.get("code") if isinstance(reply.get("code"), str) else "failed"
        raise ApiError(reply.get("error", "the swarm daemon refused the request"), code=code)
    return reply.get("result")


def wait_until_up(
    socket_path: Path, timeout: float, *, alive: Callable[[], bool] | None = None
) -> dict[str, Any]:
    """Poll ``status`` until the daemon answers (or ``alive()`` says it died); its status."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise ApiError("the swarm daemon exited during start-up")
        try:
            return request(socket_path, "status", timeout=2.0)
        except ApiError as exc:
            last = exc
        time.sleep(0.1)
    raise ApiError(f"the swarm daemon did not answer within {timeout:g} s: {last}")
