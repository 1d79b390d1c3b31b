"""The OpenAI-compatible HTTP API (aiohttp): ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``, streaming as server-sent events, ``usage``, OpenAI's error shape.

Generation runs on a :class:`~swarmp2p.serve.RingClient`; this module turns requests into
token ids and sampling parameters, and tokens back into text. Everything but a loopback
address needs an API key (``--api-key`` or ``SWARM_API_KEY``).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from swarmp2p.serve.protocol import SamplingParams
from swarmp2p.serve.sessions import GenerationError, RingBusy, RingClient
from swarmp2p.serve.text import MAX_STOP_STRINGS, TextCodec, TextStream

API_KEY_ENV = "SWARM_API_KEY"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for /v1/completions; chat defaults to the rest of the context."""
REQUEST_TIMEOUT_S = 600.0
"""A request whose ring sends nothing for this long fails (the ring's own step timeout is
usually shorter)."""
MAX_BODY_BYTES = 8 * 2**20


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond loopback without an API key."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not api_key:
        raise ValueError(
            f"refusing to serve the API on {host} without an API key: anyone who can reach it "
            f"could use the swarm; pass --api-key or set {API_KEY_ENV} (or bind 127.0.0.1)"
        )


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ServedModel:
    """A model the API answers for: its ring, its text codec, its context length."""

    name: str
    client: RingClient
    codec: TextCodec
    max_context: int
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationRequest:
    """A validated completions or chat request."""

    model: ServedModel
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


# --- parsing ----------------------------------------------------------------------------------


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ApiError(400, f"{name}: {value!r} is not a number in [{lo}, {hi}]", param=name)
    return float(value)


def _integer(body: dict, name: str, lo: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or value < lo:
        raise ApiError(400, f"{name}: {value!r} is not an integer >= {lo}", param=name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) for s in stop)
    ):
        raise ApiError(
            400,
            f"stop: must be a string or a list of up to {MAX_STOP_STRINGS} strings",
            param="stop",
        )
    return tuple(s for s in stop if s)


_UNSUPPORTED = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "logit_bias": (None, {}),
}
"""Parameters this server does not implement, and the values that ask for nothing."""


def _unsupported(body: dict) -> None:
    n = body.get("n")
    if n not in (None, 1):
        raise ApiError(400, f"n: {n!r} is not supported; this server returns one choice", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported by this server; leave it 0", param=name)
    for name, harmless in _UNSUPPORTED.items():
        if body.get(name) not in harmless:
            raise ApiError(400, f"{name} is not supported by this server", param=name)


def _chat_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: must be a non-empty list of messages", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"{where}: must be an object with a role", param=where)
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text ones are understood
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ApiError(
                        400, f"{where}.content: only text parts are supported", param=where
                    )
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content: must be a string or text parts", param=where)
        out.append({"role": message["role"], "content": content})
    return out


def parse_request(body: Any, models: dict[str, ServedModel], *, chat: bool) -> GenerationRequest:
    """Validate a request body; ApiError naming the parameter on anything wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model: required, the id of a served model", param="model")
    model = models.get(name)
    if model is None:
        raise ApiError(
            404,
            f"The model `{name}` does not exist on this server; it serves: {', '.join(models)}",
            param="model",
            code="model_not_found",
        )
    _unsupported(body)
    if chat:
        try:
            prompt = model.codec.encode_chat(_chat_messages(body))
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        where = "messages"
        max_tokens = _integer(body, "max_completion_tokens", 1) or _integer(body, "max_tokens", 1)
    else:
        prompt = _completion_prompt(body.get("prompt"), model.codec)
        where = "prompt"
        max_tokens = _integer(body, "max_tokens", 1) or COMPLETIONS_DEFAULT_MAX_TOKENS
    if not prompt:
        raise ApiError(400, f"{where}: the prompt is empty after tokenizing", param=where)
    room = model.max_context - len(prompt)
    if room < 1:
        raise ApiError(
            400,
            f"This model's maximum context length is {model.max_context} tokens, but the "
            f"{where} has {len(prompt)} tokens; shorten it",
            param=where,
            code="context_length_exceeded",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream: {stream!r} is not true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options: must be an object", param="stream_options")
    seed = _integer(body, "seed", 0)
    try:
        sampling = SamplingParams(
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
            top_k=_integer(body, "top_k", 0) or 0,
            seed=None if seed is None else seed % 2**63,
        )
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    return GenerationRequest(
        model=model,
        prompt=tuple(prompt),
        max_tokens=min(max_tokens or room, room),
        sampling=sampling,
        stop=_stop(body),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )


def _completion_prompt(prompt: Any, codec: TextCodec) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return codec.encode(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return prompt
    raise ApiError(
        400,
        "prompt: must be a string, a list of token ids, or a list holding one of those "
        "(batches of several prompts are not supported)",
        param="prompt",
    )


# --- generation -------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class _Outcome:
    finish_reason: str = "stop"
    completion_tokens: int = 0


async def _generate(req: GenerationRequest, outcome: _Outcome) -> AsyncIterator[str]:
    """Each new piece of text; ``outcome`` holds the finish reason and token count at the end."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def post(item) -> None:
        loop.call_soon_threadsafe(events.put_nowait, item)

    text = TextStream(req.model.codec, req.stop, on_text=lambda piece: post(("text", piece)))
    try:
        session = req.model.client.submit(
            req.prompt,
            max_tokens=req.max_tokens,
            sampling=req.sampling,
            stop_ids=req.model.codec.eos_ids,
            stop=text.push,
            hook=lambda kind, value: post((kind, value)) if kind != "token" else None,
        )
    except RingBusy as e:
        raise ApiError(503, str(e), type="server_error", code="overloaded") from None
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(events.get(), REQUEST_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise ApiError(
                    504, f"no token within {REQUEST_TIMEOUT_S:g} s", type="server_error"
                ) from None
            if kind == "text":
                yield value
            elif kind == "error":
                raise ApiError(500, f"generation failed: {value}", type="server_error")
            elif kind == "done":
                before = len(text.text)
                tail = text.finish()[before:]
                if tail:
                    yield tail
                outcome.finish_reason = str(value)
                outcome.completion_tokens = len(session.tokens)
                return
    finally:
        req.model.client.cancel(session)  # a no-op once finished; frees caches on disconnect


def _usage(req: GenerationRequest, outcome: _Outcome) -> dict[str, int]:
    return {
        "prompt_tokens": len(req.prompt),
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": len(req.prompt) + outcome.completion_tokens,
    }


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _Api:
    def __init__(self, models: Sequence[ServedModel], api_key: str | None) -> None:
        self.models = {m.name: m for m in models}
        self.api_key = api_key
        self.slots = {m.name: asyncio.Semaphore(m.client.max_sessions) for m in models}

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": m.name, "object": "model", "created": m.created, "owned_by": "swarmp2p"}
                    for m in self.models.values()
                ],
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"could not parse the JSON body: {e}") from None
        req = parse_request(body, self.models, chat=chat)
        kind = "chat.completion" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        head = {"id": rid, "object": kind, "created": created, "model": req.model.name}
        outcome = _Outcome()
        async with self.slots[req.model.name]:
            if req.stream:
                return await self._stream(request, req, head, outcome, chat=chat)
            pieces = [piece async for piece in _generate(req, outcome)]
        text = "".join(pieces)
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": outcome.finish_reason,
            "logprobs": None,
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return web.json_response({**head, "choices": [choice], "usage": _usage(req, outcome)})

    async def _stream(self, request, req, head, outcome, *, chat: bool) -> web.StreamResponse:
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        generation = _generate(req, outcome)
        try:  # the first event surfaces a refusal (busy ring, bad prompt) as a plain error reply
            first = await generation.__anext__()
        except StopAsyncIteration:
            first = None
        await response.prepare(request)

        def chunk(content: str | None, finish: str | None, role: bool = False) -> dict:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if content is not None:
                    delta["content"] = content
                body = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                body = {
                    "index": 0,
                    "text": content or "",
                    "finish_reason": finish,
                    "logprobs": None,
                }
            extra = {"usage": None} if req.include_usage else {}
            return {**head, "choices": [body], **extra}

        try:
            if chat:
                await response.write(_sse(chunk("", None, role=True)))
            if first is not None:
                await response.write(_sse(chunk(first, None)))
                async for piece in generation:
                    await response.write(_sse(chunk(piece, None)))
            await response.write(_sse(chunk(None if chat else "", outcome.finish_reason)))
            if req.include_usage:
                await response.write(_sse({**head, "choices": [], "usage": _usage(req, outcome)}))
            await response.write(b"data: [DONE]\n\n")
        except ApiError as e:
            await response.write(_sse(e.body()))
            await response.write(b"data: [DONE]\n\n")
        finally:
            await generation.aclose()  # on a client gone mid-stream: cancels the session
        await response.write_eof()
        return response


def build_app(models: Sequence[ServedModel], *, api_key: str | None = None) -> web.Application:
    """The aiohttp application answering for ``models``."""
    api = _Api(models, api_key)

    @web.middleware
    async def errors(request: web.Request, handler):
        if api_key is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return ApiError(
                    401,
                    "Incorrect API key provided; send it as 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                ).response()
        try:
            return await handler(request)
        except ApiError as e:
            return e.response()
        except web.HTTPRequestEntityTooLarge:
            return ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes").response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return ApiError(e.status, f"{request.method} {request.path}: {e.reason}").response()
        except GenerationError as e:
            return ApiError(500, str(e), type="server_error").response()

    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/v1/models", api.list_models)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    return app


class ApiServer:
    """Runs an app on its own thread and event loop (``start()`` returns the base URL)."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host, self.port = app, host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self) -> str:
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                runner = web.AppRunner(self.app, access_log=None)
                loop.run_until_complete(runner.setup())
                site = web.TCPSite(runner, self.host, self.port)
                loop.run_until_complete(site.start())
                self._runner = runner
                host, port = runner.addresses[0][:2]
                self.port = port
                self.url = f"http://{host}:{port}"
            except BaseException as e:
                failure.append(e)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="swarm-api", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        return self.url

    def close(self) -> None:
        if self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._thread = None

    def __enter__(self) -> ApiServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
