"""Training jobs as data: `swarm train` overrides, the planner's inputs, the peer plan check,
where a stage runs, snapshots to resume from, and what a worker's exit means. Pure.

The leader, every stage's node and the CLI compute these the same way from the same records.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence

from swarmp2p.errors import Failed
from swarmp2p.node.records import NodeRecord
from swarmp2p.node.table.jobtable import JobEntry
from swarmp2p.plan import Blocked, Job, Node, Plan, ServePlan, plan_job
from swarmp2p.plan.hardware import CAPABILITIES
from swarmp2p.plan.model_shape import ModelShape
from swarmp2p.schema import Data

OVERRIDES: dict[str, tuple[str, ...]] = {
    "pretrained": ("model", "pretrained"),
    "steps": ("train", "steps"),
    "eval_batches": ("train", "eval_batches"),
    "stages": ("split", "stages"),
    "compression": ("split", "compression"),
    "freeze_backbone": ("model", "freeze_backbone"),
    "lora": ("model", "lora", "enabled"),
    "lora_export": ("model", "lora", "export"),
    "dtype": ("model", "dtype"),
    "weight_dtype": ("model", "weight_dtype"),
    "quantization": ("model", "quantization"),
}
"""`swarm train` flag -> the job.json field it sets."""


class PlanMismatch(Failed):
    """A peer recomputed a different plan from the same inputs."""

    default_code = "plan_mismatch"


def apply_overrides(data: Data, overrides: Mapping[str, Data]) -> Data:
    """``data`` (decoded job.json) with the flags in ``overrides`` (None: not given) set."""
    out = copy.deepcopy(dict(data)) if isinstance(data, Mapping) else data
    if not isinstance(out, dict):
        return out
    for flag, value in overrides.items():
        if value is None:
            continue
        if flag not in OVERRIDES:
            raise ValueError(f"unknown override {flag!r}; one of {sorted(OVERRIDES)}")
        *parents, leaf = OVERRIDES[flag]
        node = out
        for key in parents:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[leaf] = value
    return out


# --- planning inputs --------------------------------------------------------------------------


def without_runtime(records: Sequence[NodeRecord]) -> list[str]:
    """Names of the nodes that declare no runtime capability (torch is not importable there):
    they cannot run a stage, so they are left out of planning."""
    return sorted(r.node.name for r in records if not r.node.capabilities)


def blocked_note(reason: str, records: Sequence[NodeRecord]) -> str:
    """A blocked reason, naming the live nodes left out for lack of the runtime."""
    missing = without_runtime(records)
    if not missing:
        return reason
    return (
        f"{reason}\nnot placed (no torch runtime): {', '.join(missing)}; install swarmp2p "
        "with its runtime there (install.sh)"
    )


def cluster_records(records: Sequence[NodeRecord]) -> list[Node]:
    """Planner inputs from live nodes' hardware records, sorted by node id (order-free); nodes
    without the runtime are left out; a fake device plans as real."""
    return [r.node for r in sorted(records, key=lambda r: r.node_id) if r.node.capabilities]


def compute_plan(
    job: Job,
    cluster: Sequence[Node],
    *,
    shape: ModelShape | None = None,
    capabilities: frozenset[str] | None = None,
    cuts: Sequence[int] | None = None,
) -> Plan | Blocked:
    """``plan_job`` over node records; what the leader and every assigned peer run."""
    own = CAPABILITIES if capabilities is None else capabilities
    return plan_job(job, list(cluster), own, shape=shape, cuts=cuts or None)


def check_plan(
    job: Job,
    cluster: Sequence[Node],
    plan: Plan,
    *,
    node_id: str,
    shape: ModelShape | None = None,
    capabilities: frozenset[str] | None = None,
    cuts: Sequence[int] | None = None,
) -> Plan:
    """Recompute the plan on this peer; PlanMismatch unless it is byte-identical."""
    mine = compute_plan(job, cluster, shape=shape, capabilities=capabilities, cuts=cuts)
    if not isinstance(mine, Plan):
        raise PlanMismatch(
            f"node {node_id} cannot place this job from the same inputs: {mine.reason}; "
            "run the same swarmp2p version on every node"
        )
    if mine != plan:
        ours, theirs = mine.to_json(), plan.to_json()
        raise PlanMismatch(
            f"node {node_id} computes a different plan from the same job and cluster "
            f"(first difference at byte {_first_diff(ours, theirs)} of its JSON); run the "
            "same swarmp2p version on every node"
        )
    return mine


def _first_diff(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def device_for(stage_devices: Sequence[str], record: NodeRecord) -> tuple[str, str | None]:
    """(torch device inside the worker, CUDA_VISIBLE_DEVICES or None) for a planned stage's
    devices on this node. A fake GPU (``SWARM_FAKE_DEVICES``, tests and demos) runs on the CPU."""
    device = stage_devices[0]
    if device == "cpu" or ":" not in device or device in record.fake:
        return "cpu", None
    kind, index = device.split(":", 1)
    return f"{kind}:0", index


def stages_on_machine(plan: Plan | ServePlan, node_id: str, machines: Mapping[str, str]) -> int:
    """How many of ``plan``'s (a training or a serve plan) stages share ``node_id``'s machine: its own, and those of the
    nodes ``machines`` (node id -> its host's ``machine``) names the same (daemons started
    side by side, network namespaces); an unknown machine shares with none."""
    mine = machines.get(node_id) or ""
    return sum(
        1
        for st in all_stages(plan)
        if st.node_id == node_id or (mine and machines.get(st.node_id) == mine)
    )


def all_stages(plan: Plan | ServePlan) -> tuple:
    """Every stage of every replica of ``plan``, replica by replica (a serve plan's stages)."""
    n = getattr(plan, "n_replicas", 1)
    return tuple(s for r in range(n) for s in plan.replica_stages(r)) if n > 1 else plan.stages


def cpu_threads(cores: int, stages_here: int) -> int:
    """Threads each CPU stage gets when ``stages_here`` stages share ``cores`` cores: measured
    40x slower steps with two 2-thread CPU stages on 2 cores under load (oversubscription)."""
    return max(1, cores // max(stages_here, 1))


# --- snapshots --------------------------------------------------------------------------------


def snapshot_holders(entry: JobEntry, stage: int, step: int) -> list[str]:
    return list(entry.snapshots.get(str(stage), {}).get(str(step), ()))


def resume_step(entry: JobEntry, alive: Iterable[str] | None = None, copies: int = 1) -> int:
    """The newest step every stage has a snapshot of, held by at least ``copies`` nodes (live
    ones, when ``alive`` is given); 0 when there is none."""
    n = entry.n_stages
    if not n:
        return 0
    live = None if alive is None else set(alive)
    common: set[str] | None = None
    for i in range(n):
        steps = {
            step
            for step, holders in entry.snapshots.get(str(i), {}).items()
            if len([h for h in holders if live is None or h in live]) >= copies
        }
        common = steps if common is None else common & steps
    return max((int(s) for s in common or ()), default=0)


__all__ = [
    "OVERRIDES",
    "PlanMismatch",
    "apply_overrides",
    "blocked_note",
    "check_plan",
    "cluster_records",
    "compute_plan",
    "cpu_threads",
    "device_for",
    "resume_step",
    "snapshot_holders",
    "stages_on_machine",
    "without_runtime",
]
