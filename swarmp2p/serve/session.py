"""One generation request's session: what the scheduler knows of it (:class:`SessionState`:
its prompt, limits and stop rules, the tokens and log-probabilities it has so far, where it is
in the ring, how it drafts), and its events, read from a thread (``result``, ``stream``) or
awaited on an asyncio loop (``aevents``); and the two ways a request fails (GenerationError,
RingBusy). :class:`~swarmp2p.serve.sessions.RingClient` makes sessions and delivers their events;
:class:`~swarmp2p.serve.scheduler.Scheduler` decides them.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from swarmp2p.serve.decoding.speculate import DraftLength, NgramIndex
from swarmp2p.serve.protocol import SamplingParams, TokenLogprobs

EventHook = Callable[[str, object], None]
"""``hook(kind, value)``: ("token", id), ("done", finish_reason) or ("error", message)."""


class GenerationError(RuntimeError):
    """A request failed in the ring (a stage refused it, crashed, or went silent)."""


class RingBusy(RuntimeError):
    """Every session slot is taken and the queue is full (or the wait ran out)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        """Seconds after which a retry may find a free slot (the HTTP ``Retry-After``)."""


@dataclass(eq=False, kw_only=True)
class SessionState:
    """What the scheduler knows of one request: its prompt, limits and stop rules, the tokens
    (and log-probabilities) it has so far, where it is in the ring and when it last moved."""

    sid: int
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int] = frozenset()
    stop: Callable[[list[int]], bool] | None = None
    grammar: str | None = None
    """A structured output's grammar text: it rides the session's prefill (and a replay's) to
    the last stage, which masks every token the session samples with it."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """Per generated token, when the sampling asked for log-probabilities."""
    finish_reason: str | None = None
    """"stop" (an end-of-sequence id or a stop rule), "length", or None while running."""
    error: str | None = None
    busy: bool = False
    """It failed waiting for a session slot (the ring is full), not in the ring."""
    retry_after: int = 1
    state: str = "queued"
    """"queued", "prefill" (its prompt is in the ring), "decode" (in a group), "done"."""
    group: int | None = None
    started: float = 0.0
    """When it was submitted (the scheduler's clock, as every time here)."""
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_activity: float = 0.0
    speculate: bool = True
    """Whether this session may draft when the ring speculates (off: the caller said so). A
    grammar session drafts too: its last stage masks each verified row with the grammar's state
    after the drafts before it, so a draft the grammar forbids is never kept."""
    drafter: NgramIndex | None = None
    """Its prompt lookup over prompt + tokens, while it drafts."""
    draft_len: DraftLength | None = None
    """How many tokens it drafts a lap (adaptive under "auto"; None: MAX_DRAFT)."""
    draft: tuple[int, ...] = ()
    """The draft of its step in the ring."""
    model_drafts: bool = False
    """Stage 0's draft model drafts for it (``draft_len`` says how many a lap)."""
    ask: int = 0
    """The tokens its step in the ring asked stage 0's draft model for."""
    forced: tuple[int, ...] = ()
    """The ids its grammar forces after its last token (the last stage's ``Tokens.forced``):
    its next draft, ahead of any other drafter's, where it may draft."""
    draft_forced: bool = False
    """Its step's draft is ``forced`` (kept out of the adaptive length's record: it says
    nothing of how well its drafter guesses)."""

    @property
    def expect(self) -> int:
        """The position of the next token (tokens before it)."""
        return len(self.prompt) + len(self.tokens)


@dataclass(eq=False, kw_only=True)
class Session(SessionState):
    """One request going round the ring: what the scheduler knows of it (its
    :class:`SessionState`) and how its events reach the caller. They
    arrive in ``events`` (and the hook, and ``aevents()`` when submitted with a loop)."""

    hook: EventHook | None = None
    events: queue.Queue = field(default_factory=queue.Queue)
    done: threading.Event = field(default_factory=threading.Event)
    """Set with its last event ("done" or "error")."""
    _loop: asyncio.AbstractEventLoop | None = None
    _aqueue: asyncio.Queue | None = None

    def on_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Also deliver the events on ``loop`` (for ``aevents``); call before the first event."""
        self._loop, self._aqueue = loop, asyncio.Queue()

    def emit(self, kind: str, value: object) -> None:
        """Deliver one event (the ring client driving the session calls it)."""
        self.events.put((kind, value))
        if self._aqueue is not None:
            try:
                self._loop.call_soon_threadsafe(self._aqueue.put_nowait, (kind, value))
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass
        if self.hook is not None:
            self.hook(kind, value)

    def result(self, timeout: float | None = None) -> list[int]:
        """The generated token ids once finished; GenerationError if the ring failed it."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"session {self.sid} still running after {timeout} s")
        if self.error is not None:
            if self.busy:
                raise RingBusy(self.error, self.retry_after)
            raise GenerationError(self.error)
        return list(self.tokens)

    def stream(self, timeout: float | None = None) -> Iterator[int]:
        """Each token id as it arrives; raises GenerationError if the ring fails the request."""
        while True:
            try:
                kind, value = self.events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"session {self.sid}: no event within {timeout} s") from None
            if kind == "token":
                yield value  # type: ignore[misc]
            elif kind == "error":
                if self.busy:
                    raise RingBusy(str(value), self.retry_after)
                raise GenerationError(str(value))
            else:
                return

    async def aevents(self, timeout: float | None = None) -> AsyncIterator[tuple[str, object]]:
        """Every ``(kind, value)`` event on the loop it was submitted with, the last one
        ("done" or "error") included; TimeoutError when none comes within ``timeout`` s."""
        if self._aqueue is None:
            raise RuntimeError("submit with loop= (or submit_async) to read events on a loop")
        while True:
            kind, value = await asyncio.wait_for(self._aqueue.get(), timeout)
            yield kind, value
            if kind in ("done", "error"):
                return
