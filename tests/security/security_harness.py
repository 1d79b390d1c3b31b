"""A malicious member: the project's own client code with the swarm's token, sending what a
well-behaved node never would (fields that local validation refuses)."""

from __future__ import annotations

from typing import Any

import msgpack
import zmq

from swarmp2p.net import RpcError, SecureContext, SwarmSecret, request_sync
from swarmp2p.net.auth import make_client_socket
from swarmp2p.wire.messages import ErrorReply, Message, decode, encode


def member_request(
    endpoint: str, token: str, msg: Message, timeout: float = 15.0, **raw: Any
) -> Message:
    """Send ``msg`` to ``endpoint`` as a member holding ``token``. ``raw`` fields replace the
    message's own after local validation (a malicious member skips it); the reply, or
    RpcError for an error reply."""
    secret = SwarmSecret.from_token(token)
    with SecureContext() as ctx:
        if not raw:
            return request_sync(ctx, secret, endpoint, msg, timeout)
        body = msgpack.unpackb(encode(msg), raw=False)
        body.update(raw, id=1)
        sock = make_client_socket(ctx, zmq.DEALER, secret)
        try:
            sock.connect(endpoint)
            sock.send(msgpack.packb(body, use_bin_type=True))
            if not sock.poll(int(timeout * 1000)):
                raise TimeoutError(f"no reply from {endpoint} within {timeout} s")
            reply = decode(sock.recv())
        finally:
            sock.close(0)
    if isinstance(reply, ErrorReply):
        raise RpcError.from_reply(reply)
    return reply
