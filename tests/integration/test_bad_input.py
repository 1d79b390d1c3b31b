"""An authenticated peer (a member: joined with the token, its own key) sending 10,000 malformed
or refused requests gets error replies; the daemon lives."""

from __future__ import annotations

import random

import msgpack
import pytest
import zmq
from swarm_harness import agreed_on, wait_until

from swarmp2p import PROTOCOL_VERSION
from swarmp2p.net.auth import make_client_socket
from swarmp2p.net.security import SwarmSecret
from swarmp2p.wire.messages import ErrorReply, decode

pytestmark = pytest.mark.slow

SECRET = SwarmSecret.generate()
COUNT = 10_000
BATCH = 200


def _record(node_id: str) -> dict:
    """A well-formed node record for ``node_id`` (an empty one is refused as a bad field
    before the checks these requests are aimed at)."""
    from swarmp2p.node.records import NodeRecord
    from swarmp2p.plan import Node
    from swarmp2p.schema import to_data

    try:
        node = Node(node_id=node_id, name="bad", ram=0, disk_free=0, devices=())
    except ValueError:  # an invalid id: the record cannot name it; the id field is refused
        node = Node(node_id="zz-bad", name="bad", ram=0, disk_free=0, devices=())
    return to_data(NodeRecord(node=node))


def _hello(**change):
    node_id = change.get("node_id", "zz-bad")
    body = {
        "node_id": "zz-bad",
        "name": "bad",
        "versions": [PROTOCOL_VERSION],
        "software": "0",
        "swarm_id": SECRET.swarm_id,
        "control_port": 9,
        "addresses": ["127.0.0.9"],
        "record": _record(node_id),
        "host": {},
        "term": 0,
        "version": 0,
    }
    body.update(change)
    return {"t": "node.hello", **body}


def _bad_message(rng: random.Random, msg_id: int) -> bytes:
    """One of several kinds of malformed or refused requests, each answered with an error."""
    kind = rng.randrange(12)
    env = {"v": PROTOCOL_VERSION, "id": msg_id}
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))  # not msgpack
    if kind == 1:
        return msgpack.packb([1, 2, 3])  # not a map (no id: answered with id 0)
    if kind == 2:
        body = {**env, "t": "node.nope"}
    elif kind == 3:
        body = {
            **env,
            "t": "node.heartbeat",
            "node_id": "a",
            "term": "x",
            "version": 0,
            "leader": "a",
        }
    elif kind == 4:
        body = {
            **env,
            "t": "node.heartbeat",
            "node_id": "zz-bad",  # its own id, but it never said hello
            "term": 0,
            "version": 0,
            "leader": "",
        }
    elif kind == 5:
        body = {**env, **_hello(node_id="NOT VALID")}
    elif kind == 6:
        body = {**env, **_hello(node_id=f"ghost{msg_id}")}  # a name that is not its own
    elif kind == 7:
        body = {**env, **_hello(node_id="a")}  # claims the daemon's own id
    elif kind == 8:
        body = {**env, **_hello(versions=[99])}
    elif kind == 9:
        body = {**env, "t": "node.table", "node_id": "zz", "table": {"format": 1, "term": -1}}
    elif kind == 10:
        body = {**env, "t": "node.table", "node_id": "zz", "table": {"jobs": [rng.random()]}}
    else:
        body = {
            **env,
            "t": "node.heartbeat",
            "node_id": "zz",
            "term": 0,
            "version": 0,
        }  # missing leader
    return msgpack.packb(body)


def _join(ctx, endpoint: str):
    """Join as node ``zz-bad`` with the token and a key of its own: its client keys."""
    from swarmp2p.net import ClientKeys, NodeKey, request_sync
    from swarmp2p.node.cluster.join import NodeJoin, join_endpoint

    key = NodeKey.generate()
    msg = NodeJoin(
        node_id="zz-bad",
        key=key.public,
        versions=[PROTOCOL_VERSION],
        control_port=9,
        join_port=11,
        addresses=["127.0.0.9"],
    )
    reply = request_sync(ctx, SECRET, join_endpoint(endpoint), msg, 10.0)
    return ClientKeys(public=key.public, secret=key.secret, server=reply.key)


def test_ten_thousand_bad_requests_get_error_replies_and_the_swarm_keeps_going(loopback_swarm):
    loopback_swarm.reserve("a", "b")
    a = loopback_swarm.node("a", token=SECRET.token).start()
    b = loopback_swarm.node("b", token=SECRET.token).start()
    wait_until(lambda: agreed_on([a, b], "a", 2), 20, "a and b to agree")
    wait_until(lambda: a.status()["leader_ready"], 20, "a to lead")

    rng = random.Random(6)
    ctx = zmq.Context()
    keys = _join(ctx, f"tcp://127.0.0.1:{loopback_swarm.ports['a']}")
    sock = make_client_socket(ctx, zmq.DEALER, keys)
    sock.connect(f"tcp://127.0.0.1:{loopback_swarm.ports['a']}")
    codes: dict[str, int] = {}
    try:
        sent = 0
        while sent < COUNT:
            batch = min(BATCH, COUNT - sent)
            for i in range(batch):
                sock.send(_bad_message(rng, sent + i + 1))
            for _ in range(batch):
                assert sock.poll(20_000), f"no reply after {sent} requests:\n{a.log()[-2000:]}"
                reply = decode(sock.recv())
                assert isinstance(reply, ErrorReply), reply
                codes[reply.code] = codes.get(reply.code, 0) + 1
            sent += batch
    finally:
        sock.close(0)
        ctx.term()
    assert sum(codes.values()) == COUNT
    # wire-level refusals and the daemon's own refusals both occur
    assert {"malformed", "unknown_type", "bad_field"} <= set(codes), codes
    assert {"unknown_peer", "forbidden", "version"} <= set(codes), codes

    # the daemon still answers, and the swarm still agrees on its leader
    assert agreed_on([a, b], "a", 2)
    assert [p["node_id"] for p in a.status()["peers"]] == ["a", "b"]
    log = a.log()
    refused = log.count("refused node.")
    assert 0 < refused < 500, refused  # logged, but rate-limited
    wait_until(lambda: "more bad requests in the last second" in a.log(), 5, "the dropped count")
