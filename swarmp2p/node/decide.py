"""What a node does next, as pure functions of the job table and its view. No torch, no I/O.

The leader's part: ``leader_actions`` (who to admit as a member, which jobs to place, recover
or rewire, which completed jobs to register), ``placement`` (the events a plan — or a blocked
one — makes) and ``fold_report`` (the table events a batch of a stage's worker events makes,
``node/training/reports.py``).
Every node's part: ``stale_workers`` (its workers the table no longer wants). Thin async code
in ``jobs_leader`` and ``stages`` executes what these return.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from swarmp2p.node.records import NO_HELD, NodeRecord, device_key
from swarmp2p.node.table import events as ev
from swarmp2p.node.table.jobtable import ACTIVE_STATES, FINAL_STATES, JobEntry, JobTable
from swarmp2p.node.table.registry import model_entry, unique_model_id
from swarmp2p.node.training.jobs import all_stages, blocked_note, resume_step, snapshot_holders
from swarmp2p.node.training.reports import fold_report, number
from swarmp2p.plan import Blocked, Node, Plan
from swarmp2p.plan.hardware import Speeds
from swarmp2p.plan.speed import learned_speeds
from swarmp2p.timings import TIMINGS


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaderView:
    """What the leader knows beside the table."""

    node_id: str
    alive: frozenset[str]
    names: Mapping[str, str]
    """Live node id -> its name."""
    busy: frozenset[str] = frozenset()
    """Jobs a task of the leader is placing, wiring or recovering now."""
    keys: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Live node id -> the public key it joined with (a node without one is not admitted)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Place:
    job_id: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Recover:
    """Stop the job's workers and place it again (``lost``: the stage nodes that died; empty
    when the leader that placed it died before every stage was wired)."""

    job_id: str
    lost: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Register:
    job_id: str


Action = ev.MemberJoined | Place | Recover | Register
"""What the leader does next; a node to admit is the event that admits it."""


def leader_actions(table: JobTable, view: LeaderView) -> list[Action]:
    """The leader's next steps, in a stable order."""
    out: list[Action] = []
    if table.members:  # a founded swarm lists the live nodes that are not voters (new or down)
        for node_id in sorted(view.alive - table.voters):
            key = view.keys.get(node_id)
            member = table.member(node_id)
            if member is not None and member.key != key:
                continue  # its id belongs to another key
            if key and key not in table.revoked and node_id not in table.removed:
                out.append(
                    ev.MemberJoined(node_id=node_id, name=view.names.get(node_id, ""), key=key)
                )
    for job_id, entry in sorted(table.jobs.items()):
        if job_id in view.busy:
            continue
        if entry.state == "pending":
            out.append(Place(job_id=job_id))
        elif entry.state in ACTIVE_STATES:
            lost = tuple(sorted(set(entry.stage_nodes) - view.alive))
            if lost:
                out.append(Recover(job_id=job_id, lost=lost))
            elif entry.placed_by != view.node_id and entry.state != "running":
                out.append(Recover(job_id=job_id, lost=()))
        elif entry.state == "completed" and entry.model is None:
            out.append(Register(job_id=job_id))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanTry:
    """One way to plan a job: on fixed ``cuts`` (its snapshots'), or from the job itself
    (``any_count``: with as many stages as the nodes left hold, when its count no longer fits)."""

    cuts: tuple[int, ...] | None = None
    any_count: bool = False


def plan_cuts(layers: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The cuts (first block of every stage after the first) of per-stage layer ranges."""
    return tuple(int(r[0]) for r in list(layers)[1:])


def _learned(entry: JobEntry) -> bool:
    plan = entry.plan
    return plan is not None and any(b.compression.is_learned for b in plan.boundaries)


def snapshot_layout(
    entry: JobEntry, alive: Iterable[str]
) -> tuple[int, tuple[ev.SnapshotSlice, ...]]:
    """(step, the stages it was taken on, with their live holders) of the newest snapshots
    the job can resume from; (0, ()) when there are none. Snapshots of a re-split attempt
    that never took its own are the old stages' it was cut from."""
    live = set(alive)
    step = resume_step(entry, live) if entry.plan is not None else 0
    if step and entry.plan is not None:
        return step, tuple(
            ev.SnapshotSlice(
                stage=i,
                layers=(s.layer_start, s.layer_end),
                nodes=tuple(h for h in snapshot_holders(entry, i, step) if h in live),
            )
            for i, s in enumerate(entry.plan.stages)
        )
    if entry.resplit and entry.resume_step:
        layout = tuple(
            dataclasses.replace(r, nodes=tuple(n for n in r.nodes if n in live))
            for r in entry.resplit
        )
        if all(r.nodes for r in layout):
            return entry.resume_step, layout
    return 0, ()


def plan_tries(entry: JobEntry, alive: Iterable[str]) -> list[PlanTry]:
    """How to plan ``entry``, in order: a first placement from the job; a lost one first on
    its snapshots' cuts (resuming as it was), then, unless a learned boundary was trained on
    those cuts, re-split over the nodes left (its count, else as many stages as they hold)."""
    if entry.plan is None:
        return [PlanTry()]
    step, layout = snapshot_layout(entry, alive)
    tries = [PlanTry(cuts=plan_cuts([r.layers for r in layout]))] if step else []
    if step and _learned(entry):
        return tries
    tries.append(PlanTry())
    if entry.job.split.stages != "auto":
        tries.append(PlanTry(any_count=True))
    return tries


def placement(
    entry: JobEntry,
    result: Plan | Blocked,
    *,
    cluster: Sequence[Node],
    records: Sequence[NodeRecord],
    alive: Iterable[str],
    me: str,
    now: float,
    tried: PlanTry | None = None,
) -> list[ev.Event]:
    """The events that place ``entry`` on ``result`` (a new attempt, planned as ``tried``
    says), or make it wait. A plan on other cuts than the newest snapshots' resumes from
    them re-sliced by global block index (``resplit``)."""
    if isinstance(result, Blocked):
        reason = blocked_note(result.reason, records)
        if entry.plan is not None and _learned(entry) and snapshot_layout(entry, alive)[0]:
            reason += (
                "\nthe job resumes only on its snapshots' cuts (a learned boundary was trained "
                "on them); waiting for a node to return"
            )
        return _pending(entry, reason, now)
    tried = tried or PlanTry()
    step, layout = snapshot_layout(entry, alive) if entry.plan is not None else (0, ())
    new = plan_cuts([s.layers for s in result.stages])
    same = step and new == plan_cuts([r.layers for r in layout]) and not entry.resplit
    fixed = tried.cuts is not None or tried.any_count
    return [
        ev.JobPlaced(
            job_id=entry.job_id,
            attempt=entry.attempt + 1,
            plan=result,
            cluster=tuple(cluster),
            resume_step=step,
            placed_by=me,
            at=now,
            resplit=() if same or not step else layout,
            cuts=new if fixed else (),
        )
    ]


def available_memory(
    records: Sequence[NodeRecord], table: JobTable, exclude: str | None = None
) -> list[NodeRecord]:
    """The live records with each device's ``memory_free`` less what is already promised
    there: the placed stages of every other active job (the table's, at once) and the served
    models' stages (each node's report). Live free memory already lacks what a loaded worker
    holds, so the smaller of the two counts, never their sum."""
    promised: dict[tuple[str, str], int] = {}
    for job_id, entry in table.jobs.items():
        if job_id == exclude or entry.state not in ACTIVE_STATES or entry.plan is None:
            continue
        for stage in all_stages(entry.plan):
            key = (stage.node_id, device_key(stage.devices[0]))
            promised[key] = promised.get(key, 0) + int(stage.memory.peak)
    out = []
    for record in records:
        serve = record.held.serve
        devices = []
        for d in record.node.devices:
            key = device_key(d)
            taken = promised.get((record.node_id, key), 0) + serve.get(key, 0)
            free = max(0, min(d.memory_free, d.memory_total - taken))
            devices.append(dataclasses.replace(d, memory_free=free))
        node = dataclasses.replace(record.node, devices=tuple(devices))
        out.append(dataclasses.replace(record, node=node, held=NO_HELD))
    return out


# --- learning from the run: re-balancing the split ------------------------------------------

REBALANCE_STEPS = 20
"""Steps in a row the slowest stage must be off its prediction before the split changes."""
REBALANCE_OFF = 0.25
"""How far off (a fraction of its prediction) the slowest stage must run."""
MAX_REBALANCES = 2
"""Re-balances a job may take (each restarts its workers from a snapshot)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Rebalance:
    """The run says the split is off: stage ``stage`` ran ``ratio`` x its prediction for
    REBALANCE_STEPS steps up to ``step``; ``speeds`` are the stages' devices' speeds as the run
    measured them (FLOP/s, node id -> device key -> speed)."""

    job_id: str
    attempt: int
    step: int
    stage: int
    ratio: float
    speeds: dict[str, dict[str, float]]
    dtype: str

    def reason(self, old: Sequence[int], new: Sequence[int]) -> str:
        return (
            f"re-balanced: stage {self.stage} ran {self.ratio:.2f}x its predicted time for "
            f"{REBALANCE_STEPS} steps (to step {self.step}); cuts {list(new)} instead of "
            f"{list(old)} from the speeds measured"
        )


def _rebalances(entry: JobEntry) -> bool:
    """Whether the split of ``entry`` may follow the run: the default speed split, nothing
    learned on the cuts, snapshots on, re-balances left."""
    plan = entry.plan
    return (
        entry.state == "running"
        and plan is not None
        and plan.timing is not None
        and len(plan.stages) > 1
        and plan.n_replicas == 1  # replicas share one split: not re-balanced yet
        and entry.job.split.mode == "speed"
        and not _learned(entry)
        and entry.job.train.checkpoint_every > 0
        and entry.rebalances < MAX_REBALANCES
    )


def rebalance_due(entry: JobEntry, compute: Mapping[str, Any] | None) -> Rebalance | None:
    """A re-balance when the slowest stage ran more than REBALANCE_OFF off its prediction over
    the last REBALANCE_STEPS steps in a row, and a snapshot is still to come to resume from.

    ``compute`` is the leader's metrics (``{"attempt", "steps": {step: {stage: seconds}}}``,
    each stage's compute per step, waits left out). A stage's time is its mean over the steps
    less its one slowest; predictions are calibrated by the stage that ran closest to its own
    (how well the model uses a device is common to all): the slowest stage is off when its
    measured/predicted ratio exceeds the best one's by more than 25%."""
    if not _rebalances(entry) or not isinstance(compute, Mapping):
        return None
    if compute.get("attempt") != entry.attempt:
        return None
    plan = entry.plan
    assert plan is not None and plan.timing is not None
    n = len(plan.stages)
    predicted = [s.compute_s if s.compute_s is not None else s.flops for s in plan.timing.stages]
    if len(predicted) != n or not all(p > 0 for p in predicted):
        return None
    steps = compute.get("steps") or {}
    complete = sorted(
        (int(k) for k, v in steps.items() if isinstance(v, Mapping) and len(v) == n), reverse=True
    )
    window = complete[:REBALANCE_STEPS]
    if len(window) < REBALANCE_STEPS or window[0] - window[-1] != REBALANCE_STEPS - 1:
        return None  # not 20 steps in a row yet
    last = window[0]
    every = entry.job.train.checkpoint_every
    if (last + 1) // every * every + every >= entry.job.train.steps:
        return None  # no snapshot left to resume from before the end
    per_stage: list[list[float]] = [[] for _ in range(n)]
    for k in window:
        for i in range(n):
            m = number(steps[str(k)].get(str(i)))
            if m is None or m <= 0:
                return None
            per_stage[i].append(m)
    # each stage's mean over the window without its one slowest step (a pause, a collection):
    # a stage throttled now and then (a CPU quota) is slower on average, and that counts
    means = [(sum(v) - max(v)) / (len(v) - 1) for v in per_stage]
    rel = [m / p for m, p in zip(means, predicted)]
    slowest = max(range(n), key=lambda i: means[i])
    ratio = rel[slowest] / min(rel)
    if ratio <= 1 + REBALANCE_OFF:
        return None
    learned = learned_speeds(plan.timing, means)
    speeds: dict[str, dict[str, float]] = {}
    for stage, speed in zip(plan.stages, learned):
        if speed is not None:
            speeds.setdefault(stage.node_id, {})[device_key(stage.devices[0])] = speed
    return Rebalance(
        job_id=entry.job_id,
        attempt=entry.attempt,
        step=last,
        stage=slowest,
        ratio=round(ratio, 3),
        speeds=speeds,
        dtype=plan.dtype,
    )


def rebalance_step(entry: JobEntry, due: Rebalance, alive: Iterable[str]) -> int:
    """The snapshot step to re-balance from: the newest every stage holds on a live node, once
    it is newer than the steps that called for it; 0 while there is none yet (or the job moved
    on: another attempt, not running)."""
    if entry.attempt != due.attempt or entry.state != "running":
        return 0
    step = resume_step(entry, alive)
    return step if step > due.step else 0


def with_learned_speeds(
    cluster: Sequence[Node], speeds: Mapping[str, Mapping[str, float]], dtype: str
) -> list[Node]:
    """``cluster`` (node records) with the measured speeds in ``dtype`` in place of the probe's
    on the devices the run measured."""
    out = []
    for node in cluster:
        mine = speeds.get(node.node_id) or {}
        devices = []
        for d in node.devices:
            got = mine.get(device_key(d))
            if got:
                speed = Speeds(sorted({**dict(d.speed), dtype: float(got)}.items()))
                d = dataclasses.replace(d, speed=speed)
            devices.append(d)
        out.append(dataclasses.replace(node, devices=tuple(devices)))
    return out


def learned_cluster(cluster: Sequence[Node], entry: JobEntry) -> list[Node]:
    """``cluster`` with what ``entry``'s runs measured (none learned: unchanged)."""
    if not entry.learned or not entry.learned_dtype:
        return list(cluster)
    return with_learned_speeds(cluster, entry.learned, entry.learned_dtype)


def rebalanced(
    entry: JobEntry, due: Rebalance, old: Sequence[int], new: Sequence[int], now: float
) -> list[ev.Event]:
    """The event that re-balances ``entry`` onto cuts ``new`` (none when nothing changes)."""
    if tuple(old) == tuple(new) or entry.attempt != due.attempt or entry.state != "running":
        return []
    return [
        ev.JobRebalanced(
            job_id=entry.job_id,
            attempt=due.attempt,
            reason=due.reason(old, new),
            dtype=due.dtype,
            speeds=due.speeds,
            at=now,
        )
    ]


def _pending(entry: JobEntry, reason: str, now: float) -> list[ev.Event]:
    if entry.state == "pending" and entry.reason == reason:
        return []
    return [ev.JobPending(job_id=entry.job_id, reason=reason, at=now)]


def registration(table: JobTable, job_id: str) -> list[ev.Event]:
    """A completed job's model, under an id no other model has."""
    entry = table.jobs[job_id]
    if entry.state != "completed" or entry.model is not None:
        return []
    taken = [j.model["id"] for j in table.jobs.values() if j.model is not None]
    model = model_entry(unique_model_id(entry.name, taken), entry)
    return [ev.ModelRegistered(job_id=job_id, model=model)]


def stale_workers(table: JobTable, workers: Iterable[tuple]) -> list[tuple]:
    """This node's workers ``(job, attempt, ...)`` the table no longer wants: the job ended,
    or a newer attempt replaced theirs. A job the table does not hold yet is left alone (its
    placement may not have reached this node)."""
    out = []
    for key in workers:
        entry = table.jobs.get(key[0])
        if entry is not None and (entry.state in FINAL_STATES or entry.attempt > key[1]):
            out.append(key)
    return out


# --- caps on waiting jobs ------------------------------------------------------------------


def submitted_by(who: str, node_id: str) -> str:
    """What the table records as a submission's author: the name its client gave (an ``@``
    in it dropped) and the node it came from, ``cli@node``; the node is authenticated."""
    return f"{(who or 'cli').replace('@', '')[:128]}@{node_id}"


def submitter_of(recorded: str) -> str:
    """The node a table entry's ``submitted_by`` names ("" for one recorded without it)."""
    return recorded.rpartition("@")[2] if "@" in recorded else ""


def waiting_refusal(table: JobTable, node_id: str, *, per_swarm: int, per_node: int) -> str:
    """Why the leader refuses one more job from node ``node_id`` ("" when it takes it): the
    unfinished jobs (not completed, failed or cancelled) of the swarm, or of that node's
    submissions, already reach their cap."""
    waiting = [e for e in table.jobs.values() if e.state not in FINAL_STATES]
    if len(waiting) >= per_swarm:
        return (
            f"the swarm already holds {len(waiting)} unfinished jobs, its cap of {per_swarm} "
            "(the leader's `swarm up --max-waiting-jobs`); cancel some (`swarm jobs cancel "
            "JOB`) or wait for them to finish"
        )
    mine = sum(1 for e in waiting if submitter_of(e.submitted_by) == node_id)
    if mine >= per_node:
        return (
            f"node {node_id} already has {mine} unfinished jobs in the swarm, the cap of "
            f"{per_node} per node (the leader's `swarm up --max-waiting-per-node`); cancel "
            "some (`swarm jobs cancel JOB`) or wait for them to finish"
        )
    return ""


def placement_inputs(entry: JobEntry, alive: Iterable[str], records: Sequence[NodeRecord]) -> tuple:
    """What a waiting job's placement depends on, coarsely: its own version, the live nodes,
    and each live device's free memory in GiB and free disk in GiB (a byte's change in free
    memory does not make a blocked job worth planning again)."""
    devices = tuple(
        (
            r.node_id,
            r.node.disk_free >> 30,
            tuple((d.kind, d.index, d.memory_free >> 30) for d in r.node.devices),
        )
        for r in sorted(records, key=lambda r: r.node_id)
    )
    return (entry.version, entry.attempt, tuple(sorted(alive)), devices)


def plan_again(last: tuple[tuple, float] | None, inputs: tuple, now: float) -> bool:
    """Whether to plan a waiting job again: never planned, or its inputs changed since the
    last (blocked) try ``last`` = (inputs, when), or ``Timings.plan_again_s`` passed."""
    return last is None or last[0] != inputs or now - last[1] >= TIMINGS.plan_again_s


_NEW_ID = re.compile(r"[^A-Za-z0-9_-]+")


def new_job_id(version: int, token: str) -> str:
    """A job id for a submission that named none: ``j<version>-<random hex>``."""
    return _NEW_ID.sub("", f"j{version:06d}-{token}")


__all__ = [
    "MAX_REBALANCES",
    "REBALANCE_OFF",
    "REBALANCE_STEPS",
    "Action",
    "LeaderView",
    "Place",
    "PlanTry",
    "Rebalance",
    "Recover",
    "Register",
    "available_memory",
    "fold_report",
    "leader_actions",
    "learned_cluster",
    "new_job_id",
    "placement",
    "placement_inputs",
    "plan_again",
    "plan_cuts",
    "plan_tries",
    "rebalance_due",
    "rebalance_step",
    "rebalanced",
    "registration",
    "snapshot_layout",
    "stale_workers",
    "submitted_by",
    "submitter_of",
    "waiting_refusal",
    "with_learned_speeds",
]
