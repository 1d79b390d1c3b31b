"""Election: the lowest live node id, from a node's own view."""

from __future__ import annotations

import pytest

from swarmp2p.node.cluster.election import check_node_id, leader


@pytest.mark.parametrize(
    ("view", "expected"),
    [
        ({"a": True}, "a"),
        ({"a": True, "b": True, "c": True}, "a"),
        ({"a": False, "b": True, "c": True}, "b"),
        ({"c": True, "b": True, "a": False}, "b"),
        ({"n10": True, "n9": True}, "n10"),  # string order, not numeric
        ({"z": True, "a": False, "b": False}, "z"),
        ({"0": True, "a": True}, "0"),
    ],
)
def test_lowest_live_id_leads(view, expected):
    assert leader(view) == expected


def test_empty_view_is_an_error():
    with pytest.raises(ValueError, match="no live node"):
        leader({"a": False})


@pytest.mark.parametrize("bad", ["", "A1", "-a", "a b", "a" * 65, "ä"])
def test_bad_node_ids_are_refused(bad):
    with pytest.raises(ValueError, match="is not valid"):
        check_node_id(bad)


@pytest.mark.parametrize("good", ["a", "n0123", "node-1.lab_2", "9"])
def test_good_node_ids(good):
    assert check_node_id(good) == good


def test_who_may_lead_a_member_that_holds_the_table_then_any_holder_then_anyone():
    from swarmp2p.node.cluster.election import eligible_leader

    view = {"0": True, "a": True, "b": True, "z": True, "c": False}
    # the table lists a, b, c: the newcomer 0 (no table) and the stranger z never outrank them
    assert eligible_leader(view, {"a", "b", "c"}, {"a": 5, "b": 5, "0": 0, "z": 0}) == "a"
    # a listed member that holds no table yet waits for it; then it leads as the lowest
    assert eligible_leader(view, {"0", "a", "b"}, {"a": 5, "b": 5, "0": 0}) == "a"
    assert eligible_leader(view, {"0", "a", "b"}, {"a": 5, "b": 5, "0": 6}) == "0"
    # an empty table (this node lists nobody): the nodes that hold one first
    assert eligible_leader(view, set(), {"b": 3}) == "b"
    # nobody holds a table: a brand-new swarm, the lowest live node founds it
    assert eligible_leader(view, set(), {}) == "0"
