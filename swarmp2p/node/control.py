"""What the `swarm up/down/token/status/peers` commands do; the CLI only parses and prints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from swarmp2p.net.security import SwarmSecret
from swarmp2p.node import api
from swarmp2p.node.config import NodeConfig
from swarmp2p.node.state import StateDir

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def join_command(secret: SwarmSecret) -> str:
    return f"swarm up --token {secret.token}"


def swarm_secret(state: StateDir, token: str | None) -> tuple[SwarmSecret, bool]:
    """The swarm secret to run with (saved 0600 in ``state``) and whether it was just created."""
    if token:
        secret = SwarmSecret.from_token(token)
        if state.has_secret():
            existing = SwarmSecret.load(state.secret_file)
            if existing != secret:
                raise ValueError(
                    f"state dir {state.root} already belongs to swarm {existing.swarm_id}, and "
                    f"the token is for swarm {secret.swarm_id}; use another --state-dir, or "
                    f"`swarm down` and remove {state.secret_file} to switch swarms"
                )
            return secret, False
        secret.save(state.secret_file)
        return secret, False
    if state.has_secret():
        return SwarmSecret.load(state.secret_file), False
    secret = SwarmSecret.generate()
    secret.save(state.secret_file)
    return secret, True


def token(state_dir: Path) -> str:
    """The command that joins another machine to this node's swarm."""
    state = StateDir(root=state_dir)
    if not state.has_secret():
        raise ValueError(f"no swarm in {state_dir}: run `swarm up` first")
    return join_command(SwarmSecret.load(state.secret_file))


def _running(state: StateDir) -> int | None:
    pid = state.read_pid()
    if pid is None:
        return None
    try:
        api.request(state.api_socket, "status", timeout=2.0)
    except api.ApiError:
        return None
    return pid


def _daemon_args(config: NodeConfig) -> list[str]:
    args = ["up", "--foreground", "--state-dir", str(config.state_dir), "--port", str(config.port)]
    if config.name:
        args += ["--name", config.name]
    if config.node_id:
        args += ["--node-id", config.node_id]
    if config.interface:
        args += ["--interface", config.interface]
    for peer in config.peers:
        args += ["--peer", peer]
    if not config.mdns:
        args.append("--no-mdns")
    args += ["--heartbeat", repr(config.heartbeat_s)]
    args += ["--failure-timeout", repr(config.failure_timeout_s)]
    return args


def up(config: NodeConfig, token_text: str | None, *, foreground: bool) -> dict[str, Any]:
    """Start this node's daemon; returns ``{"status", "created", "join"}``.

    In the foreground this serves until stopped (and returns nothing useful); otherwise it
    starts ``swarm up --foreground`` in a new session and returns once its local API answers.
    """
    _preflight(config)
    state = StateDir(root=config.state_dir).ensure()
    pid = _running(state)
    if pid is not None:
        raise ValueError(
            f"a swarm daemon already runs for {state.root} (pid {pid}); `swarm down` first"
        )
    secret, created = swarm_secret(state, token_text)
    if foreground:
        from swarmp2p.node.config import setup_logging
        from swarmp2p.node.daemon import serve

        setup_logging(state, foreground=True)
        if created:
            print(
                f"created swarm {secret.swarm_id}; join another machine with:\n  {join_command(secret)}",
                file=sys.stderr,
                flush=True,
            )
        serve(config, secret)
        return {"status": None, "created": created, "join": join_command(secret)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmp2p", *_daemon_args(config)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    try:
        status = api.wait_until_up(
            state.api_socket, START_TIMEOUT_S, alive=lambda: proc.poll() is None
        )
    except api.ApiError as exc:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(5)
        raise api.ApiError(f"{exc}; last log lines:\n{_log_tail(state)}") from None
    return {"status": status, "created": created, "join": join_command(secret)}


def _preflight(config: NodeConfig) -> None:
    """Refuse bad input before anything is written: the interface, fake devices, node id."""
    from swarmp2p.net.discovery import list_interfaces, select_interfaces
    from swarmp2p.node.election import check_node_id
    from swarmp2p.node.hardware import FAKE_DEVICES_ENV, parse_fake_devices

    select_interfaces(list_interfaces(), config.interface)
    if os.environ.get(FAKE_DEVICES_ENV) is not None:
        parse_fake_devices(os.environ[FAKE_DEVICES_ENV])
    if config.node_id is not None:
        check_node_id(config.node_id)


def _log_tail(state: StateDir, lines: int = 15) -> str:
    try:
        return "\n".join(state.log_file.read_text().splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def down(state_dir: Path) -> int:
    """Stop the daemon cleanly (API first, SIGTERM if it does not answer); its pid."""
    state = StateDir(root=state_dir)
    pid = state.read_pid()
    try:
        pid = api.request(state.api_socket, "down", timeout=5.0)["pid"]
    except api.ApiError:
        if pid is None:
            raise
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        if not _alive(pid):
            return pid
        time.sleep(0.05)
    raise api.ApiError(f"swarm daemon pid {pid} did not stop within {STOP_TIMEOUT_S:g} s")


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, waiting for its parent to reap it, does not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0] != "Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no procfs: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def status(state_dir: Path) -> dict[str, Any]:
    return api.request(StateDir(root=state_dir).api_socket, "status")


def submit_job(
    state_dir: Path, record: dict[str, Any], job_id: str = "", timeout: float = 20.0
) -> dict[str, Any]:
    """Submit an opaque job record through the local daemon (forwarded to the leader);
    returns once it is durable on the leader and one other live peer. Retries while no leader
    is ready."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return api.request(
                StateDir(root=state_dir).api_socket,
                "submit",
                record=record,
                job_id=job_id,
                timeout=timeout,
            )
        except api.ApiError as exc:
            retry = any(code in str(exc) for code in ("not_ready", "no_leader", "not_leader"))
            if not retry or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _gib(n: int | None) -> str:
    return f"{(n or 0) / (1 << 30):.1f}G"


def format_peers(peers: list[dict[str, Any]]) -> str:
    """A plain text table of peers."""
    rows = [("NODE", "NAME", "ADDRESS", "ALIVE", "LEADER", "DEVICES")]
    for p in peers:
        devices = ", ".join(
            f"{d['kind']}:{d['name']} {_gib(d['memory_free'])}/{_gib(d['memory_total'])}"
            + (f" cc{d['compute_capability']}" if d.get("compute_capability") else "")
            + (" (fake)" if d.get("fake") else "")
            for d in p["devices"]
        )
        rows.append(
            (
                p["node_id"],
                p["name"],
                p["address"],
                "yes" if p["alive"] else "NO",
                "*" if p["is_leader"] else "",
                devices,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows
    )


def format_status(s: dict[str, Any]) -> str:
    lines = [
        f"node    {s['node_id']} ({s['name']}), port {s['port']}",
        f"swarm   {s['swarm_id']}",
        f"leader  {s['leader']}"
        + ("" if s.get("leader_ready") or s["leader"] != s["node_id"] else " (taking over)"),
        f"table   term {s['term']}, version {s['table_version']}, {len(s['jobs'])} job(s)",
        "",
        format_peers(s["peers"]),
    ]
    return "\n".join(lines)
