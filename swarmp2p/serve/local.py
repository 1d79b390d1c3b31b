"""A serving ring of stage worker processes on this machine, wired by CURVE ZmqLinks.

The daemon places stages on many nodes; this is the one-machine case it builds on (tests,
benchmarks, ``swarm serve`` on a single node): spawn one ``swarmp2p.runtime.serve_worker`` per
stage, read each one's ``ready`` endpoint, tell each where the next one listens, and drive the
ring with a :class:`~swarmp2p.serve.RingClient`.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

from swarmp2p.net import SecureContext, SwarmSecret, ZmqLink, stop_zero_copy_collector
from swarmp2p.serve.sessions import RingClient
from swarmp2p.serve.spec import StageServeSpec

READY_TIMEOUT_S = 300.0
"""How long a worker may take to load its stage and bind its link."""
STOP_TIMEOUT_S = 10.0
"""How long a worker gets to exit after its stdin closes, before it is killed."""
STDERR_TAIL_LINES = 40


class WorkerFailed(RuntimeError):
    """A stage worker exited or reported an error."""


def even_bounds(num_blocks: int, stages: int) -> list[tuple[int, int]]:
    """``stages`` contiguous block ranges as equal as integers allow (earlier ones larger)."""
    if not 1 <= stages <= num_blocks:
        raise ValueError(f"stages: {stages} is not in [1, {num_blocks}] (the model's blocks)")
    base, extra = divmod(num_blocks, stages)
    bounds, start = [], 0
    for i in range(stages):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class StageWorker:
    """One worker process: its stdout events in a queue, a bounded tail of its stderr."""

    def __init__(self, spec: StageServeSpec, *, env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swarmp2p.runtime.serve_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.events: queue.Queue = queue.Queue()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        # both pipes drain for the life of the process, so neither can fill and block it
        self._readers = [
            threading.Thread(target=self._read_stdout, name=f"stage{spec.stage_index}-out"),
            threading.Thread(target=self._read_stderr, name=f"stage{spec.stage_index}-err"),
        ]
        for reader in self._readers:
            reader.daemon = True
            reader.start()
        self.send_line(spec.to_dict())

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                self.stderr_tail.append(f"(stdout) {line.rstrip()}")
        self.events.put({"event": "exit"})

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_tail.append(line.rstrip())

    def send_line(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def describe_exit(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def wait_event(self, name: str, timeout: float) -> dict:
        """The next event, which must be ``name``; WorkerFailed naming why otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise WorkerFailed(
                    f"stage {self.spec.stage_index} sent no {name!r} within {timeout:g} s"
                ) from None
            if event.get("event") == name:
                return event
            if event.get("event") in ("error", "exit"):
                self.proc.wait(STOP_TIMEOUT_S)
                tail = "\n".join(list(self.stderr_tail)[-10:])
                raise WorkerFailed(
                    f"stage {self.spec.stage_index} ({self.spec.model} blocks "
                    f"[{self.spec.layer_start}, {self.spec.layer_end})) "
                    f"{self.describe_exit()}: {event.get('message', 'no message')}\n{tail}"
                )

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Close stdin (the worker's stop), wait, kill on timeout; join the readers."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for reader in self._readers:
            reader.join()
        self.proc.stdout.close()
        self.proc.stderr.close()


class LocalRing:
    """Stage workers on this machine plus the session manager driving them (``.client``)."""

    def __init__(
        self,
        model: str,
        *,
        bounds: Sequence[tuple[int, int]],
        compression: Sequence[str] = (),
        codes: bool | Sequence[bool] = False,
        threads: int | Sequence[int] = 0,
        dtype: str = "float32",
        max_sessions: int = 16,
        max_context: int = 2048,
        host: str = "127.0.0.1",
        step_timeout: float = 60.0,
        ready_timeout: float = READY_TIMEOUT_S,
        env: dict[str, str] | None = None,
        groups: int | None = None,
    ) -> None:
        n = len(bounds)
        if n < 1:
            raise ValueError("bounds: at least one stage")
        compression = list(compression) or ["none"] * (n - 1)
        if len(compression) != n - 1:
            raise ValueError(f"compression: {len(compression)} spec(s) for {n - 1} boundaries")
        codes = [codes] * (n - 1) if isinstance(codes, bool) else list(codes)
        threads = [threads] * n if isinstance(threads, int) else list(threads)
        self.model = model
        self.bounds = [tuple(b) for b in bounds]
        self.max_context = max_context
        secret = SwarmSecret.generate()
        self._ctx = SecureContext()
        self.workers: list[StageWorker] = []
        self._links: list[ZmqLink] = []
        self.client: RingClient | None = None
        base = StageServeSpec(
            model=model,
            stage_index=0,
            layer_start=0,
            layer_end=1,
            is_first_stage=True,
            is_last_stage=False,
            token=secret.token,
            host=host,
            dtype=dtype,
            max_sessions=max_sessions,
            max_context=max_context,
        )
        worker_env = dict(os.environ if env is None else env)
        worker_env.setdefault("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
        try:
            back = ZmqLink.bind(self._ctx, secret, host)
            self._links.append(back)
            for i, (start, end) in enumerate(self.bounds):
                spec = replace(
                    base,
                    stage_index=i,
                    layer_start=start,
                    layer_end=end,
                    is_first_stage=i == 0,
                    is_last_stage=i == n - 1,
                    send_compression=compression[i] if i < n - 1 else "none",
                    send_codes=codes[i] if i < n - 1 else False,
                    threads=threads[i],
                )
                self.workers.append(StageWorker(spec, env=worker_env))
            ready = [w.wait_event("ready", ready_timeout) for w in self.workers]
            self.load_s = [e["load_s"] for e in ready]
            for i, worker in enumerate(self.workers):
                after = ready[i + 1]["endpoint"] if i + 1 < n else back.endpoint
                worker.send_line({"op": "connect", "next": after})
            for worker in self.workers:
                worker.wait_event("serving", ready_timeout)
            first = ZmqLink.dial(self._ctx, secret, ready[0]["endpoint"])
            self._links.append(first)
            # groups of sessions in the ring at once: one per stage keeps every stage busy,
            # but stages on one machine cannot compute on more cores than it has
            if groups is None:
                groups = max(1, min(n, os.cpu_count() or 1))
            self.client = RingClient(
                first,
                back,
                max_context=max_context,
                max_sessions=max_sessions,
                step_timeout=step_timeout,
                groups=groups,
            ).start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the manager, then every worker, then the links; idempotent."""
        if self.client is not None:
            self.client.close()
            self.client = None
        for worker in self.workers:
            worker.stop()
        self.workers = []
        for link in self._links:
            link.close()
        self._links = []
        stop_zero_copy_collector()
        self._ctx.destroy(0)

    def __enter__(self) -> LocalRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_local(
    model: str,
    *,
    stages: int = 1,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    max_context: int | None = None,
    max_sessions: int = 8,
    threads: int = 0,
    name: str | None = None,
    ready: threading.Event | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Serve ``model`` on this machine alone: ``stages`` worker processes behind the HTTP API,
    until ``stop`` is set (or Ctrl-C). The swarm daemon does the same across nodes."""
    from swarmp2p.plan import model_shape
    from swarmp2p.runtime.models import resolve_model_ref
    from swarmp2p.serve.api import ApiServer, ServedModel, build_app, check_bind
    from swarmp2p.serve.text import TextCodec

    check_bind(host, api_key)
    folder = resolve_model_ref(model)
    shape = model_shape.load(folder)
    context = min(max_context or shape.max_positions, shape.max_positions)
    codec = TextCodec.from_folder(folder)
    with LocalRing(
        folder,
        bounds=even_bounds(shape.n_layers, stages),
        threads=threads,
        max_context=context,
        max_sessions=max_sessions,
    ) as ring:
        served = ServedModel(
            name=name or model, client=ring.client, codec=codec, max_context=context
        )
        with ApiServer(build_app([served], api_key=api_key), host, port) as server:
            print(f"serving {served.name} on {server.url}/v1 ({stages} stage(s))", flush=True)
            if ready is not None:
                ready.set()
            try:
                (stop or threading.Event()).wait()
            except KeyboardInterrupt:
                pass
