"""Issue 24 items 2 and 3 against real daemons: a member that lists ghosts, and a token holder
that takes a stopped member's id. Each is refused with a clear error and the table keeps
its members, their keys and its majority."""

from __future__ import annotations

import pytest
from security_harness import credentials, join, member
from swarm_harness import agreed_on, dump, wait_until
from test_identity import _up

from swarmp2p.net import NodeKey, RpcError
from swarmp2p.node.cluster.join import MemberAdmit
from swarmp2p.node.table.store import load_table

pytestmark = pytest.mark.slow


def _members(node) -> tuple[list[str], list[str], int]:
    q = node.status()["quorum"]
    return q["members"], q["voters"], q["majority"]


def test_a_member_cannot_list_ghosts_and_a_stopped_members_id_stays_its_own(tmp_path):
    trio = _up(tmp_path, "abc")
    a, b, c = (trio.nodes[n] for n in "abc")
    try:
        keys = credentials(trio.endpoint("a"), trio.token)  # zmallory, a real member
        wait_until(lambda: "zmallory" in a.status()["quorum"]["members"], 20, "zmallory listed")
        before = _members(a)
        version = a.status()["table_version"]
        # ghosts: ids with keys nobody runs, vouched for by a member, to the leader
        for i in range(3):
            with member(trio.endpoint("a"), trio.token, keys=keys) as m:
                m.send(
                    MemberAdmit(node_id=f"ghost{i}", name="ghost", key=NodeKey.generate().public)
                )
                with pytest.raises(RpcError) as info:
                    m.reply(10.0)
            assert info.value.code == "joining", info.value
            assert "has not shown the leader a that it holds key" in info.value.detail
            assert "nothing was listed" in info.value.detail
        assert _members(a) == before and a.status()["table_version"] == version
        assert all(_members(n) == before for n in (b, c))

        # c stops cleanly: listed, down, its key kept; nobody takes its id with the token
        assert c.stop() == 0
        wait_until(lambda: a.status()["quorum"]["down"] == ["c"], 20, "c marked down")
        members, voters, majority = _members(a)
        assert "c" in members and "c" not in voters and majority == len(voters) // 2 + 1
        for at in ("a", "b"):
            with pytest.raises(RpcError) as info:
                join(trio.endpoint(at), trio.token, "c", key=NodeKey.generate())
            assert info.value.code == "refused" and "another key" in info.value.detail
        own = NodeKey.load(c.state.node_key_file).public
        for node in (a, b):
            assert load_table(node.state.table_file).member("c").key == own
        # the real c comes back with its own key: it counts again
        c = trio.start("c")
        c.wait_up()
        wait_until(
            lambda: "c" in a.status()["quorum"]["voters"] and not a.status()["quorum"]["down"],
            30,
            "c back as a voter",
        )
        wait_until(lambda: agreed_on([a, b, c], "a", 3), 30, "agreement")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump(list(trio.nodes.values()))}") from None
    finally:
        trio.stop()
