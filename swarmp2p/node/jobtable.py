"""The replicated job table: versioned events applied by one pure function, persisted atomically.

Only the leader creates events. Every event bumps ``version``; a ``lead`` event (a new leader
taking over) also bumps ``term``. Tables are ordered by ``(term, version)``: a new leader
starts from the newest table among live peers, so its term wins over whatever a dead leader
wrote and never replicated. Replication ships whole tables (they are small); a follower keeps
a pushed table only if it is newer than its own.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from swarmp2p._atomic import write_atomic

EVENT_KINDS = ("lead", "submit", "update", "remove")
JOB_STATES = (
    "submitted",
    "pending",
    "placed",
    "running",
    "resuming",
    "completed",
    "failed",
    "cancelled",
)
TABLE_FORMAT = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class JobEvent:
    """One change to the table, created by the leader at ``version`` (= table version + 1)."""

    version: int
    """The table version this event produces."""
    kind: str
    """One of ``EVENT_KINDS``."""
    leader: str = ""
    """For ``lead``: the node taking over."""
    job_id: str = ""
    """For ``submit``, ``update``, ``remove``: the job."""
    record: Mapping[str, Any] = field(default_factory=dict)
    """For ``submit``: the opaque job record; for ``update``: the fields to set."""
    state: str = ""
    """For ``update`` (optional): the job's new state."""

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"job event kind {self.kind!r} is not one of {list(EVENT_KINDS)}")
        if self.kind == "lead" and not self.leader:
            raise ValueError("a 'lead' job event needs the leader's node id")
        if self.kind != "lead" and not self.job_id:
            raise ValueError(f"a {self.kind!r} job event needs a job_id")
        if self.state and self.state not in JOB_STATES:
            raise ValueError(f"job state {self.state!r} is not one of {list(JOB_STATES)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class JobTable:
    """The job table at one version: jobs by id, each a JSON-able dict with ``state``."""

    term: int = 0
    """How many leaders have taken over; a newer term beats any version of an older one."""
    version: int = 0
    """How many events made this table."""
    leader: str = ""
    """Who versioned the latest events."""
    jobs: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: MappingProxyType({}))
    """Job id -> job (``record``, ``state``, ``version`` submitted at)."""

    @property
    def key(self) -> tuple[int, int]:
        """Order of tables: newer is larger."""
        return (self.term, self.version)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": TABLE_FORMAT,
            "term": self.term,
            "version": self.version,
            "leader": self.leader,
            "jobs": {job_id: _thaw(job) for job_id, job in sorted(self.jobs.items())},
        }

    @classmethod
    def from_dict(cls, data: Any) -> JobTable:
        """Validate a table from JSON or the wire; ValueError naming the bad field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a job table must be an object, got {type(data).__name__}")
        if data.get("format") != TABLE_FORMAT:
            raise ValueError(f"job table format {data.get('format')!r} is not {TABLE_FORMAT}")
        for name in ("term", "version"):
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"job table {name} must be a non-negative integer, got {value!r}")
        leader = data.get("leader", "")
        if not isinstance(leader, str):
            raise ValueError(f"job table leader must be a string, got {leader!r}")
        jobs = data.get("jobs")
        if not isinstance(jobs, Mapping):
            raise ValueError("job table jobs must be an object of job id -> job")
        for job_id, job in jobs.items():
            if not isinstance(job_id, str) or not isinstance(job, Mapping):
                raise ValueError(f"job table jobs[{job_id!r}] must be an object under a string id")
            if job.get("state") not in JOB_STATES:
                raise ValueError(
                    f"job table jobs[{job_id!r}].state {job.get('state')!r} is unknown"
                )
        return cls(
            term=data["term"],
            version=data["version"],
            leader=leader,
            jobs=MappingProxyType({k: _freeze(v) for k, v in jobs.items()}),
        )


def _freeze(job: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(job))


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_thaw(v) for v in value]
    return value


def apply(table: JobTable, event: JobEvent) -> JobTable:
    """The table after ``event``; ValueError if the event does not follow this table."""
    if event.version != table.version + 1:
        raise ValueError(
            f"job event version {event.version} does not follow table version {table.version}"
        )
    jobs = dict(table.jobs)
    term, leader = table.term, table.leader
    if event.kind == "lead":
        term, leader = term + 1, event.leader
    elif event.kind == "submit":
        if event.job_id in jobs:
            raise ValueError(f"job {event.job_id!r} is already in the table")
        jobs[event.job_id] = _freeze(
            {
                "job_id": event.job_id,
                "state": "submitted",
                "version": event.version,
                "record": _thaw(event.record),
            }
        )
    elif event.kind == "update":
        if event.job_id not in jobs:
            raise ValueError(f"job {event.job_id!r} is not in the table; cannot update it")
        job = dict(jobs[event.job_id])
        job["record"] = {**job.get("record", {}), **_thaw(event.record)}
        if event.state:
            job["state"] = event.state
        job["version"] = event.version
        jobs[event.job_id] = _freeze(job)
    else:  # remove
        if event.job_id not in jobs:
            raise ValueError(f"job {event.job_id!r} is not in the table; cannot remove it")
        del jobs[event.job_id]
    return JobTable(term=term, version=event.version, leader=leader, jobs=MappingProxyType(jobs))


def newest(tables: Iterable[JobTable]) -> JobTable:
    """The newest of ``tables`` by ``(term, version)``; an empty table when there are none."""
    return max(tables, key=lambda t: t.key, default=JobTable())


def _checksum(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def save(path: Path, table: JobTable) -> None:
    """Write ``table`` to ``path`` atomically (temp file, fsync, rename) with a sha256 checksum."""
    body = json.dumps(table.to_dict(), sort_keys=True, separators=(",", ":"))
    text = json.dumps({"sha256": _checksum(body.encode()), "table": body})
    write_atomic(path, text)


def load(path: Path) -> JobTable:
    """Read a table written by ``save``; an empty table if absent; ValueError if corrupt."""
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
    if _checksum(body.encode()) != expected:
        raise ValueError(f"job table {path} fails its sha256 checksum; move it away to start empty")
    return JobTable.from_dict(json.loads(body))
