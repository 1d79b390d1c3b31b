"""A serving ring of stage worker processes on this machine, wired by CURVE ZmqLinks.

The daemon places stages on many nodes; this is the one-machine case (tests, benchmarks,
``swarm serve`` on a single node without a swarm): the ring is planned by ``plan_serve`` over
one local device per stage, built by :func:`~swarmp2p.serve.ring.build_ring` (as the daemon
builds its rings) from ``workers.WorkerProcess`` workers (the daemon's wrapper) run on a
private event-loop thread, and driven by a :class:`~swarmp2p.serve.RingClient`. The API stays
synchronous.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

from swarmp2p.net import SecureContext, SwarmSecret, ZmqLink, stop_zero_copy_collector
from swarmp2p.plan.serve import ServePlan, plan_serve
from swarmp2p.plan.split import layer_range
from swarmp2p.serve.ring import build_ring
from swarmp2p.serve.sessions import RingClient
from swarmp2p.serve.spec import serve_spec
from swarmp2p.timings import TIMINGS

SERVE_WORKER_MODULE = "swarmp2p.runtime.serve_worker"


class WorkerFailed(RuntimeError):
    """A stage worker exited or reported an error."""


def even_bounds(num_blocks: int, stages: int) -> list[tuple[int, int]]:
    """``stages`` contiguous block ranges as equal as integers allow (``plan.split``'s even
    split, the one ``plan_serve`` and training use)."""
    return [layer_range(i, stages, num_blocks) for i in range(stages)]


def local_serve_plan(
    model: str,
    *,
    bounds: Sequence[tuple[int, int]] | None = None,
    stages: int = 1,
    compression: Sequence[str] = (),
    codes: bool | Sequence[bool] | None = False,
    dtype: str | None = "float32",
    max_sessions: int = 16,
    max_context: int = 2048,
    prefix_cache_mb: int = 0,
    draft: str | None = None,
) -> ServePlan:
    """The serve plan of ``model`` over one local device per stage with room for anything:
    the given ``bounds`` (else ``stages`` cut as plan_serve cuts them), with a prefix cache of
    ``prefix_cache_mb`` per stage (0: none), in ``dtype`` (a half
    dtype plans on fake GPUs of unknown capability, as a CPU does not run float16), with
    the draft model ``draft`` (a folder) priced on stage 0. ValueError when it cannot be
    planned."""
    from swarmp2p.plan import model_shape
    from swarmp2p.plan.worker_spec import local_cluster

    shape = model_shape.load(model)
    n = len(bounds) if bounds is not None else stages
    kind = "cpu" if dtype in (None, "float32") else "cuda"
    result = plan_serve(
        shape,
        local_cluster(n, kind=kind),
        stages=n,
        dtype=dtype,
        max_sessions=max_sessions,
        max_context=max_context,
        bounds=bounds,
        compression=compression,
        codes=codes,
        prefix_cache_mb=prefix_cache_mb,
        draft=None if draft is None else model_shape.load(draft),
    )
    if not isinstance(result, ServePlan):
        raise ValueError(f"cannot plan {model} on {n} local stage(s): {result.reason}")
    return result


class LocalRing:
    """Stage workers on this machine plus the session manager driving them (``.client``).

    ``plan`` (a ServePlan) or ``bounds`` (block ranges; planned with ``local_serve_plan``)
    says what each stage serves. ``shards`` (per stage, an exported shard folder or None) and
    ``tied_head`` (the last stage's tied head file) serve a trained model on ``model``, its base.
    ``draft``: a draft model folder stage 0 drafts with (the same tokenizer, checked first).
    """

    def __init__(
        self,
        model: str,
        *,
        bounds: Sequence[tuple[int, int]] | None = None,
        plan: ServePlan | None = None,
        compression: Sequence[str] = (),
        codes: bool | Sequence[bool] = False,
        threads: int | Sequence[int] = 0,
        dtype: str = "float32",
        max_sessions: int = 16,
        max_context: int = 2048,
        host: str = "127.0.0.1",
        step_timeout: float = 60.0,
        ready_timeout: float = TIMINGS.local_stage_ready_s,
        env: dict[str, str] | None = None,
        shards: Sequence[str | None] = (),
        tied_head: str | None = None,
        groups: int | None = None,
        speculate: str = "auto",
        draft: str | None = None,
    ) -> None:
        if draft is not None:  # refused before any worker starts
            from swarmp2p.models import resolve_model_ref
            from swarmp2p.serve.decoding.draft import check_draft_compatible

            check_draft_compatible(resolve_model_ref(model), resolve_model_ref(draft))
        if plan is None:
            if not bounds:
                raise ValueError("bounds: at least one stage (or give a plan)")
            plan = local_serve_plan(
                model,
                bounds=[tuple(b) for b in bounds],
                compression=compression,
                codes=codes,
                dtype=dtype,
                max_sessions=max_sessions,
                max_context=max_context,
                draft=draft,
            )
        n = len(plan.stages)
        threads = [threads] * n if isinstance(threads, int) else list(threads)
        self.model, self.plan = model, plan
        self.bounds = plan.bounds
        self.max_context = plan.max_context
        self.workers: list[Any] = []
        """``workers.WorkerProcess`` per stage, first to last."""
        self.client: RingClient | None = None
        self.load_s: list[float] = []
        self._links: list[ZmqLink] = []
        secret = SwarmSecret.generate()
        shards = list(shards) or [None] * n
        specs = [
            serve_spec(
                plan,
                i,
                model=model,
                token=secret.token,
                host=host,
                threads=threads[i],
                shard=shards[i],
                tied_head=tied_head if i == n - 1 else None,
                draft=draft if i == 0 else None,
            )
            for i in range(n)
        ]
        worker_env = dict(os.environ if env is None else env)
        worker_env.setdefault("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
        self._ctx = SecureContext()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="local-ring", daemon=True
        )
        self._thread.start()
        try:
            ends = self._run(
                self._build(specs, secret, host, worker_env, ready_timeout),
                timeout=ready_timeout + TIMINGS.local_stage_connect_s + 30,
            )
            self._links = [ends.back, ends.first]
            # groups of sessions in the ring at once: one per stage keeps every stage busy,
            # but stages on one machine cannot compute on more cores than it has
            if groups is None:
                groups = max(1, min(n, os.cpu_count() or 1))
            # CPU stages on this machine share its cores and memory bandwidth
            cpu = all(stage.device == "cpu" for stage in plan.stages)
            self.client = ends.open_client(
                plan,
                step_timeout=step_timeout,
                groups=groups,
                shared=n > 1 and cpu,
                speculate=speculate,
            )
        except BaseException:
            self.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _build(
        self,
        specs: list[Any],
        secret: SwarmSecret,
        host: str,
        env: dict[str, str],
        ready_timeout: float,
    ) -> Any:
        from swarmp2p.workers import WorkerProcess

        self.workers = [
            WorkerProcess(
                job_id="local",
                attempt=1,
                stage=spec.stage,
                spec=spec.to_dict(),
                env=env,
                on_event=lambda event: None,
                on_exit=lambda code, tail: None,
                module=SERVE_WORKER_MODULE,
                keep_stdin=True,
            )
            for spec in specs
        ]
        self.load_s = [0.0] * len(specs)

        async def start(i: int) -> str:
            worker = self.workers[i]
            try:
                await worker.start()
                ready = await worker.wait_event("ready", ready_timeout)
            except (RuntimeError, OSError) as exc:
                raise self._failed(i, exc) from None
            self.load_s[i] = float(ready.get("load_s", 0.0))
            return str(ready["endpoint"])

        async def connect(i: int, after: str) -> None:
            worker = self.workers[i]
            try:
                await worker.send_line({"op": "connect", "next": after})
                await worker.wait_event("serving", TIMINGS.local_stage_connect_s)
            except (RuntimeError, OSError) as exc:
                raise self._failed(i, exc) from None

        return await build_ring(
            len(specs),
            bind_back=lambda: ZmqLink.bind(self._ctx, secret, host),
            start=start,
            connect=connect,
            dial=lambda endpoint: ZmqLink.dial(self._ctx, secret, endpoint),
            stop=self._stop_workers,
        )

    def _failed(self, i: int, exc: BaseException) -> WorkerFailed:
        a, b = self.bounds[i]
        tail = "\n".join(list(self.workers[i].stderr_tail)[-10:])
        return WorkerFailed(f"stage {i} ({self.model} blocks [{a}, {b})): {exc}\n{tail}")

    async def _stop_workers(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)

    def wait_exit(self, stage: int, timeout: float = 30.0) -> str:
        """How stage ``stage``'s worker ended ("killed by SIGKILL"), once it has."""
        from swarmp2p.workers import exit_message

        proc = self.workers[stage].proc
        return exit_message(self._run(asyncio.wait_for(proc.wait(), timeout), timeout + 5))

    def close(self) -> None:
        """Stop the manager, then every worker, then the links; idempotent."""
        if self.client is not None:
            self.client.close()
            self.client = None
        if self._loop.is_running():
            if self.workers:
                self._run(self._stop_workers())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        if not self._loop.is_closed():
            self._loop.close()
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
    from swarmp2p.models import resolve_model_ref
    from swarmp2p.serve.api import ApiServer, build_app, check_bind
    from swarmp2p.serve.request import ServedModel
    from swarmp2p.serve.text import TextCodec

    check_bind(host, api_key)
    folder = resolve_model_ref(model)
    plan = local_serve_plan(
        folder, stages=stages, max_sessions=max_sessions, max_context=max_context or 0
    )
    codec = TextCodec.from_folder(folder)
    with LocalRing(folder, plan=plan, threads=threads) as ring:
        served = ServedModel(
            name=name or model, client=ring.client, codec=codec, max_context=plan.max_context
        )
        with ApiServer(build_app([served], api_key=api_key), host, port) as server:
            print(f"serving {served.name} on {server.url}/v1 ({stages} stage(s))", flush=True)
            if ready is not None:
                ready.set()
            try:
                (stop or threading.Event()).wait()
            except KeyboardInterrupt:
                pass
