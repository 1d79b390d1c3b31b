"""The ring's scheduling decisions, kept apart from its sockets: which messages go to stage 0
and what each session sees (:class:`Scheduler`), and what a stage server runs next
(:func:`next_stage_work`).

The scheduler is vLLM's ``Scheduler.schedule() -> SchedulerOutput`` / ``update_from_output``
split for a ring: no threads, sockets, locks or clock of its own. Every call takes the time
(``now``, monotonic seconds) and returns an :class:`Outcome`: the messages to send to stage 0,
in order, and each session's events, in order. :class:`~swarmp2p.serve.sessions.RingClient`
carries an outcome out (its sender thread writes the messages, the sessions get their events).

- **Admission.** ``max_sessions`` sessions run at once (the batch bound); more wait in a queue
  of ``max_queue`` for ``queue_timeout`` s, then fail as busy; beyond the queue a request is
  refused (``Outcome.refused``). A session's prompt goes to stage 0 as one ``prefill``.
- **Prefix cache** (``prefix_blocks`` > 0): a :class:`~swarmp2p.serve.decoding.prefix.PrefixIndex`
  of the blocks every stage holds gives each admitted session a plan (the cached blocks it
  reuses, the ones it keeps, the ones to drop first), and its ``prefill`` starts after the
  reused tokens. A session's kept blocks are reusable once its first token is back (its
  prompt ran on every stage); a rebuilt ring starts with an empty index. Sessions whose
  sampling penalises repeats (the last stage needs every prompt id) skip the cache.
- **Groups.** Once its first token is back a session joins a *group*; every group goes round the
  ring as one batched ``decode`` step per token. There are as many groups as stages (learned
  from the ``sizes`` each stage appends to a step) unless ``groups`` fixes it, so while stage i
  runs group A, stage i+1 runs group B. A session joins the smallest group (at once when that
  one is idle); with ``min_group_rows`` it joins a running group while that one has fewer rows.
- **Finish rules,** after every token, in this order: a stop id ("stop", the id kept as the last
  token), the stop rule ``stop(tokens)`` ("stop"; one that raises fails its session), then
  ``max_tokens`` or the context ("length"). A finished or failed session's caches are freed by
  an ``end`` to every stage.
- **Deadlines** (``tick``): a running session with no token for ``step_timeout`` s fails; a
  waiting one past ``queue_timeout`` s fails as busy.
- **Failover** (``reroute``): every running session replays its prompt and the tokens
  generated so far as one ``prefill`` on the rebuilt ring (which starts cold), and goes on.

- **Speculative decoding** (``speculate``: "auto", "ngram", "draft", "none"): a session in a
  group drafts by prompt lookup (``serve.decoding.speculate``; ``k`` adaptive under "auto",
  MAX_DRAFT under "ngram"), or, with a draft model at stage 0 (``draft_model``; "draft", and
  "auto" when one is loaded), asks stage 0 to draft ``k`` tokens (MAX_DRAFT under "draft";
  adaptive under "auto", a drafted token priced at ``draft_cost`` plain laps), learning them
  from the answer's ``accepted``;
  either way bounded by every row's max_tokens and context; the accepted drafts
  and the token after them are each taken by :meth:`Scheduler._take` (vLLM's ``check_stop``
  per id). Per session: ``SessionState.speculate`` False or log-probabilities asked: no
  drafts (a grammar session drafts; its last stage masks every verified row). A ring
  answering ``spec_off`` stops drafting (:attr:`Scheduler.spec_off`).

Seam for prefix caching (issue 27): a prefix cache would tell :meth:`Scheduler._admit` how
many of a prompt's tokens every stage already holds, and the ``prefill`` would start there.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from swarmp2p.serve.decoding.prefix import PrefixIndex
from swarmp2p.serve.decoding.speculate import (
    DRAFT_LAP_COST,
    DraftLength,
    NgramIndex,
    SpecStats,
    lap_drafts,
    step_drafts,
)
from swarmp2p.serve.protocol import (
    MAX_TOKEN_ID,
    Decode,
    End,
    Failed,
    Prefill,
    RingMessage,
    TokenLogprobs,
    Tokens,
)
from swarmp2p.serve.session import SessionState
from swarmp2p.timings import TIMINGS

QUEUE_PER_SLOT = 4
"""Requests that may wait per session slot (``max_queue`` defaults to this x max_sessions)."""

SPECULATE_MODES = ("auto", "ngram", "draft", "none")
"""``--speculate``: adaptive (the draft model when one is loaded, else prompt lookup), prompt
lookup of MAX_DRAFT tokens a lap, the draft model's MAX_DRAFT a lap, or none."""

TOKEN, DONE, ERROR = "token", "done", "error"
"""The kinds of a session's events: a token id, finished (with its finish reason), failed (with
the message)."""


Send = tuple[RingMessage, tuple[SessionState, ...]]
"""A message for stage 0 and the sessions it serves: when every one of them has finished
before it leaves, it need not go (none: it goes whatever happens)."""
SessionEvent = tuple[SessionState, str, object]
"""``(session, kind, value)``: (TOKEN, id), (DONE, finish reason) or (ERROR, message)."""


@dataclass(slots=True)
class Outcome:
    """What one call decided: the messages to send to stage 0 and the sessions' events, each in
    order; ``refused`` says why a submitted request was not taken (the queue is full)."""

    sends: list[Send] = field(default_factory=list)
    events: list[SessionEvent] = field(default_factory=list)
    refused: str | None = None


@dataclass(eq=False, kw_only=True)
class _Group:
    """Sessions that go round the ring together, one batched decode step per token."""

    index: int
    members: list[SessionState] = field(default_factory=list)
    joining: list[SessionState] = field(default_factory=list)
    """Sessions that join at the group's next step (the group is in the ring now)."""
    step: int = 0
    in_flight: bool = False

    @property
    def size(self) -> int:
        return len(self.members) + len(self.joining)


def check_request(prompt: Iterable[int], max_tokens: int, max_context: int) -> tuple[int, ...]:
    """The prompt as a tuple of token ids, or ValueError naming what is wrong with the request."""
    prompt = tuple(prompt)
    if not prompt:
        raise ValueError("prompt: at least one token is needed")
    if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in prompt):
        bad = next(t for t in prompt if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID)
        raise ValueError(f"prompt: token id {bad!r} is not an integer in [0, {MAX_TOKEN_ID}]")
    if len(prompt) >= max_context:
        raise ValueError(
            f"prompt: {len(prompt)} tokens, the context holds {max_context}; shorten the prompt"
        )
    if type(max_tokens) is not int or max_tokens < 1:
        raise ValueError(f"max_tokens: {max_tokens!r} is not an integer >= 1")
    return prompt


class Scheduler:
    """Admission, groups, deadlines and finish rules of one ring's sessions (see the module)."""

    def __init__(
        self,
        *,
        max_context: int,
        max_sessions: int,
        step_timeout: float,
        queue_timeout: float,
        max_queue: int | None = None,
        groups: int | None = None,
        min_group_rows: int = 1,
        speculate: str = "none",
        draft_model: bool = False,
        draft_cost: float | None = None,
        prefix_blocks: int = 0,
        prefix_salt: bytes = b"",
    ) -> None:
        if speculate not in SPECULATE_MODES:
            raise ValueError(f"speculate: {speculate!r} is not one of {', '.join(SPECULATE_MODES)}")
        if speculate == "draft" and not draft_model:
            raise ValueError("speculate: 'draft' needs a draft model at stage 0 (--draft MODEL)")
        if type(max_sessions) is not int or max_sessions < 1:
            raise ValueError(f"max_sessions: {max_sessions!r} is not an integer >= 1")
        if groups is not None and (type(groups) is not int or groups < 1):
            raise ValueError(f"groups: {groups!r} is not an integer >= 1 or None")
        if type(min_group_rows) is not int or min_group_rows < 1:
            raise ValueError(f"min_group_rows: {min_group_rows!r} is not an integer >= 1")
        self.max_context = max_context
        self.max_sessions = max_sessions
        self.step_timeout = step_timeout
        self.queue_timeout = queue_timeout
        self.max_queue = QUEUE_PER_SLOT * max_sessions if max_queue is None else max_queue
        self.min_group_rows = min_group_rows
        self._fixed_groups = groups
        self.speculate = speculate
        self.model_drafts = draft_model and speculate in ("auto", "draft")
        """Sessions draft with stage 0's draft model (else by prompt lookup)."""
        self.draft_cost = DRAFT_LAP_COST if draft_cost is None else draft_cost
        self.spec_off = ""
        """Why the ring does not speculate though asked to (a stage said so); empty otherwise."""
        self.spec = SpecStats()
        self.closed = False
        """No admissions any more (the ring client is closing)."""
        self.sessions: dict[int, SessionState] = {}
        """Every open session, queued or running, by sid."""
        self._running: dict[int, SessionState] = {}
        self._waiting: collections.deque[SessionState] = collections.deque()
        self._groups: list[_Group] = [_Group(index=0)]
        self._stages = 0
        self._sizes: tuple[int, ...] = ()
        self._mean_session_s = 0.0
        self.prefix = PrefixIndex(prefix_blocks, salt=prefix_salt) if prefix_blocks else None
        """The prompt blocks the ring's stages hold (None: no prefix cache)."""

    # -- what it holds ----------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Sessions admitted to the ring (not those waiting for a slot)."""
        return len(self._running)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def stages(self) -> int:
        """Stages of the ring, once a decode step has gone round it (0 before)."""
        return self._stages

    @property
    def stage_batch_sizes(self) -> tuple[int, ...]:
        """Rows of the latest decode step at each stage, stage 0 first."""
        return self._sizes

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return tuple(g.size for g in self._groups)

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the mean session time, scaled by the queue."""
        waits = (len(self._waiting) + 1) / self.max_sessions
        return max(1, min(int(TIMINGS.retry_after_max_s), math.ceil(self._mean_session_s * waits)))

    # -- events in, outcomes out ------------------------------------------------------------------

    def submit(self, session: SessionState, now: float) -> Outcome:
        """Admit ``session`` (its prefill goes out) or queue it; ``refused`` when the queue is
        full too (the session is not taken)."""
        out = Outcome()
        if self.closed:
            out.refused = "the ring client was closed"
            return out
        session.started = session.last_activity = now
        if len(self._running) < self.max_sessions and not self._waiting:
            self.sessions[session.sid] = session
            self._admit(session, now, out)
        elif len(self._waiting) < self.max_queue:
            self.sessions[session.sid] = session
            session.state = "queued"
            self._waiting.append(session)
        else:
            out.refused = (
                f"all {self.max_sessions} session slots are taken and {len(self._waiting)} "
                "requests wait for one; retry later"
            )
        return out

    def on_message(self, msg: RingMessage, now: float) -> Outcome:
        """What came back from the last stage: tokens or a failure (anything else is ignored)."""
        if isinstance(msg, Tokens):
            return self.on_tokens(msg, now)
        if isinstance(msg, Failed):
            return self.on_failed(msg, now)
        return Outcome()

    def on_tokens(self, msg: Tokens, now: float) -> Outcome:
        """Each row's next token: the finish rules, then the group's next step (or, after a
        prefill, joining a group). Late answers (a step before a failover, a session that ended
        or was replayed) are recognised by their step and positions and dropped."""
        out = Outcome()
        group = None
        if msg.group >= 0:
            if msg.group >= len(self._groups):
                return out
            group = self._groups[msg.group]
            if not group.in_flight or msg.step != group.step:
                return out
            group.in_flight = False
            if msg.sizes:
                self._stages, self._sizes = len(msg.sizes), msg.sizes
                self._grow_groups()
            if msg.spec_off and not self.spec_off:
                self._stop_speculating(msg.spec_off)
        joined = []
        running = self._running
        for i, sid in enumerate(msg.sids):
            session = running.get(sid)
            if session is None or msg.positions[i] != session.expect:
                continue
            if group is None:
                if session.state != "prefill":
                    continue
            elif session.group != group.index:
                continue
            session.last_activity = now
            if session.first_token_at is None:
                session.first_token_at = now
            if group is None and self.prefix is not None:
                self.prefix.stored(sid)  # its prompt ran on every stage: its blocks are there
            logprob = msg.logprobs[i] if msg.logprobs else None
            if group is not None:
                self._take_lap(session, msg, i, logprob, now, out)
            elif not self._take(session, msg.tokens[i], logprob, now, out):
                joined.append(session)
            session.forced = msg.forced[i] if msg.forced else ()
        if group is not None:
            self._step(group, out)
        for session in joined:
            self._join(session, out)
        return out

    def on_failed(self, msg: Failed, now: float) -> Outcome:
        """A stage could not serve these sessions: they fail with its message."""
        out = Outcome()
        for sid in msg.sids:
            session = self._running.get(sid)
            if session is not None:
                self._fail(session, msg.message, now, out)
        return out

    def fail(
        self, sessions: Iterable[SessionState], message: str, now: float, *, notify: bool = True
    ) -> Outcome:
        """End ``sessions`` now with ``message`` (a no-op for those already finished); with
        ``notify`` an ``end`` frees each one's caches on every stage."""
        out = Outcome()
        for session in sessions:
            self._fail(session, message, now, out, notify=notify)
        return out

    def cancel(self, session: SessionState, reason: str, now: float) -> Outcome:
        return self.fail((session,), reason, now)

    def fail_all(self, reason: str, now: float, *, notify: bool = True) -> Outcome:
        """Fail every open session, queued or running."""
        return self.fail(list(self.sessions.values()), reason, now, notify=notify)

    def tick(self, now: float) -> Outcome:
        """The deadlines: running sessions silent for ``step_timeout``, requests that waited
        ``queue_timeout`` for a slot (busy)."""
        out = Outcome()
        silent = [s for s in self._running.values() if now - s.last_activity > self.step_timeout]
        for session in silent:
            self._fail(
                session,
                f"no token from the ring within {self.step_timeout:g} s; "
                "a stage is down or overloaded",
                now,
                out,
            )
        while self._waiting and now - self._waiting[0].started > self.queue_timeout:
            session = self._waiting[0]
            session.busy, session.retry_after = True, self.retry_after()
            self._fail(
                session,
                f"waited {self.queue_timeout:g} s for a session slot (all {self.max_sessions} "
                "busy); retry later",
                now,
                out,
            )
        return out

    def reroute(self, now: float) -> Outcome:
        """The ring was rebuilt (its caches are empty): every running session replays its
        prompt and generated tokens as one prefill and goes on; groups start empty."""
        out = Outcome()
        if self.prefix is not None:
            self.prefix.clear()  # the new stages hold no blocks: cold, never wrong
        for group in self._groups:
            group.members, group.joining, group.in_flight = [], [], False
        for session in self._running.values():
            session.last_activity = now
            session.state, session.group, session.draft, session.ask = "prefill", None, (), 0
            session.forced = ()
            replay = Prefill(
                sid=session.sid,
                pos=0,
                tokens=session.prompt + tuple(session.tokens),
                sampling=session.sampling,
                prompt_len=len(session.prompt),
                grammar=session.grammar,
            )
            out.sends.append((replay, (session,)))
        return out

    def close(self) -> None:
        """Admit nobody from now on (open sessions stay until failed)."""
        self.closed = True

    # -- the rules ----------------------------------------------------------------------------------

    def _admit(self, session: SessionState, now: float, out: Outcome) -> None:
        self._running[session.sid] = session
        session.state = "prefill"
        session.admitted_at = session.last_activity = now
        plan = None
        if self.prefix is not None and not session.sampling.needs_history:
            plan = self.prefix.plan(session.sid, session.prompt)
            if not (plan.reuse or plan.keep or plan.drop):
                plan = None
        start = plan.reused_tokens if plan is not None else 0
        prefill = Prefill(
            sid=session.sid,
            pos=start,
            tokens=session.prompt[start:],
            sampling=session.sampling,
            grammar=session.grammar,
            prefix=plan,
        )
        out.sends.append((prefill, (session,)))

    def _admit_waiting(self, now: float, out: Outcome) -> None:
        while self._waiting and len(self._running) < self.max_sessions:
            self._admit(self._waiting.popleft(), now, out)

    def _join(self, session: SessionState, out: Outcome) -> None:
        """A session whose prompt is done joins the smallest group (now, if that one is idle);
        the smallest running one while it holds fewer than ``min_group_rows``."""
        filling = [g for g in self._groups if 0 < g.size < self.min_group_rows]
        group = min(filling or self._groups, key=lambda g: (g.size, g.in_flight))
        session.state, session.group = "decode", group.index
        if self._may_draft(session) and session.drafter is None and not session.model_drafts:
            if self.model_drafts:
                session.model_drafts = True
                adaptive = self.speculate == "auto"
                session.draft_len = DraftLength(lap_cost=self.draft_cost) if adaptive else None
            else:
                session.drafter = NgramIndex((*session.prompt, *session.tokens))
                session.draft_len = DraftLength() if self.speculate == "auto" else None
        group.joining.append(session)
        if not group.in_flight:
            self._step(group, out)

    def _step(self, group: _Group, out: Outcome) -> None:
        """Send the group's next decode step (with whoever joined), or leave it idle."""
        if group.joining:
            group.members.extend(group.joining)
            group.joining.clear()
        members = group.members
        if not members:
            group.in_flight = False
            return
        group.step += 1
        group.in_flight = True
        drafts, asks = self._drafts(members)
        step = Decode(
            group=group.index,
            step=group.step,
            sids=tuple(s.sid for s in members),
            positions=tuple(s.expect - 1 for s in members),
            tokens=tuple(s.tokens[-1] for s in members),
            drafts=drafts,
            asks=asks,
        )
        out.sends.append((step, tuple(members)))

    def _drafts(
        self, members: list[SessionState]
    ) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """Each row's draft for the next step, or the tokens stage 0 drafts for it
        (``speculate.step_drafts``), bounded by the room of the row with the least."""
        room = min(
            min(s.max_tokens - len(s.tokens) - 1, self.max_context - s.expect) for s in members
        )
        return step_drafts(members, room, self._may_draft)

    def _take_lap(
        self, session: SessionState, msg: Tokens, row: int, logprob, now: float, out: Outcome
    ) -> None:
        """A decode step's answer for one row: its accepted drafts, then the last stage's
        token, each through the finish rules (the first that finishes the session ends it)."""
        kept, drafted, error = lap_drafts(session, msg, row)
        if error:
            self._fail(session, error, now, out)
            return
        stats = self.spec
        stats.laps += 1
        stats.drafted += drafted
        stats.accepted += len(kept)
        for token, lp in (*((t, None) for t in kept), (msg.tokens[row], logprob)):
            stats.tokens += 1
            if self._take(session, token, lp, now, out):
                return

    def _may_draft(self, session: SessionState) -> bool:
        """Whether ``session``'s steps may carry drafts: the ring speculates and can verify,
        and the session neither turned it off nor asks for log-probabilities."""
        return (
            self.speculate != "none"
            and not self.spec_off
            and session.speculate
            and session.sampling.logprobs is None
        )

    def _stop_speculating(self, reason: str) -> None:
        """A stage cannot verify drafts: no session drafts from now on."""
        self.spec_off = reason
        for session in self._running.values():
            session.drafter = session.draft_len = None
            session.model_drafts = False

    def _take(
        self,
        session: SessionState,
        token: int,
        logprob: TokenLogprobs | None,
        now: float,
        out: Outcome,
    ) -> bool:
        """Add one generated token and ask the finish rules about it; True when the session
        finished (or failed) with it."""
        session.tokens.append(token)
        session.logprobs.append(logprob)
        if session.drafter is not None:
            session.drafter.extend((token,))
        reason = None
        if token in session.stop_ids:
            reason = "stop"
        else:
            try:
                stopped = session.stop is not None and session.stop(session.tokens)
            except Exception as e:  # a broken stop rule fails its session, not the ring
                self._fail(session, f"the stop rule failed: {type(e).__name__}: {e}", now, out)
                return True
            if stopped:
                reason = "stop"
            elif len(session.tokens) >= session.max_tokens or session.expect >= self.max_context:
                reason = "length"
        out.events.append((session, TOKEN, token))
        if reason is None:
            return False
        session.finish_reason = reason
        self._release(session, now, out)
        out.events.append((session, DONE, reason))
        return True

    def _grow_groups(self) -> None:
        want = self._fixed_groups or max(1, self._stages)
        while len(self._groups) < want:
            self._groups.append(_Group(index=len(self._groups)))

    def _leave_group(self, session: SessionState, out: Outcome) -> None:
        if session.group is None:
            return
        group = self._groups[session.group]
        session.group = None
        if session in group.joining:
            group.joining.remove(session)
        if session in group.members:
            group.members.remove(session)
        if not group.members and group.in_flight:
            group.in_flight = False  # a late answer to its step is recognised by its number
            if group.joining:
                self._step(group, out)

    def _fail(
        self,
        session: SessionState,
        message: str,
        now: float,
        out: Outcome,
        *,
        notify: bool = True,
    ) -> None:
        if session.state == "done":
            return
        session.error = message
        self._release(session, now, out, notify=notify)
        out.events.append((session, ERROR, message))

    def _release(
        self, session: SessionState, now: float, out: Outcome, *, notify: bool = True
    ) -> None:
        was_queued = session.state == "queued"
        was_running = self._running.pop(session.sid, None) is not None
        self.sessions.pop(session.sid, None)
        if was_queued:
            try:
                self._waiting.remove(session)
            except ValueError:  # never submitted here
                pass
        session.state = "done"
        self._leave_group(session, out)
        if was_running and self.prefix is not None:
            self.prefix.release(session.sid)
        if was_running:
            if session.admitted_at is not None:
                took = now - session.admitted_at
                self._mean_session_s = 0.8 * self._mean_session_s + 0.2 * took
            if notify:  # free every stage's cache; best effort, a dead stage frees nothing
                out.sends.append((End(sid=session.sid), ()))
            if not self.closed:
                self._admit_waiting(now, out)


def next_stage_work(*, decodes: int, prefills: int, decode_turn: bool) -> tuple[str | None, bool]:
    """What a stage server runs next, "decode" (one group's step), "prefill" (a batch of prompt
    chunks) or None (nothing waits), and whose turn it is after that (``decode_turn``). While
    both wait they take turns, so a long prompt delays the running sessions' next tokens by one
    chunk at most and new sessions still get their first tokens."""
    if decodes and (decode_turn or not prefills):
        return "decode", False
    if prefills:
        return "prefill", True
    return None, decode_turn
