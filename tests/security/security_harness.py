"""A malicious member: the project's own client code with the swarm's token, sending what a
well-behaved node never would (fields that local validation refuses)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgpack
import zmq

from swarmp2p.net import RpcError, SecureContext, SwarmSecret
from swarmp2p.net.auth import make_client_socket
from swarmp2p.wire.messages import ErrorReply, Message, decode, encode


class Member:
    """One DEALER to a victim's control port, with the swarm's keys."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock

    def send(self, msg: Message, **raw: Any) -> None:
        """Send ``msg``; ``raw`` fields replace its own after local validation."""
        body = msgpack.unpackb(encode(msg), raw=False)
        body.update(raw, id=1)
        self._sock.send(msgpack.packb(body, use_bin_type=True))

    def reply(self, timeout: float) -> Message | None:
        """The reply (RpcError for an error reply), or None after ``timeout`` seconds."""
        if not self._sock.poll(int(timeout * 1000)):
            return None
        reply = decode(self._sock.recv())
        if isinstance(reply, ErrorReply):
            raise RpcError.from_reply(reply)
        return reply


@contextlib.contextmanager
def member(endpoint: str, token: str) -> Iterator[Member]:
    with SecureContext() as ctx:
        sock = make_client_socket(ctx, zmq.DEALER, SwarmSecret.from_token(token))
        try:
            sock.connect(endpoint)
            yield Member(sock)
        finally:
            sock.close(0)


def member_request(
    endpoint: str, token: str, msg: Message, timeout: float = 15.0, **raw: Any
) -> Message:
    """Send ``msg`` (``raw`` fields replacing its own) and return the reply; RpcError for an
    error reply, TimeoutError for none."""
    with member(endpoint, token) as m:
        m.send(msg, **raw)
        reply = m.reply(timeout)
    if reply is None:
        raise TimeoutError(f"no reply from {endpoint} within {timeout:g} s")
    return reply
