"""A training stage's data links, opened before torch is imported (light: zmq, no torch).

The leader starts a job's stages one at a time, last to first: each needs the port the stage
after it bound. A stage that imported torch before binding held that chain for its import
(2.5 s on a quiet 2-core box, 5-7 s beside other workers) at every stage; bound first, the
stages report ``ready`` within a few tenths of a second each and import torch and load their
layers side by side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from swarmp2p.plan.worker_spec import WorkerSpec
from swarmp2p.workers.events import Ready, WorkerEvent


@dataclass(frozen=True, slots=True)
class StageLinks:
    """The stage's ZeroMQ context and its links to the stages before and after it (None at the
    pipeline's ends)."""

    ctx: Any
    prev: Any
    next: Any

    def close(self) -> None:
        for link in (self.prev, self.next):
            if link is not None:
                link.close()
        self.ctx.destroy(linger=0)


def open_stage_links(spec: WorkerSpec, emit: Callable[[WorkerEvent], None]) -> StageLinks:
    """Bind the link from the stage before (any free port), emit ``ready`` with that port, then
    dial the stage after; ValueError naming the key when the spec's link keys are unusable."""
    from swarmp2p.net import SecureContext, SwarmSecret, ZmqLink
    from swarmp2p.net.links import link_credentials

    try:
        if spec.link_keys:  # the node's own keys: only the neighbouring stages' nodes connect
            server, client = link_credentials(spec.link_keys)
        else:
            server = client = SwarmSecret.from_token(spec.token)
    except ValueError as exc:
        raise ValueError(f"link keys: {exc}") from None
    ctx = SecureContext()
    prev_link = next_link = None
    try:
        if not spec.is_first:
            prev_link = ZmqLink.bind(ctx, server, spec.host, spec.port)
        emit(Ready(port=prev_link.port if prev_link is not None else None))
        if not spec.is_last:
            if client is None:
                raise ValueError("link keys: no 'next' key for a stage that is not the last")
            next_link = ZmqLink.dial(ctx, client, spec.next)
    except BaseException:
        for link in (prev_link, next_link):
            if link is not None:
                link.close()
        ctx.destroy(linger=0)
        raise
    return StageLinks(ctx=ctx, prev=prev_link, next=next_link)


__all__ = ["StageLinks", "open_stage_links"]
