"""Membership: join, heartbeats, expiry with an injected clock, clean leave, forgetting."""

from __future__ import annotations

import pytest

from swarmp2p.node.election import leader
from swarmp2p.node.membership import Change, Membership


def _join(m: Membership, node_id: str, now: float) -> list[Change]:
    return m.hello(
        node_id=node_id, name=node_id, endpoint=f"tcp://h-{node_id}:1", record={}, now=now
    )


def test_join_then_silence_then_forget():
    m = Membership("b")
    assert _join(m, "a", 0.0) == [Change(kind="join", node_id="a")]
    assert _join(m, "a", 0.5) == []  # already alive: no new event
    assert leader(m.live_view()) == "a"
    assert m.seen("a", 2.0)
    assert m.expire(now=4.9, timeout=3.0, forget_after=10.0) == []
    changes = m.expire(now=5.1, timeout=3.0, forget_after=10.0)
    assert [(c.kind, c.node_id) for c in changes] == [("leave", "a")]
    assert "silent for 3.1 s" in changes[0].reason
    assert leader(m.live_view()) == "b"
    assert m.peers["a"].alive is False  # listed dead for a while
    assert m.expire(now=15.0, timeout=3.0, forget_after=10.0) == [] and "a" in m.peers
    m.expire(now=15.2, timeout=3.0, forget_after=10.0)
    assert "a" not in m.peers


def test_dead_peer_rejoins_with_a_hello_not_a_heartbeat():
    m = Membership("b")
    _join(m, "a", 0.0)
    m.dead("a", 1.0, "mDNS goodbye and no heartbeat")
    assert m.seen("a", 1.5) is False  # must say hello again
    assert _join(m, "a", 2.0) == [Change(kind="join", node_id="a")]
    assert m.live_view() == {"a": True, "b": True}


def test_unknown_heartbeat_and_own_id():
    m = Membership("b")
    assert m.seen("zz", 1.0) is False
    with pytest.raises(ValueError, match="claims this node's id 'b'"):
        _join(m, "b", 0.0)


def test_hello_updates_endpoint_and_record():
    m = Membership("b")
    _join(m, "a", 0.0)
    m.hello(
        node_id="a",
        name="new",
        endpoint="tcp://10.0.0.9:2",
        record={"ram": 1},
        now=1.0,
        host={"cpu_cores": 2},
    )
    peer = m.peers["a"]
    assert (peer.name, peer.endpoint, peer.record, peer.host) == (
        "new",
        "tcp://10.0.0.9:2",
        {"ram": 1},
        {"cpu_cores": 2},
    )
