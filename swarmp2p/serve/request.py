"""An OpenAI completions or chat request body, validated into a :class:`GenerationRequest`
for a :class:`ServedModel`; anything wrong is an :class:`ApiError` (OpenAI's error shape) that
names the parameter.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from swarmp2p.serve.protocol import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from swarmp2p.serve.sessions import RingClient
from swarmp2p.serve.text import MAX_STOP_STRINGS, TextCodec

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for /v1/completions; chat defaults to the rest of the context."""
MAX_N = 16
"""Choices one request may ask for (each is a session of the batch)."""
MAX_INT = 2**63 - 1
"""Every integer parameter is bounded (msgpack and torch take at most 64 bits)."""


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
                400,
                f"logit_bias[{key}]: {value!r} is not a number in [-100, 100]",
                param="logit_bias",
            )
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
        raise model_not_found(name, models)
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
