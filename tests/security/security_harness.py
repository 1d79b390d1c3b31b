"""A malicious member: the project's own client code, joined with the swarm's token like any
node (its own key pair, listed by the leader), sending what a well-behaved node never would
(fields that local validation refuses, another node's name)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import zmq

from swarmp2p import PROTOCOL_VERSION
from swarmp2p.net import ClientKeys, NodeKey, RpcError, SecureContext, SwarmSecret, request_sync
from swarmp2p.net.auth import make_client_socket
from swarmp2p.node.join import NodeJoin, NodeJoined, join_endpoint
from swarmp2p.wire.messages import ErrorReply, Message, decode, encode

_KEYS: dict[tuple[str, str], NodeKey] = {}


def join(endpoint: str, token: str, node_id: str = "mallory", key: NodeKey | None = None) -> NodeJoined:  # fmt: skip
    """``node.join`` on the join port beside the control port ``endpoint``: the node lists
    ``node_id`` with ``key`` (one key per node id and token, kept for the next call)."""
    key = key or _KEYS.setdefault((token, node_id), NodeKey.generate())
    msg = NodeJoin(
        node_id=node_id, name=node_id, key=key.public, versions=[PROTOCOL_VERSION],
        control_port=9, join_port=11, addresses=["127.0.0.1"],
    )  # fmt: skip
    deadline = time.monotonic() + 20
    with zmq.Context() as ctx:
        while True:  # until the leader lists it (a swarm being founded lists it once it leads)
            reply = request_sync(ctx, SwarmSecret.from_token(token), join_endpoint(endpoint), msg, 15.0)  # fmt: skip
            assert isinstance(reply, NodeJoined), reply
            if reply.admitted or time.monotonic() > deadline:
                return reply
            time.sleep(0.2)


def credentials(endpoint: str, token: str, node_id: str = "mallory") -> ClientKeys:
    """A member's client keys towards the node at ``endpoint`` (joining it first)."""
    joined = join(endpoint, token, node_id)
    key = _KEYS[(token, node_id)]
    return ClientKeys(public=key.public, secret=key.secret, server=joined.key)


class Member:
    """One DEALER to a victim's control port, with a member's own keys."""

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
def member(
    endpoint: str, token: str, node_id: str = "mallory", keys: ClientKeys | None = None
) -> Iterator[Member]:
    """A member's connection to ``endpoint`` (``keys``: speak with these instead)."""
    keys = keys or credentials(endpoint, token, node_id)
    with SecureContext() as ctx:
        sock = make_client_socket(ctx, zmq.DEALER, keys)
        try:
            sock.connect(endpoint)
            yield Member(sock)
        finally:
            sock.close(0)


def member_request(
    endpoint: str,
    token: str,
    msg: Message,
    timeout: float = 15.0,
    keys: ClientKeys | None = None,
    **raw: Any,
) -> Message:
    """Send ``msg`` (``raw`` fields replacing its own) and return the reply; RpcError for an
    error reply, TimeoutError for none."""
    with member(endpoint, token, keys=keys) as m:
        m.send(msg, **raw)
        reply = m.reply(timeout)
    if reply is None:
        raise TimeoutError(f"no reply from {endpoint} within {timeout:g} s")
    return reply
