"""CURVE sockets with a ZAP authenticator that admits only the client keys it is told to.

A CURVE server socket with no ZAP handler accepts *any* client key, so server sockets are made
only on a :class:`SecureContext` / :class:`AsyncSecureContext`: the first server socket
starts the context's authenticator (a thread for a sync context, an asyncio task for an
asyncio one) and ``term()`` / ``destroy()`` / ``with`` stop it, so no thread outlives the
context. Each ZAP domain has its own admission rule, so one context serves several without
letting one's clients into another's sockets.

Two kinds of credentials:

- a :class:`~swarmp2p.net.security.SwarmSecret`: the secret's admission key pair is both the
  server key and the only client key admitted (the join port; a test's one-secret swarm);
- :class:`ServerKeys` / :class:`ClientKeys`: a node's own key pair, the server key it expects,
  and (server side) a :class:`KeyCheck` that decides per client key. ZAP sets each message's
  ``User-Id`` frame property to the client's z85 public key, which :class:`~swarmp2p.net.rpc.
  RpcServer` hands to its handler: the authenticated sender of every request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.auth.thread import ThreadAuthenticator

from swarmp2p.net.security import SwarmSecret
from swarmp2p.timings import TIMINGS
from swarmp2p.wire.messages import MAX_MESSAGE_BYTES

ZAP_DOMAIN_PREFIX = "swarmp2p-"


class KeyCheck:
    """ZAP credentials provider: admits a z85 client key when ``admits(key)`` says so (asked
    at each handshake; a revoked key is also refused per message by the server's handler)."""

    def __init__(self, admits: Callable[[str], bool]) -> None:
        self._admits = admits

    def callback(self, domain: str, key: bytes) -> bool:
        try:
            return bool(self._admits(key.decode("ascii")))
        except Exception:  # a bug in a rule must refuse, never admit
            return False

    @classmethod
    def only(cls, *keys: str | bytes) -> KeyCheck:
        allowed = frozenset(k.decode("ascii") if isinstance(k, bytes) else k for k in keys)
        return cls(allowed.__contains__)

    @classmethod
    def anyone(cls) -> KeyCheck:
        """Every client key (a pairing port: the password-authenticated exchange inside is
        the authentication)."""
        return cls(lambda key: True)


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """A server socket's key pair (z85) and who it admits, under ZAP domain ``domain``. A
    context keeps the first rule registered for a domain: sockets with another rule need
    another domain (name it after what it admits)."""

    public: str
    secret: str
    admits: KeyCheck
    domain: str


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """A client socket's key pair (z85) and the server key it expects."""

    public: str
    secret: str
    server: str


ServerCredentials = SwarmSecret | ServerKeys
ClientCredentials = SwarmSecret | ClientKeys


def _server_keys(creds: ServerCredentials) -> ServerKeys:
    if isinstance(creds, ServerKeys):
        return creds
    if isinstance(creds, SwarmSecret):
        public, private = creds.curve_keypair()
        return ServerKeys(
            public=public.decode("ascii"),
            secret=private.decode("ascii"),
            admits=KeyCheck.only(public),
            domain=ZAP_DOMAIN_PREFIX + creds.swarm_id,
        )
    raise TypeError(
        f"server credentials must be a SwarmSecret or ServerKeys, got {type(creds).__name__}"
    )


def _client_keys(creds: ClientCredentials) -> ClientKeys:
    if isinstance(creds, ClientKeys):
        return creds
    if isinstance(creds, SwarmSecret):
        public, private = (k.decode("ascii") for k in creds.curve_keypair())
        return ClientKeys(public=public, secret=private, server=public)
    raise TypeError(
        f"client credentials must be a SwarmSecret or ClientKeys, got {type(creds).__name__}"
    )


class _AuthMixin:
    _swarm_auth: Any = None
    _swarm_domains: Any = None

    def _authenticator(self) -> Any:
        raise NotImplementedError

    def _admit(self, keys: ServerKeys) -> str:
        """Start the authenticator if needed and register ``keys``' domain; return it. A
        domain keeps the rule it was first registered with."""
        if self._swarm_auth is None:
            auth = self._authenticator()
            auth.start()
            self._swarm_auth = auth
            self._swarm_domains = set()
        if keys.domain not in self._swarm_domains:
            self._swarm_auth.configure_curve_callback(keys.domain, keys.admits)
            self._swarm_domains.add(keys.domain)
        return keys.domain

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


def _common(sock: zmq.Socket, max_message_bytes: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, TIMINGS.zmq_heartbeat_ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, TIMINGS.zmq_heartbeat_timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, TIMINGS.zmq_heartbeat_timeout_ms)
    limit = -1 if max_message_bytes < 0 else max_message_bytes + TRANSPORT_SLACK_BYTES
    sock.setsockopt(zmq.MAXMSGSIZE, limit)


def _own_keys(keys: ServerKeys | ClientKeys) -> list[tuple[int, bytes]]:
    return [
        (zmq.CURVE_PUBLICKEY, keys.public.encode("ascii")),
        (zmq.CURVE_SECRETKEY, keys.secret.encode("ascii")),
    ]


def _socket(
    ctx: zmq.Context, socket_type: int, max_message_bytes: int, curve: list[tuple[int, Any]]
) -> zmq.Socket:
    """A socket with the common options, then ``curve`` (CURVE keys, ZAP); closed when
    setting any fails."""
    sock = ctx.socket(socket_type)
    try:
        _common(sock, max_message_bytes)
        for option, value in curve:
            sock.setsockopt(option, value)
    except BaseException:
        sock.close(0)
        raise
    return sock


def make_server_socket(
    ctx: zmq.Context,
    socket_type: int,
    secret: ServerCredentials,
    *,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    secure: bool = True,
) -> zmq.Socket:
    """A CURVE server socket (not yet bound) that admits only the clients ``secret`` admits
    (a SwarmSecret: holders of that secret), and closes a connection whose handshake takes
    over ``TIMINGS.zmq_handshake_ivl_ms``.

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
    keys = _server_keys(secret)

    curve: list[tuple[int, Any]] = []
    if secure:
        domain = ctx._admit(keys)  # type: ignore[attr-defined]
        curve = [
            (zmq.HANDSHAKE_IVL, TIMINGS.zmq_handshake_ivl_ms),
            (zmq.ZAP_DOMAIN, domain.encode()),
            (zmq.CURVE_SERVER, 1),
            *_own_keys(keys),
        ]
    return _socket(ctx, socket_type, max_message_bytes, curve)


def make_client_socket(
    ctx: zmq.Context,
    socket_type: int,
    secret: ClientCredentials,
    *,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    secure: bool = True,
) -> zmq.Socket:
    """A CURVE client socket (not yet connected) that talks only to the server whose key
    ``secret`` names (a SwarmSecret: a holder of that secret)."""
    keys = _client_keys(secret)
    curve = [(zmq.CURVE_SERVERKEY, keys.server.encode("ascii")), *_own_keys(keys)]
    return _socket(ctx, socket_type, max_message_bytes, curve if secure else [])
