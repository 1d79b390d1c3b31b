"""Election: the lowest live node id, from a node's own view."""

from __future__ import annotations

import pytest

from swarmp2p.node.election import check_node_id, leader


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
