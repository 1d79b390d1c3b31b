"""A small stdlib client of the OpenAI-compatible API, for ``swarm generate`` and ``swarm chat``
(streams server-sent events; no dependency beyond the standard library)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from swarmp2p.timings import TIMINGS

URL_ENV = "SWARM_API_URL"


class ApiClientError(RuntimeError):
    """The API answered with an error (its message), or could not be reached."""


def _request(url: str, path: str, body: dict[str, Any], api_key: str | None):
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(
        url.rstrip("/") + path, data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        return urllib.request.urlopen(request, timeout=TIMINGS.api_client_s)
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise ApiClientError(f"{e.code}: {message}") from None
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
    url: str, path: str, body: dict[str, Any], *, api_key: str | None = None
) -> Iterator[str]:
    """Each piece of text of a streamed completion (``path`` is /v1/completions or
    /v1/chat/completions)."""
    chat = path.endswith("chat/completions")
    for event in _events(_request(url, path, {**body, "stream": True}, api_key)):
        for choice in event.get("choices", []):
            piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
            if piece:
                yield piece


def complete_text(
    url: str, path: str, body: dict[str, Any], *, api_key: str | None = None
) -> tuple[str, dict]:
    """(text, usage) of a completion, not streamed."""
    with _request(url, path, {**body, "stream": False}, api_key) as response:
        reply = json.loads(response.read())
    choice = reply["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, reply.get("usage", {})
