"""Leader election: the lowest live node id that may lead leads; every node computes it from
its own view.

Who may lead (Raft's election restriction, in this swarm's terms): a node that has never held
the swarm's table never outranks one that has. When this node's table lists members, only
they may lead, and of them first the ones that hold a table (a newcomer listed moments ago
leads once the table reached it); when it lists none (a brand-new swarm, or a newcomer not listed yet), the live
nodes that say they hold a table come first; only where nobody holds one does every live node
count (the founding of a new swarm)."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

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


def eligible_leader(
    view: Mapping[str, bool], members: Collection[str], held: Mapping[str, int]
) -> str:
    """The lowest live node id that may lead (see the module): ``members``, the ids this
    node's table lists; ``held``, node id -> the table version it holds (0: none)."""
    live = {n for n, alive in view.items() if alive}
    listed = live & set(members)
    holding = {n for n in live if held.get(n, 0) > 0}
    # a listed member that holds no table yet (listed moments ago) waits for it first
    for candidates in (listed & holding, listed, holding):
        if candidates:
            return min(candidates)
    return leader(view)


def leader(view: Mapping[str, bool]) -> str:
    """The lowest node id marked live in ``view`` (node id -> alive); ValueError if none is."""
    live = [node_id for node_id, alive in view.items() if alive]
    if not live:
        raise ValueError(f"no live node in the view {sorted(view)}; a node always sees itself live")
    return min(live)
