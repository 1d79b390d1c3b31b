"""The leader's side of training jobs: it executes what ``decide`` returns. Never imports torch.

Each heartbeat round ``tick()`` asks ``decide.leader_actions`` what to do and runs each action
as one task per job: admit a node as a member, place a waiting job (PENDING with a reason when
the plan is blocked), start its stages (``launch``: every replica's, each last to first),
re-plan a job that lost a stage node (from the newest snapshot every stage holds), register a completed job's model. Worker reports
become table events through ``decide.fold_report``; their step numbers become metrics here.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING

from swarmp2p.errors import Failed, SwarmError, Unavailable, UserError
from swarmp2p.net.rpc import ByteBudget
from swarmp2p.node import decide
from swarmp2p.node.config import SUBMIT_BURST
from swarmp2p.node.messages import (
    FilePull,
    JobAck,
    JobCancel,
    JobMetrics,
    JobMetricsFetch,
    ShardCopy,
    StageReport,
    StageStop,
    Submit,
    Submitted,
)
from swarmp2p.node.table import events as ev
from swarmp2p.node.table.jobtable import FINAL_STATES, JobEntry
from swarmp2p.node.table.replication import check_job_id
from swarmp2p.node.training import jobs, launch
from swarmp2p.node.training.metrics import MetricsStore
from swarmp2p.plan import Blocked, Node, Plan
from swarmp2p.schema import Data, SchemaError
from swarmp2p.workers.events import SnapshotSaved, WorkerEvent, decode

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext
    from swarmp2p.node.table.replication import Replication
    from swarmp2p.wire.messages import Message

log = logging.getLogger("swarmp2p.node.training.jobs")


class JobsLeader:
    """The leader's job side; every node has one (only the leader's acts)."""

    def __init__(
        self, ctx: NodeContext, replication: Replication, wall: Callable[[], float] = time.time
    ) -> None:
        self.ctx, self.rep, self.wall = ctx, replication, wall
        self.metrics = MetricsStore()
        self._busy: dict[str, asyncio.Task] = {}
        self._progress_at: dict[str, float] = {}
        self._report_lock = asyncio.Lock()
        self._rebalance: dict[str, tuple[decide.Rebalance, tuple[int, ...]]] = {}
        """Jobs to re-balance at their next snapshot: what called for it and the new cuts."""
        self._weighed: dict[str, tuple[int, int]] = {}
        """Job -> (attempt, step): its split was weighed against the run up to that step."""
        self._planning = asyncio.Lock()
        """One plan is made at a time: a plan is CPU work in a thread, and several at once
        starve the event loop of the GIL (heartbeats slipped, the swarm re-elected)."""
        self._placing: set[str] = set()
        """Waiting jobs a placement task works on now."""
        self._blocked: dict[str, tuple[tuple, float]] = {}
        """Waiting job -> (its placement inputs, when) of its last blocked plan: planned again
        only when they change (``decide.plan_again``), so many waiting jobs cost the leader
        little each round."""
        self._submit_budgets: dict[str, ByteBudget] = {}
        """Node -> its submissions' bucket (``SUBMIT_BURST``, one per ``Timings.submit_every_s``)."""

    def _submits(self, node_id: str) -> ByteBudget:
        if len(self._submit_budgets) > 4096:  # ids of nodes long gone
            self._submit_budgets.clear()
        budget = self._submit_budgets.get(node_id)
        if budget is None:
            budget = ByteBudget(
                1 / self.ctx.config.timings.submit_every_s, SUBMIT_BURST, self.ctx.clock
            )
            self._submit_budgets[node_id] = budget
        return budget

    # --- deciding ---------------------------------------------------------------------------

    def tick(self) -> None:
        """Leader: run what the table and the live view call for."""
        if not self.ctx.leading:
            return
        view = decide.LeaderView(
            node_id=self.ctx.node_id,
            alive=self.ctx.live_nodes(),
            names={p.node_id: p.name for p in self.ctx.members.alive_peers()}
            | {self.ctx.node_id: self.ctx.me.name},
            busy=frozenset(self._busy),
            keys={n: k for n in self.ctx.live_nodes() if (k := self.ctx.keyring.key_of(n))},
        )
        actions = decide.leader_actions(self.ctx.table, view)
        places = [a.job_id for a in actions if isinstance(a, decide.Place)]
        self._blocked = {j: b for j, b in self._blocked.items() if j in places}
        due = set(places)
        if self._blocked:
            records = decide.available_memory(self.ctx.live_records(), self.ctx.table)
            now = self.ctx.clock()
            due = {
                j
                for j in places
                if decide.plan_again(
                    self._blocked.get(j),
                    decide.placement_inputs(self.ctx.table.jobs[j], view.alive, records),
                    now,
                )
            }
        for action in actions:
            if isinstance(action, ev.MemberJoined):
                self._run(f"member:{action.node_id}", self._admit(action))
            elif isinstance(action, decide.Place):
                # one waiting job per round: a burst of submissions is placed in turn
                if action.job_id in due and not self._placing:
                    self._placing.add(action.job_id)
                    self._run(action.job_id, self._place_waiting(action.job_id))
            elif isinstance(action, decide.Recover):
                self._run(action.job_id, self._recover(action.job_id, action.lost))
            elif isinstance(action, decide.Register):
                self._run(action.job_id, self._register(action.job_id))

    def _run(self, key: str, coro: Coroutine[object, object, None]) -> None:
        task = self.ctx.spawn(coro, f"job:{key}")
        self._busy[key] = task
        task.add_done_callback(lambda t: self._busy.pop(key, None))

    async def _append(self, events: list[ev.Event], *, wait: bool = False) -> int:
        return (
            await self.ctx.append(events) if not wait else await self.rep.append(events, wait=True)
        )

    async def _admit(self, joined: ev.MemberJoined) -> None:
        try:
            await self._append([joined])
        except Unavailable as exc:  # another change is committing, or no majority: next tick
            log.debug("node %s not listed yet: %s", joined.node_id, exc)
            return
        log.info("node %s is a member of the swarm now", joined.node_id)

    # --- placing ------------------------------------------------------------------------------

    async def _place_waiting(self, job_id: str) -> None:
        try:
            await self._place(job_id)
        finally:
            self._placing.discard(job_id)

    async def _place(self, job_id: str) -> None:
        entry = self.ctx.table.jobs[job_id]
        # never on memory another job's stages or a served model already take
        records = decide.available_memory(self.ctx.live_records(), self.ctx.table, job_id)
        cluster = decide.learned_cluster(jobs.cluster_records(records), entry)  # its runs' speeds
        alive = self.ctx.live_nodes()
        try:
            async with self._planning:
                result, tried = await asyncio.to_thread(self._plan, entry, cluster, alive)
        except ValueError as exc:  # the model cannot be read here, or cannot take this job
            await self._append(
                [
                    ev.JobFailed(
                        job_id=job_id,
                        attempt=entry.attempt,
                        stage=-1,
                        node_id=self.ctx.node_id,
                        message=str(exc),
                        at=self.wall(),
                    )
                ]
            )
            return
        events = decide.placement(
            self.ctx.table.jobs[job_id],
            result,
            cluster=cluster,
            records=records,
            alive=alive,
            me=self.ctx.node_id,
            now=self.wall(),
            tried=tried,
        )
        if isinstance(result, Blocked):
            if events:
                await self._append(events)
                log.info("job %s waits: %s", job_id, self.ctx.table.jobs[job_id].reason)
            waiting = self.ctx.table.jobs.get(job_id)
            if waiting is not None and waiting.state == "pending":  # as the table holds it now
                inputs = decide.placement_inputs(waiting, alive, records)
                self._blocked[job_id] = (inputs, self.ctx.clock())
            return
        if not events:
            return
        await self._append(events)
        placed = self.ctx.table.jobs[job_id]
        log.info("job %s attempt %d placed on %s", job_id, placed.attempt, list(placed.stage_nodes))
        await self._launch(job_id, placed.attempt)

    @staticmethod
    def _plan(
        entry: JobEntry, cluster: list[Node], alive: frozenset[str]
    ) -> tuple[Plan | Blocked, decide.PlanTry | None]:
        """The first plan of ``decide.plan_tries`` that places the job (and how it was made),
        else the first Blocked. A plan made with any stage count is made again on its cuts:
        every stage's node checks it that way."""
        from dataclasses import replace

        shape = entry.inputs.shape if entry.inputs is not None else None
        first = None
        for tried in decide.plan_tries(entry, alive):
            job = entry.job
            if tried.any_count:
                job = replace(job, split=replace(job.split, stages="auto"))
            result = jobs.compute_plan(job, cluster, shape=shape, cuts=tried.cuts)
            if tried.any_count and not isinstance(result, Blocked):
                cuts = decide.plan_cuts([s.layers for s in result.stages])
                result = jobs.compute_plan(entry.job, cluster, shape=shape, cuts=cuts)
            if not isinstance(result, Blocked):
                return result, tried
            first = first or result
        return first, None

    async def _launch(self, job_id: str, attempt: int) -> None:
        await launch.launch(self, job_id, attempt)

    async def _recover(self, job_id: str, lost: tuple[str, ...]) -> None:
        entry = self.ctx.table.jobs[job_id]
        why = f"node(s) {', '.join(lost)} lost" if lost else "the leader that placed it was lost"
        log.warning("job %s: %s; re-planning", job_id, why)
        await self._append([ev.JobResuming(job_id=job_id, reason=why, at=self.wall())])
        await self._stop_everywhere(job_id, entry.attempt)
        await self._place(job_id)

    async def _register(self, job_id: str) -> None:
        events = decide.registration(self.ctx.table, job_id)
        if events:
            await self._append(events)
            log.info("job %s registered model %s", job_id, events[0].model["id"])

    async def _stop_everywhere(self, job_id: str, attempt: int) -> None:
        msg = StageStop(job_id=job_id, attempt=attempt)
        await asyncio.gather(
            *(
                self.ctx.call(n, msg, self.ctx.config.timings.stage_stop_s)
                for n in sorted(self.ctx.live_nodes())
            ),
            return_exceptions=True,
        )

    # --- requests -----------------------------------------------------------------------------

    async def submit(self, msg: Submit, sender: str | None = None) -> Submitted:
        """Leader: add the job from node ``sender`` (None: this one); answered once a majority
        of the members hold it. Past a cap on unfinished jobs (``decide.waiting_refusal``) it
        is refused before anything is written: the check and the append happen with no await
        between them, so concurrent submissions cannot pass the cap together."""
        self.rep.require_ready()
        sender = sender or self.ctx.node_id
        job_id = msg.job_id or decide.new_job_id(self.ctx.table.version + 1, secrets.token_hex(3))
        check_job_id(job_id)
        if job_id in self.ctx.table.jobs:
            raise UserError(f"job {job_id!r} is already in the table", code="exists")
        config = self.ctx.config
        why = decide.waiting_refusal(
            self.ctx.table,
            sender,
            per_swarm=config.max_waiting_jobs,
            per_node=config.max_waiting_per_submitter,
        )
        if why:
            raise Unavailable(f"job not submitted: {why}", code="job_cap")
        wait = self._submits(sender).wait_s(1)  # counted once past the caps, taken at once
        if wait > 0:
            raise Unavailable(
                f"job not submitted: node {sender} submitted {SUBMIT_BURST} jobs in quick "
                f"succession; past that the leader takes one every {self.ctx.config.timings.submit_every_s:g} s from "
                f"a node: retry in {wait:.1f} s",
                code="job_rate",
            )
        by = decide.submitted_by(msg.submitted_by, sender)
        event = ev.JobSubmitted(
            job_id=job_id, job=msg.job, submitted_by=by, at=self.wall(), inputs=msg.inputs
        )
        version = await self.rep.append([event], wait=True)
        log.info("job %s submitted at version %d", job_id, version)
        return Submitted(
            job_id=job_id,
            term=self.ctx.table.term,
            version=version,
            replicas=self.rep.holders(version),
        )

    async def cancel(self, job_id: str) -> dict[str, Data]:
        """Leader (a follower forwards): stop the job's workers, mark it CANCELLED."""
        if not self.ctx.leading:
            await self.ctx.to_leader(
                JobCancel(job_id=job_id), self.ctx.config.timings.stage_stop_s * 3
            )
            return {"job_id": job_id, "state": "CANCELLED"}
        entry = self.ctx.table.jobs.get(job_id)
        if entry is None:
            raise UserError(f"no job {job_id!r} in the table; see `swarm jobs`", code="no_job")
        if entry.state in FINAL_STATES:
            raise UserError(
                f"job {job_id} is already {entry.state.upper()}; nothing to cancel", code="final"
            )
        task = self._busy.pop(job_id, None)
        if task is not None:
            task.cancel()
        await self._append(
            [ev.JobCancelled(job_id=job_id, reason="cancelled by the user", at=self.wall())]
        )
        await self._stop_everywhere(job_id, -1)
        return {"job_id": job_id, "state": "CANCELLED"}

    async def on_report(self, msg: StageReport) -> None:
        """Leader: fold one batch of a stage's events into metrics and the table."""
        async with self._report_lock:
            entry = self.ctx.table.jobs.get(msg.job_id)
            if entry is None or entry.attempt != msg.attempt or entry.state in FINAL_STATES:
                return
            reported = self._decoded(msg)
            self.metrics.fold(
                msg.job_id,
                attempt=msg.attempt,
                stage=msg.stage,
                n_stages=entry.n_stages,
                events=reported,
                replica=msg.replica,
                n_replicas=entry.n_replicas,
            )
            now = self.wall()
            due = (
                now - self._progress_at.get(msg.job_id, 0.0)
                >= self.ctx.config.timings.progress_every_s
            )
            events = decide.fold_report(
                entry,
                attempt=msg.attempt,
                stage=msg.stage,
                node_id=msg.node_id,
                events=reported,
                now=now,
                progress_due=due,
                replica=msg.replica,
            )
            if not events:
                return
            if any(isinstance(e, ev.StepsReported) for e in events):
                self._progress_at[msg.job_id] = now
            await self._append(events)
        for event in events:
            if isinstance(event, ev.SnapshotHeld):
                files = [
                    e.file
                    for e in reported
                    if isinstance(e, SnapshotSaved) and e.step == event.step and e.file
                ]
                if files:
                    self._copy_snapshot(msg.job_id, msg.stage, msg.node_id, event.step, files[0])
            elif isinstance(event, ev.JobFailed):
                self.ctx.spawn(self._stop_everywhere(msg.job_id, msg.attempt), f"stop:{msg.job_id}")
        if self.ctx.table.jobs[msg.job_id].state == "completed":
            await self._register(msg.job_id)
        self._watch_balance(msg.job_id)

    @staticmethod
    def _decoded(msg: StageReport) -> list[WorkerEvent]:
        """A report's events as records; a malformed one is logged, naming its field, and left
        out (the rest of the batch still counts)."""
        out = []
        for raw in msg.events:
            try:
                out.append(decode(raw))
            except SchemaError as exc:
                log.warning(
                    "job %s stage %d: node %s reported %s", msg.job_id, msg.stage, msg.node_id, exc
                )
        return out

    # --- learning from the run ----------------------------------------------------------------

    def _watch_balance(self, job_id: str) -> None:
        """After a report: when the run says the split is off (``decide.rebalance_due``), weigh
        a split by the measured speeds; carry it out at the first snapshot after that."""
        entry = self.ctx.table.jobs.get(job_id)
        if entry is None or not self.ctx.leading:
            return
        pending = self._rebalance.get(job_id)
        if pending is not None:
            due, cuts = pending
            if due.attempt != entry.attempt or entry.state in FINAL_STATES:
                del self._rebalance[job_id]
            elif job_id not in self._busy and decide.rebalance_step(
                entry, due, self.ctx.live_nodes()
            ):
                del self._rebalance[job_id]
                self._run(job_id, self._rebalance_now(job_id, due, cuts))
            return
        weighed = self._weighed.get(job_id)
        due = decide.rebalance_due(entry, self.metrics.compute(job_id))
        if due is None or (weighed and weighed[0] == entry.attempt and due.step < weighed[1]):
            return
        self._weighed[job_id] = (entry.attempt, due.step + decide.REBALANCE_STEPS)
        self.ctx.spawn(self._weigh(job_id, due), f"balance:{job_id}")

    def _measured_cluster(self, entry: JobEntry, due: decide.Rebalance) -> list[Node]:
        """The records the attempt was planned on, with the speeds the run measured."""
        return decide.with_learned_speeds(entry.cluster, due.speeds, due.dtype)

    async def _weigh(self, job_id: str, due: decide.Rebalance) -> None:
        """Plan the job on the speeds its run measured; a different split waits for the next
        snapshot."""
        entry = self.ctx.table.jobs.get(job_id)
        if entry is None or entry.plan is None or entry.attempt != due.attempt:
            return
        shape = entry.inputs.shape if entry.inputs is not None else None
        try:
            result = await asyncio.to_thread(
                jobs.compute_plan, entry.job, self._measured_cluster(entry, due), shape=shape
            )
        except ValueError as exc:
            log.warning("job %s: cannot weigh a re-balance: %s", job_id, exc)
            return
        if isinstance(result, Blocked):
            return
        old = decide.plan_cuts([s.layers for s in entry.plan.stages])
        new = decide.plan_cuts([s.layers for s in result.stages])
        same_devices = [(s.node_id, s.devices) for s in result.stages] == [
            (s.node_id, s.devices) for s in entry.plan.stages
        ]
        if new == old or not same_devices:
            log.info(
                "job %s: stage %d runs %.2fx its prediction, but the measured speeds give the same split",
                job_id,
                due.stage,
                due.ratio,
            )
            return
        self._rebalance[job_id] = (due, new)
        log.info(
            "job %s: stage %d runs %.2fx its prediction; cuts %s instead of %s at its next snapshot",
            job_id,
            due.stage,
            due.ratio,
            list(new),
            list(old),
        )

    async def _rebalance_now(
        self, job_id: str, due: decide.Rebalance, cuts: tuple[int, ...]
    ) -> None:
        """Stop the attempt and place the job again on ``cuts`` from its newest snapshot."""
        entry = self.ctx.table.jobs[job_id]
        assert entry.plan is not None
        cluster = self._measured_cluster(entry, due)
        shape = entry.inputs.shape if entry.inputs is not None else None
        try:
            result = await asyncio.to_thread(
                jobs.compute_plan, entry.job, cluster, shape=shape, cuts=cuts
            )
        except ValueError as exc:
            log.warning("job %s: no re-balance: %s", job_id, exc)
            return
        if isinstance(result, Blocked):
            log.info(
                "job %s: no re-balance, the new split does not fit now: %s", job_id, result.reason
            )
            return
        old = decide.plan_cuts([s.layers for s in entry.plan.stages])
        events = decide.rebalanced(entry, due, old, cuts, self.wall())
        if not events:
            return
        await self._append(events)
        log.info("job %s %s", job_id, events[0].reason)
        await self._stop_everywhere(job_id, due.attempt)
        placed = decide.placement(
            self.ctx.table.jobs[job_id],
            result,
            cluster=cluster,
            records=self.ctx.live_records(),
            alive=self.ctx.live_nodes(),
            me=self.ctx.node_id,
            now=self.wall(),
            tried=decide.PlanTry(cuts=tuple(cuts)),
        )
        await self._append(placed)
        entry = self.ctx.table.jobs[job_id]
        if placed and isinstance(placed[0], ev.JobPlaced):
            log.info(
                "job %s attempt %d re-balanced onto %s",
                job_id,
                entry.attempt,
                [list(s.layers) for s in entry.plan.stages],
            )
            await self._launch(job_id, entry.attempt)

    def _copy_snapshot(self, job_id: str, stage: int, holder: str, step: int, file: str) -> None:
        """Have another live node pull a copy of a stage's snapshot."""
        others = sorted(self.ctx.live_nodes() - {holder})
        if not others:
            return
        target = others[stage % len(others)]

        async def pull() -> None:
            try:
                source = self.ctx.endpoint_of(holder)
                await self.ctx.call(
                    target,
                    FilePull(job_id=job_id, file=file, source=source),
                    self.ctx.config.timings.shard_copy_s,
                )
            except (SwarmError, OSError) as exc:
                log.warning("snapshot copy of job %s stage %d failed: %s", job_id, stage, exc)
                return
            entry = self.ctx.table.jobs.get(job_id)
            if entry is None or not self.ctx.leading:
                return
            if str(step) not in entry.snapshots.get(str(stage), {}):
                return  # already forgotten: newer snapshots came since
            await self._append(
                [ev.SnapshotHeld(job_id=job_id, stage=stage, step=step, node_id=target)]
            )

        self.ctx.spawn(pull(), f"replicate:{job_id}:{stage}")

    async def shard_copied(self, msg: ShardCopy) -> JobAck:
        """Leader: list ``msg.node_id`` as holding a copy of a stage's shard."""
        self.rep.require_ready()
        entry = self.ctx.table.jobs.get(msg.job_id)
        if entry is None or entry.model is None:
            raise UserError(f"job {msg.job_id} registered no model", code="no_model")
        await self._append(
            [ev.ShardCopied(job_id=msg.job_id, stage=msg.stage, node_id=msg.node_id)]
        )
        return JobAck(job_id=msg.job_id)

    async def job_metrics(self, job_id: str) -> dict[str, Data]:
        """The job's metrics from the leader (this node, or asked)."""
        if self.ctx.leading:
            return self.metrics.get(job_id)
        try:
            reply = await self.ctx.to_leader(JobMetricsFetch(job_id=job_id), 5.0)
        except (SwarmError, OSError):
            return self.metrics.get(job_id)  # what this node fetched last
        if isinstance(reply, JobMetrics):
            self.metrics.put(job_id, reply.metrics)
            return reply.metrics
        return {}

    async def handle(self, msg: Message, sender: str | None = None) -> Message:
        """The job requests the leader answers (``sender``: the node it came from)."""
        if isinstance(msg, Submit):
            if not self.ctx.leading:
                raise Unavailable(self._not_leading(), code="not_leader")
            return await self.submit(msg, sender)
        if isinstance(msg, StageReport):
            if not self.ctx.leading:  # the sender keeps the events and retries
                raise Unavailable(self._not_leading(), code="not_leader")
            await self.on_report(msg)
            return JobAck(job_id=msg.job_id)
        if isinstance(msg, JobCancel):
            await self.cancel(msg.job_id)
            return JobAck(job_id=msg.job_id)
        if isinstance(msg, JobMetricsFetch):
            if not self.ctx.leading:
                raise Unavailable(self._not_leading(), code="not_leader")
            return JobMetrics(job_id=msg.job_id, metrics=self.metrics.get(msg.job_id))
        if isinstance(msg, ShardCopy):
            return await self.shard_copied(msg)
        raise Failed(f"no job handler for {type(msg).TYPE}", code="internal")

    def _not_leading(self) -> str:
        why = self.rep.why_not_ready()
        return f"node {self.ctx.node_id} is not leading ({self.ctx.leader} leads in its view{'; ' + why if why else ''})"


__all__ = ["JobsLeader"]
