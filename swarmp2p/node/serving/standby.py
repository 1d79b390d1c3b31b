"""Standby copies of a served trained model's shards: once it serves, every stage's shard gets
a second live holder, so losing a stage's node does not lose the only copy of its trained
weights. The holder makes its copy (``serve.shard_hold``: fetched and sha256-checked as a
stage's shard is) and tells the leader's registry itself (``model.shard_copy`` comes only from
the node it names). Never imports torch."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from swarmp2p.errors import SwarmError
from swarmp2p.node.messages import ServeShardHold
from swarmp2p.node.serving.decide import standby_copies

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext
    from swarmp2p.node.serving.ring import Served
    from swarmp2p.node.training.stages import StageHost

log = logging.getLogger("swarmp2p.node.serving.service")


class Standby:
    """Copies of trained shards, made by the issuing node for the models it serves."""

    def __init__(self, ctx: NodeContext, stage_host: StageHost) -> None:
        self.ctx = ctx
        self.stage_host = stage_host

    def note_copy(self, served: Served, stage: int, node: str) -> None:
        """``node`` holds a copy of ``stage``'s shard now (it told the leader so itself): use
        it here."""
        if node not in served.holders[stage]:
            served.holders[stage].append(node)

    def spawn(self, served: Served, still_served: Callable[[], bool]) -> None:
        if served.trained is not None:
            self.ctx.spawn(self._copy(served, still_served), f"serve-standby:{served.name}")

    async def _copy(self, served: Served, still_served: Callable[[], bool]) -> None:
        job_id = served.trained["job_id"]
        stages = served.trained["manifest"]["stages"]
        for copy in standby_copies(served.holders, self.ctx.live_nodes()):
            if not still_served():
                return
            st = stages[copy.stage]
            ask = {
                "job_id": job_id,
                "folder": st["folder"],
                "files": dict(st["files"]),
                "sources": list(copy.sources),
                "tied": None,
            }
            hold = ServeShardHold(stage=copy.stage, shard=ask)
            try:
                await self.ctx.call(copy.target, hold, self.ctx.config.timings.standby_copy_s)
            except (SwarmError, OSError, ValueError) as exc:
                log.warning(
                    "serving %s: no standby copy of stage %d on %s: %s",
                    served.name,
                    copy.stage,
                    copy.target,
                    exc,
                )
                continue
            self.note_copy(served, copy.stage, copy.target)
            log.info(
                "serving %s: stage %d's shard has a standby copy on %s",
                served.name,
                copy.stage,
                copy.target,
            )


__all__ = ["Standby"]
