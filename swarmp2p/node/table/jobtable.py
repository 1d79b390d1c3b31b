"""The replicated job table: typed records changed only by ``apply(table, entry)``. No torch.

The table holds the swarm's members (who counts towards a majority) and every training job
with its state, plan, snapshots, shards and registered model. Each event has its own
``apply_<event>``; an event that does not follow from the table (an unknown job, a finished
one, a stale attempt's step) raises ValueError naming why, so the leader never commits it.
A table is saved atomically with a sha256 checksum; the daemon's copy is a snapshot plus an
append-only log of the entries after it (``store.py``).

Job states: pending -> placed -> running -> completed | failed | cancelled; a lost stage node
sends a running job to resuming -> placed (a new attempt) -> running.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, cast

from swarmp2p._atomic import write_atomic
from swarmp2p.node.table import events as ev
from swarmp2p.node.table import served as sv
from swarmp2p.node.table.served import ServedModel
from swarmp2p.plan import Job, Node, Plan
from swarmp2p.plan.inputs import JobInputs
from swarmp2p.plan.worker_spec import reads_data
from swarmp2p.schema import Data, SchemaError, field, parse, to_data

log = logging.getLogger("swarmp2p.node.table.jobtable")

TABLE_FORMAT = 3
"""3: members carry their public keys (issue 15); older tables are set aside on load."""
MAX_REVOKED = 4096
"""Revoked keys a table remembers (the oldest are forgotten; a rotation admits none of them)."""
MAX_VERSION = 2**53
"""Versions and terms stay below this (JSON-safe integers; a peer cannot wedge the table)."""
SNAPSHOTS_KEPT = 4
"""Snapshot steps remembered per stage (a copy may land after the next snapshot is taken)."""
JOB_STATES = ("pending", "placed", "running", "resuming", "completed", "failed", "cancelled")
ACTIVE_STATES = ("placed", "running", "resuming")
"""States in which workers may run."""
FINAL_STATES = ("completed", "failed", "cancelled")


@dataclass(frozen=True, kw_only=True, slots=True)
class Member:
    node_id: str = field(pattern=ev.NODE_PATTERN)
    name: str = field(default="", max_len=256)
    key: ev.PublicKey
    """Its z85 CURVE public key: the only key its messages are accepted with."""
    down: bool = False
    """It stopped cleanly (``MemberLeft``): it keeps its id and key (nobody else can take the
    id) but counts towards no majority until it is listed again (``MemberJoined``, same key)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StateChange:
    state: str
    at: float
    reason: str = ""
    """Why, when the change needs saying (a re-balance)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Failure:
    """The first error of a FAILED job: where it happened and what it said."""

    stage: int
    node: str
    message: str
    stderr_tail: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Shard:
    """Where a stage's exported shard is (a folder of the job's folder on ``node``)."""

    node: str
    folder: str
    manifest: dict


@dataclass(frozen=True, kw_only=True, slots=True)
class JobEntry:
    """One training job as every member holds it."""

    job_id: str = field(pattern=ev.ID_PATTERN)
    job: Job
    state: Literal["pending", "placed", "running", "resuming", "completed", "failed", "cancelled"]
    version: int = field(ge=1)
    """The table version of its last change."""
    submitted_by: str = ""
    history: tuple[StateChange, ...] = ()
    attempt: int = field(default=0, ge=0)
    plan: Plan | None = None
    cluster: tuple[Node, ...] = ()
    """The node records the current attempt was planned on (every stage's node checks)."""
    placed_by: str = ""
    resume_step: int = field(default=0, ge=0)
    reason: str | None = None
    """Why it waits (pending) or was re-planned (resuming)."""
    error: Failure | None = None
    step: int = field(default=0, ge=0)
    loss: float | None = None
    done_stages: tuple[int, ...] = ()
    """The stages that finished, each as its slot: replica r's stage i is ``r * n_stages + i``
    (one replica: the stage indices)."""
    snapshots: dict[str, dict[str, tuple[str, ...]]] = dataclasses.field(default_factory=dict)
    """Stage -> step -> the nodes holding that snapshot (string keys: the table is JSON)."""
    shards: dict[str, Shard] = dataclasses.field(default_factory=dict)
    evaluation: dict[str, dict] = dataclasses.field(default_factory=dict)
    model: dict | None = None
    """The registry entry, once the job completed (``swarm models``)."""
    inputs: JobInputs | None = None
    """The model's shape and where its files and data come from (the submitter's)."""
    resplit: tuple[ev.SnapshotSlice, ...] = ()
    """The current attempt resumes on new cuts from these old stages' snapshots."""
    cuts: tuple[int, ...] = ()
    """The cuts the current attempt's plan was made with (empty: chosen by the planner)."""
    learned: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    """Speeds the run measured (node id -> device key -> FLOP/s in ``learned_dtype``): later
    placements of the job split by them."""
    learned_dtype: str = ""
    rebalances: int = field(default=0, ge=0)
    """How many times the split was re-balanced to measured speeds."""

    @property
    def name(self) -> str:
        return self.job.name

    @property
    def n_stages(self) -> int:
        return len(self.plan.stages) if self.plan is not None else 0

    @property
    def n_replicas(self) -> int:
        return self.plan.n_replicas if self.plan is not None else 1

    @property
    def stage_nodes(self) -> tuple[str, ...]:
        """Every replica's stages' nodes, replica by replica (one replica: stage by stage)."""
        if self.plan is None:
            return ()
        return tuple(s.node_id for r in range(self.n_replicas) for s in self.plan.replica_stages(r))


@dataclass(frozen=True, kw_only=True, slots=True)
class JobTable:
    """The table at one version."""

    format: Literal[3] = TABLE_FORMAT
    epoch: str = field(default="", max_len=64)
    """The swarm history this table belongs to (set by its founding leader)."""
    term: int = field(default=0, ge=0, lt=MAX_VERSION)
    """The term of the leader that wrote the latest event."""
    version: int = field(default=0, ge=0, lt=MAX_VERSION)
    leader: str = ""
    members: tuple[Member, ...] = ()
    jobs: dict[str, JobEntry] = dataclasses.field(default_factory=dict)
    served: dict[str, ServedModel] = dataclasses.field(default_factory=dict)
    """serve id -> the served model (``swarm serve``)."""
    swarm_id: str = field(default="", max_len=16)
    admission: str = field(default="", max_len=40)
    """The admission public key of the secret that admits new nodes (``AdmissionChanged``):
    a member whose secret differs fetches the current one from the leader."""
    revoked: tuple[str, ...] = field(default=(), max_len=MAX_REVOKED)
    """Public keys of removed nodes: never admitted again."""
    removed: tuple[str, ...] = field(default=(), max_len=MAX_REVOKED)
    """Node ids removed since the secret last changed: the old token cannot bring them back
    under a new key (``swarm token --rotate`` frees them)."""

    @property
    def key(self) -> tuple[int, int]:
        """Order of tables of one history: newer is larger."""
        return (self.term, self.version)

    @property
    def member_ids(self) -> frozenset[str]:
        """Every listed member, down ones included (their ids stay theirs)."""
        return frozenset(m.node_id for m in self.members)

    @property
    def voters(self) -> frozenset[str]:
        """The members that count towards a majority (listed and not down)."""
        return frozenset(m.node_id for m in self.members if not m.down)

    def member(self, node_id: str) -> Member | None:
        return next((m for m in self.members if m.node_id == node_id), None)

    def majority(self) -> int:
        """How many voters make a majority (1 for a table with no members yet)."""
        return len(self.voters) // 2 + 1

    def to_dict(self) -> dict[str, Data]:
        return to_data(self)

    @classmethod
    def from_dict(cls, data: Data) -> JobTable:
        """A table from its JSON form; SchemaError naming the bad field."""
        return parse(cls, data, title="invalid job table")


# --- apply ------------------------------------------------------------------------------------


def _job(table: JobTable, job_id: str) -> JobEntry:
    entry = table.jobs.get(job_id)
    if entry is None:
        raise ValueError(f"job {job_id!r} is not in the table")
    return entry


def _active(entry: JobEntry, what: str) -> None:
    if entry.state in FINAL_STATES:
        raise ValueError(f"job {entry.job_id} is {entry.state}; it cannot {what}")


def _current(entry: JobEntry, attempt: int, what: str) -> None:
    _active(entry, what)
    if attempt != entry.attempt:
        raise ValueError(
            f"job {entry.job_id}: {what} of attempt {attempt}, the current one is {entry.attempt}"
        )


def _moved(entry: JobEntry, state: str, at: float, **changes: Any) -> JobEntry:
    """``entry`` in ``state`` (its history extended when the state changes)."""
    history = entry.history
    if state != entry.state:
        history = (*history, StateChange(state=state, at=at))
    return replace(entry, state=state, history=history, **changes)


def apply_leader_elected(t: JobTable, e: ev.LeaderElected, entry: ev.Entry) -> JobTable:
    return replace(t, leader=e.leader, epoch=e.epoch or t.epoch)


def apply_member_joined(t: JobTable, e: ev.MemberJoined, entry: ev.Entry) -> JobTable:
    """A node is listed (or a member that stopped cleanly counts again, with its own key)."""
    member = t.member(e.node_id)
    if e.key in t.revoked:
        raise ValueError(f"the key of node {e.node_id} was revoked (`swarm remove`)")
    if member is not None:
        if member.key != e.key:
            raise ValueError(f"node id {e.node_id} belongs to a member with another key")
        if not member.down:
            raise ValueError(f"node {e.node_id} is a member already")
        back = replace(member, down=False, name=e.name or member.name)
        return replace(t, members=tuple(back if m is member else m for m in t.members))
    if e.node_id in t.removed:
        raise ValueError(
            f"node id {e.node_id} was removed (`swarm remove`); it is free again only after "
            "`swarm token --rotate`"
        )
    holder = next((m.node_id for m in t.members if m.key == e.key), None)
    if holder is not None:
        raise ValueError(f"node {e.node_id}'s key is member {holder}'s")
    joined = Member(node_id=e.node_id, name=e.name, key=e.key)
    members = sorted((*t.members, joined), key=lambda m: m.node_id)
    return replace(t, members=tuple(members))


def apply_member_left(t: JobTable, e: ev.MemberLeft, entry: ev.Entry) -> JobTable:
    """A member stopped cleanly: still listed with its key, marked down."""
    member = t.member(e.node_id)
    if member is None:
        raise ValueError(f"node {e.node_id} is not a member")
    if member.down:
        raise ValueError(f"node {e.node_id} is down already")
    down = replace(member, down=True)
    return replace(t, members=tuple(down if m is member else m for m in t.members))


def apply_member_removed(t: JobTable, e: ev.MemberRemoved, entry: ev.Entry) -> JobTable:
    """A member (or a node that only joined) is removed and its key revoked; its id stays
    refused until the secret is rotated."""
    member = t.member(e.node_id)
    if member is not None and member.key != e.key:
        raise ValueError(f"node {e.node_id}'s key is not {e.key}")
    if member is None and e.key in t.revoked:
        raise ValueError(f"node {e.node_id} is removed already")
    revoked = (*[k for k in t.revoked if k != e.key], e.key)[-MAX_REVOKED:]
    removed = (*[n for n in t.removed if n != e.node_id], e.node_id)[-MAX_REVOKED:]
    members = tuple(m for m in t.members if m.node_id != e.node_id)
    return replace(t, members=members, revoked=revoked, removed=removed)


def apply_admission_changed(t: JobTable, e: ev.AdmissionChanged, entry: ev.Entry) -> JobTable:
    """A new secret admits from now on; the ids removed under the old one are free again
    (their keys stay revoked)."""
    removed = t.removed if e.key == t.admission else ()
    return replace(t, swarm_id=e.swarm_id, admission=e.key, removed=removed)


def apply_job_submitted(t: JobTable, e: ev.JobSubmitted, entry: ev.Entry) -> dict[str, JobEntry]:
    if e.job_id in t.jobs:
        raise ValueError(f"job {e.job_id!r} is already in the table")
    return {
        e.job_id: JobEntry(
            job_id=e.job_id,
            job=e.job,
            state="pending",
            version=entry.version,
            submitted_by=e.submitted_by,
            history=(StateChange(state="pending", at=e.at),),
            inputs=e.inputs,
        )
    }


def apply_job_waiting(
    t: JobTable, e: ev.JobPending | ev.JobResuming, entry: ev.Entry
) -> dict[str, JobEntry]:
    """An active job waits for a place (pending) or to resume, for ``e.reason``."""
    state, verb = ("pending", "wait") if isinstance(e, ev.JobPending) else ("resuming", "resume")
    job = _job(t, e.job_id)
    _active(job, verb)
    return {e.job_id: _moved(job, state, e.at, reason=e.reason)}


def apply_job_placed(t: JobTable, e: ev.JobPlaced, entry: ev.Entry) -> dict[str, JobEntry]:
    job = _job(t, e.job_id)
    _active(job, "be placed")
    if e.attempt != job.attempt + 1:
        raise ValueError(f"job {e.job_id}: attempt {e.attempt} does not follow {job.attempt}")
    state = "resuming" if e.resume_step else "placed"
    # snapshots of other cuts no longer fit: the new attempt's first ones replace them
    snapshots = {} if e.resplit else job.snapshots
    return {
        e.job_id: _moved(
            job,
            state,
            e.at,
            attempt=e.attempt,
            plan=e.plan,
            cluster=e.cluster,
            placed_by=e.placed_by,
            resume_step=e.resume_step,
            reason=None,
            done_stages=(),
            shards={},
            resplit=e.resplit,
            snapshots=snapshots,
            cuts=e.cuts,
        )
    }


def apply_job_running(t: JobTable, e: ev.JobRunning, entry: ev.Entry) -> dict[str, JobEntry]:
    job = _job(t, e.job_id)
    _current(job, e.attempt, "run")
    return {e.job_id: _moved(job, "running", e.at)}


def apply_job_rebalanced(t: JobTable, e: ev.JobRebalanced, entry: ev.Entry) -> dict[str, JobEntry]:
    job = _job(t, e.job_id)
    _current(job, e.attempt, "be re-balanced")
    if job.state != "running":
        raise ValueError(f"job {e.job_id} is {job.state}; only a running job is re-balanced")
    change = StateChange(state="resuming", at=e.at, reason=e.reason)
    return {
        e.job_id: replace(
            job,
            state="resuming",
            history=(*job.history, change),
            reason=e.reason,
            learned=e.speeds,
            learned_dtype=e.dtype,
            rebalances=job.rebalances + 1,
        )
    }


def apply_steps_reported(t: JobTable, e: ev.StepsReported, entry: ev.Entry) -> dict[str, JobEntry]:
    job = _job(t, e.job_id)
    _current(job, e.attempt, "report steps")
    state = "running" if job.state in ("placed", "resuming") else job.state
    return {e.job_id: _moved(job, state, e.at, step=max(e.step, 0), loss=e.loss)}


def apply_snapshot_held(t: JobTable, e: ev.SnapshotHeld, entry: ev.Entry) -> dict[str, JobEntry]:
    job = _job(t, e.job_id)
    snaps = {k: dict(v) for k, v in job.snapshots.items()}
    steps = snaps.setdefault(str(e.stage), {})
    holders = steps.get(str(e.step), ())
    if e.node_id not in holders:
        steps[str(e.step)] = (*holders, e.node_id)
    for old in sorted(steps, key=int)[:-SNAPSHOTS_KEPT]:
        del steps[old]
    return {e.job_id: replace(job, snapshots=snaps)}


def apply_evaluation_reported(
    t: JobTable, e: ev.EvaluationReported, entry: ev.Entry
) -> dict[str, JobEntry]:
    job = _job(t, e.job_id)
    numbers = {"loss": e.loss, "perplexity": e.perplexity, "top1": e.top1, "tokens": e.tokens}
    return {e.job_id: replace(job, evaluation={**job.evaluation, e.name: numbers})}


def apply_stage_exported(t: JobTable, e: ev.StageExported, entry: ev.Entry) -> dict[str, JobEntry]:
    job = _job(t, e.job_id)
    _current(job, e.attempt, "export")
    shard = Shard(node=e.node_id, folder=e.folder, manifest=e.manifest)
    return {e.job_id: replace(job, shards={**job.shards, str(e.stage): shard})}


def apply_stage_finished(t: JobTable, e: ev.StageFinished, entry: ev.Entry) -> dict[str, JobEntry]:
    job = _job(t, e.job_id)
    _current(job, e.attempt, "finish a stage")
    if not (e.replica < job.n_replicas and e.stage < job.n_stages):
        raise ValueError(f"job {e.job_id} has no stage {e.stage} of replica {e.replica}")
    done = tuple(sorted({*job.done_stages, e.replica * job.n_stages + e.stage}))
    if len(done) < job.n_stages * job.n_replicas:
        return {e.job_id: replace(job, done_stages=done)}
    steps = job.job.train.steps if reads_data(job.job) else 0  # a none job runs no step
    return {e.job_id: _moved(job, "completed", e.at, done_stages=done, step=steps, reason=None)}


def apply_job_failed(t: JobTable, e: ev.JobFailed, entry: ev.Entry) -> dict[str, JobEntry]:
    job = _job(t, e.job_id)
    _active(job, "fail")
    failure = Failure(stage=e.stage, node=e.node_id, message=e.message, stderr_tail=e.stderr_tail)
    return {e.job_id: _moved(job, "failed", e.at, error=failure)}


def apply_job_cancelled(t: JobTable, e: ev.JobCancelled, entry: ev.Entry) -> dict[str, JobEntry]:
    job = _job(t, e.job_id)
    _active(job, "be cancelled")
    return {e.job_id: _moved(job, "cancelled", e.at, reason=e.reason)}


def apply_model_registered(
    t: JobTable, e: ev.ModelRegistered, entry: ev.Entry
) -> dict[str, JobEntry]:
    job = _job(t, e.job_id)
    if job.state != "completed":
        raise ValueError(f"job {e.job_id} is {job.state}; only a completed job registers a model")
    model_id = e.model.get("id")
    taken = {j.model.get("id") for j in t.jobs.values() if j.model is not None}
    if model_id in taken:
        raise ValueError(f"model id {model_id!r} is taken")
    return {e.job_id: replace(job, model=e.model)}


def apply_shard_copied(t: JobTable, e: ev.ShardCopied, entry: ev.Entry) -> dict[str, JobEntry]:
    from swarmp2p.node.table.registry import ModelEntry, add_copy

    job = _job(t, e.job_id)
    if job.model is None:
        raise ValueError(f"job {e.job_id} registered no model")
    updated = add_copy(cast(ModelEntry, job.model), e.stage, e.node_id)
    return {e.job_id: job if updated is None else replace(job, model=updated)}


_APPLY: dict[type, Callable[..., JobTable | dict[str, JobEntry]]] = {
    ev.LeaderElected: apply_leader_elected,
    ev.MemberJoined: apply_member_joined,
    ev.MemberLeft: apply_member_left,
    ev.MemberRemoved: apply_member_removed,
    ev.AdmissionChanged: apply_admission_changed,
    ev.JobSubmitted: apply_job_submitted,
    ev.JobPending: apply_job_waiting,
    ev.JobPlaced: apply_job_placed,
    ev.JobRunning: apply_job_running,
    ev.JobResuming: apply_job_waiting,
    ev.JobRebalanced: apply_job_rebalanced,
    ev.StepsReported: apply_steps_reported,
    ev.SnapshotHeld: apply_snapshot_held,
    ev.EvaluationReported: apply_evaluation_reported,
    ev.StageExported: apply_stage_exported,
    ev.StageFinished: apply_stage_finished,
    ev.JobFailed: apply_job_failed,
    ev.JobCancelled: apply_job_cancelled,
    ev.ModelRegistered: apply_model_registered,
    ev.ShardCopied: apply_shard_copied,
    ev.ServeRequested: sv.apply_serve_requested,
    ev.ServePlaced: sv.apply_serve_placed,
    ev.ServeStageLost: sv.apply_serve_stage_lost,
    ev.ServeDegraded: sv.apply_serve_degraded,
    ev.ServeFailed: sv.apply_serve_failed,
    ev.ServeStopped: sv.apply_serve_stopped,
}


def apply(table: JobTable, entry: ev.Entry) -> JobTable:
    """The table after ``entry``; ValueError when the entry does not follow this table."""
    if entry.version != table.version + 1:
        raise ValueError(
            f"table entry version {entry.version} does not follow table version {table.version}"
        )
    if entry.term < table.term:
        raise ValueError(f"table entry of term {entry.term} after term {table.term}")
    if entry.version >= MAX_VERSION or entry.term >= MAX_VERSION:
        raise ValueError("table entry version/term out of range")
    out = _APPLY[type(entry.event)](table, entry.event, entry)
    if isinstance(out, JobTable):
        return replace(out, term=entry.term, version=entry.version)
    jobs = dict(table.jobs)
    for job_id, job in out.items():
        jobs[job_id] = replace(job, version=entry.version)
    return replace(table, term=entry.term, version=entry.version, jobs=jobs)


def apply_all(table: JobTable, entries: list[ev.Entry]) -> JobTable:
    for entry in entries:
        table = apply(table, entry)
    return table


# --- persistence ------------------------------------------------------------------------------


def checksum(body: str) -> str:
    """The sha256 a saved table carries of its body."""
    return hashlib.sha256(body.encode()).hexdigest()


def encode(table: JobTable) -> str:
    """The table's canonical JSON (sorted keys, no whitespace)."""
    return json.dumps(table.to_dict(), sort_keys=True, separators=(",", ":"))


def save(path: Path, table: JobTable, body: str | None = None) -> None:
    """Write ``table`` to ``path`` atomically (temp file, fsync, rename) with a sha256."""
    body = encode(table) if body is None else body
    write_atomic(path, json.dumps({"sha256": checksum(body), "table": body}))


def load(path: Path) -> JobTable:
    """Read a table written by ``save``; an empty table if absent. A table of an older format
    is moved aside (``.format-1``), never deleted, and an empty table returned; a corrupt one
    raises ValueError saying what to do."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return JobTable()
    try:
        outer = json.loads(text)
        body = outer["table"]
        expected = outer["sha256"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(
            f"job table {path} is not a saved table; move it away to start empty"
        ) from None
    if checksum(body) != expected:
        raise ValueError(f"job table {path} fails its sha256 checksum; move it away to start empty")
    data = json.loads(body)
    if isinstance(data, dict) and data.get("format") in (1, 2):
        old = data["format"]
        aside = path.with_name(path.name + f".format-{old}")
        path.rename(aside)
        log.warning(
            "job table %s is of an older swarmp2p (format %d, members without keys); kept as "
            "%s, and this node joins its swarm again",
            path,
            old,
            aside,
        )
        return JobTable()
    try:
        return JobTable.from_dict(data)
    except SchemaError as exc:
        raise ValueError(f"job table {path}: {exc}; move it away to start empty") from None


__all__ = [
    "ACTIVE_STATES",
    "FINAL_STATES",
    "JOB_STATES",
    "MAX_REVOKED",
    "MAX_VERSION",
    "Failure",
    "JobEntry",
    "JobTable",
    "Member",
    "Shard",
    "StateChange",
    "apply",
    "apply_all",
    "checksum",
    "encode",
    "load",
    "save",
]
