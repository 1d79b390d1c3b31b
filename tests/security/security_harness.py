"""A malicious member: the project's own client code, joined with the swarm's token like any
node (its own key pair, listed by the leader), sending what a well-behaved node never would
(fields that local validation refuses, another node's name). Its id, ``zmallory``, sorts
after the victims' so that, live for a moment after its hello, it never becomes the lowest
live member (the leader in everyone's view) that then never leads."""

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
from swarmp2p.node.cluster.join import NodeJoin, NodeJoined, join_endpoint
from swarmp2p.node.messages import NodeHello
from swarmp2p.node.records import Host, NodeRecord
from swarmp2p.plan import Node
from swarmp2p.wire.messages import ErrorReply, Message, decode, encode

_KEYS: dict[tuple[str, str], NodeKey] = {}


def join(
    endpoint: str, token: str, node_id: str = "zmallory", key: NodeKey | None = None
) -> NodeJoined:
    """``node.join`` on the join port beside the control port ``endpoint``, then what a real
    newcomer does to be listed: join the leader too and say hello on the leader's control
    port with its own key (the leader lists a node only on that proof; its record has no
    devices, so nothing is planned on it). One key per node id and token, kept for the next
    call."""
    key = key or _KEYS.setdefault((token, node_id), NodeKey.generate())
    msg = NodeJoin(
        node_id=node_id,
        name=node_id,
        key=key.public,
        versions=[PROTOCOL_VERSION],
        control_port=9,
        join_port=11,
        addresses=["127.0.0.1"],
    )
    secret = SwarmSecret.from_token(token)
    deadline = time.monotonic() + 20
    with zmq.Context() as ctx:
        while True:  # until the leader lists it (a swarm being founded lists it once it leads)
            reply = request_sync(ctx, secret, join_endpoint(endpoint), msg, 15.0)
            assert isinstance(reply, NodeJoined), reply
            if reply.admitted or time.monotonic() > deadline:
                break
            _meet_leader(ctx, secret, endpoint, reply, msg, key)
            time.sleep(0.2)
        return reply


def _leader_endpoint(endpoint: str, reply: NodeJoined) -> str:
    if reply.leader == reply.node_id:
        return endpoint
    return next((n.endpoint for n in reply.nodes if n.node_id == reply.leader and n.endpoint), "")


def _server_key(ctx, secret, where: str, reply: NodeJoined, msg: NodeJoin) -> str:
    if reply.leader == reply.node_id:
        return reply.key
    there = request_sync(ctx, secret, join_endpoint(where), msg, 15.0)  # bound there too
    return there.key


def _say(ctx, where: str, server: str, key: NodeKey, msg: Message) -> Message:
    keys = ClientKeys(public=key.public, secret=key.secret, server=server)
    return request_sync(ctx, keys, where, msg, 5.0)


def _meet_leader(
    ctx, secret, endpoint: str, reply: NodeJoined, msg: NodeJoin, key: NodeKey
) -> None:
    """Join the leader and say hello on its control port (proof of the key's secret half)."""
    where = _leader_endpoint(endpoint, reply)
    if not reply.leader or not where:
        return
    hello = NodeHello(
        node_id=msg.node_id,
        name=msg.name,
        versions=[PROTOCOL_VERSION],
        software="",
        swarm_id=secret.swarm_id,
        control_port=9,
        addresses=["127.0.0.1"],
        record=NodeRecord(
            node=Node(node_id=msg.node_id, name=msg.name, ram=0, disk_free=0, devices=())
        ),
        host=Host(),
        term=0,
        version=0,
        join_port=11,
    )
    with contextlib.suppress(RpcError, TimeoutError):
        _say(ctx, where, _server_key(ctx, secret, where, reply, msg), key, hello)


def credentials(endpoint: str, token: str, node_id: str = "zmallory") -> ClientKeys:
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
    endpoint: str, token: str, node_id: str = "zmallory", keys: ClientKeys | None = None
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
