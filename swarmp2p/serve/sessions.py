"""The session manager: drives generation requests round a ring of stage servers.

What to send and what each session sees is decided by a pure
:class:`~swarmp2p.serve.scheduler.Scheduler` (admission, groups, deadlines, finish rules,
failover replays: see there); this module only carries its outcomes out, with two threads that
own the sockets. The *receiver* reads what the last stage sends, hands it to the scheduler and,
every ``Timings.ring_poll_s``, asks it about the deadlines; the *sender* writes the messages the scheduler
returns to stage 0, in order. Both act under one lock, held while the scheduler decides and the
sessions get their events, never across a socket call. Callers — an asyncio event loop included
— never touch a socket: ``submit`` queues and returns at once, and a session's events can be
awaited on a loop (``submit(..., loop=...)`` / ``submit_async``).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable

from swarmp2p.net import Link, LinkClosed, LinkTimeout
from swarmp2p.serve.protocol import GREEDY, MAX_SID, SamplingParams, decode_message
from swarmp2p.serve.scheduler import (
    QUEUE_PER_SLOT,
    TOKEN,
    Outcome,
    Scheduler,
    check_request,
)
from swarmp2p.serve.session import EventHook, GenerationError, RingBusy, Session
from swarmp2p.timings import TIMINGS
from swarmp2p.wire import WireError

__all__ = ["QUEUE_PER_SLOT", "RingClient"]


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
        step_timeout: float = TIMINGS.serve_step_s,
        max_queue: int | None = None,
        queue_timeout: float = TIMINGS.ring_queue_s,
        groups: int | None = None,
        min_group_rows: int = 1,
        speculate: str = "none",
        draft_model: bool = False,
        draft_cost: float | None = None,
        prefix_blocks: int = 0,
        prefix_salt: bytes = b"",
    ) -> None:
        self._scheduler = Scheduler(
            max_context=max_context,
            max_sessions=max_sessions,
            step_timeout=step_timeout,
            queue_timeout=queue_timeout,
            max_queue=max_queue,
            groups=groups,
            min_group_rows=min_group_rows,
            speculate=speculate,
            draft_model=draft_model,
            draft_cost=draft_cost,
            prefix_blocks=prefix_blocks,
            prefix_salt=prefix_salt,
        )
        self._first = first
        self._last = last
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._reroute: tuple[Link, queue.Queue] | None = None

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
            self._scheduler.close()
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
        return self._scheduler.active

    @property
    def closed(self) -> bool:
        """``close()`` was called: no new sessions."""
        return self._scheduler.closed

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a session slot."""
        return self._scheduler.queue_depth

    @property
    def stages(self) -> int:
        """Stages of the ring, once a decode step has gone round it (0 before)."""
        return self._scheduler.stages

    @property
    def stage_batch_sizes(self) -> tuple[int, ...]:
        """Rows of the latest decode step at each stage, stage 0 first."""
        return self._scheduler.stage_batch_sizes

    @property
    def group_sizes(self) -> tuple[int, ...]:
        """Sessions in each group (a group is one batched step in the ring)."""
        with self._lock:
            return self._scheduler.group_sizes

    @property
    def speculate(self) -> str:
        """The ring's speculative decoding: "auto", "ngram", "draft" or "none"."""
        return self._scheduler.speculate

    @property
    def draft_model(self) -> bool:
        """Whether sessions draft with stage 0's draft model (else by prompt lookup)."""
        return self._scheduler.model_drafts

    @property
    def spec_off(self) -> str:
        """Why the ring stopped speculating though asked to (empty: it did not)."""
        return self._scheduler.spec_off

    def spec_stats(self) -> dict[str, float | int]:
        """Speculative decoding so far: laps, tokens, drafted, accepted, acceptance rate,
        mean tokens per lap."""
        with self._lock:
            return self._scheduler.spec.to_dict()

    @property
    def prefix_stats(self) -> dict[str, int | float] | None:
        """The prefix cache's blocks, lookups, hits, hit rate and reused tokens (None: off)."""
        with self._lock:
            index = self._scheduler.prefix
            return None if index is None else index.stats()

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the mean session time, scaled by the queue."""
        return self._scheduler.retry_after()

    @property
    def _sessions(self) -> dict[int, Session]:
        """Every open session by sid (``node/serving`` reads it to fail them all)."""
        return self._scheduler.sessions  # type: ignore[return-value]

    # the scheduler's limits, read and set through the client (tests shrink them)
    max_context = property(
        lambda self: self._scheduler.max_context,
        lambda self, v: setattr(self._scheduler, "max_context", v),
    )
    max_sessions = property(lambda self: self._scheduler.max_sessions)
    max_queue = property(lambda self: self._scheduler.max_queue)
    min_group_rows = property(lambda self: self._scheduler.min_group_rows)
    step_timeout = property(
        lambda self: self._scheduler.step_timeout,
        lambda self, v: setattr(self._scheduler, "step_timeout", v),
    )
    queue_timeout = property(
        lambda self: self._scheduler.queue_timeout,
        lambda self, v: setattr(self._scheduler, "queue_timeout", v),
    )

    # -- requests --------------------------------------------------------------------------------

    def submit(
        self,
        prompt: Iterable[int],
        *,
        max_tokens: int,
        sampling: SamplingParams | None = None,
        stop_ids: Iterable[int] = (),
        stop: Callable[[list[int]], bool] | None = None,
        grammar: str | None = None,
        hook: EventHook | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        speculate: bool = True,
    ) -> Session:
        """Start generating after ``prompt``; returns at once (the session may wait for a
        slot). ``stop_ids`` end the session when sampled (the id is kept as its last token);
        ``stop(tokens)`` is asked after every other token, the last one ``max_tokens`` allows
        included. Greedy unless ``sampling`` says otherwise; ``grammar`` (a structured output's,
        ``serve.decoding.grammar``) constrains every token at the last stage. With ``loop``, the
        events can be awaited there (``aevents``). ``speculate`` False: this session never
        drafts. RingBusy when the queue is full too."""
        prompt = check_request(prompt, max_tokens, self._scheduler.max_context)
        if not self._threads:
            raise RuntimeError("RingClient.start() first")
        session = Session(
            sid=next(self._ids) % MAX_SID,
            prompt=prompt,
            max_tokens=max_tokens,
            sampling=sampling or GREEDY,
            stop_ids=frozenset(stop_ids),
            stop=stop,
            grammar=grammar,
            hook=hook,
            speculate=speculate,
        )
        if loop is not None:
            session.on_loop(loop)
        with self._lock:
            if self._scheduler.closed:
                raise GenerationError("the ring client was closed")
            now = time.monotonic()
            outcome = self._scheduler.submit(session, now)
            if outcome.refused is not None:
                raise RingBusy(outcome.refused, self._scheduler.retry_after())
            self._carry_out(outcome, now)
        return session

    async def submit_async(self, prompt: Iterable[int], **kw) -> Session:
        """``submit`` with the running loop, so that ``aevents()`` works there."""
        return self.submit(prompt, loop=asyncio.get_running_loop(), **kw)

    def cancel(self, session: Session, reason: str = "cancelled by the client") -> None:
        """End ``session`` now (its caches are freed); a no-op once it has finished."""
        with self._lock:
            now = time.monotonic()
            self._carry_out(self._scheduler.cancel(session, reason, now), now)

    def fail_all(self, reason: str, *, notify: bool = True) -> None:
        """Fail every open session (queued or running) with ``reason``."""
        with self._lock:
            now = time.monotonic()
            self._carry_out(self._scheduler.fail_all(reason, now, notify=notify), now)

    def reroute(
        self, first: Link, last: Link, timeout: float = 2 * TIMINGS.ring_send_s
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

    # -- carrying out what the scheduler decided (under the lock) ---------------------------------

    def _carry_out(self, outcome: Outcome, now: float) -> None:
        """Hand the outcome's messages to the sender, then deliver its events: the next step
        leaves before the consumers' hooks and loops hear of this one's tokens."""
        put = self._outbox.put
        for message, sessions in outcome.sends:
            put(("send", message, sessions))
        for session, kind, value in outcome.events:
            if session.done.is_set():
                continue  # its last event went out already (its hook broke, failing it)
            if kind != TOKEN:
                session.done.set()
            try:
                session.emit(kind, value)
            except Exception as e:  # a consumer's hook broke: its session fails, the ring goes on
                session.hook = None
                failed = self._scheduler.cancel(session, f"{type(e).__name__}: {e}", now)
                self._carry_out(failed, now)

    # -- the threads -------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        """The only writer of the link to stage 0."""
        while not self._stop.is_set():
            try:
                item = self._outbox.get(timeout=TIMINGS.ring_poll_s)
            except queue.Empty:
                continue
            if item[0] == "swap":
                _, link, reply = item
                old, self._first = self._first, link
                reply.put(old)
                continue
            _, message, sessions = item
            if sessions and all(s.state == "done" for s in sessions):
                continue  # every session of it ended while it waited
            try:
                self._first.send([message.encode()], timeout=TIMINGS.ring_send_s)
            except (LinkTimeout, LinkClosed) as e:
                with self._lock:
                    now = time.monotonic()
                    outcome = self._scheduler.fail(sessions, f"cannot reach stage 0: {e}", now)
                    self._carry_out(outcome, now)

    def _switch_links(self) -> None:
        """On the receiver: read the new ring from now on and replay every running session."""
        (last, reply), self._reroute = self._reroute, None
        old_last, self._last = self._last, last
        reply.put(old_last)
        now = time.monotonic()
        self._carry_out(self._scheduler.reroute(now), now)

    def _receive(self) -> None:
        """The only reader of the link from the last stage."""
        next_check = time.monotonic() + TIMINGS.ring_poll_s
        while not self._stop.is_set():
            if self._reroute is not None:
                with self._lock:
                    self._switch_links()
            try:
                parts = self._last.recv(TIMINGS.ring_poll_s)
            except LinkTimeout:
                parts = None
            except LinkClosed:
                return
            msg = None
            if parts is not None:
                try:
                    msg = decode_message(parts[0])
                except (WireError, IndexError):
                    pass  # not ours to act on; the stage that sent it logged why
            now = time.monotonic()
            with self._lock:
                if msg is not None:
                    self._carry_out(self._scheduler.on_message(msg, now), now)
                if now >= next_check:
                    self._carry_out(self._scheduler.tick(now), now)
                    next_check = now + TIMINGS.ring_poll_s
