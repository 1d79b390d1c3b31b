"""CURVE sockets with a ZAP authenticator that admits only the swarm's client key.

A CURVE server socket with no ZAP handler accepts *any* client key, so server sockets are made
only on a :class:`SecureContext` / :class:`AsyncSecureContext`: the first server socket
starts the context's authenticator (a thread for a sync context, an asyncio task for an
asyncio one) and ``term()`` / ``destroy()`` / ``with`` stop it, so no thread outlives the
context. Each secret gets its own ZAP domain, so one context can serve two swarms without
letting either's clients into the other's sockets.
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.auth.thread import ThreadAuthenticator

from swarmp2p.net.security import SwarmSecret
from swarmp2p.wire.messages import MAX_MESSAGE_BYTES

ZAP_DOMAIN_PREFIX = "swarmp2p-"


class _KeyCheck:
    """ZAP credentials provider: admits exactly one z85 client key."""

    def __init__(self, public_key: bytes) -> None:
        self._key = public_key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._key


class _AuthMixin:
    _swarm_auth: Any = None
    _swarm_domains: Any = None

    def _authenticator(self) -> Any:
        raise NotImplementedError

    def _admit(self, secret: SwarmSecret) -> str:
        """Start the authenticator if needed and register ``secret``'s domain; return it."""
        if self._swarm_auth is None:
            auth = self._authenticator()
            auth.start()
            self._swarm_auth = auth
            self._swarm_domains = set()
        domain = ZAP_DOMAIN_PREFIX + secret.swarm_id
        if domain not in self._swarm_domains:
            self._swarm_auth.configure_curve_callback(domain, _KeyCheck(secret.curve_keypair()[0]))
            self._swarm_domains.add(domain)
        return domain

    def _stop_auth(self) -> None:
        auth, self._swarm_auth = self._swarm_auth, None
        if auth is not None:
            auth.stop()

    # The mixin comes first in each context's bases, so these wrap zmq's own term/destroy: no
    # ZAP thread or task outlives its context.
    def term(self) -> None:
        self._stop_auth()
        super().term()

    def destroy(self, linger: int | None = None) -> None:
        self._stop_auth()
        super().destroy(linger)


class SecureContext(_AuthMixin, zmq.Context):
    """A sync context whose server sockets are guarded by a ZAP thread stopped with it."""

    def _authenticator(self) -> Any:
        return ThreadAuthenticator(self)


class AsyncSecureContext(_AuthMixin, zmq.asyncio.Context):
    """An asyncio context whose server sockets are guarded by a ZAP task stopped with it."""

    def _authenticator(self) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "an AsyncSecureContext makes server sockets only inside a running event loop "
                "(its ZAP authenticator is an asyncio task); call from async code"
            ) from None
        return AsyncioAuthenticator(self)


TRANSPORT_SLACK_BYTES = 256
"""Added to ``zmq.MAXMSGSIZE``: libzmq counts a CURVE frame's box overhead against the cap."""


HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 6000
"""ZMTP heartbeats: a peer silent this long (host gone, cable pulled) is disconnected, so the
socket reconnects instead of queueing into a dead TCP connection."""


HANDSHAKE_IVL_MS = 5000
"""A connection that has not finished its CURVE handshake in this long is closed. The handshake
is four small messages (milliseconds on a LAN, well under a second on a loaded 2-core box);
libzmq's default, 30 s, let idle unauthenticated connections hold a descriptor each for that
long (issue 15). Set on server sockets, which accept from anyone."""


def _common(sock: zmq.Socket, max_message_bytes: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    limit = -1 if max_message_bytes < 0 else max_message_bytes + TRANSPORT_SLACK_BYTES
    sock.setsockopt(zmq.MAXMSGSIZE, limit)


def make_server_socket(
    ctx: zmq.Context,
    socket_type: int,
    secret: SwarmSecret,
    *,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    secure: bool = True,
) -> zmq.Socket:
    """A CURVE server socket (not yet bound) that admits only clients holding ``secret``, and
    closes a connection whose handshake takes over ``HANDSHAKE_IVL_MS``.

    ``max_message_bytes`` (plus a small CURVE slack) becomes ``zmq.MAXMSGSIZE``: a peer
    sending a larger frame is disconnected before the frame is buffered (-1: no cap). ``secure=False`` (plain TCP, anyone may
    connect) exists only for benchmarks that measure CURVE's cost.
    """
    if secure and not isinstance(ctx, _AuthMixin):
        raise TypeError(
            f"make_server_socket needs a swarmp2p.net.SecureContext or AsyncSecureContext, "
            f"got {type(ctx).__name__}: a CURVE server without a ZAP authenticator admits any "
            "client key"
        )
    if not isinstance(secret, SwarmSecret):
        raise TypeError(f"secret must be a SwarmSecret, got {type(secret).__name__}")
    sock = ctx.socket(socket_type)
    try:
        _common(sock, max_message_bytes)
        if secure:
            domain = ctx._admit(secret)  # type: ignore[attr-defined]
            public, private = secret.curve_keypair()
            sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
            sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, private)
    except BaseException:
        sock.close(0)
        raise
    return sock


def make_client_socket(
    ctx: zmq.Context,
    socket_type: int,
    secret: SwarmSecret,
    *,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    secure: bool = True,
) -> zmq.Socket:
    """A CURVE client socket (not yet connected) that talks only to servers holding ``secret``."""
    if not isinstance(secret, SwarmSecret):
        raise TypeError(f"secret must be a SwarmSecret, got {type(secret).__name__}")
    sock = ctx.socket(socket_type)
    try:
        _common(sock, max_message_bytes)
        if secure:
            public, private = secret.curve_keypair()
            sock.setsockopt(zmq.CURVE_SERVERKEY, public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, private)
    except BaseException:
        sock.close(0)
        raise
    return sock
