"""Stage worker subprocesses, training and serving alike: start one, drain stdout (JSON-lines
events) and stderr at once, keep a bounded stderr tail, and report how it ended (the signal it
died of, if any). The one wrapper: the daemon runs its workers with it, and
``serve.local.LocalRing`` runs its own on a private event loop.

A worker dies with its parent: on Linux it is started with ``PR_SET_PDEATHSIG`` = SIGKILL, so
a SIGKILLed daemon never leaves a stage running on a job the swarm has re-planned.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any

from swarmp2p.timings import TIMINGS

STDERR_TAIL_LINES = 40
"""The last lines of a worker's stderr kept for its error message."""


def exit_message(code: int | None) -> str:
    """What a worker's exit code says (a negative code is the signal it died of)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exited with code {code}"


log = logging.getLogger("swarmp2p.workers")

WORKER_MODULE = "swarmp2p.runtime.worker"
_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGKILL) -> None:  # pragma: no cover - in the child
    """Have the kernel send ``signum`` to this process when its parent (thread) ends: run in
    the child between fork and exec (``preexec_fn``). Linux only; elsewhere a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):
        pass


def preexec(signum: int = signal.SIGKILL) -> Callable[[], None] | None:
    """The ``preexec_fn`` that makes a child die with its parent, None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    return functools.partial(die_with_parent, signum)


class WorkerProcess:
    """One stage worker. ``on_event(event)`` gets each stdout event; ``on_exit(code, tail)``
    the exit code (negative: killed by that signal) and the last stderr lines."""

    def __init__(
        self,
        *,
        job_id: str,
        attempt: int,
        stage: int,
        spec: Mapping[str, Any],
        env: Mapping[str, str] | None = None,
        on_event: Callable[[dict[str, Any]], None],
        on_exit: Callable[[int, list[str]], None],
        log_path: str | None = None,
        module: str = WORKER_MODULE,
        keep_stdin: bool = False,
    ) -> None:
        self.job_id, self.attempt, self.stage = job_id, attempt, stage
        self._module, self._keep_stdin = module, keep_stdin
        self._events: dict[str, asyncio.Future] = {}
        self.last_error: str | None = None
        """The message of the worker's last ``error`` event."""
        self._spec = dict(spec)
        self._env = dict(env or {})
        self._on_event, self._on_exit = on_event, on_exit
        self._log_path = log_path
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.proc: asyncio.subprocess.Process | None = None
        self.ready: asyncio.Future[dict[str, Any]] | None = None
        self.returncode: int | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.job_id, self.attempt, self.stage)

    async def start(self) -> None:
        env = {**os.environ, **self._env}
        self.ready = asyncio.get_running_loop().create_future()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            self._module,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            preexec_fn=preexec(),
            limit=1 << 22,
        )
        if self._keep_stdin:  # a serve worker reads its spec, then ops, one JSON line each
            await self.send_line(self._spec)
        else:
            self.proc.stdin.write(json.dumps(self._spec).encode())
            await self.proc.stdin.drain()
            self.proc.stdin.close()
        self._tasks = [
            asyncio.ensure_future(self._read_stdout()),
            asyncio.ensure_future(self._read_stderr()),
        ]
        self._tasks.append(asyncio.ensure_future(self._wait()))

    async def send_line(self, obj: Mapping[str, Any]) -> None:
        """One JSON line on the worker's stdin (a serve worker's ``connect`` op)."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        await self.proc.stdin.drain()

    async def wait_ready(self, timeout: float = TIMINGS.worker_ready_s) -> dict[str, Any]:
        """The ``ready`` event (with the bound port); RuntimeError if the worker ends first."""
        assert self.ready is not None
        return await asyncio.wait_for(asyncio.shield(self.ready), timeout)

    async def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        """The first ``name`` event; RuntimeError naming why when the worker ends first or
        sends none within ``timeout``."""
        future = self._event_future(name)
        waiter = asyncio.ensure_future(asyncio.shield(future))
        ended = self._tasks[2] if len(self._tasks) > 2 else None
        await asyncio.wait(
            [waiter, *([ended] if ended else [])],
            timeout=timeout,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if future.done():
            return future.result()
        waiter.cancel()
        tail = f": {self.last_error or (self.stderr_tail[-1] if self.stderr_tail else '')}"
        if ended is not None and ended.done():
            raise RuntimeError(
                f"stage {self.stage} worker {exit_message(self.returncode)} before {name!r}{tail}"
            )
        raise RuntimeError(f"stage {self.stage} worker sent no {name!r} within {timeout:g} s{tail}")

    def _event_future(self, name: str) -> asyncio.Future:
        future = self._events.get(name)
        if future is None:
            future = self._events[name] = asyncio.get_running_loop().create_future()
        return future

    async def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            if not line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                self.stderr_tail.append(f"(stdout) {line}")
                continue
            if not isinstance(event, dict):
                continue
            kind = event.get("event")
            if kind == "ready" and self.ready and not self.ready.done():
                self.ready.set_result(event)
            if kind == "error":
                self.last_error = str(event.get("message"))
            if isinstance(kind, str):
                future = self._event_future(kind)
                if not future.done():
                    future.set_result(event)
            try:
                self._on_event(event)
            except Exception:
                log.exception("worker event handler failed")

    async def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        out = open(self._log_path, "a") if self._log_path else None  # noqa: SIM115
        try:
            async for raw in self.proc.stderr:
                line = raw.decode(errors="replace").rstrip("\n")
                self.stderr_tail.append(line)
                if out is not None:
                    out.write(line + "\n")
                    out.flush()
        finally:
            if out is not None:
                out.close()

    async def _wait(self) -> None:
        assert self.proc is not None
        code = await self.proc.wait()
        # let the readers hand over what the worker wrote last
        await asyncio.gather(*self._tasks[:2], return_exceptions=True)
        self.returncode = code
        if self.ready is not None and not self.ready.done():
            self.ready.set_exception(
                RuntimeError(
                    f"stage {self.stage} worker {exit_message(code)} before it was ready"
                    + (f": {self.stderr_tail[-1]}" if self.stderr_tail else "")
                )
            )
        if self._stopping:
            return
        try:
            self._on_exit(code, list(self.stderr_tail))
        except Exception:
            log.exception("worker exit handler failed")

    async def stop(self) -> None:
        """End of input for a worker that reads its stdin (a serve worker stops cleanly on
        it), else SIGTERM; SIGKILL after a grace period. No exit report is made."""
        self._stopping = True
        proc = self.proc
        if proc is not None and proc.returncode is None:
            if self._keep_stdin and proc.stdin is not None and not proc.stdin.is_closing():
                proc.stdin.close()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(proc.wait(), TIMINGS.worker_stop_grace_s)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), TIMINGS.worker_stop_grace_s)
                except asyncio.TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 2.0)
        if self.ready is not None and not self.ready.done():
            self.ready.cancel()
        elif self.ready is not None and not self.ready.cancelled():
            self.ready.exception()  # seen: waiters of wait_event never asked for it
        for future in self._events.values():
            if not future.done():
                future.cancel()
