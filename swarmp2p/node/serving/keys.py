"""The API keys of the models this node serves. Never imports torch.

The table is replicated to every member and written to disk there, so a served model's API
key never enters it: the table holds the key's sha256 (``ServedModel.api_key_sha256``), and
the issuing node, the only one that answers the model's API, keeps the key itself in
``<state>/serve/keys/<serve id>.key`` (0600) to serve it again after a restart.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

from swarmp2p._atomic import write_atomic
from swarmp2p.errors import Failed, UserError
from swarmp2p.paths import UnsafeName, confine

KEYS_FOLDER = "keys"
"""Under ``<state>/serve/``: one 0600 file per served model that has an API key."""


def key_digest(api_key: str | None) -> str:
    """The sha256 the table holds of an API key ("" without one)."""
    return hashlib.sha256(api_key.encode()).hexdigest() if api_key else ""


class ApiKeys:
    """The key files of one node's served models."""

    def __init__(self, serve_root: Path) -> None:
        self.folder = serve_root / KEYS_FOLDER

    def path(self, serve_id: str) -> Path:
        try:
            return confine(self.folder, f"{serve_id}.key", what="API key file")
        except UnsafeName as exc:
            raise UserError(str(exc), code="bad_field") from None

    def write(self, serve_id: str, api_key: str) -> None:
        write_atomic(self.path(serve_id), api_key, mode=0o600)

    def remove(self, serve_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(serve_id).unlink()

    def read(self, serve_id: str, digest: str, name: str) -> str | None:
        """The key of ``serve_id`` (None when it was served without one: ``digest`` "");
        Failed naming the file when it is missing or holds another key."""
        if not digest:
            return None
        path = self.path(serve_id)
        try:
            key = path.read_text().strip()
        except OSError as exc:
            raise Failed(
                f"model {name!r} needs its API key, and {path} cannot be read ({exc}); "
                f"`swarm serve --stop {name}` and serve it again",
                code="no_file",
            ) from None
        if key_digest(key) != digest:
            raise Failed(
                f"model {name!r}: {path} holds another API key than the one it was served "
                f"with; `swarm serve --stop {name}` and serve it again",
                code="no_file",
            )
        return key


__all__ = ["KEYS_FOLDER", "ApiKeys", "key_digest"]
