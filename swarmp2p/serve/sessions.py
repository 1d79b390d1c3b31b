"""The session manager: drives generation requests round a ring of stage servers.

Sessions are admitted up to ``max_sessions`` (the batch bound; more wait in a bounded queue for
a bounded time, then fail as busy). An admitted session's prompt goes to stage 0 as one
``prefill``; once its first token is back it joins a *group*, and every group goes round the
ring as one batched ``decode`` step per token: each stage runs a group's rows as one forward.
There are as many groups as stages (learned from the ``sizes`` each stage appends), so while
stage i runs group A, stage i+1 runs group B and every stage computes all the time. New sessions
join a group between its steps; finished ones leave it. With ``min_group_rows`` a session joins
a running group while that one has fewer rows, and a new group starts only once every running
group holds that many (stages sharing one machine's cores: see ``serve/local.py``).

Two threads do all the socket work: the *receiver* reads tokens from the last stage, decides
per session (an end-of-sequence id, ``max_tokens``, the context, a stop rule) and queues each
group's next step; the *sender* writes queued messages to stage 0. Callers — an asyncio event
loop included — never touch a socket: ``submit`` queues and returns at once, and a session's
events can be awaited on a loop (``submit(..., loop=...)`` / ``submit_async``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from swarmp2p.net import Link, LinkClosed, LinkTimeout
from swarmp2p.serve.protocol import (
    GREEDY,
    MAX_SID,
    MAX_TOKEN_ID,
    Decode,
    End,
    Failed,
    Prefill,
    SamplingParams,
    Tokens,
    decode_message,
)
from swarmp2p.serve.session import EventHook, GenerationError, RingBusy, Session
from swarmp2p.wire import WireError

POLL_S = 0.05
"""How often the threads check their stop flag, the step deadlines and the queue's waits."""
STEP_TIMEOUT_S = 60.0
"""A session that gets no token for this long fails with an error naming the ring."""
SEND_TIMEOUT_S = 10.0
"""How long the sender waits for stage 0 to take a message before failing its sessions."""
QUEUE_TIMEOUT_S = 30.0
"""How long a request waits for a session slot before it fails as busy (HTTP 503)."""
QUEUE_PER_SLOT = 4
"""Requests that may wait per session slot (``max_queue`` defaults to this x max_sessions)."""
RETRY_AFTER_MAX_S = 60


@dataclass(eq=False, kw_only=True)
class _Group:
    """Sessions that go round the ring together, one batched decode step per token."""

    index: int
    members: list[Session] = field(default_factory=list)
    joining: list[Session] = field(default_factory=list)
    """Sessions that join at the group's next step (the group is in the ring now)."""
    step: int = 0
    in_flight: bool = False

    @property
    def size(self) -> int:
        return len(self.members) + len(self.joining)


class RingClient:
    """Generation over a ring: ``first`` is the link to stage 0, ``last`` the link the last
    stage sends its tokens on. ``start()`` runs the two threads; ``close()`` stops them."""

    def __init__(
        self,
        first: Link,
        last: Link,
        *,
        max_context: int,
        max_sessions: int = 16,
        step_timeout: float = STEP_TIMEOUT_S,
        max_queue: int | None = None,
        queue_timeout: float = QUEUE_TIMEOUT_S,
        groups: int | None = None,
        min_group_rows: int = 1,
    ) -> None:
        if type(max_sessions) is not int or max_sessions < 1:
            raise ValueError(f"max_sessions: {max_sessions!r} is not an integer >= 1")
        if groups is not None and (type(groups) is not int or groups < 1):
            raise ValueError(f"groups: {groups!r} is not an integer >= 1 or None")
        if type(min_group_rows) is not int or min_group_rows < 1:
            raise ValueError(f"min_group_rows: {min_group_rows!r} is not an integer >= 1")
        self._first = first
        self._last = last
        self.max_context = max_context
        self.max_sessions = max_sessions
        self.step_timeout = step_timeout
        self.max_queue = QUEUE_PER_SLOT * max_sessions if max_queue is None else max_queue
        self.queue_timeout = queue_timeout
        self._fixed_groups = groups
        self.min_group_rows = min_group_rows
        self._lock = threading.RLock()
        self._sessions: dict[int, Session] = {}
        """Every open session, queued or running (the daemon reads it)."""
        self._running: dict[int, Session] = {}
        self._waiting: collections.deque[Session] = collections.deque()
        self._groups: list[_Group] = [_Group(index=0)]
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._outbox: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._reroute: tuple[Link, queue.Queue] | None = None
        self._stages = 0
        self._sizes: tuple[int, ...] = ()
        self._mean_session_s = 0.0
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> RingClient:
        if not self._threads:
            self._threads = [
                threading.Thread(target=self._receive, name="ring-receiver", daemon=True),
                threading.Thread(target=self._send_loop, name="ring-sender", daemon=True),
            ]
            for thread in self._threads:
                thread.start()
        return self

    def close(self) -> None:
        """Stop both threads and fail every open session; idempotent, never blocks on a link
        for longer than one poll."""
        with self._lock:
            self._closed = True
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._threads = []
        self.fail_all("the ring client was closed", notify=False)

    def __enter__(self) -> RingClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what it is doing --------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Sessions admitted to the ring (not those waiting for a slot)."""
        return len(self._running)

    @property
    def closed(self) -> bool:
        """``close()`` was called: no new sessions."""
        return self._closed

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a session slot."""
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
        """Sessions in each group (a group is one batched step in the ring)."""
        with self._lock:
            return tuple(g.size for g in self._groups)

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the mean session time, scaled by the queue."""
        waits = (len(self._waiting) + 1) / self.max_sessions
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(self._mean_session_s * waits)))

    # -- requests --------------------------------------------------------------------------------

    def submit(
        self,
        prompt: Iterable[int],
        *,
        max_tokens: int,
        sampling: SamplingParams | None = None,
        stop_ids: Iterable[int] = (),
        stop: Callable[[list[int]], bool] | None = None,
        hook: EventHook | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> Session:
        """Start generating after ``prompt``; returns at once (the session may wait for a
        slot). ``stop_ids`` end the session when sampled (the id is kept as its last token);
        ``stop(tokens)`` is asked after every other token, the last one ``max_tokens`` allows
        included. Greedy unless ``sampling`` says otherwise. With ``loop``, the events can be
        awaited there (``aevents``). RingBusy when the queue is full too."""
        prompt = tuple(prompt)
        if not prompt:
            raise ValueError("prompt: at least one token is needed")
        if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in prompt):
            bad = next(t for t in prompt if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID)
            raise ValueError(f"prompt: token id {bad!r} is not an integer in [0, {MAX_TOKEN_ID}]")
        if len(prompt) >= self.max_context:
            raise ValueError(
                f"prompt: {len(prompt)} tokens, the context holds {self.max_context}; "
                "shorten the prompt"
            )
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"max_tokens: {max_tokens!r} is not an integer >= 1")
        if not self._threads:
            raise RuntimeError("RingClient.start() first")
        session = Session(
            sid=next(self._ids) % MAX_SID,
            prompt=prompt,
            max_tokens=max_tokens,
            sampling=sampling or GREEDY,
            stop_ids=frozenset(stop_ids),
            stop=stop,
            hook=hook,
        )
        if loop is not None:
            session.on_loop(loop)
        with self._lock:
            if self._closed:
                raise GenerationError("the ring client was closed")
            if len(self._running) < self.max_sessions and not self._waiting:
                self._sessions[session.sid] = session
                self._admit(session)
            elif len(self._waiting) < self.max_queue:
                self._sessions[session.sid] = session
                self._waiting.append(session)
            else:
                raise RingBusy(
                    f"all {self.max_sessions} session slots are taken and {len(self._waiting)} "
                    "requests wait for one; retry later",
                    self.retry_after(),
                )
        return session

    async def submit_async(self, prompt: Iterable[int], **kw) -> Session:
        """``submit`` with the running loop, so that ``aevents()`` works there."""
        return self.submit(prompt, loop=asyncio.get_running_loop(), **kw)

    def cancel(self, session: Session, reason: str = "cancelled by the client") -> None:
        """End ``session`` now (its caches are freed); a no-op once it has finished."""
        with self._lock:
            self._fail(session, reason)

    def fail_all(self, reason: str, *, notify: bool = True) -> None:
        """Fail every open session (queued or running) with ``reason``."""
        with self._lock:
            for session in list(self._sessions.values()):
                self._fail(session, reason, notify=notify)

    def reroute(
        self, first: Link, last: Link, timeout: float = 2 * SEND_TIMEOUT_S
    ) -> tuple[Link, Link]:
        """Drive a rebuilt ring from now on (a stage was re-placed): every running session
        replays its prompt and the tokens generated so far as one ``prefill``, rebuilding every
        stage's cache, and goes on. Returns the old links for the caller to close."""
        if not self._threads:
            raise RuntimeError("RingClient.start() first")
        old_first: queue.Queue = queue.Queue(1)
        old_last: queue.Queue = queue.Queue(1)
        self._outbox.put(("swap", first, old_first))
        with self._lock:
            self._reroute = (last, old_last)
        try:
            return old_first.get(timeout=timeout), old_last.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"the ring threads did not switch links within {timeout} s"
            ) from None

    def generate(self, prompt: Iterable[int], *, timeout: float | None = None, **kw) -> list[int]:
        """``submit(...).result(timeout)``."""
        return self.submit(prompt, **kw).result(timeout)

    # -- scheduling (under the lock) ------------------------------------------------------------

    def _queue(self, message, sessions: Iterable[Session]) -> None:
        self._outbox.put(("send", [message.encode()], tuple(sessions)))

    def _admit(self, session: Session) -> None:
        now = time.monotonic()
        self._running[session.sid] = session
        session.state = "prefill"
        session.admitted_at = session.last_activity = now
        self._queue(
            Prefill(sid=session.sid, pos=0, tokens=session.prompt, sampling=session.sampling),
            (session,),
        )

    def _admit_waiting(self) -> None:
        while self._waiting and len(self._running) < self.max_sessions:
            self._admit(self._waiting.popleft())

    def _join(self, session: Session) -> None:
        """A session whose prompt is done joins the smallest group (now, if that one is idle);
        the smallest running one while it holds fewer than ``min_group_rows``."""
        filling = [g for g in self._groups if 0 < g.size < self.min_group_rows]
        group = min(filling or self._groups, key=lambda g: (g.size, g.in_flight))
        session.state, session.group = "decode", group.index
        group.joining.append(session)
        if not group.in_flight:
            self._step(group)

    def _step(self, group: _Group) -> None:
        """Send the group's next decode step (with whoever joined), or leave it idle."""
        group.members = [s for s in group.members + group.joining if not s.done.is_set()]
        group.joining = []
        if not group.members:
            group.in_flight = False
            return
        group.step += 1
        group.in_flight = True
        step = Decode(
            group=group.index,
            step=group.step,
            sids=tuple(s.sid for s in group.members),
            positions=tuple(s.expect - 1 for s in group.members),
            tokens=tuple(s.tokens[-1] for s in group.members),
        )
        self._queue(step, group.members)

    def _leave_group(self, session: Session) -> None:
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
                self._step(group)

    def _on_tokens(self, msg: Tokens) -> None:
        group = None
        if msg.group >= 0:
            if msg.group >= len(self._groups):
                return
            group = self._groups[msg.group]
            if not group.in_flight or msg.step != group.step:
                return  # an answer to a step of before a failover or a failed step
            group.in_flight = False
            if msg.sizes:
                self._stages, self._sizes = len(msg.sizes), msg.sizes
                self._grow_groups()
        now = time.monotonic()
        joined = []
        for i, sid in enumerate(msg.sids):
            session = self._running.get(sid)
            if session is None or session.done.is_set() or msg.positions[i] != session.expect:
                continue  # a late answer for a session that ended, failed or was replayed
            if (group is None) != (session.state == "prefill"):
                continue
            if group is not None and session.group != group.index:
                continue
            session.last_activity = now
            if session.first_token_at is None:
                session.first_token_at = now
            session.tokens.append(msg.tokens[i])
            session.logprobs.append(msg.logprobs[i] if msg.logprobs else None)
            if self._finished(session):
                continue
            session.emit("token", msg.tokens[i])
            if group is None:
                joined.append(session)
        if group is not None:
            self._step(group)
        for session in joined:
            self._join(session)

    def _finished(self, session: Session) -> bool:
        """Ask the stop rules about the newest token; finish the session if one says so."""
        token = session.tokens[-1]
        reason = None
        if token in session.stop_ids:
            reason = "stop"
        else:
            try:
                stopped = session.stop is not None and session.stop(session.tokens)
            except Exception as e:  # a broken stop rule fails its session, not the ring
                self._fail(session, f"the stop rule failed: {type(e).__name__}: {e}")
                return True
            if stopped:
                reason = "stop"
            elif len(session.tokens) >= session.max_tokens or session.expect >= self.max_context:
                reason = "length"
        if reason is None:
            return False
        session.emit("token", token)
        session.finish_reason = reason
        self._release(session)
        session.emit("done", reason)
        return True

    def _grow_groups(self) -> None:
        want = self._fixed_groups or max(1, self._stages)
        while len(self._groups) < want:
            self._groups.append(_Group(index=len(self._groups)))

    def _fail(self, session: Session, message: str, *, notify: bool = True) -> None:
        if session.done.is_set():
            return
        session.error = message
        self._release(session, notify=notify)
        session.emit("error", message)

    def _release(self, session: Session, *, notify: bool = True) -> None:
        was_running = self._running.pop(session.sid, None) is not None
        self._sessions.pop(session.sid, None)
        if session in self._waiting:
            self._waiting.remove(session)
        session.state = "done"
        session.done.set()
        self._leave_group(session)
        if was_running:
            if session.admitted_at is not None:
                took = time.monotonic() - session.admitted_at
                self._mean_session_s = 0.8 * self._mean_session_s + 0.2 * took
            if notify:  # free every stage's cache; best effort, a dead stage frees nothing
                self._queue(End(sid=session.sid), ())
            if not self._closed:
                self._admit_waiting()

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for session in list(self._running.values()):
            if now - session.last_activity > self.step_timeout:
                self._fail(
                    session,
                    f"no token from the ring within {self.step_timeout:g} s; "
                    "a stage is down or overloaded",
                )
        while self._waiting and now - self._waiting[0].started > self.queue_timeout:
            session = self._waiting[0]
            session.busy, session.retry_after = True, self.retry_after()
            self._fail(
                session,
                f"waited {self.queue_timeout:g} s for a session slot (all {self.max_sessions} "
                "busy); retry later",
            )

    # -- the threads -------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        """The only writer of the link to stage 0."""
        while not self._stop.is_set():
            try:
                item = self._outbox.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item[0] == "swap":
                _, link, reply = item
                old, self._first = self._first, link
                reply.put(old)
                continue
            _, parts, sessions = item
            if sessions and all(s.done.is_set() for s in sessions):
                continue  # every session of it ended while it waited
            try:
                self._first.send(parts, timeout=SEND_TIMEOUT_S)
            except (LinkTimeout, LinkClosed) as e:
                with self._lock:
                    for session in sessions:
                        self._fail(session, f"cannot reach stage 0: {e}")

    def _switch_links(self) -> None:
        """On the receiver: read the new ring from now on and replay every running session."""
        (last, reply), self._reroute = self._reroute, None
        old_last, self._last = self._last, last
        reply.put(old_last)
        for group in self._groups:
            group.members, group.joining, group.in_flight = [], [], False
        now = time.monotonic()
        for session in list(self._running.values()):
            session.last_activity = now
            session.state, session.group = "prefill", None
            replay = Prefill(
                sid=session.sid,
                pos=0,
                tokens=session.prompt + tuple(session.tokens),
                sampling=session.sampling,
                prompt_len=len(session.prompt),
            )
            self._queue(replay, (session,))

    def _receive(self) -> None:
        """The only reader of the link from the last stage."""
        next_check = time.monotonic() + POLL_S
        while not self._stop.is_set():
            if self._reroute is not None:
                with self._lock:
                    self._switch_links()
            try:
                parts = self._last.recv(POLL_S)
            except LinkTimeout:
                parts = None
            except LinkClosed:
                return
            with self._lock:
                if parts is not None:
                    self._on_message(parts)
                if time.monotonic() >= next_check:
                    self._check_deadlines()
                    next_check = time.monotonic() + POLL_S

    def _on_message(self, parts: list) -> None:
        try:
            msg = decode_message(parts[0])
        except (WireError, IndexError):
            return  # not ours to act on; the stage that sent it logged why
        if isinstance(msg, Tokens):
            try:
                self._on_tokens(msg)
            except Exception as e:  # a consumer's hook broke: its sessions fail, the ring goes on
                for sid in msg.sids:
                    session = self._running.get(sid)
                    if session is not None:
                        session.hook = None
                        self._fail(session, f"{type(e).__name__}: {e}")
        elif isinstance(msg, Failed):
            for sid in msg.sids:
                session = self._running.get(sid)
                if session is not None:
                    self._fail(session, msg.message)
