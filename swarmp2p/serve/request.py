"""An OpenAI completions or chat request body, validated into a :class:`GenerationRequest`
for a :class:`ServedModel`; anything wrong is an :class:`ApiError` (OpenAI's error shape) that
names the parameter.

The body's shape is two records, :class:`CompletionBody` and :class:`ChatBody`, under OpenAI's
own parameter names, checked by ``swarmp2p.schema`` (every bad parameter named with its path);
``parse_request`` then applies what needs the served model (its vocabulary, its context, its
chat template) and refuses what this server does not do. ``response_format`` json_object and
json_schema, and a tool call that ``tool_choice`` forces, become a grammar
(``serve.decoding.grammar``) the last stage constrains every token with; ``tools`` reach the
chat template, and with tool_choice auto the reply's ``<tool_call>`` blocks become its
``tool_calls``. As OpenAI-compatible servers do, a ``null`` parameter is
an absent one and a parameter this server does not know is ignored.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web

from swarmp2p.schema import Bounds, FieldError, SchemaError, field, parse, show
from swarmp2p.serve.decoding.grammar import (
    GrammarError,
    grammar_for,
    tag_tokens,
    tool_call_grammar,
)
from swarmp2p.serve.protocol import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from swarmp2p.serve.sessions import RingClient
from swarmp2p.serve.text import MAX_STOP_STRINGS, TextCodec

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for /v1/completions; chat defaults to the rest of the context."""
MAX_N = 16
"""Choices one request may ask for (each is a session of the batch)."""
MAX_STOP_LENGTH = 1024
"""Characters one stop string may hold."""
MAX_TOOLS = 128
"""Tools one request may offer (OpenAI's limit)."""
FUNCTION_NAME = r"[A-Za-z0-9_.\-]{1,64}"
"""OpenAI's rule for a function's name."""


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


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ServedModel:
    """A model the API answers for: its ring, its text codec, its context length."""

    name: str
    client: RingClient
    codec: TextCodec
    max_context: int
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
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
    grammar: str | None = None
    """The llguidance grammar every generated token must follow (response_format, a forced
    tool call); None: unconstrained."""
    tool_calls: bool = False
    """The reply's ``<tool_call>`` blocks are parsed into ``tool_calls`` (tools were offered)."""


# --- the bodies' shape: records under OpenAI's names -------------------------------------------


class _OpenAI:
    """A body record as OpenAI-compatible servers read one: ``null`` is absent, an unknown key
    is ignored."""

    __slots__ = ()

    @classmethod
    def __schema_prepare__(cls, data: dict[str, object]) -> dict[str, object]:
        return _lenient(cls, data)


def _lenient(cls: type, data: dict[str, object]) -> dict[str, object]:
    """``data`` without its nulls and the keys ``cls`` does not know."""
    known = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in known and v is not None}


class StopStrings(tuple):
    """``stop``: one string or a list of up to MAX_STOP_STRINGS (empty ones dropped)."""

    __slots__ = ()

    @classmethod
    def from_data(cls, value: object, path: str) -> StopStrings:
        stop = [value] if isinstance(value, str) else value
        if (
            not isinstance(stop, list)
            or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and len(s) <= MAX_STOP_LENGTH for s in stop)
        ):
            raise ValueError(
                f"must be a string or a list of up to {MAX_STOP_STRINGS} strings of at most "
                f"{MAX_STOP_LENGTH} characters"
            )
        return cls(s for s in stop if s)

    def to_data(self) -> list[str]:
        return list(self)


class Prompt:
    """``prompt``: a string, a list of token ids, or a list holding one of those; the field
    holds what ``from_data`` returns (the string, or the ids as a tuple)."""

    @classmethod
    def from_data(cls, value: object, path: str) -> str | tuple[int, ...]:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]  # a batch of one
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(type(t) is int for t in value):
            return tuple(value)  # each id is checked against the model's vocabulary
        raise ValueError(
            "must be a string, a list of token ids, or a list holding one of those "
            "(batches of several prompts are not supported)"
        )


class MessageContent(str):
    """A chat message's ``content``: a string, or a list of text parts (joined)."""

    __slots__ = ()

    @classmethod
    def from_data(cls, value: object, path: str) -> MessageContent:
        if isinstance(value, str):
            return cls(value)
        if not isinstance(value, list):
            raise ValueError(f"must be a string or text parts, got {show(value)}")
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError(f"part {i}: only text parts are supported")
            text = part.get("text", "")
            if not isinstance(text, str):
                raise ValueError(f"part {i}: a text part's text is a string")
            texts.append(text)
        return cls("".join(texts))

    def to_data(self) -> str:
        return str(self)


class Seed(int):
    """``seed``: any 64-bit integer, signed or not (the sampler takes it modulo 2**63)."""

    __slots__ = ()

    @classmethod
    def from_data(cls, value: object, path: str) -> Seed:
        if type(value) is not int or not -(2**63) <= value <= 2**64 - 1:
            raise ValueError(
                "must be an integer in [-9223372036854775808, 18446744073709551615], "
                f"got {show(value)}"
            )
        return cls(value)

    def to_data(self) -> int:
        return int(self)


_NO_CONTENT, _NO_STOP = MessageContent(""), StopStrings()


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatMessage(_OpenAI):
    """One message of ``messages`` (an assistant's earlier ``tool_calls``, a ``tool`` message's
    ``tool_call_id``: a tool-calling conversation goes on)."""

    role: str
    content: MessageContent = _NO_CONTENT
    name: str | None = None
    tool_calls: Annotated[list[dict], Bounds(max_len=MAX_TOOLS)] | None = None
    tool_call_id: str | None = field(default=None, max_len=256)


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamOptions(_OpenAI):
    """``stream_options``."""

    include_usage: bool = False
    """A last chunk with the usage."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JsonSchema(_OpenAI):
    """``response_format.json_schema``: the schema the reply's JSON must match."""

    name: str = field(default="schema", pattern=FUNCTION_NAME)
    schema: dict = dataclasses.field(default_factory=dict)
    """A JSON Schema; ``{}``: any JSON value."""
    strict: bool = False
    """Always kept here: the output is constrained to the schema whether or not it is set."""
    description: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class ResponseFormat(_OpenAI):
    """``response_format``: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    def __post_init__(self) -> None:
        if self.type == "json_schema" and self.json_schema is None:
            raise SchemaError(
                [FieldError(path="json_schema", message="required with type json_schema")]
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class FunctionDef(_OpenAI):
    """A tool's ``function``: its name and its parameters' JSON Schema."""

    name: str = field(pattern=FUNCTION_NAME)
    description: str = ""
    parameters: dict = dataclasses.field(default_factory=dict)
    strict: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Tool(_OpenAI):
    """One of ``tools``."""

    type: Literal["function"]
    function: FunctionDef


Bias = Annotated[float, Bounds(ge=-100, le=100)]
"""A ``logit_bias`` value."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Body(_OpenAI):
    """What completions and chat bodies share."""

    model: str = field(min_len=1)
    """The id of a served model."""
    n: int = field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions = StreamOptions()
    stop: StopStrings = _NO_STOP
    temperature: float = field(default=1.0, ge=0.0, le=2.0)
    top_p: float = field(default=1.0, ge=0.0, le=1.0)
    top_k: int = field(default=-1, ge=-1, le=2**31 - 1)
    """-1 (or 0): off."""
    min_p: float = field(default=0.0, ge=0.0, le=1.0)
    seed: Seed | None = None
    presence_penalty: float = field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = field(default=1.0, ge=0.01, le=10.0)
    logit_bias: Annotated[dict[str, Bias], Bounds(max_len=MAX_LOGIT_BIAS)] = dataclasses.field(
        default_factory=dict
    )
    """Token id (a decimal string) to a bias added to its logit."""
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Bounds(max_len=MAX_TOOLS)] = dataclasses.field(
        default_factory=list
    )
    tool_choice: str | dict | None = None
    """"none", "auto" (the default with tools), "required", or ``{"type": "function",
    "function": {"name": N}}``."""
    parallel_tool_calls: bool = True
    # asked for, refused by parse_request (this server does not do them)
    echo: bool = False
    suffix: str = ""
    best_of: int | None = field(default=None, ge=1)
    functions: list = dataclasses.field(default_factory=list)
    function_call: str | dict = "none"

    def __post_init__(self) -> None:
        for key in self.logit_bias:
            if not (key.isascii() and key.isdigit() and len(key) < 12):
                raise SchemaError(
                    [FieldError(path="logit_bias", message=f"key {key!r} is not a token id")]
                )


@dataclass(frozen=True, kw_only=True, slots=True)
class CompletionBody(_Body):
    """A ``/v1/completions`` body."""

    prompt: Prompt
    max_tokens: int | None = field(default=None, ge=1)
    """Tokens to generate (OpenAI's default: COMPLETIONS_DEFAULT_MAX_TOKENS)."""
    logprobs: int | None = field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """Top alternatives per token to report (``false`` is none)."""

    @classmethod
    def __schema_prepare__(cls, data: dict[str, object]) -> dict[str, object]:
        if data.get("logprobs") is False:  # as absent
            data = {k: v for k, v in data.items() if k != "logprobs"}
        return _lenient(cls, data)


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatBody(_Body):
    """A ``/v1/chat/completions`` body."""

    messages: Annotated[list[ChatMessage], Bounds(min_len=1)]
    max_completion_tokens: int | None = field(default=None, ge=1)
    max_tokens: int | None = field(default=None, ge=1)
    """The older name of ``max_completion_tokens`` (which wins)."""
    logprobs: bool = False
    top_logprobs: int | None = field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def __post_init__(self) -> None:
        _Body.__post_init__(self)
        if self.top_logprobs is not None and not self.logprobs:
            raise SchemaError([FieldError(path="top_logprobs", message="needs logprobs: true")])


_B = TypeVar("_B", bound=_Body)


def _body(cls: type[_B], data: dict[str, object]) -> _B:
    """``data`` as a ``cls`` record; ApiError listing every bad parameter, the first as its
    ``param``."""
    try:
        return parse(cls, data)
    except SchemaError as exc:
        errors = [
            f"{e}, the id of a served model"
            if e.path == "model" and e.message == "required"
            else str(e)
            for e in exc.errors
        ]
        param = exc.errors[0].path.split(".", 1)[0] or None
        raise ApiError(400, "; ".join(errors), param=param) from None


# --- what needs the served model, and what is refused ------------------------------------------


def _refuse_unsupported(body: _Body) -> None:
    """Parameters asking for something this server does not do get a 400 naming them."""
    if body.echo:
        raise ApiError(400, "echo is not supported by this server", param="echo")
    if body.suffix:
        raise ApiError(400, "suffix is not supported by this server", param="suffix")
    if body.best_of not in (None, body.n):
        raise ApiError(400, "best_of is not supported (beyond best_of == n)", param="best_of")
    if body.functions or body.function_call != "none":
        name = "functions" if body.functions else "function_call"
        raise ApiError(
            400,
            f"{name}: the deprecated functions API is not supported; use tools and tool_choice",
            param=name,
        )


def _tool_choice(body: _Body) -> str | None:
    """What ``tool_choice`` asks: "none", "auto", "required", or the name of the function to
    call; ApiError naming it when it is not one of those, or names no offered tool."""
    choice = body.tool_choice
    if choice is None:
        return "auto" if body.tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ApiError(
                400,
                f"tool_choice: {show(choice)} is not none, auto, required or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        name = None if choice == "none" else choice
    else:
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ApiError(
                400,
                'tool_choice: an object is {"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
    if name is not None and not body.tools:
        raise ApiError(400, f"tool_choice {name}: needs tools", param="tool_choice")
    known = [t.function.name for t in body.tools]
    if name not in (None, "auto", "required") and name not in known:
        raise ApiError(
            400,
            f"tool_choice names function {name!r}, not one of the tools ({', '.join(known)})",
            param="tool_choice",
        )
    return "none" if name is None else name


def _constraint(body: _Body, model: ServedModel, tools: str) -> str | None:
    """The grammar text the request asks for (response_format, or a forced tool call), or
    None; ApiError naming the parameter when it cannot be one."""
    kind = body.response_format.type if body.response_format is not None else "text"
    if tools != "none" and kind != "text":
        raise ApiError(
            400,
            f"response_format {kind} and tools cannot be asked for together (a reply is either "
            'a tool call or JSON); leave one out, or send tool_choice "none"',
            param="response_format",
        )
    if kind == "text" and tools in ("none", "auto"):
        return None
    param = "response_format" if kind != "text" else "tool_choice"
    if not model.codec.eos_ids:
        raise ApiError(
            400,
            f"{param}: the model names no end-of-sequence id, so a constrained reply could not "
            "end; give its generation_config.json an eos_token_id",
            param=param,
        )
    try:
        if kind != "text":
            fmt = body.response_format
            return grammar_for(
                {"type": kind, "json_schema": fmt.json_schema and _schema_spec(fmt.json_schema)}
            ).text
        functions = [{"type": "function", "function": _function(t.function)} for t in body.tools]
        name = None if tools == "required" else tools
        return tool_call_grammar(functions, name, tag_tokens(model.codec.tokenizer)).text
    except GrammarError as e:
        raise ApiError(400, str(e), param=param, code="invalid_schema") from None


def _schema_spec(spec: JsonSchema) -> dict[str, Any]:
    return {"name": spec.name, "schema": spec.schema, "strict": spec.strict}


def _function(function: FunctionDef) -> dict[str, Any]:
    return {"name": function.name, "parameters": function.parameters or {"type": "object"}}


def _chat_messages(req: ChatBody) -> list[dict[str, Any]]:
    """The messages as a chat template reads them: a tool call's arguments as an object, as
    templates take them (they arrive as a JSON string, OpenAI's shape)."""
    out = []
    for m in req.messages:
        message: dict[str, Any] = {"role": m.role, "content": str(m.content)}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [_template_call(call) for call in m.tool_calls]
        out.append(message)
    return out


def _template_call(call: dict) -> dict:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _logit_bias(body: _Body, vocab: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in body.logit_bias.items():
        token = int(key)
        if token >= vocab:
            raise ApiError(
                400,
                f"logit_bias: token id {token} is outside the vocabulary ({vocab} ids)",
                param="logit_bias",
            )
        out.append((token, value))
    return tuple(out)


def _completion_prompt(prompt: str | tuple[int, ...], model: ServedModel) -> list[int]:
    if isinstance(prompt, str):
        return model.codec.encode(prompt)
    vocab = model.vocab
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        shown = bad if len(str(bad)) < 40 else f"{str(bad)[:40]}..."
        raise ApiError(
            400,
            f"prompt: token id {shown} is outside the vocabulary (ids 0..{vocab - 1})",
            param="prompt",
        )
    return list(prompt)


def parse_request(body: object, models: dict[str, ServedModel], *, chat: bool) -> GenerationRequest:
    """Validate a request body; ApiError naming the parameter on anything wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    name = body.get("model")
    if isinstance(name, str) and name and name not in models:
        raise model_not_found(name, models)
    req = _body(ChatBody, body) if chat else _body(CompletionBody, body)
    model = models[req.model]
    _refuse_unsupported(req)
    tools = _tool_choice(req)
    if tools != "none" and not chat:
        raise ApiError(400, "tools: tool calls go with /v1/chat/completions", param="tools")
    if tools != "none" and not model.codec.takes_tools:
        raise ApiError(
            400,
            f"tools: the chat template of {model.name} does not take tools (it never reads "
            "them), so the model would not see them; serve a model whose template renders "
            'tools, or send tool_choice "none"',
            param="tools",
            code="unsupported_tools",
        )
    grammar = _constraint(req, model, tools)
    if isinstance(req, ChatBody):
        variables = {}
        if tools != "none":
            variables["tools"] = [
                {"type": "function", "function": dataclasses.asdict(t.function)} for t in req.tools
            ]
        try:
            prompt = model.codec.encode_chat(_chat_messages(req), **variables)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        where, verb = "messages", "have"
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        prompt = _completion_prompt(req.prompt, model)
        where, verb = "prompt", "has"
        max_tokens = req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        logprobs = req.logprobs
    if not prompt:
        raise ApiError(400, f"{where}: the prompt is empty after tokenizing", param=where)
    room = model.max_context - len(prompt)
    if room < 1:
        raise ApiError(
            400,
            f"This model's maximum context length is {model.max_context} tokens, but the "
            f"{where} {verb} {len(prompt)} tokens; shorten it",
            param=where,
            code="context_length_exceeded",
        )
    try:
        sampling = SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p or 1e-9,
            top_k=max(req.top_k, 0),
            min_p=req.min_p,
            seed=None if req.seed is None else int(req.seed) % 2**63,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=_logit_bias(req, model.vocab),
            logprobs=logprobs,
        )
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    return GenerationRequest(
        model=model,
        prompt=tuple(prompt),
        max_tokens=min(max_tokens or room, room),
        sampling=sampling,
        n=req.n,
        stop=tuple(req.stop),
        stream=req.stream,
        include_usage=req.stream_options.include_usage,
        logprobs=logprobs,
        chat=chat,
        grammar=grammar,
        tool_calls=tools != "none",
    )


def parse_body(raw: bytes, models: dict[str, ServedModel], chat: bool) -> GenerationRequest:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"could not parse the JSON body: {e}") from None
    except RecursionError:
        raise ApiError(400, "could not parse the JSON body: nested too deeply") from None
    return parse_request(body, models, chat=chat)


def model_not_found(name: str, models: dict[str, ServedModel]) -> ApiError:
    shown = name if len(name) <= 200 else name[:200] + "..."
    return ApiError(
        404,
        f"The model `{shown}` does not exist on this server; it serves: {', '.join(models)}",
        param="model",
        code="model_not_found",
    )
