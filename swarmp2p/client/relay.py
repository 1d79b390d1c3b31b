"""`swarm generate`/`swarm chat` for a model another member serves: the request goes to the
local daemon, which relays it to the issuing node over the swarm's CURVE links
(``node/serving/relay.py``); the response comes back piece by piece (``relay_next``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmp2p.node import requests as rq
from swarmp2p.node.api import ApiError, send
from swarmp2p.node.state import StateDir
from swarmp2p.timings import TIMINGS

if TYPE_CHECKING:  # the serve package's __init__ loads the API server (aiohttp): not at import
    from swarmp2p.serve.client import Post


class _Relayed:
    """One relayed response: its body's lines as they arrive; leaving early cancels it on the
    issuing node."""

    def __init__(self, state_dir: Path, node: str, relay: int) -> None:
        self.socket = StateDir(root=state_dir).api_socket
        self.node, self.relay = node, relay
        self.done = False

    def _ask(self, close: bool = False) -> dict[str, Any]:
        from swarmp2p.serve.client import ApiClientError

        req = rq.RelayNextRequest(node=self.node, relay=self.relay, close=close)
        try:  # the daemon's own ask to the issuer times out first, with the reason
            return send(self.socket, req, timeout=TIMINGS.relay_call_s + 5)
        except ApiError as exc:
            raise ApiClientError(f"the relay through node {self.node} failed: {exc}") from None

    def _texts(self) -> Iterator[tuple[int, str]]:
        while not self.done:
            reply = self._ask()
            self.done = bool(reply["done"])
            if reply["text"] or self.done:
                yield int(reply["status"]), reply["text"]

    def __iter__(self) -> Iterator[bytes]:
        from swarmp2p.serve.client import error_message

        partial = ""
        for status, text in self._texts():
            if status != 200:  # the API's error answer: all of it, then its message
                rest = "".join(t for _, t in self._texts())
                raise error_message(status, (partial + text + rest).encode())
            lines = (partial + text).split("\n")
            partial = lines.pop()
            for line in lines:
                yield (line + "\n").encode()
        if partial:
            yield partial.encode()

    def __enter__(self) -> _Relayed:
        return self

    def __exit__(self, *exc: object) -> None:
        from swarmp2p.serve.client import ApiClientError

        if not self.done:
            self.done = True
            with contextlib.suppress(ApiClientError):
                self._ask(close=True)


def relay_post(state_dir: Path, model: str) -> Post:
    """A :data:`~swarmp2p.serve.client.Post` reaching ``model`` through the local daemon."""

    def post(path: str, body: dict[str, Any]) -> _Relayed:
        from swarmp2p.serve.client import ApiClientError

        req = rq.RelayOpenRequest(model=model, path=path, body=json.dumps(body))
        try:
            opened = send(
                StateDir(root=state_dir).api_socket, req, timeout=TIMINGS.relay_call_s + 5
            )
        except ApiError as exc:
            raise ApiClientError(str(exc)) from None
        return _Relayed(state_dir, opened["node"], int(opened["relay"]))

    return post


__all__ = ["relay_post"]
