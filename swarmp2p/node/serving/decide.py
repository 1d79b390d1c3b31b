"""What the issuing node does next for the models it serves: a pure function of the table's
served models, who is alive, what this node runs and the clock. ``service.py`` carries the
actions out (events to the leader, rings built, sessions failed). Never imports torch.

Rules, per served model this node issues (``ServedModel.issuer``):

- A stage whose node left the live view is lost (``MarkLost``: ``serve_stage_lost``), and a
  ring that lost a stage (a node, or a worker on a live node) is re-placed on the live nodes
  (``Replan``: a new ring, the old attempt's workers stopped, every open session replayed).
- A ring that cannot be re-placed is degraded and retried each round; its open requests wait
  ``grace_s`` (the leader may still count the lost node alive for a failure timeout and place
  a stage on it), then fail with the reason (``FailOpen``).
- Workers that died on live nodes more than ``max_crash_rebuilds`` times: given up
  (``GiveUp``: ``serve_failed``); a failed model's requests fail at once.
- A model of the table this node runs nothing for (this daemon restarted) is opened again from
  its request (``Restore``: the old attempt's workers stopped first), from ``restore_from`` (the
  peers found each other) until ``restore_until`` (then given up).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from swarmp2p.node.table.served import LIVE_SERVE_STATES, ServedModel


@dataclass(frozen=True, kw_only=True, slots=True)
class Local:
    """What this node runs for a served model (its handles, summarized for deciding)."""

    running: bool
    """Its ring client and its API are up."""
    busy: bool
    """An open or a rebuild is in flight: decide nothing until it ends."""
    retry_at: float = 0.0
    """Nothing runs (an open after a restart failed): open it again from then on."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MarkLost:
    """Write that stage ``stage`` (on ``node_id``) of ring ``attempt`` is lost."""

    serve_id: str
    attempt: int
    stage: int
    node_id: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Replan:
    """Build a new ring on the live nodes and move the open sessions onto it (a failover)."""

    serve_id: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Restore:
    """Open the model again from its request (the API, a new ring); first stop the workers of
    ``stop_attempt`` on ``stop_nodes``, the ring this node drove before it restarted."""

    serve_id: str
    stop_attempt: int
    stop_nodes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class FailOpen:
    """Fail every open request of the model now with ``reason``."""

    serve_id: str
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class GiveUp:
    """Write that the model failed (``reason``) and fail its open requests."""

    serve_id: str
    reason: str


ServeAction = MarkLost | Replan | Restore | FailOpen | GiveUp


def decide_serving(
    served: Mapping[str, ServedModel],
    *,
    me: str,
    alive: frozenset[str],
    local: Mapping[str, Local],
    now: float,
    grace_s: float,
    restore_from: float,
    restore_until: float,
    max_crash_rebuilds: int,
) -> list[ServeAction]:
    """The actions for the served models ``me`` issues, in serve id order (``now`` and the
    times: wall-clock seconds, as the table's ``at`` fields)."""
    out: list[ServeAction] = []
    for serve_id in sorted(served):
        model = served[serve_id]
        if model.issuer != me:
            continue
        here = local.get(serve_id)
        if model.state == "failed":
            if here is not None and here.running:  # requests sent since fail at once
                out.append(FailOpen(serve_id=serve_id, reason=model.reason))
            continue
        if here is None or not (here.running or here.busy):
            if here is None or now >= here.retry_at:
                out.extend(_restore(model, now, restore_from, restore_until))
            continue
        if here.busy:
            continue
        out.extend(_failover(model, alive, now, grace_s, max_crash_rebuilds))
    return out


def _restore(
    model: ServedModel, now: float, restore_from: float, restore_until: float
) -> list[ServeAction]:
    if now < restore_from:
        return []
    if now > restore_until:
        why = model.reason or "no ring could be placed"
        return [
            GiveUp(
                serve_id=model.serve_id, reason=f"gave up serving it again after a restart: {why}"
            )
        ]
    return [
        Restore(
            serve_id=model.serve_id,
            stop_attempt=model.live_attempt,
            stop_nodes=tuple(sorted(set(model.stage_nodes))),
        )
    ]


def _failover(
    model: ServedModel, alive: frozenset[str], now: float, grace_s: float, max_crash_rebuilds: int
) -> list[ServeAction]:
    if model.state not in LIVE_SERVE_STATES:
        return []
    out: list[ServeAction] = [
        MarkLost(serve_id=model.serve_id, attempt=model.live_attempt, stage=i, node_id=node)
        for i, node in enumerate(model.stage_nodes)
        if node not in alive and i not in model.lost
    ]
    if not out and model.state == "serving":
        return []
    if model.crash_rebuilds > max_crash_rebuilds:
        why = f"stage worker(s) died {model.crash_rebuilds} times; last: {model.reason}"
        return [GiveUp(serve_id=model.serve_id, reason=why)]
    since = model.degraded_since
    if model.state == "degraded" and since is not None and now - since > grace_s:
        out.append(FailOpen(serve_id=model.serve_id, reason=model.reason))
    out.append(Replan(serve_id=model.serve_id))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class StandbyCopy:
    """Copy stage ``stage``'s trained shard to ``target`` from ``sources`` (its live holders)."""

    stage: int
    target: str
    sources: tuple[str, ...]


def standby_copies(holders: Sequence[Sequence[str]], alive: frozenset[str]) -> list[StandbyCopy]:
    """Per stage of a served trained model, a second live holder of its shard where it has
    one live holder and another node lives: losing a stage's node then loses no only copy."""
    out = []
    for i, held in enumerate(holders):
        live = [h for h in held if h in alive]
        others = sorted(alive - set(live))
        if len(live) == 1 and others:
            out.append(StandbyCopy(stage=i, target=others[i % len(others)], sources=tuple(live)))
    return out


__all__ = [
    "FailOpen",
    "GiveUp",
    "Local",
    "MarkLost",
    "Replan",
    "Restore",
    "ServeAction",
    "StandbyCopy",
    "decide_serving",
    "standby_copies",
]
