"""The issuing node's ring for ``swarm serve``: what it holds per served model, the plan it asks
the leader for (``serve.plan``, answered from ``plan.serve.plan_serve`` over the live nodes'
records), and the ring built from it with :func:`swarmp2p.serve.ring.build_ring` (each stage
started on its node with ``serve.stage_start``, which re-checks the plan, then connected).
Never imports torch."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from swarmp2p.errors import Failed, SwarmError, Unavailable, UserError, from_code
from swarmp2p.net.rpc import RpcTimeout
from swarmp2p.node.messages import (
    ServePlace,
    ServePlaced,
    ServeStage,
    ServeStageConnect,
    ServeStageStart,
    ServeStageStop,
)
from swarmp2p.node.training.jobs import blocked_note, cluster_records
from swarmp2p.plan.serve import ServeInputs, ServePlan, ServeRequest
from swarmp2p.plan.split import Compression
from swarmp2p.schema import SchemaError
from swarmp2p.serve.ring import RingEnds, build_ring
from swarmp2p.wire.messages import Message

if TYPE_CHECKING:
    from swarmp2p.net import SecureContext, ZmqLink
    from swarmp2p.node.context import NodeContext
    from swarmp2p.node.serving.model import TrainedEntry
    from swarmp2p.node.serving.model_files import FileListing
    from swarmp2p.node.table.served import ServedModel
    from swarmp2p.node.training.resolve import LocalModel
    from swarmp2p.plan.model_shape import ModelShape
    from swarmp2p.plan.quantization import QuantSpec
    from swarmp2p.serve.api import ApiServer
    from swarmp2p.serve.sessions import RingClient

log = logging.getLogger("swarmp2p.node.serving.service")


@dataclass(eq=False, kw_only=True)
class Served:
    """What this node runs for a model it serves (it ran ``swarm serve``): the request as it
    resolved it here and the ring's runtime handles. The model's state (placement, failovers,
    why it is degraded) is the table's ``ServedModel``; this only carries it out."""

    request: ServeRequest
    """The request, its API key included (the table holds only its digest)."""
    serve_id: str
    folder: str
    """The model folder (or Hub id) read here; a trained model's base."""
    shape: ModelShape
    """The model's shape, read here and sent with each plan."""
    dtype: str | None
    """The dtype asked for (a trained model's training dtype); None: the plan's choice."""
    quantization: QuantSpec | None
    trained: TrainedEntry | None = None
    """A registry model's entry (``swarm models``) when MODEL names one; its stages load
    the base model plus their trained shards."""
    holders: list[list[str]] = field(default_factory=list)
    """A trained model: per stage, the nodes known to hold an intact copy of its shard."""
    files: FileListing | None = None
    """A folder model: ``{name: [bytes, sha256]}`` of its files, for stage nodes to check or
    fetch their copy against."""
    embedded: bool = False
    draft: str | None = None
    """The draft model stage 0 drafts with (a folder as every node names it, or "embedded")."""
    draft_shape: ModelShape | None = None
    local: LocalModel | None = None
    """The model as ``node.inputs.serve_model`` resolved it here (tokenizer folder, revision)."""
    attempt: int = 0
    """The newest ring attempt tried from here (each attempt's workers are told apart)."""
    live_attempt: int = 0
    """The attempt whose workers this node started for the ring now (0: none)."""
    live_nodes: tuple[str, ...] = ()
    zmq: SecureContext | None = None
    links: list[ZmqLink] = field(default_factory=list)
    client: RingClient | None = None
    api: ApiServer | None = None
    url: str = ""

    @property
    def name(self) -> str:
        return self.request.served_name


def served_view(record: ServedModel | None, here: Served | None, restoring: bool) -> dict[str, Any]:
    """What ``swarm status`` shows of a served model: the table's record, with this node's
    handles where it runs them (``restoring``: this node drives no ring of it yet)."""
    plan = record.plan if record is not None else None
    holders = here.holders if here is not None and here.trained else None
    state = record.state if record is not None else "starting"
    if restoring and record is not None and state != "failed":
        state = "restoring"
    name = record.name if record is not None else here.name if here is not None else ""
    endpoints = record.endpoints if record is not None else ()
    return {
        "model": name,
        "trained": here.trained["id"] if here is not None and here.trained else None,
        "url": (record.url if record is not None else "") or (here.url if here else ""),
        "state": state,
        "reason": record.reason if record is not None else "",
        "failovers": record.failovers if record is not None else 0,
        "replayed": record.replayed if record is not None else 0,
        "dtype": plan.dtype if plan is not None else None,
        "max_context": plan.max_context if plan is not None else None,
        "sessions": _sessions(here.client) if here is not None else None,
        "stages": [
            {
                "index": s.index,
                "node_id": s.node_id,
                "node": s.node_id,
                "node_name": s.node,
                "devices": [s.device],
                "layers": list(s.layers),
                "memory": s.memory.peak,
                "endpoint": endpoints[s.index] if s.index < len(endpoints) else "",
                **({"holders": list(holders[s.index])} if holders else {}),
            }
            for s in (plan.stages if plan is not None else ())
        ],
    }


def _sessions(client: RingClient | None) -> dict[str, object] | None:
    """The ring's sessions now: running, queued for a slot, the bound, the rows of the
    latest decode step at each stage, and its speculative decoding (the mode, why it is off
    where a stage declined, acceptance and tokens per lap; None before the ring runs)."""
    if client is None:
        return None
    return {
        "active": client.active,
        "queued": client.queue_depth,
        "max": client.max_sessions,
        "stage_batch": list(client.stage_batch_sizes),
        "speculate": client.speculate,
        "draft_model": client.draft_model,
        "speculate_off": client.spec_off,
        "speculation": client.spec_stats(),
        "prefix_cache": client.prefix_stats,
    }


async def call_node(ctx: NodeContext, node_id: str, msg: Message, timeout: float) -> Message:
    """A request to a node (this one included); a refusal keeps its code and names the node."""
    try:
        return await ctx.call(node_id, msg, timeout)
    except RpcTimeout:
        raise Failed(
            f"node {node_id} did not answer {msg.TYPE} in {timeout:g} s", code="stage_failed"
        ) from None
    except SwarmError as exc:
        raise from_code(exc.code, f"node {node_id}: {exc.message}") from None


def alive_holders(served: Served, alive: frozenset[str]) -> list[list[str]]:
    """Per stage, the live holders of its shard; Unavailable when a stage has none."""
    out = [[h for h in held if h in alive] for held in served.holders]
    lost = [(i, held) for i, (held, live) in enumerate(zip(served.holders, out)) if not live]
    if lost:
        raise Unavailable(
            "; ".join(
                f"stage {i}'s trained shard is held only by {', '.join(held)}, not alive"
                for i, held in lost
            )
            + f"; {served.trained['id']} cannot be served until one of them is back",
            code="no_peer",
        )
    return out


def inputs_of(served: Served, alive: frozenset[str]) -> ServeInputs:
    """What the issuing node plans from (the leader adds the live nodes' records)."""
    req = served.request
    trained = served.trained
    return ServeInputs(
        shape=served.shape,
        stages=req.stages,
        dtype=served.dtype,
        quantization=served.quantization,
        max_sessions=req.max_sessions,
        max_context=req.max_context,
        prefix_cache_mb=req.prefix_cache_mb,
        draft=served.draft,
        draft_shape=served.draft_shape,
        bounds=tuple(tuple(b) for b in trained["manifest"]["split"]) if trained else None,
        holders=tuple(tuple(h) for h in alive_holders(served, alive)) if trained else None,
        trained_compression=tuple(
            Compression.from_data(c, f"compression[{i}]")
            for i, c in enumerate(trained["manifest"].get("compression", []))
        )
        if trained
        else (),
    )


def place(ctx: NodeContext, msg: ServePlace) -> ServePlaced:
    """The leader: the serve plan of ``msg.inputs`` over the live nodes; Failed (``blocked``)
    naming every device that cannot take its stage."""
    if ctx.leader != ctx.node_id:
        raise Unavailable(f"node {ctx.node_id} is not the leader", code="not_leader")
    from swarmp2p.node.decide import available_memory

    # never on memory a job's stages or another served model already take
    records = available_memory(ctx.live_records(), ctx.table)
    inputs = replace(msg.inputs, cluster=tuple(cluster_records(records)))
    try:
        result = inputs.plan()
    except SchemaError as exc:  # a request no cluster could meet (more stages than blocks)
        raise UserError("; ".join(str(e) for e in exc.errors), code="bad_field") from None
    if not isinstance(result, ServePlan):
        raise Failed(blocked_note(result.reason, records), code="blocked")
    return ServePlaced(
        serve_id=msg.serve_id, leader=ctx.node_id, inputs=inputs, plan=result.to_json()
    )


async def plan_ring(ctx: NodeContext, served: Served) -> tuple[ServeInputs, ServePlan]:
    """Ask the leader (this node, or forwarded) for the ring's plan."""
    ask = ServePlace(serve_id=served.serve_id, inputs=inputs_of(served, ctx.live_nodes()))
    if ctx.leader == ctx.node_id:
        reply = place(ctx, ask)
    else:
        try:
            reply = await ctx.to_leader(ask, ctx.config.timings.serve_plan_s)
        except RpcTimeout:
            raise Unavailable(
                f"the leader {ctx.leader} did not answer serve.plan in {ctx.config.timings.serve_plan_s:g} s",
                code="no_leader",
            ) from None
    if not isinstance(reply, ServePlaced):
        raise Failed(f"the leader answered {type(reply).TYPE}, not serve.placed")
    return reply.inputs, ServePlan.from_json(reply.plan)


def shard_ask(served: Served, alive: frozenset[str], i: int, n: int) -> dict[str, Any]:
    """What a stage node needs to make stage ``i``'s trained shard local."""
    stages = served.trained["manifest"]["stages"]
    holders = alive_holders(served, alive)
    tied = None
    if (
        i == n - 1
        and n > 1
        and served.shape.tie_embeddings
        and stages[0].get("weights_included", True)
    ):
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


async def stop_stages(ctx: NodeContext, serve_id: str, attempt: int, nodes: set[str]) -> None:
    """Stop the workers of ``attempt`` on ``nodes`` (the live ones)."""
    stop = ServeStageStop(serve_id=serve_id, attempt=attempt, stage=-1)
    await asyncio.gather(
        *(call_node(ctx, node, stop, 15.0) for node in sorted(nodes & ctx.live_nodes())),
        return_exceptions=True,
    )


async def build(
    ctx: NodeContext, served: Served, on_copy: Callable[[int, str], None]
) -> tuple[ServePlan, RingEnds]:
    """Plan, then start and connect every stage: the plan and the new ring's ends. On failure
    every worker of this attempt is stopped and the new links closed. ``on_copy(stage, node)``
    hears of a node that fetched a copy of a trained stage's shard to serve it."""
    from swarmp2p.net import ClientKeys, KeyCheck, ServerKeys, ZmqLink

    served.attempt += 1
    attempt = served.attempt
    inputs, plan = await plan_ring(ctx, served)
    n = len(plan.stages)
    alive = ctx.live_nodes()
    nodes = {s.node_id for s in plan.stages}
    # the ring's links are keyed per node: the return link admits only the last stage's
    # node, and the first stage's node is the only one the issuer dials
    first_key = ctx.member_key(plan.stages[0].node_id)
    last_key = ctx.member_key(plan.stages[-1].node_id)
    mine = ctx.key
    back_keys = ServerKeys(
        public=mine.public,
        secret=mine.secret,
        admits=KeyCheck.only(last_key),
        domain=f"swarmp2p-serve-{last_key}",
    )
    first_keys = ClientKeys(public=mine.public, secret=mine.secret, server=first_key)

    async def start(i: int) -> str:
        node = plan.stages[i].node_id
        msg = ServeStageStart(
            serve_id=served.serve_id,
            attempt=attempt,
            stage=i,
            inputs=inputs,
            plan=plan.to_json(),
            model=served.folder,
            issuer=ctx.node_id,
            embedded=served.embedded,
            revision=served.local.revision if served.local is not None else "",
            files=served.files,
            shard=shard_ask(served, alive, i, n) if served.trained else None,
        )
        reply = await call_node(ctx, node, msg, ctx.config.timings.serve_stage_start_s)
        if not isinstance(reply, ServeStage) or not reply.endpoint:
            raise Failed(
                f"node {node} answered serve.stage_start without an endpoint", code="stage_failed"
            )
        if served.trained and node not in served.holders[i]:
            on_copy(i, node)  # it fetched a copy
        return reply.endpoint

    async def connect(i: int, after: str) -> None:
        msg = ServeStageConnect(serve_id=served.serve_id, attempt=attempt, stage=i, next=after)
        await call_node(ctx, plan.stages[i].node_id, msg, ctx.config.timings.serve_stage_connect_s)

    async def stop() -> None:
        await stop_stages(ctx, served.serve_id, attempt, nodes)

    ends = await build_ring(
        n,
        bind_back=lambda: ZmqLink.bind(served.zmq, back_keys, ctx.me.addresses[0]),
        start=start,
        connect=connect,
        dial=lambda endpoint: ZmqLink.dial(served.zmq, first_keys, endpoint),
        stop=stop,
    )
    if served.live_attempt:
        log.info(
            "serving %s: ring rebuilt (attempt %d) on %s",
            served.name,
            attempt,
            ", ".join(s.node_id for s in plan.stages),
        )
    served.live_attempt, served.live_nodes = attempt, tuple(sorted(nodes))
    served.links.extend([ends.back, ends.first])
    return plan, ends


async def open_served(
    ctx: NodeContext, served: Served, on_copy: Callable[[int, str], None], step_timeout: float
) -> tuple[ServePlan, RingEnds]:
    """Start the first ring of ``served`` and its API (``served.url``): the ring's plan and
    ends. On failure what started stays in ``served`` for :func:`close_served`."""
    from swarmp2p.net import SecureContext
    from swarmp2p.serve import ServedModel as ApiModel
    from swarmp2p.serve import build_app
    from swarmp2p.serve.api import ApiServer
    from swarmp2p.serve.text import TextCodec

    served.zmq = SecureContext()
    codec_folder = served.local.codec if served.local is not None else served.folder
    codec = await asyncio.to_thread(TextCodec.from_folder, codec_folder)
    if served.files is None and os.path.isdir(served.folder):
        from swarmp2p.node.serving.model_files import folder_listing

        try:
            served.files = await asyncio.to_thread(folder_listing, served.folder)
        except (OSError, ValueError) as exc:
            raise Failed(f"model {served.name!r}: {exc}", code="no_file") from None
    plan, ends = await build(ctx, served, on_copy)
    trained = served.trained["id"] if served.trained else served.folder
    client = ends.open_client(
        plan,
        step_timeout=step_timeout,
        speculate=served.request.speculate,
        salt=f"{served.name}\0{trained}",
    )
    served.client = client
    model = ApiModel(name=served.name, client=client, codec=codec, max_context=plan.max_context)
    req = served.request
    served.api = ApiServer(build_app([model], api_key=req.api_key), req.host, req.port)
    try:
        served.url = await served.api.start_async()  # on this daemon's loop
    except OSError as exc:
        served.api = None
        raise UserError(
            f"port: cannot listen on {req.host}:{req.port}: {exc}", code="bad_field"
        ) from None
    return plan, ends


async def close_served(ctx: NodeContext, served: Served) -> None:
    """Close the API, the ring client and links of ``served`` and stop the workers it
    started."""
    if served.api is not None:
        await served.api.close_async()
        served.api = None
    if served.client is not None:
        await asyncio.to_thread(served.client.close)
        served.client = None
    if served.live_attempt:
        nodes = set(served.live_nodes)
        await stop_stages(ctx, served.serve_id, served.live_attempt, nodes)
    for link in served.links:
        link.close()
    served.links = []
    if served.zmq is not None:
        from swarmp2p.net import stop_zero_copy_collector

        stop_zero_copy_collector()
        served.zmq.destroy(0)
        served.zmq = None


def check_request(req: ServeRequest) -> None:
    """The API's bind rule (beyond loopback only with an API key) and its port free, as a
    UserError: before any stage loads, not once the ring runs."""
    from swarmp2p.serve.api import check_bind

    try:
        check_bind(req.host, req.api_key)
    except ValueError as exc:
        raise UserError(str(exc), code="bad_field") from None
    if req.port:
        _check_port(req.host, req.port)


def _check_port(host: str, port: int) -> None:
    """UserError naming the port and the flag when nothing can listen on ``host:port`` now
    (bound as aiohttp binds it, SO_REUSEADDR, so a closed server's TIME_WAIT is no conflict)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise UserError(f"host: cannot listen on {host!r}: {exc}", code="bad_field") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            taken = "in use (another `swarm serve` or program listens there)"
            why = taken if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
            raise UserError(
                f"port: cannot listen on {host}:{port}: {why}; pass --port N for another "
                "port (--port 0: any free one)",
                code="bad_field",
            ) from None


__all__ = [
    "Served",
    "alive_holders",
    "build",
    "call_node",
    "check_request",
    "close_served",
    "inputs_of",
    "open_served",
    "place",
    "plan_ring",
    "served_view",
    "shard_ask",
    "stop_stages",
]
