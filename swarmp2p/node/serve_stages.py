"""Every node's side of ``swarm serve``: a serve worker per stage placed here, started from the
files it loads made local first (the model's files or a trained stage's shard, fetched from a
node that has them when this node holds no intact copy), connected to the next stage, stopped.
Never imports torch."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from swarmp2p.errors import SwarmError
from swarmp2p.net.rpc import RpcError, RpcTimeout
from swarmp2p.node.jobs import device_for
from swarmp2p.node.messages import (
    ServeFileRead,
    ServeStage,
    ServeStageConnect,
    ServeStageExit,
    ServeStageStart,
    ServeStageStop,
    ShardRead,
)
from swarmp2p.node.serve_placement import ServeError
from swarmp2p.node.workers import WorkerProcess, _die_with_parent

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from swarmp2p.node.context import NodeContext
    from swarmp2p.node.stages import StageHost

log = logging.getLogger("swarmp2p.node.serve_stages")

SERVE_WORKER_MODULE = "swarmp2p.runtime.serve_worker"
LOAD_TIMEOUT_S = 120.0
"""How long a stage's node may take to load its slice and bind its link."""
CONNECT_TIMEOUT_S = 30.0


class ServeWorkerProcess(WorkerProcess):
    """A serve worker: the jobs' worker management, with stdin kept open for the connect
    line (``send_line``) and a ``serving`` future set by the worker's ``serving`` event."""

    serving: asyncio.Future | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.ready = loop.create_future()
        self.serving = loop.create_future()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            SERVE_WORKER_MODULE,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **self._env},
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            limit=1 << 22,
        )
        await self.send_line(self._spec)
        self._tasks = [
            asyncio.ensure_future(self._read_stdout()),
            asyncio.ensure_future(self._read_stderr()),
        ]
        self._tasks.append(asyncio.ensure_future(self._wait()))

    async def send_line(self, obj: dict[str, Any]) -> None:
        import json

        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        await self.proc.stdin.drain()

    def event(self, event: dict[str, Any]) -> None:
        if event.get("event") == "serving" and self.serving and not self.serving.done():
            self.serving.set_result(event)

    async def wait_serving(self, timeout: float) -> None:
        assert self.serving is not None and self.ready is not None
        await asyncio.wait(
            [asyncio.ensure_future(asyncio.shield(self.serving)), self._tasks[2]],
            timeout=timeout,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if not self.serving.done():
            tail = f": {self.stderr_tail[-1]}" if self.stderr_tail else ""
            raise RuntimeError(
                f"stage {self.stage} worker did not start serving within {timeout:g} s{tail}"
            )


class ServeStages:
    """This node's serve workers. ``call_node(node_id, msg, timeout)`` reaches a node (this one
    included), for telling an issuing node that its stage's worker died."""

    def __init__(
        self,
        ctx: NodeContext,
        stage_host: StageHost,
        call_node: Callable[[str, Any, float], Awaitable[Any]],
    ) -> None:
        self.ctx = ctx
        self.stage_host = stage_host
        self._call_node = call_node
        self.workers: dict[tuple[str, int, int], ServeWorkerProcess] = {}
        self._pulls: dict[str, asyncio.Lock] = {}
        self._issuers: dict[str, tuple[str, float]] = {}
        """serve id -> (issuing node, when its first stage started here)."""
        self._claims: dict[str, tuple[set[str], float]] = {}
        """node -> (the serve ids its last heartbeat claimed, when it came)."""
        self._held: dict[tuple[str, int, int], tuple[str, int]] = {}
        """worker key -> (device, the bytes its placement priced): what serving holds here."""

    # --- workers nobody issues any more ---------------------------------------------------------

    def issuer_claims(self, node_id: str, serving: list | None, now: float) -> None:
        """A heartbeat from ``node_id`` lists the serve ids it issues (None: a peer that does
        not say; its workers are then reaped only when it dies)."""
        if serving is not None:
            self._claims[node_id] = ({str(s) for s in serving}, now)

    def reap(self, alive: set[str], mine: set[str], now: float) -> None:
        """Stop the workers of every serve id whose issuer died, or no longer claims it (it
        restarted, or stopped serving while this node was unreachable)."""
        grace = 2 * self.ctx.config.heartbeat_s
        for serve_id in sorted({k[0] for k in self.workers}):
            issuer, since = self._issuers.get(serve_id, ("", now))
            if issuer == self.ctx.node_id:
                why = None if serve_id in mine else "this node no longer serves it"
            elif issuer not in alive:
                why = f"its issuing node {issuer} is gone"
            else:
                claimed, at = self._claims.get(issuer, (None, 0.0))
                stale = claimed is not None and at > since + grace and serve_id not in claimed
                why = f"its issuing node {issuer} no longer serves it" if stale else None
            if why is not None:
                log.warning("stopping the serve workers of %s: %s", serve_id, why)
                victims = [self.workers.pop(k) for k in list(self.workers) if k[0] == serve_id]
                self.ctx.spawn(
                    asyncio.gather(*(w.stop() for w in victims)), f"serve-reap:{serve_id}"
                )
        running = {k[0] for k in self.workers}
        for serve_id in [s for s in self._issuers if s not in running]:
            del self._issuers[serve_id]

    async def handle(self, msg: Any) -> Any:
        if isinstance(msg, ServeStageStart):
            return await self.start(msg)
        if isinstance(msg, ServeStageConnect):
            worker = self._worker(msg.serve_id, msg.attempt, msg.stage)
            await worker.send_line({"op": "connect", "next": msg.next})
            try:
                await worker.wait_serving(CONNECT_TIMEOUT_S)
            except RuntimeError as exc:
                raise RpcError("stage_failed", str(exc)) from None
            return ServeStage(
                serve_id=msg.serve_id, attempt=msg.attempt, stage=msg.stage, endpoint="",
                state="serving",
            )  # fmt: skip
        if isinstance(msg, ServeStageStop):
            keys = [
                k
                for k in self.workers
                if k[0] == msg.serve_id
                and k[1] == msg.attempt
                and (msg.stage < 0 or k[2] == msg.stage)
            ]
            for key in keys:
                await self.workers.pop(key).stop()
            return ServeStage(
                serve_id=msg.serve_id, attempt=msg.attempt, stage=msg.stage, endpoint="",
                state="stopped",
            )  # fmt: skip
        raise RpcError("unexpected", f"a serve stage does not take {type(msg).TYPE}")

    async def _report_exit(self, issuer: str, msg: ServeStageExit) -> None:
        try:
            await self._call_node(issuer, msg, CONNECT_TIMEOUT_S)
        except ServeError as exc:
            log.info("could not tell %s that a serve worker died: %s", issuer, exc)

    def _worker(self, serve_id: str, attempt: int, stage: int) -> ServeWorkerProcess:
        worker = self.workers.get((serve_id, attempt, stage))
        if worker is None:
            raise RpcError(
                "no_stage", f"no serve worker {serve_id} attempt {attempt} stage {stage} here"
            )
        return worker

    # --- the files a stage loads ---------------------------------------------------------------

    def _lock(self, key: str) -> asyncio.Lock:
        return self._pulls.setdefault(key, asyncio.Lock())

    def peer_endpoint(self, node_id: str) -> str:
        peer = self.ctx.members.peers.get(node_id)
        if peer is None or not peer.alive:
            raise ServeError(f"node {node_id} is not alive")
        return peer.endpoint

    def _reader(self, node_id: str, read_msg: Any) -> Any:
        """A model_files Reader over RPC: ``read_msg(file, offset, size)`` is the request."""
        from swarmp2p.node.model_files import rpc_reader

        return rpc_reader(self.ctx.call_endpoint, self.peer_endpoint(node_id), read_msg)

    async def _local_model(self, msg: ServeStageStart) -> str:
        """The folder this stage loads: only the files its blocks read made local, from this
        node's own copy when it matches the issuer's listing (at the same path, or its
        embedded model), else fetched (``node.inputs``: the issuer first, then any node that
        holds them, into ``<state>/models/<digest>``); a Hub model's from the Hub."""
        from swarmp2p.runtime.models import embedded_dir

        spec = msg.spec
        model = str(spec.get("model", ""))
        start, end = int(spec.get("layer_start", 0)), int(spec.get("layer_end", 0))
        layers = (start, end, bool(spec.get("is_first_stage")), bool(spec.get("is_last_stage")))
        reader = None
        if msg.issuer != self.ctx.node_id:
            serve_id = msg.serve_id
            reader = self._reader(
                msg.issuer,
                lambda f, o, n: ServeFileRead(serve_id=serve_id, file=f, offset=o, size=n),
            )
        return await self.stage_host.inputs.serve_stage_folder(
            model,
            msg.files,
            issuer=msg.issuer,
            revision=str(msg.env.get("revision") or ""),
            layers=layers,
            what=f"serve {msg.serve_id} stage {spec.get('stage_index')}",
            first_reader=reader,
            also=[embedded_dir()] if msg.env.get("embedded") else [],
        )

    async def _local_shard(self, ask: dict[str, Any]) -> tuple[str, str | None]:
        """(shard folder, tied-head file or None) of a trained stage on this node: the copy in
        its job folder when intact, else fetched from a holder first."""
        import json

        from swarmp2p.node import model_files
        from swarmp2p.node.stages import CHUNK_BYTES
        from swarmp2p.paths import confine

        def _safe(name: str) -> str:
            """A relative name from the issuer, confined to the job's folder."""
            confine(job_dir, name, what="shard file")
            return name

        job_id = str(ask.get("job_id", ""))
        job_dir = self.stage_host.job_dir(job_id)
        rel = _safe(str(ask.get("folder", "")))
        folder = job_dir / rel
        files = ask.get("files")
        if not isinstance(files, dict) or not files:
            raise ServeError(f"shard {rel}: no file list")
        for name in files:
            _safe(str(name))

        def intact() -> bool:
            try:
                manifest = json.loads((folder / "manifest.json").read_text())
            except (OSError, ValueError):
                return False
            if manifest.get("files") != files:
                return False
            return all(
                (folder / n).is_file() and model_files.sha256_file(folder / n) == sha
                for n, sha in files.items()
            )

        def job_reader(node: str, prefix: str) -> Any:
            if node == self.ctx.node_id:
                return model_files.local_reader(job_dir / prefix)
            return self._reader(
                node,
                lambda f, o, n: ShardRead(job_id=job_id, file=f"{prefix}/{f}", offset=o, size=n),
            )

        async def from_any(sources: list[str], what: str, fetch: Any) -> None:
            errors = []
            for node in sources:
                if node == self.ctx.node_id and what == "shard":
                    continue  # this node's copy is the damaged one
                try:
                    await fetch(node)
                    return
                except (ServeError, RpcError, RpcTimeout, OSError, ValueError) as exc:
                    errors.append(f"{node}: {exc}")
            raise ServeError(
                f"cannot fetch {what} of job {job_id} from any holder ("
                + ("; ".join(errors) or "none alive")
                + ")"
            )

        async with self._lock(str(folder)):
            if not await asyncio.to_thread(intact):
                log.info("fetching shard %s of job %s", rel, job_id)
                await from_any(
                    list(ask.get("sources") or []),
                    "shard",
                    lambda node: model_files.pull_files(
                        job_reader(node, rel),
                        {**files, "manifest.json": None},
                        folder,
                        CHUNK_BYTES,
                        last="manifest.json",
                    ),
                )
                if not await asyncio.to_thread(intact):
                    raise ServeError(f"shard {rel} of job {job_id}: its manifest lists other files than the registry")  # fmt: skip
        tied = ask.get("tied")
        if not tied:
            return str(folder), None
        file = _safe(str(tied.get("file", "")))
        dest = job_dir / "serve" / (file.replace("/", "-") + ".head.safetensors")
        async with self._lock(str(dest)):
            if not dest.is_file():
                prefix, name = file.rsplit("/", 1)
                await from_any(
                    list(tied.get("sources") or []),
                    f"{file}'s embedding",
                    lambda node: model_files.pull_non_block_tensors(
                        job_reader(node, prefix), name, dest, CHUNK_BYTES
                    ),
                )
        return str(folder), str(dest)

    async def start(self, msg: ServeStageStart) -> ServeStage:
        from swarmp2p.paths import UnsafeName, check_id
        from swarmp2p.serve.spec import StageServeSpec

        try:
            check_id(msg.serve_id, what="serve id")  # it names log files and folders here
        except UnsafeName as exc:
            raise RpcError("bad_field", str(exc)) from None

        device_name = str(msg.env.get("device", "cpu"))
        device, visible = device_for([device_name], self.ctx.me.record)
        local: dict[str, Any] = {}
        try:
            local["model"] = await self._local_model(msg)
            if msg.shard is not None:
                local["shard"], local["tied_head"] = await self._local_shard(msg.shard)
        except (ServeError, ValueError, OSError, RpcTimeout, SwarmError) as exc:
            raise RpcError("stage_failed", f"node {self.ctx.node_id}: {exc}") from None
        try:
            spec = StageServeSpec.from_dict(
                {
                    **msg.spec,
                    **local,
                    "token": self.ctx.secret.token,
                    "host": self.ctx.me.addresses[0],
                    "device": device,
                }
            )
        except ValueError as exc:
            raise RpcError("bad_field", str(exc)) from None
        env = {"CUDA_VISIBLE_DEVICES": visible if visible is not None else ""}
        if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            here = max(int(msg.env.get("stages_here", 1) or 1), 1)
            cores = int(self.ctx.me.host.get("cpu_cores") or 1)
            env["OMP_NUM_THREADS"] = str(max(1, cores // here))
        key = (msg.serve_id, msg.attempt, spec.stage_index)
        if key in self.workers:
            raise RpcError("exists", f"stage {spec.stage_index} of {msg.serve_id} already runs")
        self._issuers.setdefault(msg.serve_id, (msg.issuer, self.ctx.clock()))
        log_dir = self.ctx.state.root / "serve"
        log_dir.mkdir(parents=True, exist_ok=True)
        worker: ServeWorkerProcess | None = None

        def on_exit(code: int, tail: list[str]) -> None:
            from swarmp2p.node.jobs import exit_message

            why = exit_message(code) + (f": {tail[-1]}" if tail else "")
            log.warning("serve worker %s stage %d %s", msg.serve_id, spec.stage_index, why)
            if self.workers.get(key) is worker:
                self.workers.pop(key)
            exited = ServeStageExit(
                serve_id=msg.serve_id,
                attempt=msg.attempt,
                stage=spec.stage_index,
                node_id=self.ctx.node_id,
                message=why,
            )
            self.ctx.spawn(self._report_exit(msg.issuer, exited), f"serve-exit:{key}")

        worker = ServeWorkerProcess(
            job_id=msg.serve_id,
            attempt=msg.attempt,
            stage=spec.stage_index,
            spec=replace(spec).to_dict(),
            env=env,
            on_event=lambda e: worker.event(e) if worker is not None else None,
            on_exit=on_exit,
            log_path=str(log_dir / f"{msg.serve_id}-{msg.attempt}-{spec.stage_index}.log"),
        )
        self.workers[key] = worker
        from swarmp2p.node.hardware import device_key

        memory = msg.env.get("memory")
        self._held[key] = (device_key(device_name), memory if type(memory) is int and memory > 0 else 0)  # fmt: skip
        try:
            await worker.start()
            ready = await worker.wait_ready(LOAD_TIMEOUT_S)
        except (RuntimeError, asyncio.TimeoutError, OSError) as exc:
            self.workers.pop(key, None)
            await worker.stop()
            what = str(exc) or f"no ready event in {LOAD_TIMEOUT_S:g} s"
            raise RpcError("stage_failed", f"node {self.ctx.node_id}: {what}") from None
        return ServeStage(
            serve_id=msg.serve_id,
            attempt=msg.attempt,
            stage=spec.stage_index,
            endpoint=str(ready["endpoint"]),
            state="ready",
        )

    def held(self) -> dict[str, int]:
        """Bytes this node's serve workers hold per device (their placements' prices)."""
        out: dict[str, int] = {}
        for key, (device, nbytes) in list(self._held.items()):
            if key not in self.workers:
                del self._held[key]
                continue
            out[device] = out.get(device, 0) + nbytes
        return out

    async def close(self) -> None:
        for worker in list(self.workers.values()):
            await worker.stop()
        self.workers.clear()
