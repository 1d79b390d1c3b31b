"""The OpenAI-compatible HTTP API (aiohttp): ``/v1/models`` (and ``/v1/models/{id}``),
``/v1/completions``, ``/v1/chat/completions``, streaming as server-sent events, ``usage``,
OpenAI's error shape, ``/health`` and ``/metrics`` (Prometheus text).

Generation runs on a :class:`~swarmp2p.serve.RingClient`, which never blocks the event loop:
this module turns requests into token ids and sampling parameters, submits one session per
choice (``n``), awaits their events on the loop, and turns tokens back into text. The app
(:func:`build_app`) mounts on any aiohttp loop; :class:`ApiServer` runs it on its own thread.
Everything but a loopback address needs an API key (``--api-key`` or ``SWARM_API_KEY``); the
``Host`` of every request must be this server's (127.0.0.1, localhost, ::1, or the bound
host) and a browser's ``Origin`` too, so DNS rebinding and cross-site posts get 403.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import threading
import time
import urllib.parse
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from swarmp2p.serve.metrics import ServeMetrics
from swarmp2p.serve.protocol import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from swarmp2p.serve.sessions import GenerationError, RingBusy, RingClient, Session
from swarmp2p.serve.text import MAX_STOP_STRINGS, TextCodec, TextStream

API_KEY_ENV = "SWARM_API_KEY"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for /v1/completions; chat defaults to the rest of the context."""
REQUEST_TIMEOUT_S = 600.0
"""A request whose ring sends nothing for this long fails (the ring's own step timeout is
usually shorter)."""
MAX_BODY_BYTES = 8 * 2**20
MAX_N = 16
"""Choices one request may ask for (each is a session of the batch)."""
MAX_INT = 2**63 - 1
"""Every integer parameter is bounded (msgpack and torch take at most 64 bits)."""
WATCH_S = 0.25
"""How often a waiting request looks whether its client left or the server is stopping."""
SHUTDOWN_TIMEOUT_S = 5.0
"""How long closing the server waits for requests to finish (they are cancelled at once)."""
OFF_LOOP_BYTES = 64 * 1024
"""A request body larger than this is parsed and tokenized on a worker thread, so that the
event loop (the daemon's, once it mounts the app) never stalls on a long prompt."""
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
ARRIVED = web.RequestKey("swarm_arrived", float)
"""When the request arrived (time.monotonic): time to first token counts from it."""
MODEL = web.RequestKey("swarm_model", str)


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
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.headers = headers or {}

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
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def _busy(e: RingBusy | Session) -> ApiError:
    message = str(e) if isinstance(e, RingBusy) else e.error
    return ApiError(
        503,
        message,
        type="server_error",
        code="overloaded",
        headers={"Retry-After": str(e.retry_after)},
    )


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
    vocab_size: int | None = None
    """The model's vocabulary (config ``vocab_size``); None: the tokenizer's."""

    @property
    def vocab(self) -> int:
        """Token ids a prompt may hold: below both the tokenizer's and the model's size."""
        if self.vocab_size is None:
            return self.codec.vocab_size
        return min(self.codec.vocab_size, self.vocab_size)

    def card(self) -> dict[str, Any]:
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "swarmp2p",
            "max_model_len": self.max_context,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationRequest:
    """A validated completions or chat request."""

    model: ServedModel
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    n: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None
    """Top alternatives per token to report (0: the chosen token's only); None: no logprobs."""
    chat: bool


# --- parsing ----------------------------------------------------------------------------------


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ApiError(400, f"{name}: {value!r} is not a number in [{lo}, {hi}]", param=name)
    return float(value)


def _integer(body: dict, name: str, lo: int, hi: int = MAX_INT) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or not lo <= value <= hi:
        shown = value if len(repr(value)) < 40 else f"{repr(value)[:40]}..."
        raise ApiError(400, f"{name}: {shown!r} is not an integer in [{lo}, {hi}]", param=name)
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
        or not all(isinstance(s, str) and len(s) <= 1024 for s in stop)
    ):
        raise ApiError(
            400,
            f"stop: must be a string or a list of up to {MAX_STOP_STRINGS} strings",
            param="stop",
        )
    return tuple(s for s in stop if s)


def _refuse_unsupported(body: dict, n: int) -> None:
    """Parameters asking for something this server does not do get a 400 naming them."""
    if body.get("echo") not in (None, False):
        raise ApiError(400, "echo is not supported by this server", param="echo")
    if body.get("suffix") not in (None, ""):
        raise ApiError(400, "suffix is not supported by this server", param="suffix")
    if body.get("best_of") not in (None, n):
        raise ApiError(400, "best_of is not supported (beyond best_of == n)", param="best_of")
    for name in ("tools", "functions"):
        if body.get(name) not in (None, []):
            raise ApiError(400, f"{name}: tool calling is not supported by this server", param=name)
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise ApiError(400, f"{name}: tool calling is not supported by this server", param=name)
    fmt = body.get("response_format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind in ("json_object", "json_schema"):
        raise ApiError(
            400,
            f"response_format {kind} is not supported: this server cannot constrain its output "
            "to JSON (it would be ignored, so it is refused); ask for JSON in the prompt and "
            "validate the reply, or leave response_format out",
            param="response_format",
            code="unsupported_response_format",
        )
    raise ApiError(
        400,
        "response_format: must be an object whose type is text, json_object or json_schema",
        param="response_format",
    )


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
                text = part.get("text", "")
                if not isinstance(text, str):
                    raise ApiError(400, f"{where}.content: a text part's text is a string")
                texts.append(text)
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content: must be a string or text parts", param=where)
        entry = {"role": message["role"], "content": content}
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        out.append(entry)
    return out


def _logit_bias(body: dict, vocab: int) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(
            400,
            f"logit_bias: must be an object of up to {MAX_LOGIT_BIAS} token ids to biases",
            param="logit_bias",
        )
    out = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12):
            raise ApiError(400, f"logit_bias: key {key!r} is not a token id", param="logit_bias")
        token = int(key)
        if token >= vocab:
            raise ApiError(
                400,
                f"logit_bias: token id {token} is outside the vocabulary ({vocab} ids)",
                param="logit_bias",
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not -100 <= value <= 100
        ):
            raise ApiError(
                400, f"logit_bias[{key}]: {value!r} is not a number in [-100, 100]",
                param="logit_bias",
            )  # fmt: skip
        out.append((token, float(value)))
    return tuple(out)


def _logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        wanted = body.get("logprobs")
        if wanted not in (None, True, False):
            raise ApiError(400, f"logprobs: {wanted!r} is not true or false", param="logprobs")
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and not wanted:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (top or 0) if wanted else None
    if body.get("logprobs") is False:
        return None
    return _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)


def parse_request(body: Any, models: dict[str, ServedModel], *, chat: bool) -> GenerationRequest:
    """Validate a request body; ApiError naming the parameter on anything wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model: required, the id of a served model", param="model")
    model = models.get(name)
    if model is None:
        raise _model_not_found(name, models)
    n = _integer(body, "n", 1, MAX_N) or 1
    _refuse_unsupported(body, n)
    if chat:
        try:
            prompt = model.codec.encode_chat(_chat_messages(body))
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        where = "messages"
        max_tokens = _integer(body, "max_completion_tokens", 1) or _integer(body, "max_tokens", 1)
    else:
        prompt = _completion_prompt(body.get("prompt"), model)
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
    seed = _integer(body, "seed", -(2**63), 2**64 - 1)
    top_k = _integer(body, "top_k", -1, 2**31 - 1)
    repetition = body.get("repetition_penalty")
    if repetition is not None and (
        isinstance(repetition, bool)
        or not isinstance(repetition, (int, float))
        or not 0.01 <= repetition <= 10
    ):
        raise ApiError(
            400,
            f"repetition_penalty: {repetition!r} is not a number in [0.01, 10]",
            param="repetition_penalty",
        )
    logprobs = _logprobs(body, chat)
    try:
        sampling = SamplingParams(
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
            top_k=max(top_k or 0, 0),
            min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
            seed=None if seed is None else seed % 2**63,
            presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
            repetition_penalty=1.0 if repetition is None else float(repetition),
            logit_bias=_logit_bias(body, model.vocab),
            logprobs=logprobs,
        )
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    return GenerationRequest(
        model=model,
        prompt=tuple(prompt),
        max_tokens=min(max_tokens or room, room),
        sampling=sampling,
        n=n,
        stop=_stop(body),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        logprobs=logprobs,
        chat=chat,
    )


def _parse_body(raw: bytes, models: dict[str, ServedModel], chat: bool) -> GenerationRequest:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"could not parse the JSON body: {e}") from None
    except RecursionError:
        raise ApiError(400, "could not parse the JSON body: nested too deeply") from None
    return parse_request(body, models, chat=chat)


def _model_not_found(name: str, models: dict[str, ServedModel]) -> ApiError:
    shown = name if len(name) <= 200 else name[:200] + "..."
    return ApiError(
        404,
        f"The model `{shown}` does not exist on this server; it serves: {', '.join(models)}",
        param="model",
        code="model_not_found",
    )


def _completion_prompt(prompt: Any, model: ServedModel) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return model.codec.encode(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        vocab = model.vocab
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            shown = bad if len(str(bad)) < 40 else f"{str(bad)[:40]}..."
            raise ApiError(
                400,
                f"prompt: token id {shown} is outside the vocabulary (ids 0..{vocab - 1})",
                param="prompt",
            )
        return prompt
    raise ApiError(
        400,
        "prompt: must be a string, a list of token ids, or a list holding one of those "
        "(batches of several prompts are not supported)",
        param="prompt",
    )


# --- generation -------------------------------------------------------------------------------


@dataclass(eq=False, kw_only=True)
class _Choice:
    index: int
    session: Session
    text: TextStream
    reported: int = 0
    """Tokens whose events were handled (their logprobs reported)."""
    last_token_at: float | None = None
    finish_reason: str | None = None


class ClientGone(Exception):
    """The client closed its connection; its generation was cancelled."""


class _Generation:
    """The sessions of one request (one per choice), their text, and their events merged on
    the loop. ``close()`` cancels whatever still runs (a no-op for finished sessions)."""

    def __init__(self, req: GenerationRequest, request: web.Request, api: _Api) -> None:
        self.req, self.request, self.api = req, request, api
        self.choices: list[_Choice] = []
        self.events: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._arrived = request.get(ARRIVED, time.monotonic())

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        req = self.req
        for index in range(req.n):
            sampling = req.sampling
            if req.n > 1 and sampling.seed is not None:
                sampling = replace(sampling, seed=(sampling.seed + index) % 2**63)
            text = TextStream(req.model.codec, req.stop)
            try:
                session = req.model.client.submit(
                    req.prompt,
                    max_tokens=req.max_tokens,
                    sampling=sampling,
                    stop_ids=req.model.codec.eos_ids,
                    stop=text.push,
                    loop=loop,
                )
            except RingBusy as e:
                self.close()
                raise _busy(e) from None
            except GenerationError as e:
                self.close()
                raise ApiError(503, str(e), type="server_error") from None
            except ValueError as e:
                self.close()
                raise ApiError(400, str(e)) from None
            choice = _Choice(index=index, session=session, text=text)
            self.choices.append(choice)
            self._tasks.append(asyncio.ensure_future(self._pump(choice)))

    async def _pump(self, choice: _Choice) -> None:
        async for kind, value in choice.session.aevents():
            await self.events.put((choice, kind, value))

    def close(self) -> None:
        for choice in self.choices:
            self.req.model.client.cancel(choice.session)
        for task in self._tasks:
            task.cancel()

    async def next(self) -> tuple[_Choice, str, object]:
        """The next event of any choice; ClientGone when the client left, ApiError when the
        server stops or nothing comes for REQUEST_TIMEOUT_S."""
        waited = 0.0
        while True:
            try:
                return await asyncio.wait_for(self.events.get(), WATCH_S)
            except asyncio.TimeoutError:
                waited += WATCH_S
            transport = self.request.transport
            if transport is None or transport.is_closing():
                raise ClientGone()
            if self.api.closing:
                raise ApiError(503, "the server is shutting down", type="server_error")
            if waited >= REQUEST_TIMEOUT_S:
                raise ApiError(504, f"no token within {REQUEST_TIMEOUT_S:g} s", type="server_error")

    def handle(self, choice: _Choice, kind: str, value: object) -> tuple[str, list[int]]:
        """Text that became ready with this event and the tokens it reported; raises the
        error a failed session ended with."""
        model = self.req.model
        if kind == "error":
            if choice.session.busy:
                raise _busy(choice.session)
            raise ApiError(500, f"generation failed: {value}", type="server_error")
        now = time.monotonic()
        if kind == "token":
            if choice.last_token_at is None:
                self.api.metrics.first_token(model.name, now - self._arrived)
            else:
                self.api.metrics.inter_token(model.name, now - choice.last_token_at)
            choice.last_token_at = now
            tokens = [choice.reported]
            choice.reported += 1
            return choice.text.take(), tokens
        choice.text.finish()
        choice.finish_reason = str(value)
        return choice.text.take(), []

    def usage(self) -> dict[str, int]:
        completion = sum(len(c.session.tokens) for c in self.choices)
        prompt = len(self.req.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    # -- logprobs in OpenAI's two shapes --------------------------------------------------------

    def chat_logprobs(self, choice: _Choice, indices: list[int]) -> list[dict] | None:
        if self.req.logprobs is None:
            return None
        codec = self.req.model.codec
        out = []
        for i in indices:
            token, lp = choice.session.tokens[i], choice.session.logprobs[i]
            if lp is None:
                continue
            out.append(
                {
                    **_token_entry(codec, token, lp.logprob),
                    "top_logprobs": [_token_entry(codec, t, v) for t, v in lp.top],
                }
            )
        return out

    def completion_logprobs(self, choice: _Choice, indices: list[int], offset: int) -> dict | None:
        if self.req.logprobs is None:
            return None
        codec = self.req.model.codec
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for i in indices:
            token, lp = choice.session.tokens[i], choice.session.logprobs[i]
            if lp is None:
                continue
            text = codec.token_text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({codec.token_text(t): v for t, v in lp.top})
            out["text_offset"].append(offset)
            offset += len(text)
        return out


def _token_entry(codec: TextCodec, token: int, logprob: float) -> dict[str, Any]:
    text = codec.token_text(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


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
            raise _model_not_found(name, self.models)
        return web.json_response(model.card())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        if len(raw) > OFF_LOOP_BYTES:  # parsing and tokenizing a large body: not on the loop
            req = await asyncio.to_thread(_parse_body, raw, self.models, chat)
        else:
            req = _parse_body(raw, self.models, chat)
        request[MODEL] = req.model.name
        if self.closing:
            raise ApiError(503, "the server is shutting down", type="server_error")
        kind = "chat.completion" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": rid, "object": kind, "created": int(time.time()), "model": req.model.name}
        generation = _Generation(req, request, self)
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

    async def _whole(self, generation: _Generation, head: dict) -> web.Response:
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
            entry: dict[str, Any] = {"index": choice.index, "finish_reason": choice.finish_reason}
            if req.chat:
                entry["message"] = {"role": "assistant", "content": text}
                content = generation.chat_logprobs(choice, indices)
                entry["logprobs"] = None if content is None else {"content": content}
            else:
                entry["text"] = text
                entry["logprobs"] = generation.completion_logprobs(choice, indices, 0)
            choices.append(entry)
        return web.json_response({**head, "choices": choices, "usage": generation.usage()})

    async def _stream(
        self, request: web.Request, generation: _Generation, head: dict
    ) -> web.StreamResponse:
        req = generation.req
        head = {**head, "object": "chat.completion.chunk" if req.chat else "text_completion"}
        extra = {"usage": None} if req.include_usage else {}
        offsets = [0] * req.n

        def chunk(choice: _Choice, content: str | None, tokens: list[int], finish=None) -> dict:
            if req.chat:
                delta: dict[str, Any] = {}
                if content:
                    delta["content"] = content
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
                    role = {"index": choice.index, "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None, "logprobs": None}  # fmt: skip
                    await response.write(_sse({**head, "choices": [role], **extra}))
            done = 0
            while True:
                choice, kind, _ = event
                if piece or (tokens and req.logprobs is not None):
                    await response.write(_sse(chunk(choice, piece, tokens)))
                if kind == "done":
                    done += 1
                    await response.write(_sse(chunk(choice, None, [], choice.finish_reason)))
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
    """Runs an app on its own thread and event loop (``start()`` returns the base URL).
    ``close()`` never hangs: waiting requests are cancelled, and a loop that already died is
    only joined."""

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
            api = self.app.get(API)
            if api is not None:  # it answers to the address it binds, whatever build_app said
                api.allow_host(self.host)
            try:
                runner = web.AppRunner(
                    self.app,
                    access_log=None,
                    handle_signals=False,
                    shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                    handler_cancellation=True,
                )
                loop.run_until_complete(runner.setup())
                site = web.TCPSite(runner, self.host, self.port)
                loop.run_until_complete(site.start())
                self._runner = runner
                host, port = runner.addresses[0][:2]
                self.port = port
                self.url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
            except BaseException as e:
                failure.append(e)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
                loop.run_until_complete(runner.cleanup())
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
        """Stop serving; idempotent."""
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
