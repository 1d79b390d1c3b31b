"""The table events a batch of one stage's worker events makes (``fold_report``): progress,
snapshots, evaluations, exports, a stage's end or its failure. Pure: no torch, no I/O; the
leader folds every report through it (``decide`` re-exports it)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from swarmp2p.node.table import events as ev
from swarmp2p.node.table.jobtable import FINAL_STATES, JobEntry
from swarmp2p.workers import exit_message
from swarmp2p.workers.events import (
    Done,
    Evaluated,
    Exited,
    Exported,
    SnapshotSaved,
    StepDone,
    WorkerEvent,
)


def number(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (a bool is not), else None."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else None


def fold_report(
    entry: JobEntry,
    *,
    attempt: int,
    stage: int,
    node_id: str,
    events: Sequence[WorkerEvent],
    now: float,
    progress_due: bool,
    replica: int = 0,
) -> list[ev.Event]:
    """The table events one batch of stage ``stage``'s worker events makes (none for another
    attempt's stage, already stopped). Steps become one progress sample when ``progress_due``
    (or at the last step); loss curves are the leader's metrics, not table events. Progress,
    evaluations, snapshots and exports are replica 0's (the others' would repeat them)."""
    if attempt != entry.attempt or entry.state in FINAL_STATES or entry.plan is None:
        return []
    if replica:  # another replica: its stages' ends and failures count
        return list(_fold_ends(entry, attempt, stage, node_id, events, now, replica))
    last = stage == entry.n_stages - 1
    out: list[ev.Event] = []
    newest_step: StepDone | None = None
    for event in events:
        if isinstance(event, StepDone) and last:
            newest_step = event
        elif isinstance(event, SnapshotSaved):
            out.append(
                ev.SnapshotHeld(job_id=entry.job_id, stage=stage, step=event.step, node_id=node_id)
            )
            progress_due = True
        elif isinstance(event, Evaluated) and last:
            out.append(
                ev.EvaluationReported(
                    job_id=entry.job_id,
                    name=event.name[:64],
                    loss=number(event.loss),
                    perplexity=number(event.perplexity),
                    top1=number(event.top1),
                    tokens=event.tokens,
                )
            )
        elif isinstance(event, Exported) and event.manifest_data is not None:
            out.append(
                ev.StageExported(
                    job_id=entry.job_id,
                    attempt=attempt,
                    stage=stage,
                    node_id=node_id,
                    folder=f"export/stage-{stage}",
                    manifest=event.manifest_data,
                )
            )
        elif isinstance(event, (Done, Exited)):
            if isinstance(event, Done) and newest_step is not None:
                out.append(_progress(entry, attempt, newest_step, now))
                newest_step = None
            out.extend(_fold_ends(entry, attempt, stage, node_id, [event], now, 0))
    if newest_step is not None:
        steps = entry.job.train.steps
        if progress_due or newest_step.step + 1 >= steps or entry.state != "running":
            out.insert(0, _progress(entry, attempt, newest_step, now))
    return out


def _fold_ends(
    entry: JobEntry,
    attempt: int,
    stage: int,
    node_id: str,
    events: Sequence[WorkerEvent],
    now: float,
    replica: int,
) -> Iterable[ev.Event]:
    """A stage's ``done`` (it finished) and failed ``exit`` events as table events."""
    for event in events:
        if isinstance(event, Done):
            yield ev.StageFinished(
                job_id=entry.job_id, attempt=attempt, stage=stage, at=now, replica=replica
            )
        elif isinstance(event, Exited) and event.code != 0:
            how = exit_message(event.code)
            tail = [line[:2000] for line in event.stderr_tail][-ev.MAX_TAIL_LINES :]
            message = f"{event.error} ({how})" if event.error else how
            yield ev.JobFailed(
                job_id=entry.job_id,
                attempt=attempt,
                stage=stage,
                node_id=node_id,
                message=f"replica {replica}: {message}" if replica else message,
                stderr_tail=tuple(tail),
                at=now,
            )


def _progress(entry: JobEntry, attempt: int, step: StepDone, now: float) -> ev.Event:
    return ev.StepsReported(
        job_id=entry.job_id, attempt=attempt, step=step.step + 1, loss=number(step.loss), at=now
    )


__all__ = ["fold_report", "number"]
