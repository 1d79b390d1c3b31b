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
    pipeline's ends), and with replicas its ring's links to the next and from the previous
    replica's member (None with one replica)."""

    ctx: Any
    prev: Any
    next: Any
    ring_next: Any = None
    ring_prev: Any = None

    def close(self) -> None:
        for link in (self.prev, self.next, self.ring_next, self.ring_prev):
            if link is not None:
                link.close()
        self.ctx.destroy(linger=0)


def _ring_credentials(spec: WorkerSpec, peer: str) -> tuple[Any, Any]:
    """(server, client) credentials of the ring link to replica ``peer`` ("next"/"prev"): the
    bound end admits only that replica's node, the dialled one must be it."""
    from swarmp2p.net import SwarmSecret
    from swarmp2p.net.links import link_credentials

    if not spec.ring_keys:
        secret = SwarmSecret.from_token(spec.token)
        return secret, secret
    keys = spec.ring_keys
    try:
        server, _ = link_credentials({**keys, "prev": keys.get(peer, ""), "next": ""})
        _, client = link_credentials({**keys, "prev": "", "next": keys.get(peer, "")})
    except ValueError as exc:
        raise ValueError(f"ring keys: {exc}") from None
    if client is None:
        raise ValueError(f"ring keys: no {peer!r} key for the replica ring")
    return server, client


def open_stage_links(spec: WorkerSpec, emit: Callable[[WorkerEvent], None]) -> StageLinks:
    """Bind the link from the stage before (any free port) and the replica ring's bound ends,
    emit ``ready`` with their ports, then dial the stage after and the ring's other ends;
    ValueError naming the key when the spec's link keys are unusable."""
    from swarmp2p.net import SecureContext, SwarmSecret, ZmqLink
    from swarmp2p.net.links import link_credentials

    try:
        if spec.link_keys:  # the node's own keys: only the neighbouring stages' nodes connect
            server, client = link_credentials(spec.link_keys)
        else:
            server = client = SwarmSecret.from_token(spec.token)
    except ValueError as exc:
        raise ValueError(f"link keys: {exc}") from None
    ring = spec.n_replicas > 1
    ring_keys = {p: _ring_credentials(spec, p) for p in ("next", "prev")} if ring else {}
    ctx = SecureContext()
    opened: dict[str, Any] = {}
    try:
        if not spec.is_first:
            opened["prev"] = ZmqLink.bind(ctx, server, spec.host, spec.port)
        for peer, endpoint in (("next", spec.ring_next), ("prev", spec.ring_prev)):
            if ring and endpoint is None:
                opened[f"ring_{peer}"] = ZmqLink.bind(ctx, ring_keys[peer][0], spec.host, 0)
        ports = {k: link.port for k, link in opened.items()}
        emit(
            Ready(
                port=ports.get("prev"),
                ring_next_port=ports.get("ring_next"),
                ring_prev_port=ports.get("ring_prev"),
            )
        )
        if not spec.is_last:
            if client is None:
                raise ValueError("link keys: no 'next' key for a stage that is not the last")
            opened["next"] = ZmqLink.dial(ctx, client, spec.next)
        for peer, endpoint in (("next", spec.ring_next), ("prev", spec.ring_prev)):
            if ring and endpoint is not None:
                opened[f"ring_{peer}"] = ZmqLink.dial(ctx, ring_keys[peer][1], endpoint)
    except BaseException:
        for link in opened.values():
            link.close()
        ctx.destroy(linger=0)
        raise
    return StageLinks(ctx=ctx, **{k: opened.get(k) for k in ("prev", "next")},
                      ring_next=opened.get("ring_next"), ring_prev=opened.get("ring_prev"))  # fmt: skip


__all__ = ["StageLinks", "open_stage_links"]
