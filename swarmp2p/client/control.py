"""What the `swarm up/down/token/invite/remove/status/peers` commands do; the CLI only parses
and prints."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from swarmp2p.node import api
from swarmp2p.node import requests as rq
from swarmp2p.node.config import NodeConfig
from swarmp2p.node.state import StateDir, pid_alive
from swarmp2p.timings import TIMINGS

if TYPE_CHECKING:  # net.security loads all of swarmp2p.net (zmq, the wire codec, numpy):
    # `swarm status`, `peers`, `down` need none of it; what reads or writes a secret imports it
    from swarmp2p.net.security import SwarmSecret


TOKEN_ENV = "SWARM_TOKEN"
JOIN_COMMAND = "swarm up --token -"
"""How a script joins another machine: it reads the token on stdin. Never the token itself:
printed text lands in terminals' scrollback and in logs, and a token in argv is read by
``ps``. People join with a pairing code (:func:`code_command`)."""


def join_command() -> str:
    """What `swarm up` prints for joining another machine without mDNS (no secret in it)."""
    return (
        f"{JOIN_COMMAND}   (then paste the token `swarm token` prints here; "
        f"or set {TOKEN_ENV}, or pass --token-file FILE)"
    )


def code_command(code: str, minutes: float) -> str:
    """The join command with a pairing code (what `swarm up` and `swarm invite` print)."""
    return f"swarm up --code {code}   (one machine, valid {minutes:g} minutes; `swarm invite` makes another)"


def read_code(option: str, stdin: TextIO | None = None) -> str:
    """``--code WORDS`` or ``--code -`` (the words on stdin)."""
    if option != "-":
        return option
    stdin = sys.stdin if stdin is None else stdin
    text = stdin.readline() if not stdin.isatty() else input("pairing code: ")
    if not text.strip():
        raise ValueError("--code -: nothing on stdin; type the code `swarm invite` printed")
    return text.strip()


def lan_swarms(seconds: float = TIMINGS.lan_browse_s) -> list[dict[str, Any]]:
    """The swarms advertised on the LAN: ``{"swarm_id", "nodes": [names], "open"}`` each."""
    import asyncio

    from swarmp2p.net.discovery import browse

    seen = asyncio.run(browse(seconds))
    swarms: dict[str, dict[str, Any]] = {}
    for s in seen:
        entry = swarms.setdefault(
            s.advert.swarm_id, {"swarm_id": s.advert.swarm_id, "nodes": [], "open": False}
        )
        entry["nodes"].append(s.advert.name or s.advert.node_id)
        entry["open"] = entry["open"] or "open" in s.advert.invite_ports()
    return sorted(swarms.values(), key=lambda e: e["swarm_id"])


def swarms_found_message(swarms: list[dict[str, Any]]) -> str:
    lines = ["this machine has no swarm yet; swarms on this LAN:"]
    for s in swarms:
        nodes = ", ".join(sorted(s["nodes"])[:6]) + (" ..." if len(s["nodes"]) > 6 else "")
        lines.append(
            f"  {s['swarm_id']}  {len(s['nodes'])} node(s): {nodes}{'  (open)' if s['open'] else ''}"
        )
    lines.append(
        "join one: run `swarm invite` on one of its machines, then `swarm up --code WORDS` "
        "here (`swarm up --open` joins an open one); or `swarm up --new` starts another swarm"
    )
    return "\n".join(lines)


def read_token(
    option: str | None,
    token_file: str | None,
    env: Mapping[str, str],
    stdin: TextIO | None = None,
) -> str | None:
    """The swarm token handed to `swarm up`: ``--token -`` (stdin), ``--token-file FILE`` or
    ``$SWARM_TOKEN``; None when none was given. ValueError for a token in argv (every local
    user reads argv with ``ps``), for two ways at once, or an unreadable or shared file."""
    from swarmp2p.net.security import read_secret

    return read_secret(
        "the swarm token",
        option=option,
        file=token_file,
        env=env,
        flag="--token",
        file_flag="--token-file",
        env_name=TOKEN_ENV,
        stdin=stdin,
    )


def swarm_secret(state: StateDir, token: str | None) -> tuple[SwarmSecret, bool]:
    """The swarm secret to run with (saved 0600 in ``state``) and whether it was just created."""
    from swarmp2p.net.security import SwarmSecret

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


def token(state_dir: Path) -> SwarmSecret:
    """This node's swarm secret (its ``token`` joins another machine, on stdin)."""
    from swarmp2p.net.security import SwarmSecret

    state = StateDir(root=state_dir)
    if not state.has_secret():
        raise ValueError(f"no swarm in {state_dir}: run `swarm up` first")
    return SwarmSecret.load(state.secret_file)


def _running(state: StateDir) -> int | None:
    pid = state.read_pid()
    if pid is None:
        return None
    try:
        api.send(state.api_socket, rq.StatusRequest(), timeout=2.0)
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
    if config.open_swarm:
        args.append("--open")
    args += ["--heartbeat", repr(config.heartbeat_s)]
    args += ["--failure-timeout", repr(config.failure_timeout_s)]
    args += ["--max-waiting-jobs", str(config.max_waiting_jobs)]
    args += ["--max-waiting-per-node", str(config.max_waiting_per_submitter)]
    return args


def up(
    config: NodeConfig,
    token_text: str | None,
    *,
    foreground: bool,
    code: str | None = None,
    new: bool = False,
) -> dict[str, Any]:
    """Start this node's daemon; returns ``{"status", "created", "join", "paired"}``.

    The secret comes from the token, the state dir, a pairing ``code`` (or, with
    ``config.open_swarm``, the single open swarm on the LAN), or is created: on a machine
    with no swarm, no token and no code, the swarms seen on the LAN are listed instead
    (UserError) unless ``new``. In the foreground this serves until stopped; otherwise it
    starts ``swarm up --foreground`` in a new session and returns once its local API answers.
    """
    from dataclasses import replace

    from swarmp2p.errors import UserError
    from swarmp2p.net.security import SwarmSecret

    _preflight(config)
    state = StateDir(root=config.state_dir).ensure()
    pid = _running(state)
    if pid is not None:
        if code is not None or token_text or new or foreground:
            raise UserError(
                f"a swarm daemon already runs for {state.root} (pid {pid}); `swarm down` "
                "first to start it again or to join another swarm",
                code="exists",
            )
        status = api.request(state.api_socket, "status", timeout=5.0)
        return {
            "status": status,
            "created": False,
            "join": join_command(),
            "paired": None,
            "already": pid,
        }
    _check_ports(config)
    if code is not None and (token_text or new):
        raise ValueError("--code joins with a pairing code: give no token and no --new with it")
    paired = None
    fresh = not token_text and not state.has_secret() and not new
    if code is not None or (config.open_swarm and fresh):
        if state.has_secret():
            existing = SwarmSecret.load(state.secret_file)
            raise ValueError(
                f"state dir {state.root} already belongs to swarm {existing.swarm_id}; a pairing "
                "code joins a machine with no swarm (use another --state-dir)"
            )
        paired = _pair(code)
    if paired is not None:
        paired.secret.save(state.secret_file)
        secret, created = paired.secret, False
        if paired.peer:  # a first peer, so joining waits for no mDNS round
            config = replace(config, peers=(*config.peers, paired.peer))
    else:
        if fresh and config.mdns and not config.open_swarm:
            found = lan_swarms()
            if found:
                raise UserError(swarms_found_message(found), code="bad_request")
        secret, created = swarm_secret(state, token_text)
    if foreground:
        from swarmp2p.node.config import raise_open_file_limit, setup_logging
        from swarmp2p.node.daemon import serve

        setup_logging(state, foreground=True)
        before, after = raise_open_file_limit()
        if after != before:
            import logging

            logging.getLogger("swarmp2p.node").info("open files: limit %d -> %d", before, after)
        if created:
            how = (
                "run `swarm invite` here, then on it `swarm up --code WORDS`"
                if config.mdns
                else join_command()
            )
            print(
                f"created swarm {secret.swarm_id}; join another machine: {how}",
                file=sys.stderr,
                flush=True,
            )
        serve(config, secret)
        return {"status": None, "created": created, "join": join_command(), "paired": paired}
    # The daemon reads the secret from the state dir (saved 0600 above): no token in its argv
    # or its environment.
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmp2p", *_daemon_args(config)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
        env={k: v for k, v in os.environ.items() if k != TOKEN_ENV},
    )
    try:
        status = api.wait_until_up(
            state.api_socket, TIMINGS.daemon_start_s, alive=lambda: proc.poll() is None
        )
    except api.ApiError as exc:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(5)
        tail = _log_tail(state)
        cause = [
            line.split(CANNOT_START, 1)[1] for line in tail.splitlines() if CANNOT_START in line
        ]
        if cause:  # the daemon named a cause the user can fix (a port in use...)
            raise UserError(f"the swarm daemon did not start: {cause[-1]}") from None
        raise api.ApiError(f"{exc}; last log lines:\n{tail}") from None
    join = join_command()
    if created and config.mdns:
        try:
            got = invite(state.root, minutes=10)
            join = code_command(got["code"], 10)
        except api.ApiError:
            pass
    return {"status": status, "created": created, "join": join, "paired": paired}


def _pair(code: str | None):
    """Pair with the invite of ``code`` on the LAN (None: the single open swarm)."""
    import asyncio

    from swarmp2p.errors import UserError
    from swarmp2p.node.cluster.pairing import pair

    try:
        return asyncio.run(pair(code))
    except UserError as exc:
        if code is None and exc.code == "no_invite":
            return None  # --open and no open swarm yet: this machine founds one
        raise


def invite(state_dir: Path, minutes: float = 10) -> dict[str, Any]:
    """A one-time pairing code from the local daemon: ``{"code", "expires_in_s", ...}``."""
    return api.send(StateDir(root=state_dir).api_socket, rq.InviteRequest(minutes=minutes))


def remove(state_dir: Path, node_id: str) -> dict[str, Any]:
    """`swarm remove NODE`: off the members, its key revoked everywhere."""
    return api.send(
        StateDir(root=state_dir).api_socket, rq.RemoveRequest(node_id=node_id), timeout=30.0
    )


def rotate(state_dir: Path) -> SwarmSecret:
    """`swarm token --rotate`: a new secret for the whole swarm; the new one."""
    api.send(StateDir(root=state_dir).api_socket, rq.RotateRequest(), timeout=30.0)
    return token(state_dir)


def _preflight(config: NodeConfig) -> None:
    """Refuse bad input before anything is written: the interface, fake devices, node id."""
    from swarmp2p.net.discovery import list_interfaces, select_interfaces
    from swarmp2p.node.cluster.election import check_node_id
    from swarmp2p.node.config import log_destinations
    from swarmp2p.node.hardware import FAKE_DEVICES_ENV, parse_fake_devices

    log_destinations(True)  # a bad SWARM_LOG
    select_interfaces(list_interfaces(), config.interface)
    if os.environ.get(FAKE_DEVICES_ENV) is not None:
        parse_fake_devices(os.environ[FAKE_DEVICES_ENV])
    if config.node_id is not None:
        check_node_id(config.node_id)


CANNOT_START = "cannot start: "
"""What the daemon logs before a cause the user can fix (``Daemon.run``)."""


def _check_ports(config: NodeConfig) -> None:
    """UserError naming the port, what it is for and the flag that moves it, when another
    process listens on the control port or the join port (checked again at the bind)."""
    from swarmp2p.net.discovery import list_interfaces, select_interfaces
    from swarmp2p.node.cluster.join import JOIN_PORT_OFFSET
    from swarmp2p.node.config import check_port_free

    if not config.port:
        return
    chosen = select_interfaces(list_interfaces(), config.interface)
    host = chosen[0][1] if config.interface and chosen else "0.0.0.0"
    check_port_free(host, config.port, "control")
    check_port_free(host, config.port + JOIN_PORT_OFFSET, "join")


def _log_tail(state: StateDir, lines: int = 15) -> str:
    try:
        return "\n".join(state.log_file.read_text().splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def down(state_dir: Path) -> int:
    """Stop the daemon cleanly (API first, SIGTERM if it does not answer); its pid.

    SIGTERM goes only to the process that ``daemon.pid`` names when it is this state dir's
    daemon (its start-time stamp and command line match); a pid file left by a crash or a
    reboot names some other process, so it is removed and nothing is signalled."""
    state = StateDir(root=state_dir)
    try:
        pid = api.send(state.api_socket, rq.DownRequest(), timeout=5.0)["pid"]
    except api.ApiError as exc:
        pid, why = state.daemon_pid()
        if pid is None:
            if not state.pid_file.exists():
                raise
            with contextlib.suppress(FileNotFoundError):
                state.pid_file.unlink()
            raise api.ApiError(
                f"no swarm daemon is running for {state.root}: {why}; removed the stale "
                f"{state.pid_file.name} (the local API said: {exc})"
            ) from None
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + TIMINGS.daemon_stop_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return pid
        time.sleep(0.05)
    raise api.ApiError(f"swarm daemon pid {pid} did not stop within {TIMINGS.daemon_stop_s:g} s")


def status(state_dir: Path) -> dict[str, Any]:
    return api.send(StateDir(root=state_dir).api_socket, rq.StatusRequest())


def _gib(n: int | None) -> str:
    return f"{(n or 0) / (1 << 30):.1f}G"


def format_peers(peers: list[dict[str, Any]]) -> str:
    """A plain text table of peers (KEY: each one's public key fingerprint; ``(joining)``
    after it marks a node that joined but is not listed as a member yet)."""
    rows = [("NODE", "NAME", "ADDRESS", "ALIVE", "LEADER", "KEY", "DEVICES")]
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
                (p.get("key") or "-") + ("" if p.get("member", True) else " (joining)"),
                devices,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows
    )


def _quorum_lines(q: dict[str, Any] | None) -> list[str]:
    if not q or not q.get("members"):
        return []
    line = f"members {len(q['members'])} ({', '.join(q['members'])}), majority {q['majority']}"
    if q.get("down"):
        line += f" of {len(q.get('voters') or [])} voting ({', '.join(q['down'])} down)"
    out = [line] + ([f"quorum  NO: {q['reason']}"] if not q.get("ok") else [])
    for d in q.get("dropped") or []:  # this node's writes no majority held, rolled back
        first, last = d["versions"]
        out.append(f"dropped versions {first}-{last} ({', '.join(d['events'])}): {d['why']}")
    return out


UNFINISHED = ("pending", "placed", "running", "resuming")
"""The job states `swarm status` lists one line each (finished ones: `swarm jobs`)."""


def _job_lines(jobs: list[dict[str, Any]]) -> list[str]:
    """A line per unfinished job (state, step, last training loss), then how many finished."""
    lines, finished = [], 0
    for j in jobs:
        if j.get("state") not in UNFINISHED:
            finished += 1
            continue
        r = j.get("record") or {}
        metrics = r.get("metrics") or {}
        steps = ((r.get("job") or {}).get("train") or {}).get("steps")
        step = max(r.get("step") or 0, metrics.get("step") or 0)
        loss = metrics.get("loss", r.get("loss"))
        name = f" ({r['name']})" if r.get("name") else ""
        lines.append(
            f"job     {j['job_id']}{name} {j['state'].upper()}, step {step}/{steps or '?'}"
            + (f", training loss {loss:.4f}" if isinstance(loss, (int, float)) else "")
        )
    if finished:
        lines.append(f"jobs    {finished} finished (`swarm jobs` lists them)")
    return lines


def format_status(s: dict[str, Any]) -> str:
    lines = [
        f"node    {s['node_id']} ({s['name']}), port {s['port']}, key {s.get('key', '-')}",
        f"swarm   {s['swarm_id']}",
        *(
            ["removed THIS NODE WAS REMOVED: its key is revoked (join again under a new identity)"]
            if s.get("removed")
            else []
        ),
        f"leader  {s['leader']}"
        + ("" if s.get("leader_ready") or s["leader"] != s["node_id"] else " (taking over)"),
        f"table   term {s['term']}, version {s['table_version']}, {len(s['jobs'])} job(s)",
        *_quorum_lines(s.get("quorum")),
        *_job_lines(s["jobs"]),
        "",
        format_peers(s["peers"]),
    ]
    for m in s.get("served") or []:
        stages = ", ".join(
            f"{st['node']} [{st['layers'][0]}-{st['layers'][1] - 1}]" for st in m["stages"]
        )
        where = f" at {m['url']}/v1" if m.get("url") else ""
        why = f"; {m['reason']}" if m.get("reason") else ""
        n = m.get("sessions")
        load = f", {n['active']}/{n['max']} sessions, {n['queued']} queued" if n else ""
        cache = (n or {}).get("prefix_cache")
        if cache:
            load += (
                f", prefix cache {cache['hit_rate']:.0%} hits, "
                f"{cache['reused_tokens']} tokens reused"
            )
        lines.append(f"served  {m['model']}{where} ({m['state']}{load}): {stages or '-'}{why}")
        if n and n.get("speculate"):
            lines.append(f"        {speculation_line(n)}")
    lines += [f"fetch   {fetch_line(f)}" for f in s.get("fetching") or []]
    return "\n".join(lines)


def speculation_line(sessions: dict[str, Any]) -> str:
    """``speculate auto: 62% of 410 drafted tokens accepted, 2.31 tokens a lap`` (or off, and
    why) for a served model's sessions in ``swarm status``."""
    mode = sessions["speculate"]
    if mode == "none":
        return "speculate none"
    if sessions.get("draft_model"):
        mode += " (draft model at stage 0)"
    if sessions.get("speculate_off"):
        return f"speculate {mode}: off, {sessions['speculate_off']}"
    stats = sessions.get("speculation") or {}
    if not stats.get("drafted"):
        return f"speculate {mode}: nothing drafted yet"
    return (
        f"speculate {mode}: {stats['acceptance']:.0%} of {stats['drafted']} drafted tokens "
        f"accepted, {stats['tokens_per_lap']:.2f} tokens a lap"
    )


def fetch_line(f: dict[str, Any]) -> str:
    """``b: tiny stage 1 from a: 2/3 files, 1.2/3.4 MB`` (a status line: one of the fetches
    ``node.inputs`` reports)."""
    done, total = f.get("bytes") or (0, 0)
    files = f.get("files") or (0, 0)
    return (
        f"{f.get('node')}: {f.get('what')} from {f.get('from')}: {files[0]}/{files[1]} files, "
        f"{done / 1e6:.1f}/{total / 1e6:.1f} MB"
    )
