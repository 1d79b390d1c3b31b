"""The node's state directory: node id, swarm secret, job table, pid file, API socket, logs.

Default: ``$XDG_STATE_HOME/swarmp2p`` (``~/.local/state/swarmp2p``), mode 0700; files that
hold secrets are 0600.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from swarmp2p._atomic import write_atomic
from swarmp2p.node.election import check_node_id


def default_state_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_STATE_HOME/swarmp2p``, or ``~/.local/state/swarmp2p``."""
    env = os.environ if env is None else env
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "swarmp2p"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` atomically to a file only the owner may read (0600)."""
    write_atomic(path, text, mode=0o600)


@dataclass(frozen=True, kw_only=True, slots=True)
class StateDir:
    """Paths inside one node's state directory."""

    root: Path

    @property
    def node_id_file(self) -> Path:
        return self.root / "node_id"

    @property
    def secret_file(self) -> Path:
        return self.root / "secret"

    @property
    def table_file(self) -> Path:
        return self.root / "jobs.json"

    @property
    def pid_file(self) -> Path:
        return self.root / "daemon.pid"

    @property
    def api_socket(self) -> Path:
        return self.root / "api.sock"

    @property
    def log_file(self) -> Path:
        return self.root / "daemon.log"

    def ensure(self) -> StateDir:
        """Create the directory (0700) if needed and tighten its mode; returns self."""
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        return self

    def node_id(self, wanted: str | None = None) -> str:
        """The stable node id: ``wanted`` (saved for next time), the saved one, or a new one."""
        if wanted is not None:
            check_node_id(wanted)
            write_private(self.node_id_file, wanted + "\n")
            return wanted
        try:
            return check_node_id(self.node_id_file.read_text().strip())
        except FileNotFoundError:
            pass
        except ValueError as exc:
            raise ValueError(f"{self.node_id_file}: {exc}; fix it or pass --node-id") from None
        node_id = "n" + secrets.token_hex(6)
        write_private(self.node_id_file, node_id + "\n")
        return node_id

    def has_secret(self) -> bool:
        return self.secret_file.exists()

    def read_pid(self) -> int | None:
        """The daemon pid from the pid file if that process still exists, else None."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return pid
