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
from typing import overload

from swarmp2p._atomic import write_atomic
from swarmp2p.node.cluster.election import check_node_id


def default_state_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_STATE_HOME/swarmp2p``, or ``~/.local/state/swarmp2p``."""
    env = os.environ if env is None else env
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "swarmp2p"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` atomically to a file only the owner may read (0600)."""
    write_atomic(path, text, mode=0o600)


class _InRoot:
    """A file of the state directory: ``StateDir(root=R).attr`` is ``R / file``."""

    def __init__(self, file: str) -> None:
        self.file = file

    @overload
    def __get__(self, state: None, owner: type) -> _InRoot: ...
    @overload
    def __get__(self, state: StateDir, owner: type) -> Path: ...
    def __get__(self, state: StateDir | None, owner: type) -> _InRoot | Path:
        return self if state is None else state.root / self.file


@dataclass(frozen=True, kw_only=True, slots=True)
class StateDir:
    """Paths inside one node's state directory."""

    root: Path

    node_id_file = _InRoot("node_id")
    secret_file = _InRoot("secret")
    node_key_file = _InRoot("node.key")
    """This node's own CURVE key pair (0600): who it is to the other members."""
    table_file = _InRoot("jobs.json")
    pid_file = _InRoot("daemon.pid")
    api_socket = _InRoot("api.sock")
    log_file = _InRoot("daemon.log")
    dashboard_key_file = _InRoot("dashboard.key")

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

    def write_pid(self, pid: int | None = None) -> None:
        """Write ``daemon.pid`` (0600, atomic): the pid, its start time and the boot id, so a
        later `swarm down` can tell this process from another that got the same pid."""
        pid = os.getpid() if pid is None else pid
        write_private(self.pid_file, f"{pid} {_start_time(pid) or '-'} {_boot_id() or '-'}\n")

    def read_pid(self) -> int | None:
        """The daemon pid from the pid file if that process still exists, else None."""
        try:
            pid = int(self.pid_file.read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return pid

    def daemon_pid(self) -> tuple[int | None, str]:
        """``(pid, "")`` when the pid file names a live daemon of THIS state dir, else
        ``(None, why)``: its start time and boot id match the stamp written beside the pid,
        and its command line is ``swarm up --foreground`` for this directory (a pid file
        left by a crash or a reboot, or written by someone else, names another process)."""
        try:
            fields = self.pid_file.read_text().split()
            pid = int(fields[0])
        except FileNotFoundError:
            return None, f"there is no {self.pid_file.name}"
        except (ValueError, IndexError, OSError):
            return None, f"{self.pid_file} does not hold a pid"
        if pid <= 0 or not pid_alive(pid):
            return None, f"pid {pid} of {self.pid_file.name} is not running"
        if len(fields) >= 3:
            started, boot = _start_time(pid), _boot_id()
            if (fields[2] != "-" and boot and fields[2] != boot) or (
                fields[1] != "-" and started and fields[1] != started
            ):
                return None, f"pid {pid} of {self.pid_file.name} is another process now"
        why = _not_daemon_of(pid, self.root)
        if why:
            return None, f"pid {pid} of {self.pid_file.name} {why}"
        return pid, ""


def _proc(pid: int, name: str) -> bytes:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read()


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat_fields = _proc(pid, "stat").rsplit(b")", 1)[1].split()
        return stat_fields[0] != b"Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no procfs: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat (clock ticks after boot); "" without procfs."""
    try:
        return _proc(pid, "stat").rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return ""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _not_daemon_of(pid: int, root: Path) -> str:
    """ "" when ``pid``'s command line is a swarm daemon for ``root``, else what it is."""
    try:
        argv = [a.decode(errors="replace") for a in _proc(pid, "cmdline").split(b"\0")]
    except PermissionError:
        return "belongs to another user"
    except OSError:
        return "cannot be inspected (no /proc)"
    ours = any(a == "swarmp2p" or Path(a).name == "swarm" for a in argv)
    if not ours or "up" not in argv[1:] or "--foreground" not in argv:
        return f"is not a swarm daemon ({' '.join(argv).strip()[:80]!r})"
    named: str | None = None
    for i, arg in enumerate(argv):
        if arg == "--state-dir" and i + 1 < len(argv):
            named = argv[i + 1]
        elif arg.startswith("--state-dir="):
            named = arg.split("=", 1)[1]
    try:
        if named is None:  # the daemon's own environment chose its default
            env = dict(
                kv.split("=", 1)
                for kv in os.fsdecode(_proc(pid, "environ")).split("\0")
                if "=" in kv
            )
            named = env.get("SWARM_STATE_DIR") or str(default_state_dir(env))
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return "cannot be inspected"
    if os.path.realpath(os.path.join(cwd, named)) != os.path.realpath(root):
        return f"is the daemon of another state dir ({named})"
    return ""
