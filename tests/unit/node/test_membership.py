"""Membership: join, heartbeats, expiry with an injected clock, clean leave, forgetting."""

from __future__ import annotations

import pytest

from swarmp2p.node.cluster.election import leader
from swarmp2p.node.cluster.membership import Change, Membership


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


# --- the keyring: which key speaks for which node ------------------------------------------


def _ring(table_box: list, now: list | None = None):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _tables import key

    from swarmp2p.node.cluster.membership import Keyring

    now = now or [0.0]
    return Keyring("a", key("a"), lambda: table_box[0], lambda: now[0]), key


def test_the_keyring_binds_members_by_the_table_and_joiners_until_listed():
    from _tables import founded

    from swarmp2p.node.cluster.membership import Refused
    from swarmp2p.node.table import events as ev

    log = founded("a", "b")
    box = [log.table]
    ring, key = _ring(box)
    assert ring.node_of(key("b")) == "b" and ring.key_of("b") == key("b")
    assert ring.node_of(key("c")) is None and not ring.admits(key("c"))
    ring.admit("c", key("c"), 0.0)  # c passed the join port: bound, not a member
    assert (
        ring.node_of(key("c")) == "c"
        and not ring.is_member("c")
        and ring.pending == {"c": key("c")}
    )
    with pytest.raises(Refused, match="belongs to a member with another key"):
        ring.admit("b", key("x"), 0.0)  # nobody takes over a member's id
    with pytest.raises(Refused, match="presents the key of b"):
        ring.admit("x", key("b"), 0.0)  # nor its key
    with pytest.raises(Refused, match="this node's"):
        ring.admit("a", key("a"), 0.0)
    box[0] = log(ev.MemberJoined(node_id="c", key=key("c")))
    assert ring.is_member("c") and ring.pending == {}


def test_a_removed_key_is_refused_at_once_and_a_left_member_stays_bound():
    from _tables import founded

    from swarmp2p.node.cluster.membership import Refused
    from swarmp2p.node.table import events as ev

    log = founded("a", "b", "c")
    box = [log.table]
    now = [5.0]
    ring, key = _ring(box, now)
    assert ring.admits(key("b")) and ring.admits(key("c"))
    box[0] = log(ev.MemberRemoved(node_id="c", key=key("c"), reason="lost"))
    assert not ring.admits(key("c")) and ring.key_of("c") is None  # its next message: refused
    with pytest.raises(Refused, match="revoked"):
        ring.admit("c", key("c"), 6.0)
    box[0] = log(ev.MemberLeft(node_id="b", reason="stopped"))
    assert ring.node_of(key("b")) == "b" and ring.is_member("b")  # listed, marked down
    ring.prune(keep=set(), now=5.0 + 61, older_than=60)
    assert ring.node_of(key("b")) == "b"  # its id stays bound to its key while it is away
    with pytest.raises(Refused, match="another key"):
        ring.admit("b", key("squatter"), 70.0)  # nobody joins under a stopped member's id
    with pytest.raises(Refused, match="free again only after"):
        ring.admit("c", key("c-new"), 70.0)  # nor under a removed one's, before a rotation
