"""The OpenAI-compatible HTTP API (aiohttp): ``/v1/models`` (and ``/v1/models/{id}``),
``/v1/completions``, ``/v1/chat/completions``, streaming as server-sent events, ``usage``,
OpenAI's error shape, ``/health`` and ``/metrics`` (Prometheus text).

Generation runs on a :class:`~swarmp2p.serve.RingClient`, which never blocks the event loop:
this module routes, guards and answers; ``serve/request.py`` validates a request into token ids
and sampling parameters, ``serve/generation.py`` runs its sessions (one per choice) and turns
their tokens back into text. The app (:func:`build_app`) mounts on any aiohttp loop;
:class:`ApiServer` runs it on its own thread.
Everything but a loopback address needs an API key (``--api-key`` or ``SWARM_API_KEY``); the
``Host`` of every request must be this server's (127.0.0.1, localhost, ::1, or the bound
host) and a browser's ``Origin`` too, so DNS rebinding and cross-site posts get 403.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import threading
import time
import urllib.parse
import uuid
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from swarmp2p._ratelog import HttpLog
from swarmp2p.serve.generation import Choice, ClientGone, Generation
from swarmp2p.serve.metrics import ServeMetrics
from swarmp2p.serve.request import ApiError, ServedModel, model_not_found, parse_body
from swarmp2p.serve.session import GenerationError
from swarmp2p.timings import TIMINGS

log = logging.getLogger("swarmp2p.serve.api")

API_KEY_ENV = "SWARM_API_KEY"
MAX_BODY_BYTES = 8 * 2**20
OFF_LOOP_BYTES = 64 * 1024
"""A request body larger than this is parsed and tokenized on a worker thread, so that the
event loop (the daemon's, once it mounts the app) never stalls on a long prompt."""
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
ARRIVED = web.RequestKey("swarm_arrived", float)
"""When the request arrived (time.monotonic): time to first token counts from it."""
MODEL = web.RequestKey("swarm_model", str)


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond loopback without an API key."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not api_key:
        raise ValueError(
            f"refusing to serve the API on {host} without an API key: anyone who can reach it "
            f"could use the swarm; pass --api-key-file FILE or --api-key - (stdin), or set "
            f"{API_KEY_ENV} (or bind 127.0.0.1)"
        )


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _Api:
    def __init__(
        self, models: Sequence[ServedModel], api_key: str | None, hosts: frozenset[str] | None
    ) -> None:
        self.models = {m.name: m for m in models}
        self.api_key = api_key
        self.metrics = ServeMetrics()
        self.closing = False
        self.hosts = None if hosts is None else set(hosts)
        """Host names requests may name; None: any."""

    def allow_host(self, host: str) -> None:
        """Also answer requests naming ``host`` (the address a server bound); any host for
        an address on every interface."""
        if self.hosts is not None:
            wider = allowed_hosts(host)
            self.hosts = None if wider is None else self.hosts | wider

    async def health(self, request: web.Request) -> web.Response:
        stopped = [m.name for m in self.models.values() if m.client.closed]
        body = {
            "status": "stopping" if self.closing else "unavailable" if stopped else "ok",
            "models": {
                m.name: {"active": m.client.active, "queued": m.client.queue_depth}
                for m in self.models.values()
            },
        }
        return web.json_response(body, status=503 if self.closing or stopped else 200)

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(self.models.values()).encode("utf-8"),
            headers={
                "Content-Type": "text/plain; version=0.0.4; charset=utf-8",  # Prometheus' format
                "X-Content-Type-Options": "nosniff",
            },
        )

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [m.card() for m in self.models.values()]}
        )

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        model = self.models.get(name)
        if model is None:
            raise model_not_found(name, self.models)
        return web.json_response(model.card())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        if len(raw) > OFF_LOOP_BYTES:  # parsing and tokenizing a large body: not on the loop
            req = await asyncio.to_thread(parse_body, raw, self.models, chat)
        else:
            req = parse_body(raw, self.models, chat)
        request[MODEL] = req.model.name
        if self.closing:
            raise ApiError(503, "the server is shutting down", type="server_error")
        kind = "chat.completion" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": rid, "object": kind, "created": int(time.time()), "model": req.model.name}
        generation = Generation(
            req,
            request,
            metrics=self.metrics,
            closing=lambda: self.closing,
            arrived=request.get(ARRIVED, time.monotonic()),
        )
        generation.start()
        try:
            if req.stream:
                return await self._stream(request, generation, head)
            return await self._whole(generation, head)
        except ClientGone:
            return web.Response(status=499)  # nobody reads it; the sessions are cancelled
        finally:
            generation.close()
            if generation.choices:
                used = generation.usage()["completion_tokens"]
                self.metrics.tokens(req.model.name, len(req.prompt), used)

    async def _whole(self, generation: Generation, head: dict) -> web.Response:
        req = generation.req
        texts = {c.index: [] for c in generation.choices}
        done = 0
        while done < req.n:
            choice, kind, value = await generation.next()
            piece, _ = generation.handle(choice, kind, value)
            texts[choice.index].append(piece)
            done += kind == "done"
        choices = []
        for choice in generation.choices:
            text = "".join(texts[choice.index])
            indices = list(range(len(choice.session.tokens)))
            entry: dict[str, Any] = {"index": choice.index}
            if req.chat:
                content, calls = choice.split(text, final=True)  # before its reply_reason
                entry["message"] = {"role": "assistant", "content": content}
                if calls:
                    entry["message"].update(content=content.strip() or None, tool_calls=calls)
                content = generation.chat_logprobs(choice, indices)
                entry["logprobs"] = None if content is None else {"content": content}
            else:
                entry["text"] = text
                entry["logprobs"] = generation.completion_logprobs(choice, indices, 0)
            choices.append({**entry, "finish_reason": choice.reply_reason})
        return web.json_response({**head, "choices": choices, "usage": generation.usage()})

    async def _stream(
        self, request: web.Request, generation: Generation, head: dict
    ) -> web.StreamResponse:
        req = generation.req
        head = {**head, "object": "chat.completion.chunk" if req.chat else "text_completion"}
        extra = {"usage": None} if req.include_usage else {}
        offsets = [0] * req.n

        def chunk(
            choice: Choice, content: str | None, tokens: list[int], finish=None, calls=()
        ) -> dict:
            if req.chat:
                delta: dict[str, Any] = {}
                if content:
                    delta["content"] = content
                if calls:
                    delta["tool_calls"] = [
                        {"index": choice.tools.calls.index(c), **c} for c in calls
                    ]
                logprobs = generation.chat_logprobs(choice, tokens)
                body = {
                    "index": choice.index,
                    "delta": delta,
                    "finish_reason": finish,
                    "logprobs": None if logprobs is None else {"content": logprobs},
                }
            else:
                body = {
                    "index": choice.index,
                    "text": content or "",
                    "finish_reason": finish,
                    "logprobs": generation.completion_logprobs(
                        choice, tokens, offsets[choice.index]
                    ),
                }
                offsets[choice.index] += len(content or "")
            return {**head, "choices": [body], **extra}

        # the first event surfaces a refusal (busy ring, failed prefill) as a plain error reply
        event = await generation.next()
        piece, tokens = generation.handle(*event)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        try:
            await response.prepare(request)
            if req.chat:
                for choice in generation.choices:
                    role = {
                        "index": choice.index,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                        "logprobs": None,
                    }
                    await response.write(_sse({**head, "choices": [role], **extra}))
            done = 0
            while True:
                choice, kind, _ = event
                piece, calls = choice.split(piece, final=kind == "done")
                if piece or calls or (tokens and req.logprobs is not None):
                    await response.write(_sse(chunk(choice, piece, tokens, calls=calls)))
                if kind == "done":
                    done += 1
                    await response.write(_sse(chunk(choice, None, [], choice.reply_reason)))
                    if done == req.n:
                        break
                event = await generation.next()
                piece, tokens = generation.handle(*event)
            if req.include_usage:
                await response.write(_sse({**head, "choices": [], "usage": generation.usage()}))
            await response.write(b"data: [DONE]\n\n")
        except ApiError as e:
            await response.write(_sse(e.body()))
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, ClientGone):
            return response  # the client left; the sessions are cancelled by the caller
        await response.write_eof()
        return response


API = web.AppKey("swarm_api", _Api)
"""The app's state (its models, metrics), for whoever mounts it."""


def _host_name(host_header: str) -> str:
    """The host of a ``Host`` header or an origin's netloc, lower-case, no port or brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def allowed_hosts(host: str, extra: Sequence[str] = ()) -> frozenset[str] | None:
    """Host names a request may name for a server bound to ``host`` (None: any — a server on
    every interface answers to addresses it cannot list; an API key guards it)."""
    if host in ("0.0.0.0", "::", ""):
        return None
    return LOOPBACK_HOSTS | {_host_name(host)} | {_host_name(h) for h in extra}


def build_app(
    models: Sequence[ServedModel],
    *,
    api_key: str | None = None,
    host: str = "127.0.0.1",
    extra_hosts: Sequence[str] = (),
) -> web.Application:
    """The aiohttp application answering for ``models`` as a server bound to ``host`` (its
    name and loopback's are the Host names it accepts, plus ``extra_hosts``; ApiServer adds the
    address it binds). Mountable on any loop; nothing in it blocks the loop."""
    api = _Api(models, api_key, allowed_hosts(host, extra_hosts))

    def _refused_host(request: web.Request) -> ApiError | None:
        hosts = api.hosts
        if hosts is None:
            return None
        given = request.headers.get("Host")
        if given is not None and _host_name(given) not in hosts:
            return ApiError(
                403,
                f"Host {given[:100]!r} is not this server's; it answers to "
                f"{', '.join(sorted(hosts))} (a DNS-rebinding guard)",
                type="permission_error",
            )
        origin = request.headers.get("Origin")
        if origin is not None:
            netloc = urllib.parse.urlsplit(origin).netloc if origin != "null" else ""
            if _host_name(netloc) not in hosts:
                return ApiError(
                    403,
                    f"Origin {origin[:100]!r} may not use this API (a cross-site request); "
                    "call it from a program, not from a web page of another site",
                    type="permission_error",
                )
        return None

    @web.middleware
    async def errors(request: web.Request, handler):
        request[ARRIVED] = time.monotonic()
        refused = _refused_host(request)
        if refused is not None:
            return refused.response()
        if api_key is not None and request.path not in ("/health",):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return ApiError(
                    401,
                    "Incorrect API key provided; send it as 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                ).response()
        try:
            response = await handler(request)
        except ApiError as e:
            response = e.response()
        except web.HTTPRequestEntityTooLarge:
            response = ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes").response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            response = ApiError(e.status, f"{request.method} {request.path}: {e.reason}").response()
        except GenerationError as e:
            response = ApiError(500, str(e), type="server_error").response()
        if request.path.endswith("completions"):
            api.metrics.request(request.get(MODEL, ""), request.path, response.status)
        return response

    async def on_shutdown(app: web.Application) -> None:
        api.closing = True  # waiting requests cancel their sessions and answer at once

    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY_BYTES)
    app.on_shutdown.append(on_shutdown)
    app[API] = api
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics_text)
    app.router.add_get("/v1/models", api.list_models)
    app.router.add_get("/v1/models/{model:.+}", api.get_model)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    return app


class ApiServer:
    """Serves an app on an event loop: the caller's (``await start_async()``, as the daemon
    does, so its served models answer on the daemon's own loop) or one of its own on a thread
    (``start()``, for ``python -m swarmp2p.serve``). Both return the base URL. Closing never
    hangs: waiting requests are cancelled, and a loop that already died is only joined."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host, self.port = app, host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    async def start_async(self) -> str:
        """Serve on the running event loop."""
        api = self.app.get(API)
        if api is not None:  # it answers to the address it binds, whatever build_app said
            api.allow_host(self.host)
        runner = web.AppRunner(
            self.app,
            access_log=None,
            logger=HttpLog(log, "API"),  # a malformed request is one line, rate-limited
            handle_signals=False,
            shutdown_timeout=TIMINGS.api_shutdown_s,
            handler_cancellation=True,
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.port = port
        self.url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        return self.url

    async def close_async(self) -> None:
        """Stop serving on the running event loop; idempotent."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def start(self) -> str:
        """Serve on an event loop of its own, on a thread."""
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.start_async())
            except BaseException as e:
                failure.append(e)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
                loop.run_until_complete(self.close_async())
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="swarm-api", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        return self.url

    def close(self) -> None:
        """Stop what ``start()`` started; idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._loop.stop)
        except RuntimeError:  # the loop is closed already (its thread ended)
            pass
        thread.join()

    def __enter__(self) -> ApiServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
