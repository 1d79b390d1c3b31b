"""The served models of the replicated table (``swarm serve``): their record and the
``apply_serve_<event>`` of each serving event, dispatched by ``jobtable.apply`` like every
other event (so persistence, replication and replay are the job table's). No torch.

A served model: serve_requested + serve_placed -> serving; serve_stage_lost -> replacing;
serve_placed (failover) -> serving, or serve_degraded -> degraded (retried) -> serve_placed;
serve_failed -> failed; serve_stopped removes it. An event that does not follow raises
ValueError naming why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from swarmp2p.node.table import events as ev
from swarmp2p.plan.serve import ServePlan, ServeRequest
from swarmp2p.schema import field

if TYPE_CHECKING:
    from swarmp2p.node.table.jobtable import JobTable


SERVE_STATES = ("serving", "replacing", "degraded", "failed")
"""serving: its ring runs; replacing: a stage was lost, a new ring is being placed; degraded:
no new ring could be placed yet (retried); failed: given up. Stopped models leave the table."""
LIVE_SERVE_STATES = ("serving", "replacing", "degraded")


@dataclass(frozen=True, kw_only=True, slots=True)
class ServedModel:
    """One served model as every member holds it: the request, where its live ring runs."""

    serve_id: str = field(pattern=ev.ID_PATTERN)
    issuer: str = field(pattern=ev.NODE_PATTERN)
    """The node that ran ``swarm serve``: it answers the API and drives the ring."""
    request: ServeRequest
    """Without its API key (``api_key_sha256``: the key stays in a 0600 file on the issuer)."""
    api_key_sha256: str = ""
    state: Literal["serving", "replacing", "degraded", "failed"]
    version: int = field(ge=1)
    """The table version of its last change."""
    requested_at: float = 0.0
    attempt: int = field(default=0, ge=0)
    """The newest ring attempt tried (placed or degraded)."""
    live_attempt: int = field(default=0, ge=0)
    """The attempt whose workers form the ring (0: none)."""
    plan: ServePlan | None = None
    """The live ring's plan: stage -> node placement, dtype, context."""
    endpoints: tuple[str, ...] = ()
    url: str = ""
    reason: str = ""
    failovers: int = field(default=0, ge=0)
    replayed: int = field(default=0, ge=0)
    lost: tuple[int, ...] = ()
    """Stages of the live ring lost since it was placed."""
    crash_rebuilds: int = field(default=0, ge=0)
    """Rings rebuilt because a worker died on a live node (not a node loss)."""
    degraded_since: float | None = None
    """When a new ring first could not be placed (wall time), for the retry grace."""

    @property
    def name(self) -> str:
        return self.request.served_name

    @property
    def stage_nodes(self) -> tuple[str, ...]:
        return tuple(s.node_id for s in self.plan.stages) if self.plan is not None else ()


# --- apply ------------------------------------------------------------------------------------


def _served(t: JobTable, serve_id: str, what: str) -> ServedModel:
    served = t.served.get(serve_id)
    if served is None:
        raise ValueError(f"served model {serve_id!r} is not in the table; it cannot {what}")
    return served


def _serving_changed(t: JobTable, served: ServedModel, version: int) -> JobTable:
    return replace(t, served={**t.served, served.serve_id: replace(served, version=version)})


def apply_serve_requested(t: JobTable, e: ev.ServeRequested, entry: ev.Entry) -> JobTable:
    if e.serve_id in t.served:
        raise ValueError(f"served model {e.serve_id!r} is already in the table")
    name = e.request.served_name
    twin = next((s for s in t.served.values() if s.issuer == e.issuer and s.name == name), None)
    if twin is not None:
        raise ValueError(f"node {e.issuer} serves {name!r} already (as {twin.serve_id})")
    served = ServedModel(
        serve_id=e.serve_id,
        issuer=e.issuer,
        request=e.request,
        api_key_sha256=e.api_key_sha256,
        state="degraded",
        reason="requested; no ring placed yet",
        version=entry.version,
        requested_at=e.at,
    )
    return _serving_changed(t, served, entry.version)


def apply_serve_placed(t: JobTable, e: ev.ServePlaced, entry: ev.Entry) -> JobTable:
    served = _served(t, e.serve_id, "be placed")
    if served.state == "failed":
        raise ValueError(f"served model {e.serve_id} failed; stop it and serve it again")
    if e.attempt <= served.attempt:
        raise ValueError(
            f"served model {e.serve_id}: ring attempt {e.attempt} does not follow {served.attempt}"
        )
    if e.failover and (not served.live_attempt or served.state == "serving"):
        raise ValueError(f"served model {e.serve_id} lost no stage of a live ring to fail over")
    return _serving_changed(
        t,
        replace(
            served,
            state="serving",
            attempt=e.attempt,
            live_attempt=e.attempt,
            plan=e.plan,
            endpoints=e.endpoints,
            url=e.url,
            reason="",
            failovers=served.failovers + int(e.failover),
            replayed=served.replayed + e.replayed,
            lost=(),
            crash_rebuilds=served.crash_rebuilds if e.failover else 0,
            degraded_since=None,
        ),
        entry.version,
    )


def apply_serve_stage_lost(t: JobTable, e: ev.ServeStageLost, entry: ev.Entry) -> JobTable:
    served = _served(t, e.serve_id, "lose a stage")
    if served.state not in LIVE_SERVE_STATES:
        raise ValueError(f"served model {e.serve_id} is {served.state}; it has no ring to lose")
    if e.attempt != served.live_attempt:
        raise ValueError(
            f"served model {e.serve_id}: stage lost of ring attempt {e.attempt}, the live one is "
            f"{served.live_attempt or 'none'}"
        )
    if served.plan is None or e.stage >= len(served.plan.stages):
        raise ValueError(f"served model {e.serve_id}'s ring has no stage {e.stage}")
    placed = served.plan.stages[e.stage].node_id
    if e.node_id != placed:
        raise ValueError(
            f"served model {e.serve_id}: stage {e.stage} runs on {placed}, not {e.node_id}"
        )
    first = served.state == "serving"  # the first loss of this ring
    why = e.reason or (
        f"stage {e.stage}'s worker ended on node {e.node_id}"
        if e.crashed
        else f"a stage node was lost ({e.node_id})"
    )
    return _serving_changed(
        t,
        replace(
            served,
            state="replacing" if served.state == "serving" else served.state,
            lost=tuple(sorted({*served.lost, e.stage})),
            reason=f"{why}; re-placing" if first else served.reason,
            crash_rebuilds=served.crash_rebuilds + int(e.crashed and first),
        ),
        entry.version,
    )


def apply_serve_degraded(t: JobTable, e: ev.ServeDegraded, entry: ev.Entry) -> JobTable:
    served = _served(t, e.serve_id, "be degraded")
    if served.state == "failed":
        raise ValueError(f"served model {e.serve_id} failed; it is not retried")
    if e.attempt < served.attempt:
        raise ValueError(
            f"served model {e.serve_id}: ring attempt {e.attempt} is older than {served.attempt}"
        )
    since = served.degraded_since if served.degraded_since is not None else e.at
    changed = replace(
        served, state="degraded", attempt=e.attempt, reason=e.reason, degraded_since=since
    )
    return _serving_changed(t, changed, entry.version)


def apply_serve_failed(t: JobTable, e: ev.ServeFailed, entry: ev.Entry) -> JobTable:
    served = _served(t, e.serve_id, "fail")
    if served.state == "failed":
        raise ValueError(f"served model {e.serve_id} failed already")
    return _serving_changed(t, replace(served, state="failed", reason=e.reason), entry.version)


def apply_serve_stopped(t: JobTable, e: ev.ServeStopped, entry: ev.Entry) -> JobTable:
    _served(t, e.serve_id, "stop")
    return replace(t, served={k: v for k, v in t.served.items() if k != e.serve_id})


__all__ = [
    "LIVE_SERVE_STATES",
    "SERVE_STATES",
    "ServedModel",
    "apply_serve_degraded",
    "apply_serve_failed",
    "apply_serve_placed",
    "apply_serve_requested",
    "apply_serve_stage_lost",
    "apply_serve_stopped",
]
