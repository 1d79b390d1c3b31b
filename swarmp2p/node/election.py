"""Leader election: the lowest live node id leads; every node computes it from its own view."""

from __future__ import annotations

import re
from collections.abc import Mapping

NODE_ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
"""Node ids are short lowercase strings; plain string order decides who leads. Matched with
``fullmatch``: ``$`` would let a trailing newline through."""


def check_node_id(node_id: str) -> str:
    """Return ``node_id`` if well formed, else raise ValueError saying what is allowed."""
    if not isinstance(node_id, str) or not NODE_ID_PATTERN.fullmatch(node_id):
        raise ValueError(
            f"node id {node_id!r} is not valid: use 1-64 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit (the lowest id in string order leads)"
        )
    return node_id


def leader(view: Mapping[str, bool]) -> str:
    """The lowest node id marked live in ``view`` (node id -> alive); ValueError if none is."""
    live = [node_id for node_id, alive in view.items() if alive]
    if not live:
        raise ValueError(f"no live node in the view {sorted(view)}; a node always sees itself live")
    return min(live)
