"""The local API between the CLI and its daemon: JSON lines over a unix socket.

Why a unix socket: it lives in the 0700 state directory and is itself 0600, so the kernel lets
only the user who runs the daemon (and root) open it -- no key is needed, and nothing on it is
ever reachable from the network. Each request is one JSON object ``{"op": ..., ...}`` on one
line; each reply is ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "..."}``.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

MAX_LINE_BYTES = 1 << 20
API_OPS = ("status", "peers", "submit", "down")


class ApiError(RuntimeError):
    """The daemon is not running, not answering, or refused the request."""


def request(socket_path: Path, op: str, *, timeout: float = 10.0, **fields: Any) -> Any:
    """Send one request to the daemon whose API socket is ``socket_path``; its result."""
    if op not in API_OPS:
        raise ValueError(f"unknown local API op {op!r}; one of {list(API_OPS)}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(socket_path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise ApiError(
                f"no swarm daemon is running for {socket_path.parent} (start one with `swarm up`)"
            ) from None
        sock.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                raise ApiError(
                    f"the swarm daemon did not answer {op!r} within {timeout:g} s"
                ) from None
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_LINE_BYTES * 16:
                raise ApiError("the swarm daemon's reply is too large")
    finally:
        sock.close()
    if not data:
        raise ApiError(f"the swarm daemon closed the connection without answering {op!r}")
    reply = json.loads(data)
    if not reply.get("ok"):
        raise ApiError(reply.get("error", "the swarm daemon refused the request"))
    return reply.get("result")


def wait_until_up(socket_path: Path, timeout: float, *, alive=None) -> dict[str, Any]:
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
