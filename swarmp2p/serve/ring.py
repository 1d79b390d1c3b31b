"""Wiring a serving ring, once: the daemon (stages on many nodes) and
:class:`~swarmp2p.serve.local.LocalRing` (worker processes on this machine) both build theirs
here, each handing in how to start, connect and stop its stages.

The steps: bind the return link the last stage sends tokens to; start every stage at once
(each answers with its bound input endpoint); tell each stage where the next one listens (the
last: the return link) and wait until every stage serves; dial the first stage. If any step
fails, every stage is stopped and the links made here are closed, then the first error (in
stage order) is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarmp2p.serve.decoding.speculate import draft_lap_cost
from swarmp2p.serve.sessions import RingClient

if TYPE_CHECKING:
    from swarmp2p.plan.serve import ServePlan

SHARED_MIN_GROUP_ROWS = 8
"""Rows a group of sessions fills before the next group starts, when two stages share a device.
A second group keeps a second stage computing, but stages on one device share its memory
bandwidth, and a small batch reads every weight for fewer rows: on the 2-core dev machine a
decode step of the embedded model cost 85 ms for 4 rows and 117 ms for 8, and two processes
stepping at once ran at 1.37x one alone, so 8 sessions on 2 stages went faster in one group
(see docs/serving.md, "Stages busy at once")."""


@dataclass(frozen=True, slots=True)
class RingEnds:
    """A built ring: the link to its first stage, the return link, each stage's endpoint."""

    first: Any
    """Sends to stage 0 (a ZmqLink)."""
    back: Any
    """Receives what the last stage sends (a ZmqLink)."""
    endpoints: tuple[str, ...]

    def open_client(
        self,
        plan: ServePlan,
        *,
        step_timeout: float,
        groups: int | None = None,
        shared: bool = False,
        speculate: str = "auto",
        salt: str = "",
    ) -> RingClient:
        """A started RingClient driving this ring within ``plan``'s context, session slots and
        prefix cache (its blocks named under ``salt`` and the plan: another model, adapter or
        dtype shares none); its groups fill to SHARED_MIN_GROUP_ROWS first when two stages
        share a device (two of the plan's, or all of them: ``shared``); ``speculate``: its
        speculative decoding (with stage 0's draft model when the plan has one)."""
        places = {(stage.node_id, stage.device) for stage in plan.stages}
        shared = shared or len(places) < len(plan.stages)
        min_group_rows = SHARED_MIN_GROUP_ROWS if shared else 1
        return RingClient(
            self.first,
            self.back,
            max_context=plan.max_context,
            max_sessions=plan.max_sessions,
            step_timeout=step_timeout,
            groups=groups,
            min_group_rows=min_group_rows,
            speculate=speculate,
            draft_model=plan.draft is not None,
            draft_cost=draft_lap_cost(plan.draft_compute) if plan.draft is not None else None,
            prefix_blocks=plan.prefix_blocks,
            prefix_salt=hashlib.sha256(f"{salt}\0{plan.to_json()}".encode()).digest(),
        ).start()


async def build_ring(
    n: int,
    *,
    bind_back: Callable[[], Any],
    start: Callable[[int], Awaitable[str]],
    connect: Callable[[int, str], Awaitable[None]],
    dial: Callable[[str], Any],
    stop: Callable[[], Awaitable[None]],
) -> RingEnds:
    """Build a ring of ``n`` stages: ``start(i)`` starts stage i and returns its input
    endpoint; ``connect(i, next)`` points it at ``next`` and returns once it serves;
    ``bind_back()`` binds the return link (its ``.endpoint``); ``dial(endpoint)`` a link to
    stage 0; ``stop()`` stops whatever was started (called only on failure)."""
    if n < 1:
        raise ValueError(f"a ring needs at least one stage, got {n}")
    links: list[Any] = []
    try:
        back = bind_back()
        links.append(back)
        endpoints = await _all(start(i) for i in range(n))
        after = [*endpoints[1:], back.endpoint]
        await _all(connect(i, after[i]) for i in range(n))
        first = dial(endpoints[0])
        links.append(first)
        return RingEnds(first=first, back=back, endpoints=tuple(endpoints))
    except BaseException:
        with contextlib.suppress(Exception):
            await stop()
        for link in links:
            link.close()
        raise


async def _all(steps: Any) -> list[Any]:
    """Run ``steps`` at once and let every one finish (none keeps running once this returns);
    the first failure in order is raised."""
    results = await asyncio.gather(*steps, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)


__all__ = ["RingEnds", "build_ring"]
