"""A job's snapshot files on a node: where they live (one folder per cuts), their names, the
most bytes one may have, and whether a peer may have this node pull one (the table must list
it). No torch, no I/O beyond names."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from swarmp2p.errors import UserError

if TYPE_CHECKING:
    from swarmp2p.node.table.jobtable import JobTable
    from swarmp2p.plan import Plan


def snapshot_dir(job_folder: Path, layers: Sequence[Sequence[int]]) -> Path:
    """Where a job's snapshots taken on these cuts live: one folder per cuts, so a re-split
    attempt's snapshots never take the names of the old cuts' it is cut from."""
    cuts = [int(r[0]) for r in list(layers)[1:]]
    return job_folder / "snapshots" / ("cuts-" + ("-".join(map(str, cuts)) or "none"))


_SNAP = re.compile(r"step-(\d{8})\.pt")
"""The runtime's snapshot file names (``runtime.torch.snapshot.snapshot_path``)."""
_SNAP_FILE = re.compile(r"snapshots/cuts-(?:none|\d+(?:-\d+)*)/stage-(\d{1,4})/step-(\d{8})\.pt")
"""A snapshot's path in its job's folder (``snapshot_dir``/stage-N/step-XXXXXXXX.pt)."""
SNAPSHOT_SLACK = 64 * 2**20
"""Bytes a snapshot may have beyond its stages' planned weights and trainable state
(compressor halves, the loss scaler, the pickle's own framing)."""


def snapshot_limit(plan: Plan) -> int:
    """The most bytes a snapshot of a job planned as ``plan`` may have: the weights and the
    trainable state (parameters, gradients, optimizer) of all its stages, which bound any one
    stage's (a re-split attempt's old stages too), and ``SNAPSHOT_SLACK``."""
    return SNAPSHOT_SLACK + sum(s.memory.weights + s.memory.trainable_state for s in plan.stages)


def listed_snapshot(table: JobTable, job_id: str, file: str) -> int:
    """Whether a peer may have this node pull ``file`` of job ``job_id`` (``job.file_pull``):
    the table must hold the job, ``file`` must name a snapshot and the table list that stage's
    snapshot at that step; the most bytes it may have (``snapshot_limit``). UserError naming
    what is wrong otherwise (code ``not_listed`` for a snapshot not listed yet)."""
    entry = table.jobs.get(job_id)
    if entry is None:
        raise UserError(
            f"no job {job_id!r} in the table: this node pulls no file for it", code="no_job"
        )
    m = _SNAP_FILE.fullmatch(file)
    if m is None:
        raise UserError(
            f"{file!r} is not a snapshot of job {job_id} (snapshots/cuts-*/stage-N/"
            "step-XXXXXXXX.pt): a peer has this node pull snapshots only",
            code="bad_field",
        )
    stage, step = int(m.group(1)), int(m.group(2))
    if entry.plan is None or str(step) not in entry.snapshots.get(str(stage), {}):
        raise UserError(
            f"the table lists no snapshot of stage {stage} at step {step} for job {job_id}",
            code="not_listed",
        )
    return snapshot_limit(entry.plan)


def snapshot_step(name: str) -> int | None:
    m = _SNAP.fullmatch(name)
    return int(m.group(1)) if m else None


def snapshot_name(step: int) -> str:
    return f"step-{step:08d}.pt"


__all__ = [
    "SNAPSHOT_SLACK",
    "listed_snapshot",
    "snapshot_dir",
    "snapshot_limit",
    "snapshot_name",
    "snapshot_step",
]
