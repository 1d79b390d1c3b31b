"""One API request's generation: a session per choice (``n``) on the model's ring, their events
merged on the event loop, their text streamed, and their log-probabilities in OpenAI's shapes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from swarmp2p.serve.decoding.grammar import ToolCallStream
from swarmp2p.serve.metrics import ServeMetrics
from swarmp2p.serve.request import ApiError, GenerationRequest
from swarmp2p.serve.session import GenerationError, RingBusy, Session
from swarmp2p.serve.text import TextCodec, TextStream
from swarmp2p.timings import TIMINGS


def busy_error(e: RingBusy | Session) -> ApiError:
    """A 503 with ``Retry-After`` for a full ring (refused at once, or after waiting)."""
    message = str(e) if isinstance(e, RingBusy) else e.error
    return ApiError(
        503,
        message,
        type="server_error",
        code="overloaded",
        headers={"Retry-After": str(e.retry_after)},
    )


@dataclass(eq=False, kw_only=True)
class Choice:
    """One choice of a request: its session and its streamed text."""

    index: int
    session: Session
    text: TextStream
    reported: int = 0
    """Tokens whose events were handled (their logprobs reported)."""
    last_token_at: float | None = None
    finish_reason: str | None = None
    tools: ToolCallStream | None = None
    """Where a reply that may call tools is split into content and calls."""

    def split(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """``text`` as content and the tool calls it completed (all content without tools);
        ``final``: the reply ended, and what was held back is content."""
        if self.tools is None:
            return text, []
        content, calls = self.tools.push(text)
        return (content + self.tools.finish(), calls) if final else (content, calls)

    @property
    def reply_reason(self) -> str | None:
        """The finish reason the reply reports: "tool_calls" once it called a tool."""
        if self.tools is not None and self.tools.calls and self.finish_reason == "stop":
            return "tool_calls"
        return self.finish_reason


class ClientGone(Exception):
    """The client closed its connection; its generation was cancelled."""


class Generation:
    """The sessions of one request (one per choice), their text, and their events merged on
    the loop. ``close()`` cancels whatever still runs (a no-op for finished sessions)."""

    def __init__(
        self,
        req: GenerationRequest,
        request: web.Request,
        *,
        metrics: ServeMetrics,
        closing: Callable[[], bool],
        arrived: float,
    ) -> None:
        self.req, self.request = req, request
        self.metrics, self._closing, self._arrived = metrics, closing, arrived
        self.choices: list[Choice] = []
        self.events: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        req = self.req
        for index in range(req.n):
            sampling = req.sampling
            if req.n > 1 and sampling.seed is not None:
                sampling = replace(sampling, seed=(sampling.seed + index) % 2**63)
            text = TextStream(req.model.codec, req.stop, prompt=req.prompt)
            try:
                session = req.model.client.submit(
                    req.prompt,
                    max_tokens=req.max_tokens,
                    sampling=sampling,
                    stop_ids=req.model.codec.eos_ids,
                    stop=text.push,
                    grammar=req.grammar,
                    loop=loop,
                )
            except RingBusy as e:
                self.close()
                raise busy_error(e) from None
            except GenerationError as e:
                self.close()
                raise ApiError(503, str(e), type="server_error") from None
            except ValueError as e:
                self.close()
                raise ApiError(400, str(e)) from None
            tools = ToolCallStream() if req.tool_calls else None
            choice = Choice(index=index, session=session, text=text, tools=tools)
            self.choices.append(choice)
            self._tasks.append(asyncio.ensure_future(self._pump(choice)))

    async def _pump(self, choice: Choice) -> None:
        async for kind, value in choice.session.aevents():
            await self.events.put((choice, kind, value))

    def close(self) -> None:
        for choice in self.choices:
            self.req.model.client.cancel(choice.session)
        for task in self._tasks:
            task.cancel()

    async def next(self) -> tuple[Choice, str, object]:
        """The next event of any choice; ClientGone when the client left, ApiError when the
        server stops or nothing comes for TIMINGS.generation_idle_s."""
        waited = 0.0
        while True:
            try:
                return await asyncio.wait_for(self.events.get(), TIMINGS.generation_watch_s)
            except asyncio.TimeoutError:
                waited += TIMINGS.generation_watch_s
            transport = self.request.transport
            if transport is None or transport.is_closing():
                raise ClientGone()
            if self._closing():
                raise ApiError(503, "the server is shutting down", type="server_error")
            if waited >= TIMINGS.generation_idle_s:
                raise ApiError(
                    504, f"no token within {TIMINGS.generation_idle_s:g} s", type="server_error"
                )

    def handle(self, choice: Choice, kind: str, value: object) -> tuple[str, list[int]]:
        """Text that became ready with this event and the tokens it reported; raises the
        error a failed session ended with."""
        model = self.req.model
        if kind == "error":
            if choice.session.busy:
                raise busy_error(choice.session)
            raise ApiError(500, f"generation failed: {value}", type="server_error")
        now = time.monotonic()
        if kind == "token":
            if choice.last_token_at is None:
                self.metrics.first_token(model.name, now - self._arrived)
            else:
                self.metrics.inter_token(model.name, now - choice.last_token_at)
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

    def chat_logprobs(self, choice: Choice, indices: list[int]) -> list[dict] | None:
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

    def completion_logprobs(self, choice: Choice, indices: list[int], offset: int) -> dict | None:
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
