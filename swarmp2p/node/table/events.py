"""The job table's events: each a domain fact, a frozen record checked by the schema. No torch.

Only the leader creates events; ``jobtable.apply`` applies one to a table (each has its own
``apply_<name>``), and replication ships them to the members, so persistence, replication and
replay are one code path. An event on the wire or on disk is ``{"event": NAME, **fields}``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, ClassVar

from swarmp2p.net.security import KEY_PATTERN
from swarmp2p.plan import Job, Node, Plan
from swarmp2p.plan.inputs import JobInputs
from swarmp2p.plan.serve import ServePlan, ServeRequest
from swarmp2p.schema import Bounds, Data, SchemaError, field, parse, registered, to_data

ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}"
"""Job ids, model ids, serve ids: one path component, never ``.`` or ``..`` (issue 15)."""
NODE_PATTERN = r"[a-z0-9][a-z0-9._-]{0,63}"
MAX_TAIL_LINES = 40

JobId = Annotated[str, Bounds(pattern=ID_PATTERN)]
NodeId = Annotated[str, Bounds(pattern=NODE_PATTERN)]
PublicKey = Annotated[str, Bounds(pattern=KEY_PATTERN)]
"""A node's (or the admission's) z85 CURVE public key."""
Attempt = Annotated[int, Bounds(ge=1)]
StageIndex = Annotated[int, Bounds(ge=0)]
Reason = Annotated[str, Bounds(max_len=20000)]


class Event:
    """Base of every table event; ``NAME`` is its wire name."""

    NAME: ClassVar[str] = ""
    OMIT_DEFAULTS: ClassVar[frozenset[str]] = frozenset()
    """Fields written only when they differ from their default (``replica``): a one-replica
    job's events keep the bytes they had before replicas."""


EVENTS: dict[str, type[Event]] = {}


def event(name: str):
    """Class decorator: a frozen record registered as table event ``name``."""
    return registered(EVENTS, name, attr="NAME", what="table event")


# --- the swarm -------------------------------------------------------------------------------


@event("leader_elected")
class LeaderElected(Event):
    """``leader`` won the votes of a majority of the members for the entry's term."""

    leader: NodeId
    epoch: str = field(default="", max_len=64)
    """The swarm history's id (set when a swarm's first leader founds its table)."""


@event("member_joined")
class MemberJoined(Event):
    """A node belongs to the swarm from now on: it counts towards the majority, and speaks
    with the key pair whose public half is ``key`` (its id is bound to that key)."""

    node_id: NodeId
    name: str = field(default="", max_len=256)
    key: PublicKey


@event("member_left")
class MemberLeft(Event):
    """A node no longer belongs: it stopped cleanly (it may join again with the secret)."""

    node_id: NodeId
    reason: str = field(default="", max_len=1000)


@event("member_removed")
class MemberRemoved(Event):
    """``swarm remove``: the node no longer belongs and its key ``key`` is revoked (refused
    by every member from now on, even with the secret)."""

    node_id: NodeId
    key: PublicKey
    reason: str = field(default="", max_len=1000)


@event("admission_changed")
class AdmissionChanged(Event):
    """The swarm secret that admits new nodes is now the one whose admission public key is
    ``key`` and whose public id is ``swarm_id`` (a new swarm, or ``swarm token --rotate``)."""

    swarm_id: str = field(pattern=r"[0-9a-f]{16}")
    key: PublicKey


MEMBERSHIP_EVENTS = (MemberJoined, MemberLeft, MemberRemoved)
"""Events that change who counts towards a majority: one at a time may be uncommitted."""


# --- a training job's life -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotSlice:
    """One stage of the cuts a job's snapshots were taken on: its global blocks
    ``[start, end)`` and the nodes holding its snapshot (a resplit attempt cuts its new
    stages' slices from these)."""

    stage: StageIndex
    layers: tuple[int, int]
    nodes: tuple[NodeId, ...]

    def __post_init__(self) -> None:
        if not 0 <= self.layers[0] < self.layers[1]:
            raise ValueError(f"layers {list(self.layers)} is not a block range [start, end)")


@event("job_submitted")
class JobSubmitted(Event):
    job_id: JobId
    job: Job
    submitted_by: str = field(max_len=256)
    at: float
    inputs: JobInputs | None = None
    """The model's shape and where its files and data come from, as the submitter resolved
    them (None: a job submitted by an older node; every node then reads the model itself)."""


@event("job_pending")
class JobPending(Event):
    """The job cannot be placed now; ``reason`` names every rejected device or node."""

    job_id: JobId
    reason: Reason
    at: float


@event("job_placed")
class JobPlaced(Event):
    """Attempt ``attempt`` of the job runs on ``plan`` (checked by every stage's node against
    ``cluster``, the records it was planned on), from snapshot step ``resume_step`` (0: fresh)."""

    job_id: JobId
    attempt: Attempt
    plan: Plan
    cluster: tuple[Node, ...]
    resume_step: int = field(default=0, ge=0)
    placed_by: NodeId
    at: float
    resplit: tuple[SnapshotSlice, ...] = ()
    """Resuming on new cuts: the old cuts' stages whose snapshots at ``resume_step`` each new
    stage's slice is cut from; empty otherwise."""
    cuts: tuple[int, ...] = ()
    """The cuts the plan was made with (every stage's node checks it with these); empty: the
    planner chose them from the job (a first placement)."""


@event("job_running")
class JobRunning(Event):
    """Every stage of ``attempt`` started and is wired to the next."""

    job_id: JobId
    attempt: Attempt
    at: float


@event("job_resuming")
class JobResuming(Event):
    """A stage's node was lost (or the leader that placed it): the job is re-planned."""

    job_id: JobId
    reason: str = field(max_len=2000)
    at: float


@event("job_rebalanced")
class JobRebalanced(Event):
    """Attempt ``attempt``'s split no longer fits how fast its stages run (``reason``): the job
    is re-placed from its newest snapshot, split by the speeds the run measured (``speeds``:
    node id -> device key such as "cuda:0" -> FLOP/s in ``dtype``)."""

    job_id: JobId
    attempt: Attempt
    reason: str = field(max_len=2000)
    dtype: str = field(max_len=16)
    speeds: dict[str, dict[str, float]]
    at: float


@event("steps_reported")
class StepsReported(Event):
    """Progress of ``attempt``: ``step`` steps done, the last stage's loss then (a sample,
    not the curve: loss curves stay out of the replicated table)."""

    job_id: JobId
    attempt: Attempt
    step: int = field(ge=0)
    loss: float | None = None
    at: float


@event("snapshot_held")
class SnapshotHeld(Event):
    """``node_id`` holds stage ``stage``'s snapshot after ``step`` steps."""

    job_id: JobId
    stage: StageIndex
    step: int = field(ge=1)
    node_id: NodeId


@event("evaluation_reported")
class EvaluationReported(Event):
    job_id: JobId
    name: str = field(max_len=64)
    """The pass: "base", "calibrated_boundary" or "trained"."""
    loss: float | None = None
    perplexity: float | None = None
    top1: float | None = None
    tokens: int = field(default=0, ge=0)


@event("stage_exported")
class StageExported(Event):
    """Stage ``stage``'s shard is in ``folder`` of the job's folder on ``node_id``."""

    job_id: JobId
    attempt: Attempt
    stage: StageIndex
    node_id: NodeId
    folder: str = field(max_len=256)
    manifest: dict


@event("stage_finished")
class StageFinished(Event):
    """Stage ``stage`` of replica ``replica`` of ``attempt`` ran every step and exited
    cleanly."""

    OMIT_DEFAULTS = frozenset({"replica"})

    job_id: JobId
    attempt: Attempt
    stage: StageIndex
    at: float
    replica: int = field(default=0, ge=0, le=1024)


@event("job_failed")
class JobFailed(Event):
    """The first error: where (``stage`` -1: not a stage's) and what."""

    job_id: JobId
    attempt: int = field(ge=0)
    stage: int = field(ge=-1)
    node_id: str = field(max_len=64)
    message: str = field(max_len=20000)
    stderr_tail: tuple[str, ...] = field(default=(), max_len=MAX_TAIL_LINES)
    at: float


@event("job_cancelled")
class JobCancelled(Event):
    job_id: JobId
    reason: str = field(max_len=1000)
    at: float


@event("model_registered")
class ModelRegistered(Event):
    """The completed job's model enters the registry as ``model["id"]``."""

    job_id: JobId
    model: dict


@event("shard_copied")
class ShardCopied(Event):
    """``node_id`` holds an intact copy of stage ``stage``'s shard of the job's model."""

    job_id: JobId
    stage: StageIndex
    node_id: NodeId


# --- a served model's life (``swarm serve``) --------------------------------------------------
# Written by the leader on the issuing node's word (``serve.note``, only the issuer of a serve
# id speaks for it); ``node/serving/decide.py`` decides them, ``node/serving/service.py`` runs
# the rings. A served model: requested+placed -> serving -> stage lost -> replacing -> placed
# again (a failover) | degraded (no placement fits; retried) -> ... ; failed; stopped (gone).

ApiKeyDigest = Annotated[str, Bounds(pattern=r"(|[0-9a-f]{64})")]
"""The sha256 of a served model's API key ("" without one): the key itself never enters the
replicated table; the issuing node keeps it in a 0600 file of its own."""


@event("serve_requested")
class ServeRequested(Event):
    """``issuer`` serves ``request`` as ``serve_id`` (its first ring is up: a request that
    never served is never written)."""

    serve_id: JobId
    issuer: NodeId
    request: ServeRequest
    """The request, ``api_key`` left out (see ``api_key_sha256``)."""
    api_key_sha256: ApiKeyDigest = ""
    at: float

    def __post_init__(self) -> None:
        if self.request.api_key is not None:
            raise ValueError("serve_requested: the API key never enters the table (its digest)")


@event("serve_placed")
class ServePlaced(Event):
    """Ring ``attempt`` of ``serve_id`` runs on ``plan`` (its stages answer at ``endpoints``),
    its API at ``url``. ``failover``: it replaces a ring that lost a stage (``replayed``
    sessions moved onto it); otherwise it is the first ring or one opened after a restart."""

    serve_id: JobId
    attempt: Attempt
    plan: ServePlan
    endpoints: tuple[str, ...] = field(default=(), max_len=64)
    url: str = field(default="", max_len=512)
    failover: bool = False
    replayed: int = field(default=0, ge=0)
    at: float


@event("serve_stage_lost")
class ServeStageLost(Event):
    """Stage ``stage`` of ring ``attempt`` is lost: its node ``node_id`` is gone, or
    (``crashed``) its worker ended while the node lives on. The ring is re-placed."""

    serve_id: JobId
    attempt: Attempt
    stage: StageIndex
    node_id: NodeId
    crashed: bool = False
    reason: str = field(default="", max_len=2000)
    at: float


@event("serve_degraded")
class ServeDegraded(Event):
    """Ring ``attempt`` could not be built (no placement fits the live nodes, or the leader
    did not answer): ``reason``; the issuing node retries each round."""

    serve_id: JobId
    attempt: Attempt
    reason: Reason
    at: float


@event("serve_failed")
class ServeFailed(Event):
    """The issuing node gave up (workers died too often, or a restart could not serve it
    again in time): open requests fail with ``reason`` until it is stopped."""

    serve_id: JobId
    reason: Reason
    at: float


@event("serve_stopped")
class ServeStopped(Event):
    """``swarm serve --stop``: the served model leaves the table."""

    serve_id: JobId
    at: float


SERVE_EVENTS = (
    ServeRequested,
    ServePlaced,
    ServeStageLost,
    ServeDegraded,
    ServeFailed,
    ServeStopped,
)
"""The events an issuing node asks the leader to write (``serve.note``)."""


# --- the log ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One event at its table version, created by the leader of ``term``."""

    version: int = field(ge=1)
    term: int = field(ge=1)
    event: Event


def event_to_data(ev: Event) -> dict[str, Data]:
    data = to_data(ev)
    for name in ev.OMIT_DEFAULTS:
        if data.get(name) == _DEFAULTS[type(ev)][name]:
            del data[name]
    return {"event": ev.NAME, **data}


_DEFAULTS: dict[type, dict[str, object]] = {
    cls: {f.name: f.default for f in dataclasses.fields(cls) if f.name in cls.OMIT_DEFAULTS}
    for cls in EVENTS.values()
}


def event_from_data(data: Data, path: str = "event") -> Event:
    """An event from ``{"event": NAME, ...}``; SchemaError naming the bad field."""
    if not isinstance(data, dict) or data.get("event") not in EVENTS:
        name = data.get("event") if isinstance(data, dict) else None
        raise SchemaError(f"{path}: unknown table event {name!r}; known: {', '.join(EVENTS)}")
    fields = {k: v for k, v in data.items() if k != "event"}
    return parse(EVENTS[data["event"]], fields, title=f"invalid {path} {data['event']}")


def entry_to_data(entry: Entry) -> dict[str, Data]:
    return {"version": entry.version, "term": entry.term, "event": event_to_data(entry.event)}


def entry_from_data(data: Data) -> Entry:
    if not isinstance(data, dict) or set(data) != {"version", "term", "event"}:
        raise SchemaError("a table entry is {version, term, event}")
    version, term = data["version"], data["term"]
    if type(version) is not int or type(term) is not int or version < 1 or term < 1:
        raise SchemaError(
            f"table entry version/term must be integers >= 1, got {version!r}/{term!r}"
        )
    if version > 2**62 or term > 2**62:
        raise SchemaError("table entry version/term is out of range")
    return Entry(version=version, term=term, event=event_from_data(data["event"]))


__all__ = [
    "EVENTS",
    "ID_PATTERN",
    "MEMBERSHIP_EVENTS",
    "NODE_PATTERN",
    "SERVE_EVENTS",
    "AdmissionChanged",
    "Entry",
    "EvaluationReported",
    "Event",
    "JobCancelled",
    "JobFailed",
    "JobPending",
    "JobPlaced",
    "JobRebalanced",
    "JobResuming",
    "JobRunning",
    "JobSubmitted",
    "LeaderElected",
    "MemberJoined",
    "MemberLeft",
    "MemberRemoved",
    "ModelRegistered",
    "PublicKey",
    "ServeDegraded",
    "ServeFailed",
    "ServePlaced",
    "ServeRequested",
    "ServeStageLost",
    "ServeStopped",
    "ShardCopied",
    "SnapshotHeld",
    "StageExported",
    "StageFinished",
    "StepsReported",
    "entry_from_data",
    "entry_to_data",
    "event_from_data",
    "event_to_data",
]
