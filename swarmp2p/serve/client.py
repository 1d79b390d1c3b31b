"""A small stdlib client of the OpenAI-compatible API, for ``swarm generate`` and ``swarm chat``
(streams server-sent events; no dependency beyond the standard library)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from swarmp2p.timings import TIMINGS

URL_ENV = "SWARM_API_URL"


class ApiClientError(RuntimeError):
    """The API answered with an error (its message), or could not be reached."""


Post = Callable[[str, dict[str, Any]], AbstractContextManager[Iterable[bytes]]]
"""``post(path, body)``: the response body's lines, or ApiClientError naming the API's error
(another way to the API than HTTP: ``swarmp2p.client.relay``, through the swarm)."""


def error_message(status: int, body: bytes, reason: str = "") -> ApiClientError:
    """The error an API's error answer (OpenAI's shape) says, as ``"<status>: <message>"``."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = reason or body[:200].decode("utf-8", "replace")
    return ApiClientError(f"{status}: {message}")


def _request(url: str | Post, path: str, body: dict[str, Any], api_key: str | None):
    if callable(url):
        return url(path, body)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(
        url.rstrip("/") + path, data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        return urllib.request.urlopen(request, timeout=TIMINGS.api_client_s)
    except urllib.error.HTTPError as e:
        raise error_message(e.code, e.read(), str(e.reason)) from None
    except urllib.error.URLError as e:
        raise ApiClientError(
            f"cannot reach the swarm API at {url} ({e.reason}); is `swarm serve` running? "
            f"(--url or {URL_ENV} names another address)"
        ) from None


def _events(response) -> Iterator[dict]:
    with response:
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise ApiClientError(event["error"].get("message", "the server failed the request"))
            yield event


def stream_text(
    url: str | Post, path: str, body: dict[str, Any], *, api_key: str | None = None
) -> Iterator[str]:
    """Each piece of text of a streamed completion (``path`` is /v1/completions or
    /v1/chat/completions) from the API at ``url`` (a base URL, or a :data:`Post`)."""
    chat = path.endswith("chat/completions")
    for event in _events(_request(url, path, {**body, "stream": True}, api_key)):
        for choice in event.get("choices", []):
            piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
            if piece:
                yield piece


def complete_text(
    url: str | Post, path: str, body: dict[str, Any], *, api_key: str | None = None
) -> tuple[str, dict]:
    """(text, usage) of a completion, not streamed."""
    with _request(url, path, {**body, "stream": False}, api_key) as response:
        raw = b"".join(response)
    try:
        reply = json.loads(raw)
    except ValueError:
        raise ApiClientError(f"the API's answer was cut off after {len(raw)} bytes") from None
    choice = reply["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, reply.get("usage", {})
