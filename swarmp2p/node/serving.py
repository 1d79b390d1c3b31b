"""``swarm serve`` across the swarm: placement, stage workers on their nodes, the HTTP API on the
issuing node, and failover. Never imports torch.

Roles:

- The issuing node (the one whose CLI ran ``swarm serve``) asks the leader for a placement
  (``serve.plan``), starts one serve worker per stage on the stages' nodes
  (``serve.stage_start``, answered with the worker's bound input endpoint), tells each stage
  where the next listens (``serve.stage_connect``; the last stage sends tokens back to a link
  bound here), drives the ring with a :class:`~swarmp2p.serve.RingClient` and answers the
  OpenAI-compatible API on ``--host``/``--port``.
- The leader places the stages from the shape it is sent (``node/serve_placement.py``): each
  priced with the KV cache of ``max_sessions`` x ``max_context`` tokens, on the live nodes
  with the most free memory, or a trained model's stages where their shards are; a stage that
  does not fit is refused with the node and the bytes.
- Every node starts and stops serve workers (``node/serve_stages.py``), fetching the files a
  stage loads when it holds no intact copy: from the issuing node (``serve.file_read``,
  answered here) or from a node holding a trained stage's shard.
- Once a trained model serves, every shard gets a standby copy on a second node.

Failover: each heartbeat round the issuing node checks that every stage's node is alive. When
one is lost it re-plans on the live nodes, stops the survivors' old workers, starts a new ring
and hands it to ``RingClient.reroute``: every open session replays its prompt and the tokens
generated so far, so a greedy request completes with the same text. When no placement fits,
every open request fails at once with the reason, and the ring is retried each round.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmp2p._atomic import write_atomic
from swarmp2p.errors import SwarmError
from swarmp2p.net.rpc import RpcError, RpcTimeout
from swarmp2p.node.messages import (
    ServeFileRead,
    ServePlace,
    ServePlaced,
    ServeStage,
    ServeStageConnect,
    ServeStageExit,
    ServeStageStart,
    ServeStageStop,
    ShardChunk,
    ShardCopy,
)
from swarmp2p.node.registry import holders
from swarmp2p.node.serve_placement import (
    DTYPES,
    ServeError,
    place_stages,
    resolve_model,
    trained_entry,
    trained_settings,
)
from swarmp2p.node.serve_stages import CONNECT_TIMEOUT_S, ServeStages
from swarmp2p.plan.model_shape import EMBEDDED

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext
    from swarmp2p.node.jobs_leader import JobsLeader
    from swarmp2p.node.stages import StageHost

log = logging.getLogger("swarmp2p.node.serving")

START_TIMEOUT_S = 3500.0
"""How long the issuing node waits for a stage to start: fetching the model's files or a
trained shard to that node first (chunks time out on their own), then loading."""
COPY_TIMEOUT_S = 3600.0
"""How long one file of a standby copy may take (chunks time out on their own)."""
MAX_CRASH_REBUILDS = 3
"""Rings rebuilt after worker crashes (not node losses) before the model is left degraded."""
STEP_TIMEOUT_S = 60.0
"""A session that gets no token for this long fails (covers a re-placement's reload)."""
SAVED_FILE = "served.json"
RESTORE_FOR_S = 600.0
"""How long a restarted daemon keeps trying to serve its saved models again."""
RESTORE_EVERY_S = 5.0
REQUEST_KEYS = (
    "model", "name", "stages", "port", "host", "max_sessions", "max_context", "dtype",
    "quantization", "api_key", "cwd",
)  # fmt: skip
_NAME = re.compile(r"^[\w./:@+-]{1,200}$")


# --- what the issuing node holds per served model ---------------------------------------------


@dataclass(eq=False, kw_only=True)
class _Served:
    name: str
    serve_id: str
    folder: str
    stages_wanted: int
    max_sessions: int
    max_context: int
    dtype: str
    quantization: dict | None
    host: str
    port: int
    api_key: str | None
    request: dict[str, Any] = field(default_factory=dict)
    """The request it was served with (saved, to serve it again after a restart)."""
    shape: Any = None
    """The model's ModelShape, read here and sent to the leader with each placement."""
    trained: dict[str, Any] | None = None
    """A registry model's entry (``swarm models``) when MODEL names one; its stages load
    the base model plus their trained shards."""
    holders: list[list[str]] = field(default_factory=list)
    """A trained model: per stage, the nodes known to hold an intact copy of its shard."""
    files: dict[str, Any] | None = None
    """A folder model: ``{name: [bytes, sha256]}`` of its files, for stage nodes to check or
    fetch their copy against."""
    embedded: bool = False
    local: Any = None
    """The model as ``node.inputs.serve_model`` resolved it here (tokenizer folder, revision)."""
    attempt: int = 0
    live_attempt: int = 0
    """The attempt whose workers form the ring now (0: none)."""
    placed: list[dict[str, Any]] = field(default_factory=list)
    ctx: Any = None
    links: list[Any] = field(default_factory=list)
    client: Any = None
    api: Any = None
    url: str = ""
    state: str = "starting"
    reason: str = ""
    failovers: int = 0
    replayed: int = 0
    """Sessions replayed onto a rebuilt ring, in all."""
    crashed: dict[int, str] = field(default_factory=dict)
    """Stage index -> why its worker died, for the live ring (its node lives on)."""
    crash_rebuilds: int = 0
    rebuilding: asyncio.Task | None = None
    degraded_since: float | None = None
    """When the ring first could not be rebuilt (monotonic), for the retry grace."""

    def view(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "trained": self.trained["id"] if self.trained else None,
            "url": self.url,
            "state": self.state,
            "reason": self.reason,
            "failovers": self.failovers,
            "replayed": self.replayed,
            "stages": [
                {
                    "index": i,
                    "node_id": s["node_id"],
                    "node": s["node_id"],
                    "devices": [s["device"]],
                    "layers": [s["layer_start"], s["layer_end"]],
                    "endpoint": s.get("worker", ""),
                    **({"holders": list(self.holders[i])} if self.trained else {}),
                }
                for i, s in enumerate(self.placed)
            ],
        }


class Serving:
    """The serving side of one daemon (issuing node, leader and stage host at once)."""

    def __init__(self, ctx: NodeContext, stage_host: StageHost, jobs: JobsLeader) -> None:
        self.ctx = ctx
        self.stage_host = stage_host
        self.jobs = jobs
        self.served: dict[str, _Served] = {}
        self.stages = ServeStages(ctx, stage_host, self._call_node)
        self._serving_lock = asyncio.Lock()
        self._restoring: dict[str, tuple[dict[str, Any], str, asyncio.Task | None]] = {}
        """name -> (request, why it does not serve yet, its retry task): saved models being
        served again after this daemon restarted."""

    # --- served models outlive a restart of this daemon ----------------------------------------

    @property
    def _saved_file(self) -> Path:
        return self.ctx.state.root / "serve" / SAVED_FILE

    def _save(self) -> None:
        """Record the requests of every served (and still restoring) model, 0600: a request
        may hold an API key."""
        saved = {name: req for name, (req, _, _) in self._restoring.items()}
        saved.update({name: s.request for name, s in self.served.items() if s.request})
        write_atomic(self._saved_file, json.dumps(saved, indent=2, sort_keys=True), mode=0o600)

    def restore(self) -> None:
        """Serve again what this node served when it stopped (``swarm serve --stop`` forgets a
        model); each is retried until it serves or RESTORE_FOR_S has passed."""
        try:
            saved = json.loads(self._saved_file.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s (%s); serving nothing again", self._saved_file, exc)
            return
        for name, req in sorted(saved.items()) if isinstance(saved, dict) else []:
            if isinstance(req, dict):
                task = self.ctx.spawn(self._restore(name, req), f"serve-restore:{name}")
                self._restoring[name] = (req, "waiting for the swarm to gather", task)

    async def _restore(self, name: str, req: dict[str, Any]) -> None:
        await asyncio.sleep(2 * self.ctx.config.failure_timeout_s)  # peers find each other first
        deadline = self.ctx.clock() + RESTORE_FOR_S
        while True:
            try:
                await self._api_serve(req, restoring=True)
            except (ServeError, ValueError, OSError) as exc:
                self._restoring[name] = (req, str(exc), self._restoring[name][2])
                if self.ctx.clock() > deadline:
                    log.warning("gave up serving %s again after a restart: %s", name, exc)
                    self._restoring[name] = (req, f"gave up: {exc}", None)
                    return
                await asyncio.sleep(RESTORE_EVERY_S)
                continue
            self._restoring.pop(name, None)
            log.info("serving %s again after a restart", name)
            return

    # --- status and the local API -------------------------------------------------------------

    def issued(self) -> list[str]:
        """The serve ids this node issues now (sent with every heartbeat)."""
        return sorted(s.serve_id for s in self.served.values())

    def status(self) -> list[dict[str, Any]]:
        views = {name: s.view() for name, s in self.served.items()}
        for name, (_, why, task) in self._restoring.items():
            views.setdefault(name, {
                "model": name, "trained": None, "url": "", "failovers": 0, "replayed": 0,
                "state": "restoring" if task is not None else "failed", "reason": why,
                "stages": [],
            })  # fmt: skip
        return [views[name] for name in sorted(views)]

    def api_handlers(self) -> dict[str, Any]:
        return {"serve": self._api_serve, "serve_stop": self._api_stop, "served": self._api_list}

    async def _api_list(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        return self.status()

    async def _api_stop(self, req: dict[str, Any]) -> dict[str, Any]:
        name = req.get("model")
        served = self.served.get(name) if isinstance(name, str) else None
        pending = self._restoring.pop(name, None) if isinstance(name, str) else None
        if pending is not None and pending[2] is not None:
            pending[2].cancel()
        if served is None and pending is None:
            known = ", ".join(sorted({*self.served, *self._restoring})) or "none"
            raise ServeError(f"model {name!r} is not served from this node (served: {known})")
        if served is not None:
            await self._teardown(served)
            self.served.pop(served.name, None)
        await asyncio.to_thread(self._save)
        log.info("stopped serving %s", name)
        return {"model": name, "stopped": True}

    async def _api_serve(self, req: dict[str, Any], restoring: bool = False) -> dict[str, Any]:
        served = await self._parse(req)
        if not restoring and served.name in self._restoring:
            raise ServeError(
                f"model {served.name!r} is being served again after a restart "
                f"({self._restoring[served.name][1]}); `swarm serve --stop {served.name}` first"
            )
        async with self._serving_lock:
            if served.name in self.served:
                raise ServeError(
                    f"model {served.name!r} is already served at {self.served[served.name].url}; "
                    f"`swarm serve --stop {served.name}` first"
                )
            self.served[served.name] = served
        try:
            await self._open(served)
        except BaseException:
            self.served.pop(served.name, None)
            await self._teardown(served)
            raise
        served.state = "serving"
        log.info("serving %s at %s on %d stage(s)", served.name, served.url, len(served.placed))
        self._restoring.pop(served.name, None)
        await asyncio.to_thread(self._save)
        self._spawn_standby(served)
        return served.view()

    async def _parse(self, req: dict[str, Any]) -> _Served:
        from swarmp2p.serve.api import check_bind

        model = req.get("model")
        if not isinstance(model, str) or not model:
            raise ServeError("model: name a local folder, a Hub id in the cache, or 'embedded'")
        name = req.get("name") or model
        if not isinstance(name, str) or not _NAME.match(name):
            raise ServeError(f"name: {name!r} must be 1-200 of [A-Za-z0-9_./:@+-]")
        ints = {}
        for key, default, lo in (
            ("stages", 0, 0),
            ("port", 8080, 0),
            ("max_sessions", 4, 1),
            ("max_context", 0, 0),
        ):
            value = req.get(key, default)
            value = default if value is None else value
            if type(value) is not int or value < lo or (key == "port" and value > 65535):
                raise ServeError(f"{key}: {value!r} is not an integer >= {lo}")
            ints[key] = value
        dtype = req.get("dtype") or "float32"
        if req.get("dtype") is not None and dtype not in DTYPES:
            raise ServeError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        quantization = req.get("quantization")
        if quantization is not None and not isinstance(quantization, dict):
            raise ServeError(f"quantization: {quantization!r} is not a map such as {{'bits': 4}}")
        host = req.get("host") or "127.0.0.1"
        api_key = req.get("api_key") or None
        check_bind(host, api_key)
        trained = trained_entry(self.ctx.table, model)
        cwd = req.get("cwd")
        if (
            trained is None
            and isinstance(cwd, str)
            and model != EMBEDDED
            and not os.path.isabs(model)
        ):
            here = os.path.join(cwd, os.path.expanduser(model))
            model_arg = os.path.abspath(here) if os.path.isdir(here) else model
        else:
            model_arg = model
        if trained is not None:
            dtype, quantization = trained_settings(trained, ints["stages"], req, quantization)
        job = self.ctx.table.jobs.get(str(trained["job_id"])) if trained else None
        try:  # a Hub model, or a trained model's base this node lacks, is read from elsewhere
            here = await self.stages.stage_host.inputs.serve_model(
                trained["base"] if trained else model_arg,
                trained=job.inputs if job is not None else None,
                local=lambda ref: resolve_model(ref, trained),
            )
        except SwarmError as exc:
            raise ServeError(str(exc)) from None
        folder, shape = here.folder, here.shape
        context = min(ints["max_context"] or shape.max_positions, shape.max_positions)
        return _Served(
            name=name,
            serve_id=f"s{int(time.time() * 1000) % 10**10}-{os.getpid() % 1000}",
            folder=folder,
            stages_wanted=ints["stages"],
            max_sessions=ints["max_sessions"],
            max_context=context,
            dtype=dtype,
            quantization=quantization,
            host=host,
            port=ints["port"],
            api_key=api_key,
            request={k: req[k] for k in REQUEST_KEYS if req.get(k) is not None},
            shape=shape,
            trained=trained,
            holders=[holders(st) for st in trained["manifest"]["stages"]] if trained else [],
            embedded=model == EMBEDDED or (trained is not None and trained["base"] == EMBEDDED),
            files=here.files,
            local=here,
        )

    # --- building a ring ------------------------------------------------------------------------

    async def _open(self, served: _Served) -> None:
        from swarmp2p.net import SecureContext
        from swarmp2p.serve import RingClient, ServedModel, build_app
        from swarmp2p.serve.api import ApiServer
        from swarmp2p.serve.text import TextCodec

        served.ctx = SecureContext()
        codec_folder = served.local.codec if served.local is not None else served.folder
        codec = await asyncio.to_thread(TextCodec.from_folder, codec_folder)
        if served.files is None and os.path.isdir(served.folder):
            from swarmp2p.node.model_files import folder_listing

            try:
                served.files = await asyncio.to_thread(folder_listing, served.folder)
            except (OSError, ValueError) as exc:
                raise ServeError(f"model {served.name!r}: {exc}") from None
        first, back = await self._build(served)
        served.client = RingClient(
            first,
            back,
            max_context=served.max_context,
            max_sessions=served.max_sessions,
            step_timeout=STEP_TIMEOUT_S,
        ).start()
        app = build_app(
            [
                ServedModel(
                    name=served.name,
                    client=served.client,
                    codec=codec,
                    max_context=served.max_context,
                )
            ],
            api_key=served.api_key,
        )
        served.api = ApiServer(app, served.host, served.port)
        try:
            served.url = await asyncio.to_thread(served.api.start)
        except OSError as exc:
            served.api = None
            raise ServeError(f"port: cannot listen on {served.host}:{served.port}: {exc}") from None

    def _alive(self) -> set[str]:
        return {self.ctx.node_id} | {p.node_id for p in self.ctx.members.alive_peers()}

    def _alive_holders(self, served: _Served) -> list[list[str]]:
        """Per stage, the live holders of its shard; ServeError when a stage has none."""
        alive = self._alive()
        out = [[h for h in held if h in alive] for held in served.holders]
        lost = [(i, held) for i, (held, live) in enumerate(zip(served.holders, out)) if not live]
        if lost:
            raise ServeError(
                "; ".join(
                    f"stage {i}'s trained shard is held only by {', '.join(held)}, not alive"
                    for i, held in lost
                )
                + f"; {served.trained['id']} cannot be served until one of them is back"
            )
        return out

    async def _plan(self, served: _Served) -> list[dict[str, Any]]:
        from swarmp2p.plan.model_shape import shape_to_wire

        ask = ServePlace(
            serve_id=served.serve_id,
            model=served.folder,
            stages=served.stages_wanted,
            max_sessions=served.max_sessions,
            max_context=served.max_context,
            dtype=served.dtype,
            quantization=served.quantization,
            shape=shape_to_wire(served.shape),
            bounds=served.trained["manifest"]["split"] if served.trained else None,
            holders=self._alive_holders(served) if served.trained else None,
        )
        if self.ctx.leader == self.ctx.node_id:
            try:
                reply = await self._place(ask)
            except RpcError as exc:
                raise ServeError(str(exc)) from None
        else:
            peer = self.ctx.members.peers.get(self.ctx.leader)
            if peer is None or not peer.alive:
                raise ServeError(f"the leader {self.ctx.leader} is not reachable; retry")
            try:
                reply = await self.ctx.call_endpoint(peer.endpoint, ask, CONNECT_TIMEOUT_S)
            except RpcError as exc:
                raise ServeError(str(exc)) from None
            except RpcTimeout:
                raise ServeError(
                    f"the leader {self.ctx.leader} did not answer serve.plan"
                ) from None
        if not isinstance(reply, ServePlaced):
            raise ServeError(f"the leader answered {type(reply).TYPE}, not serve.placed")
        return [dict(s) for s in reply.stages]

    async def _call_node(self, node_id: str, msg: Any, timeout: float) -> Any:
        if node_id == self.ctx.node_id:
            try:
                return await self.handle(msg)
            except RpcError as exc:
                raise ServeError(f"node {node_id}: {exc}") from None
        peer = self.ctx.members.peers.get(node_id)
        if peer is None or not peer.alive:
            raise ServeError(f"node {node_id} is not alive")
        try:
            return await self.ctx.call_endpoint(peer.endpoint, msg, timeout)
        except RpcTimeout:
            raise ServeError(f"node {node_id} did not answer {msg.TYPE} in {timeout:g} s") from None
        except RpcError as exc:
            raise ServeError(f"node {node_id}: {exc}") from None

    def _shard_ask(self, served: _Served, i: int, n: int) -> dict[str, Any]:
        """What a stage node needs to make stage ``i``'s trained shard local."""
        stages = served.trained["manifest"]["stages"]
        holders = self._alive_holders(served)
        tied = None
        last_of_many = i == n - 1 and n > 1
        if last_of_many and served.shape.tie_embeddings and stages[0].get("weights_included", True):
            # export stores a tied head once, as stage 0's embedding: the last stage serves
            # with that one, as the exported model does
            tied = {"file": f"{stages[0]['folder']}/weights.safetensors", "sources": holders[0]}
        return {
            "job_id": served.trained["job_id"],
            "folder": stages[i]["folder"],
            "files": dict(stages[i]["files"]),
            "sources": holders[i],
            "tied": tied,
        }

    async def _build(self, served: _Served) -> tuple[Any, Any]:
        """Place, start, connect; (first, back) links of the new ring. On failure every
        worker started here is stopped and the new links closed."""
        from swarmp2p.net import ZmqLink

        served.attempt += 1
        attempt = served.attempt
        placed = await self._plan(served)
        n = len(placed)
        here: dict[str, int] = {}
        for s in placed:
            here[s["node_id"]] = here.get(s["node_id"], 0) + 1
        links: list[Any] = []
        started: list[str] = []
        try:
            back = ZmqLink.bind(served.ctx, self.ctx.secret, self.ctx.me.addresses[0])
            links.append(back)

            async def start(i: int, s: dict[str, Any]) -> ServeStage:
                spec = {
                    "model": served.folder,
                    "stage_index": i,
                    "layer_start": s["layer_start"],
                    "layer_end": s["layer_end"],
                    "is_first_stage": i == 0,
                    "is_last_stage": i == n - 1,
                    "dtype": served.dtype,
                    "quantization": served.quantization,
                    "max_sessions": served.max_sessions,
                    "max_context": served.max_context,
                }
                env = {"stages_here": here[s["node_id"]], "device": s["device"],
                       "memory": int(s.get("memory") or 0)}  # fmt: skip
                if served.trained:
                    spec["send_codes"] = True  # every node runs this version's serve codec
                env["embedded"] = served.embedded
                if served.local is not None and served.local.revision:
                    env["revision"] = served.local.revision  # a Hub model: every stage alike
                msg = ServeStageStart(
                    serve_id=served.serve_id,
                    attempt=attempt,
                    spec=spec,
                    env=env,
                    issuer=self.ctx.node_id,
                    files=served.files,
                    shard=self._shard_ask(served, i, n) if served.trained else None,
                )
                started.append(s["node_id"])
                reply = await self._call_node(s["node_id"], msg, START_TIMEOUT_S)
                s["worker"] = reply.endpoint
                if served.trained and s["node_id"] not in served.holders[i]:
                    self._note_copy(served, i, s["node_id"])  # it fetched a copy
                return reply

            await asyncio.gather(*(start(i, s) for i, s in enumerate(placed)))
            await asyncio.gather(
                *(
                    self._call_node(
                        s["node_id"],
                        ServeStageConnect(
                            serve_id=served.serve_id,
                            attempt=attempt,
                            stage=i,
                            next=placed[i + 1]["worker"] if i + 1 < n else back.endpoint,
                        ),
                        CONNECT_TIMEOUT_S,
                    )
                    for i, s in enumerate(placed)
                )
            )
            first = ZmqLink.dial(served.ctx, self.ctx.secret, placed[0]["worker"])
            links.append(first)
        except BaseException:
            await self._stop_stages(served.serve_id, attempt, set(started))
            for link in links:
                link.close()
            raise
        old = served.placed
        served.placed, served.live_attempt = placed, attempt
        served.crashed = {}
        served.links.extend(links)
        if old:
            log.info(
                "serving %s: ring rebuilt (attempt %d) on %s",
                served.name,
                attempt,
                ", ".join(s["node_id"] for s in placed),
            )
        return first, back

    async def _stop_stages(self, serve_id: str, attempt: int, nodes: set[str]) -> None:
        alive = {self.ctx.node_id} | {p.node_id for p in self.ctx.members.alive_peers()}
        stop = ServeStageStop(serve_id=serve_id, attempt=attempt, stage=-1)
        await asyncio.gather(
            *(self._call_node(node, stop, 15.0) for node in sorted(nodes & alive)),
            return_exceptions=True,
        )

    async def _teardown(self, served: _Served) -> None:
        if served.rebuilding is not None:
            served.rebuilding.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await served.rebuilding
        if served.api is not None:
            await asyncio.to_thread(served.api.close)
            served.api = None
        if served.client is not None:
            await asyncio.to_thread(served.client.close)
            served.client = None
        if served.live_attempt:
            nodes = {s["node_id"] for s in served.placed}
            await self._stop_stages(served.serve_id, served.live_attempt, nodes)
        for link in served.links:
            link.close()
        served.links = []
        if served.ctx is not None:
            from swarmp2p.net import stop_zero_copy_collector

            stop_zero_copy_collector()
            served.ctx.destroy(0)
            served.ctx = None

    async def close(self) -> None:
        for served in list(self.served.values()):
            with contextlib.suppress(Exception):
                await self._teardown(served)
        self.served.clear()
        await self.stages.close()

    # --- failover -------------------------------------------------------------------------------

    def tick(self) -> None:
        """Each heartbeat round: stop stage workers nobody issues any more; rebuild a ring that
        lost a stage node."""
        alive = {self.ctx.node_id} | {p.node_id for p in self.ctx.members.alive_peers()}
        self.stages.reap(alive, set(self.issued()), self.ctx.clock())
        for served in self.served.values():
            if served.state == "failed" and served.client is not None:
                _fail_open(served.client, served.reason)  # requests sent since fail at once
                continue
            if served.state not in ("serving", "degraded") or served.client is None:
                continue
            if served.rebuilding is not None and not served.rebuilding.done():
                continue
            lost = sorted({s["node_id"] for s in served.placed} - alive)
            if served.crashed and not lost and served.state == "serving":
                served.crash_rebuilds += 1
                if served.crash_rebuilds > MAX_CRASH_REBUILDS:
                    reason = (
                        f"stage worker(s) died {served.crash_rebuilds} times; last: "
                        + "; ".join(f"stage {i}: {m}" for i, m in sorted(served.crashed.items()))
                    )
                    served.state, served.reason = "failed", reason
                    log.warning("serving %s: %s; giving up", served.name, reason)
                    _fail_open(served.client, reason)
                    continue
            if lost or served.crashed or served.state == "degraded":
                served.rebuilding = self.ctx.spawn(
                    self._failover(served, lost), f"serve-failover:{served.name}"
                )

    def _rebuild_grace_s(self) -> float:
        return 2 * self.ctx.config.failure_timeout_s

    async def _failover(self, served: _Served, lost: list[str]) -> None:
        if lost:
            log.warning("serving %s: lost stage node(s) %s; re-placing", served.name, lost)
        elif served.crashed:
            log.warning("serving %s: stage worker(s) died (%s); re-placing", served.name,
                        "; ".join(f"stage {i}: {m}" for i, m in sorted(served.crashed.items())))  # fmt: skip
        old_attempt, old_nodes = served.live_attempt, {s["node_id"] for s in served.placed}
        try:
            first, back = await self._build(served)
        except (ServeError, RuntimeError, OSError) as exc:
            reason = f"a stage node was lost ({', '.join(lost) or 'earlier'}) and the model "
            reason += f"cannot be re-placed on the live nodes: {exc}"
            if served.state != "degraded" or served.reason != reason:
                log.warning("serving %s: %s", served.name, reason)
            now = time.monotonic()
            if served.degraded_since is None:
                served.degraded_since = now
            served.state, served.reason = "degraded", reason
            # The leader may still count the lost node alive for up to a failure timeout and
            # place a stage on it: keep the open sessions and retry each round for a grace of
            # two failure timeouts; only then fail them, with the reason.
            if now - served.degraded_since > self._rebuild_grace_s():
                _fail_open(served.client, reason)
            return
        await self._stop_stages(served.serve_id, old_attempt, old_nodes)
        served.replayed += served.client.active
        olds = await asyncio.to_thread(served.client.reroute, first, back)
        for link in olds:
            link.close()
            with contextlib.suppress(ValueError):
                served.links.remove(link)
        served.failovers += 1
        served.state, served.reason, served.degraded_since = "serving", "", None
        self._spawn_standby(served)

    # --- standby copies of a trained model's shards ---------------------------------------------

    def _note_copy(self, served: _Served, stage: int, node: str) -> None:
        """``node`` holds a copy of ``stage``'s shard now: use it here, and have the leader
        list it in the registry (best effort: a copy it misses is only not found later)."""
        served.holders[stage].append(node)
        note = ShardCopy(job_id=served.trained["job_id"], stage=stage, node_id=node)

        async def tell() -> None:
            try:
                await self.ctx.to_leader(note, 10.0)
            except (ServeError, SwarmError) as exc:
                log.info("the registry does not list %s's copy of stage %d: %s", node, stage, exc)

        self.ctx.spawn(tell(), f"shard-copy:{note.job_id}:{stage}")

    def _spawn_standby(self, served: _Served) -> None:
        if served.trained is not None:
            self.ctx.spawn(self._standby(served), f"serve-standby:{served.name}")

    async def _standby(self, served: _Served) -> None:
        """Give every stage's shard a second live holder (a copy in that node's job folder),
        so losing a stage's node does not lose the only copy of its trained weights."""
        from swarmp2p.node.messages import FilePull

        job_id = served.trained["job_id"]
        for i, st in enumerate(served.trained["manifest"]["stages"]):
            alive = self._alive()
            live = [h for h in served.holders[i] if h in alive]
            others = sorted(alive - set(live))
            if (
                not live
                or len(live) >= 2
                or not others
                or self.served.get(served.name) is not served
            ):
                continue
            target, source = others[i % len(others)], live[0]
            try:
                endpoint = (
                    self.ctx.own_endpoint
                    if source == self.ctx.node_id
                    else self.stages.peer_endpoint(source)
                )
                for name in [*sorted(st["files"]), "manifest.json"]:
                    pull = FilePull(job_id=job_id, file=f"{st['folder']}/{name}", source=endpoint)
                    if target == self.ctx.node_id:
                        await self.stage_host.pull_file(pull.job_id, pull.file, pull.source)
                    else:
                        await self.ctx.call_endpoint(
                            self.stages.peer_endpoint(target), pull, COPY_TIMEOUT_S
                        )
            except (ServeError, RpcError, RpcTimeout, OSError, ValueError) as exc:
                log.warning("serving %s: no standby copy of stage %d on %s: %s", served.name, i, target, exc)  # fmt: skip
                continue
            if target not in served.holders[i]:
                self._note_copy(served, i, target)
            log.info("serving %s: stage %d's shard has a standby copy on %s", served.name, i, target)  # fmt: skip

    # --- the leader: placement ------------------------------------------------------------------

    async def _place(self, msg: ServePlace) -> ServePlaced:
        if self.ctx.leader != self.ctx.node_id:
            raise RpcError("not_leader", f"node {self.ctx.node_id} is not the leader")
        from swarmp2p.plan import model_shape

        try:
            if msg.shape is not None:
                shape = model_shape.shape_from_wire(msg.shape)
            else:
                shape = await asyncio.to_thread(model_shape.load, msg.model)
        except (OSError, ValueError) as exc:
            raise RpcError("bad_model", f"model {msg.model!r}: {exc}") from None
        if (
            msg.bounds is not None
            and msg.holders is not None
            and len(msg.holders) != len(msg.bounds)
        ):
            raise RpcError("bad_field", "holders: one list of nodes per stage of bounds")
        from swarmp2p.node.decide import available_memory

        # never on memory a job's stages or another served model already take
        records = available_memory(self.ctx.live_records(), self.ctx.table)
        try:
            stages = place_stages(
                shape,
                records,
                stages=msg.stages,
                max_sessions=msg.max_sessions,
                max_context=msg.max_context,
                dtype=msg.dtype,
                quantization=msg.quantization,
                bounds=msg.bounds,
                holders=msg.holders,
            )
        except ServeError as exc:
            raise RpcError("blocked", str(exc)) from None
        except (TypeError, ValueError) as exc:
            raise RpcError("bad_field", f"serve.plan: {exc}") from None
        return ServePlaced(serve_id=msg.serve_id, leader=self.ctx.node_id, stages=stages)

    # --- every node: dispatch ---------------------------------------------------------------

    async def handle(self, msg: Any) -> Any:
        if isinstance(msg, ServePlace):
            return await self._place(msg)
        if isinstance(msg, ServeFileRead):
            return await self._read_file(msg)
        if isinstance(msg, ServeStageExit):
            served = next((s for s in self.served.values() if s.serve_id == msg.serve_id), None)
            if served is not None and served.live_attempt == msg.attempt:
                served.crashed[msg.stage] = f"node {msg.node_id}: {msg.message}"
            return ServeStage(
                serve_id=msg.serve_id, attempt=msg.attempt, stage=msg.stage, endpoint="",
                state="exited",
            )  # fmt: skip
        if isinstance(msg, (ServeStageStart, ServeStageConnect, ServeStageStop)):
            return await self.stages.handle(msg)
        raise RpcError("unexpected", f"serving does not take {type(msg).TYPE}")

    async def _read_file(self, msg: ServeFileRead) -> ShardChunk:
        """A chunk of a file of a folder model this node serves (to a stage node fetching it)."""
        from swarmp2p.node.stages import CHUNK_BYTES

        served = next((s for s in self.served.values() if s.serve_id == msg.serve_id), None)
        if served is None or not served.files or msg.file not in served.files:
            raise RpcError("no_file", f"node {self.ctx.node_id} serves no file {msg.file!r} of {msg.serve_id}")  # fmt: skip
        if not 0 < msg.size <= CHUNK_BYTES or msg.offset < 0:
            raise RpcError("bad_field", f"size must be in 1..{CHUNK_BYTES}, offset >= 0")

        def read() -> ShardChunk:
            with open(os.path.join(served.folder, msg.file), "rb") as f:
                total = os.fstat(f.fileno()).st_size
                f.seek(msg.offset)
                return ShardChunk(data=f.read(msg.size), total=total)

        try:
            return await asyncio.to_thread(read)
        except FileNotFoundError:  # a trained model's base: this node holds only its config
            raise RpcError("no_file", f"node {self.ctx.node_id} holds no {msg.file} of {msg.serve_id}") from None  # fmt: skip


def _fail_open(client: Any, reason: str) -> None:
    """Fail every open session of ``client`` now with ``reason`` (RingClient has no public
    "fail all"; ``cancel`` per session does it)."""
    for session in list(getattr(client, "_sessions", {}).values()):
        client.cancel(session, reason)


__all__ = ["ServeError", "Serving", "place_stages"]
