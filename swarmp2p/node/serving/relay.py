"""Any member reaches any served model: `swarm generate`/`swarm chat` on a node that does not
serve MODEL go to the node that does over the swarm's CURVE links, never over plain HTTP
between machines. Never imports torch.

The member's CLI asks its own daemon (``relay_open``, then ``relay_next`` until done, on the
local socket); the daemon finds MODEL's issuing node in the replicated table and forwards
each ask as ``serve.relay_open``/``serve.relay_next``. The issuing node posts the body to its
own API on this machine (the same checks, key, metrics and streaming as any HTTP client's)
and hands the response back in pieces as they come: a streamed answer arrives token by
token. Membership is the authorization (the control port admits only members' keys); the
API key guards the HTTP port, which anyone on the LAN may reach.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from swarmp2p._tasks import cancel_all
from swarmp2p.errors import Failed, Unavailable, UserError
from swarmp2p.node import requests as rq
from swarmp2p.node.messages import RELAY_TEXT_CHARS, ServeRelay, ServeRelayNext, ServeRelayOpen
from swarmp2p.node.serving.ring import call_node
from swarmp2p.node.table.served import LIVE_SERVE_STATES

if TYPE_CHECKING:
    import aiohttp

    from swarmp2p.node.api import ApiHandler
    from swarmp2p.node.context import NodeContext

log = logging.getLogger("swarmp2p.node.serving.relay")

MAX_RELAYS_PER_NODE = 16
"""Relayed requests one member may have open on an issuing node at once (a ring serves a
few sessions; past this a member's client is looping, not waiting)."""

Target = Callable[[str], "tuple[str, str | None] | None"]
"""served name -> (the API's base URL on this machine, its API key), None: not served here."""


@dataclass(eq=False, kw_only=True)
class _Relay:
    """One relayed request on the issuing node: its response so far, not yet asked for."""

    sender: str
    asked_at: float
    status: int = 0
    pending: list[str] = field(default_factory=list)
    size: int = 0
    done: bool = False
    task: asyncio.Task | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    drained: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, text: str) -> None:
        if text:
            self.pending.append(text)
            self.size += len(text)
        self.changed.set()

    def take(self) -> str:
        """Up to RELAY_TEXT_CHARS of what is pending, in order."""
        out, n = [], 0
        while self.pending and n + len(self.pending[0]) <= RELAY_TEXT_CHARS:
            n += len(self.pending[0])
            out.append(self.pending.pop(0))
        if not out and self.pending:  # one piece larger than a reply: split it
            head = self.pending[0]
            out.append(head[:RELAY_TEXT_CHARS])
            self.pending[0] = head[RELAY_TEXT_CHARS:]
            n = RELAY_TEXT_CHARS
        self.size -= n
        self.drained.set()
        return "".join(out)


def local_url(url: str) -> str:
    """The base URL to reach an API bound to ``url``'s address from this machine (a wildcard
    bind answers on loopback)."""
    for wildcard, loopback in (("//0.0.0.0:", "//127.0.0.1:"), ("//[::]:", "//[::1]:")):
        url = url.replace(wildcard, loopback, 1)
    return url


class Relays:
    """Both sides of relayed requests on one daemon: the issuing node's relays of its own API
    (``serve.relay_*`` from members) and the member's local API ops forwarding to an issuer."""

    def __init__(self, ctx: NodeContext, target: Target, clock=time.monotonic) -> None:
        self.ctx, self.target, self.clock = ctx, target, clock
        self._relays: dict[int, _Relay] = {}
        self._http: aiohttp.ClientSession | None = None

    # --- the issuing node ------------------------------------------------------------------

    async def handle(self, msg: ServeRelayOpen | ServeRelayNext, sender: str) -> ServeRelay:
        if isinstance(msg, ServeRelayOpen):
            return self._open(msg, sender)
        return await self._next(msg, sender)

    def _open(self, msg: ServeRelayOpen, sender: str) -> ServeRelay:
        found = self.target(msg.model)
        if found is None:
            raise UserError(
                f"model {msg.model!r} is not served from node {self.ctx.node_id}",
                code="not_served",
            )
        if sum(r.sender == sender for r in self._relays.values()) >= MAX_RELAYS_PER_NODE:
            raise Unavailable(
                f"node {sender} has {MAX_RELAYS_PER_NODE} relayed requests open on node "
                f"{self.ctx.node_id}; let one finish",
                code="slow_down",
            )
        relay_id = secrets.randbits(62) + 1
        relay = _Relay(sender=sender, asked_at=self.clock())
        url, key = found
        relay.task = asyncio.ensure_future(self._pump(relay, local_url(url), key, msg))
        self._relays[relay_id] = relay
        return ServeRelay(relay=relay_id)

    async def _pump(self, relay: _Relay, url: str, key: str | None, msg: ServeRelayOpen) -> None:
        """Post the body to this node's API; what it writes goes into ``relay``."""
        import aiohttp

        if self._http is None:
            timeout = aiohttp.ClientTimeout(
                total=None, sock_read=self.ctx.config.timings.api_client_s
            )
            self._http = aiohttp.ClientSession(timeout=timeout)
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        stream = False
        try:
            with contextlib.suppress(ValueError, AttributeError):
                stream = bool(json.loads(msg.body).get("stream"))
            async with self._http.post(
                url + msg.path, data=msg.body.encode(), headers=headers
            ) as r:
                relay.status = r.status
                decoder = codecs.getincrementaldecoder("utf-8")("replace")
                async for piece in r.content.iter_any():
                    relay.push(decoder.decode(piece))
                    while relay.size >= RELAY_TEXT_CHARS:  # nobody asked for it yet: wait
                        relay.drained.clear()
                        await relay.drained.wait()
                relay.push(decoder.decode(b"", final=True))
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            error = {"message": f"node {self.ctx.node_id}'s API failed the request: {exc}"}
            if relay.status == 0:
                relay.status = 502
                relay.push(json.dumps({"error": error}))
            elif stream:
                relay.push("data: " + json.dumps({"error": error}) + "\n\ndata: [DONE]\n\n")
        finally:
            relay.done = True
            relay.changed.set()

    async def _next(self, msg: ServeRelayNext, sender: str) -> ServeRelay:
        relay = self._relays.get(msg.relay)
        if relay is None or relay.sender != sender:
            raise Failed(
                f"node {self.ctx.node_id} holds no relayed request {msg.relay} of node {sender} "
                f"(it ended, or nobody asked for it for "
                f"{self.ctx.config.timings.relay_idle_s:g} s)",
                code="failed",
            )
        relay.asked_at = self.clock()
        if msg.close:
            await self._drop(msg.relay)
            return ServeRelay(relay=msg.relay, status=relay.status, done=True)
        if not relay.pending and not relay.done:
            relay.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(relay.changed.wait(), self.ctx.config.timings.relay_wait_s)
        text = relay.take() if relay.status else ""
        done = relay.done and not relay.pending
        if done:
            self._relays.pop(msg.relay, None)
        return ServeRelay(relay=msg.relay, status=relay.status, text=text, done=done)

    async def _drop(self, relay_id: int) -> None:
        relay = self._relays.pop(relay_id, None)
        if relay is not None:
            await cancel_all(relay.task)

    def reap(self) -> None:
        """Each round: cancel the relays nobody asked about for ``relay_idle_s``."""
        idle = self.ctx.config.timings.relay_idle_s
        now = self.clock()
        for relay_id, relay in list(self._relays.items()):
            if now - relay.asked_at > idle:
                log.info(
                    "relayed request of node %s: nobody asked for %g s; cancelled",
                    relay.sender,
                    idle,
                )
                self._relays.pop(relay_id, None)
                if relay.task is not None:
                    relay.task.cancel()

    async def close(self) -> None:
        relays, self._relays = list(self._relays.values()), {}
        await cancel_all(*(r.task for r in relays))
        if self._http is not None:
            await self._http.close()
            self._http = None

    # --- the member: the local API's ops --------------------------------------------------

    def issuer_of(self, model: str) -> str | None:
        """The node that serves ``model`` (the table's served models, live ones, by serve id)."""
        live = sorted(
            (m for m in self.ctx.table.served.values() if m.state in LIVE_SERVE_STATES),
            key=lambda m: m.serve_id,
        )
        return next((m.issuer for m in live if m.name == model), None)

    def served_names(self) -> str:
        """The swarm's served models with their issuing nodes, for a message."""
        live = [m for m in self.ctx.table.served.values() if m.state in LIVE_SERVE_STATES]
        return ", ".join(sorted(f"{m.name} (node {m.issuer})" for m in live)) or "none"

    def api_handlers(self) -> dict[str, ApiHandler]:
        return {"relay_open": self._api_open, "relay_next": self._api_next}

    async def _api_open(self, req: rq.RelayOpenRequest) -> dict[str, Any]:
        node = self.issuer_of(req.model)
        if node is None:
            raise UserError(
                f"model {req.model!r} is not served in the swarm (served: "
                f"{self.served_names()}); `swarm serve {req.model}` serves it",
                code="not_served",
            )
        if node not in self.ctx.live_nodes():
            raise Unavailable(
                f"model {req.model!r} is served from node {node}, which this node does not "
                "see now (`swarm peers`)",
                code="no_peer",
            )
        msg = ServeRelayOpen(model=req.model, path=req.path, body=req.body)
        reply = await call_node(self.ctx, node, msg, self.ctx.config.timings.relay_call_s)
        return {"node": node, "relay": reply.relay}

    async def _api_next(self, req: rq.RelayNextRequest) -> dict[str, Any]:
        if req.node not in self.ctx.table.member_ids or req.node == self.ctx.node_id:
            raise UserError(
                f"node {req.node!r} is not another member of the swarm", code="bad_field"
            )
        msg = ServeRelayNext(relay=req.relay, close=req.close)
        reply = await call_node(self.ctx, req.node, msg, self.ctx.config.timings.relay_call_s)
        return {"status": reply.status, "text": reply.text, "done": reply.done}


__all__ = ["MAX_RELAYS_PER_NODE", "Relays", "local_url"]
