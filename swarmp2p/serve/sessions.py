"""The session manager: drives generation requests round a ring of stage servers.

It sends a session's prompt to stage 0, receives each sampled token id from the last stage,
decides whether the session is finished (an end-of-sequence id, ``max_tokens``, the context,
a stop rule) and otherwise sends that token back to stage 0. The decision is made on the
receiving thread, so a token goes round the ring with no other thread in its path.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from swarmp2p.net import Link, LinkClosed, LinkTimeout
from swarmp2p.serve.protocol import GREEDY, RingMessage, SamplingParams
from swarmp2p.wire import WireError

POLL_S = 0.05
"""How often the receiving thread checks its stop flag and the step deadlines."""
STEP_TIMEOUT_S = 60.0
"""A session that gets no token for this long fails with an error naming the ring."""
SEND_TIMEOUT_S = 10.0

EventHook = Callable[[str, object], None]
"""``hook(kind, value)``: ("token", id), ("done", finish_reason) or ("error", message)."""


class GenerationError(RuntimeError):
    """A request failed in the ring (a stage refused it, crashed, or went silent)."""


class RingBusy(RuntimeError):
    """Every session slot is taken; wait for one to finish."""


@dataclass(eq=False, kw_only=True)
class Session:
    """One request going round the ring. Its events arrive in ``events`` (and the hook)."""

    sid: int
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    stop: Callable[[list[int]], bool] | None
    hook: EventHook | None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """"stop" (an end-of-sequence id or a stop rule), "length", or None while running."""
    error: str | None = None
    events: queue.Queue = field(default_factory=queue.Queue)
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_activity: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)

    def _emit(self, kind: str, value: object) -> None:
        self.events.put((kind, value))
        if self.hook is not None:
            self.hook(kind, value)

    def result(self, timeout: float | None = None) -> list[int]:
        """The generated token ids once finished; GenerationError if the ring failed it."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"session {self.sid} still running after {timeout} s")
        if self.error is not None:
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
                raise GenerationError(str(value))
            else:
                return


class RingClient:
    """Generation over a ring: ``first`` is the link to stage 0, ``last`` the link the last
    stage sends its tokens on. ``start()`` runs the receiving thread; ``close()`` stops it."""

    def __init__(
        self,
        first: Link,
        last: Link,
        *,
        max_context: int,
        max_sessions: int = 16,
        step_timeout: float = STEP_TIMEOUT_S,
    ) -> None:
        self._first = first
        self._last = last
        self.max_context = max_context
        self.max_sessions = max_sessions
        self.step_timeout = step_timeout
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._sessions: dict[int, Session] = {}
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reroute: tuple[Link, queue.Queue] | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> RingClient:
        if self._thread is None:
            self._thread = threading.Thread(target=self._receive, name="ring-client", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop receiving and fail every open session."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for session in list(self._sessions.values()):
            self._fail(session, "the ring client was closed", notify=False)

    def __enter__(self) -> RingClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def active(self) -> int:
        return len(self._sessions)

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
    ) -> Session:
        """Start generating after ``prompt``. ``stop_ids`` end the session when sampled (the id
        is kept as its last token); ``stop(tokens)`` is asked after every other token, the last
        one ``max_tokens`` allows included. Greedy unless ``sampling`` says otherwise."""
        prompt = tuple(int(t) for t in prompt)
        if not prompt:
            raise ValueError("prompt: at least one token is needed")
        if len(prompt) >= self.max_context:
            raise ValueError(
                f"prompt: {len(prompt)} tokens, the context holds {self.max_context}; "
                "shorten the prompt"
            )
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"max_tokens: {max_tokens!r} is not an integer >= 1")
        if self._thread is None:
            raise RuntimeError("RingClient.start() first")
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise RingBusy(
                    f"all {self.max_sessions} session slots are taken; wait for one to finish"
                )
            session = Session(
                sid=next(self._ids),
                prompt=prompt,
                max_tokens=max_tokens,
                sampling=sampling or GREEDY,
                stop_ids=frozenset(stop_ids),
                stop=stop,
                hook=hook,
            )
            self._sessions[session.sid] = session
        message = RingMessage(
            op="prefill", sid=session.sid, pos=0, tokens=prompt, sampling=session.sampling
        )
        self._send(session, message)
        return session

    def cancel(self, session: Session, reason: str = "cancelled by the client") -> None:
        """End ``session`` now (its caches are freed); a no-op once it has finished."""
        self._fail(session, reason)

    def reroute(self, first: Link, last: Link, timeout: float = 10.0) -> tuple[Link, Link]:
        """Drive a rebuilt ring from now on (a stage was re-placed): every open session replays
        its prompt and the tokens generated so far as one ``prefill``, rebuilding every
        stage's cache, and goes on. Returns the old links for the caller to close."""
        if self._thread is None:
            raise RuntimeError("RingClient.start() first")
        reply: queue.Queue = queue.Queue(1)
        with self._send_lock:
            old_first, self._first = self._first, first
            self._reroute = (last, reply)
        try:
            return old_first, reply.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"the receiving thread did not switch links within {timeout} s"
            ) from None

    def generate(self, prompt: Iterable[int], *, timeout: float | None = None, **kw) -> list[int]:
        """``submit(...).result(timeout)``."""
        return self.submit(prompt, **kw).result(timeout)

    # -- the receiving thread ----------------------------------------------------------------------

    def _send(self, session: Session, message: RingMessage) -> None:
        try:
            with self._send_lock:
                self._first.send([message.encode()], timeout=SEND_TIMEOUT_S)
        except (LinkTimeout, LinkClosed) as e:
            self._fail(session, f"cannot reach stage 0: {e}")

    def _switch_links(self) -> None:
        """On the receiving thread: read the new ring from now on and replay every session."""
        (last, reply), self._reroute = self._reroute, None
        old_last, self._last = self._last, last
        reply.put(old_last)
        for session in list(self._sessions.values()):
            session.last_activity = time.monotonic()
            replay = RingMessage(
                op="prefill",
                sid=session.sid,
                pos=0,
                tokens=session.prompt + tuple(session.tokens),
                sampling=session.sampling,
            )
            self._send(session, replay)

    def _receive(self) -> None:
        while not self._stop.is_set():
            if self._reroute is not None:
                self._switch_links()
            try:
                parts = self._last.recv(POLL_S)
            except LinkTimeout:
                self._check_deadlines()
                continue
            except LinkClosed:
                return
            try:
                msg = RingMessage.decode(parts[0])
            except (WireError, IndexError):
                continue  # not ours to act on; the stage that sent it logged why
            session = self._sessions.get(msg.sid)
            if session is None:
                continue  # a late reply of a session that already failed or ended
            if msg.op == "error":
                self._fail(session, msg.message)
            elif msg.op == "token":
                self._on_token(session, msg)
            self._check_deadlines()

    def _on_token(self, session: Session, msg: RingMessage) -> None:
        if session.done.is_set():
            return  # cancelled while this token was on its way
        now = time.monotonic()
        session.last_activity = now
        if session.first_token_at is None:
            session.first_token_at = now
        session.tokens.append(msg.token)
        session._emit("token", msg.token)
        held = len(session.prompt) + len(session.tokens)
        if msg.token in session.stop_ids or (
            session.stop is not None and session.stop(session.tokens)
        ):
            self._finish(session, "stop")
        elif len(session.tokens) >= session.max_tokens or held >= self.max_context:
            self._finish(session, "length")
        else:
            step = RingMessage(op="decode", sid=session.sid, pos=held - 1, tokens=(msg.token,))
            self._send(session, step)

    def _finish(self, session: Session, reason: str) -> None:
        session.finish_reason = reason
        self._release(session)
        session._emit("done", reason)

    def _fail(self, session: Session, message: str, *, notify: bool = True) -> None:
        if session.done.is_set():
            return
        session.error = message
        self._release(session, notify=notify)
        session._emit("error", message)

    def _release(self, session: Session, *, notify: bool = True) -> None:
        with self._lock:
            self._sessions.pop(session.sid, None)
        session.done.set()
        if notify:  # free every stage's cache; best effort, a dead stage frees nothing
            try:
                with self._send_lock:
                    self._first.send([RingMessage(op="end", sid=session.sid).encode()], 1.0)
            except (LinkTimeout, LinkClosed):
                pass

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for session in list(self._sessions.values()):
            if now - session.last_activity > self.step_timeout:
                self._fail(
                    session,
                    f"no token from the ring within {self.step_timeout:g} s; "
                    "a stage is down or overloaded",
                )
