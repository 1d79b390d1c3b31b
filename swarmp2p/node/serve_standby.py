"""Standby copies of a served trained model's shards: once it serves, every stage's shard gets
a second live holder, so losing a stage's node does not lose the only copy of its trained
weights. The leader's registry lists each copy (``model.shard_copy``). Never imports torch."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from swarmp2p.errors import SwarmError
from swarmp2p.node.messages import FilePull, ShardCopy

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext
    from swarmp2p.node.serve_ring import Served
    from swarmp2p.node.stages import StageHost

log = logging.getLogger("swarmp2p.node.serving")

COPY_TIMEOUT_S = 3600.0
"""How long one file of a standby copy may take (chunks time out on their own)."""


class Standby:
    """Copies of trained shards, made by the issuing node for the models it serves."""

    def __init__(self, ctx: NodeContext, stage_host: StageHost) -> None:
        self.ctx = ctx
        self.stage_host = stage_host

    def note_copy(self, served: Served, stage: int, node: str) -> None:
        """``node`` holds a copy of ``stage``'s shard now: use it here, and have the leader
        list it in the registry (best effort: a copy it misses is only not found later)."""
        served.holders[stage].append(node)
        note = ShardCopy(job_id=served.trained["job_id"], stage=stage, node_id=node)

        async def tell() -> None:
            try:
                await self.ctx.to_leader(note, 10.0)
            except SwarmError as exc:
                log.info("the registry does not list %s's copy of stage %d: %s", node, stage, exc)

        self.ctx.spawn(tell(), f"shard-copy:{note.job_id}:{stage}")

    def spawn(self, served: Served, still_served: Callable[[], bool]) -> None:
        if served.trained is not None:
            self.ctx.spawn(self._copy(served, still_served), f"serve-standby:{served.name}")

    async def _copy(self, served: Served, still_served: Callable[[], bool]) -> None:
        job_id = served.trained["job_id"]
        for i, st in enumerate(served.trained["manifest"]["stages"]):
            alive = self.ctx.live_nodes()
            live = [h for h in served.holders[i] if h in alive]
            others = sorted(alive - set(live))
            if not live or len(live) >= 2 or not others or not still_served():
                continue
            target, source = others[i % len(others)], live[0]
            try:
                endpoint = self.ctx.endpoint_of(source)
                for name in [*sorted(st["files"]), "manifest.json"]:
                    pull = FilePull(job_id=job_id, file=f"{st['folder']}/{name}", source=endpoint)
                    if target == self.ctx.node_id:
                        await self.stage_host.pull_file(pull.job_id, pull.file, pull.source)
                    else:
                        await self.ctx.call(target, pull, COPY_TIMEOUT_S)
            except (SwarmError, OSError, ValueError) as exc:
                log.warning("serving %s: no standby copy of stage %d on %s: %s", served.name, i, target, exc)  # fmt: skip
                continue
            if target not in served.holders[i]:
                self.note_copy(served, i, target)
            log.info("serving %s: stage %d's shard has a standby copy on %s", served.name, i, target)  # fmt: skip


__all__ = ["COPY_TIMEOUT_S", "Standby"]
