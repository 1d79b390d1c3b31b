"""`swarm up/down/token/invite/remove/status/peers`: the node daemon and its membership."""

from __future__ import annotations

import json
import os

import click

from swarmp2p.cli import (
    _STATE_DIR_OPTION,
    _ask,
    _echo_json,
    _fail,
    _state_dir,
    main,
)
from swarmp2p.timings import TIMINGS, Timings

# --- the node daemon: up, down, token, status, peers -----------------------------------------


def _seconds_option(flag: str, envvar: str, default: float, what: str):
    """A timing option in seconds, also read from ``envvar``."""
    return click.option(
        flag,
        type=float,
        default=default,
        envvar=envvar,
        show_envvar=True,
        show_default=True,
        help=what,
    )


def _count_option(flag: str, envvar: str, default: int, what: str):
    """A cap of at least 1 (the daemon's own default: ``node.config``), also read from
    ``envvar``."""
    return click.option(
        flag,
        type=click.IntRange(min=1),
        metavar="N",
        default=default,
        envvar=envvar,
        show_envvar=True,
        show_default=True,
        help=what,
    )


@main.command()
@click.option(
    "--token",
    default=None,
    metavar="-",
    help="Join a swarm, reading its token from stdin ('-'). The token also comes from "
    "$SWARM_TOKEN or --token-file; never in the command line, where `ps` shows it.",
)
@click.option(
    "--token-file",
    default=None,
    type=click.Path(dir_okay=False),
    help="Join the swarm of the token in this file (mode 0600).",
)
@click.option(
    "--code",
    default=None,
    metavar="WORDS",
    help="Join the swarm whose member printed this pairing code (`swarm invite`); '-' reads "
    "it from stdin.",
)
@click.option(
    "--open",
    "open_swarm",
    is_flag=True,
    help="A trusted home LAN only: join the single open swarm found without a code (or start "
    "one), and let any machine on the LAN join this one the same way.",
)
@click.option("--new", is_flag=True, help="Start a new swarm even when others are seen on the LAN.")
@click.option("--name", default="", help="Human name of this node (default: host name).")
@click.option("--node-id", default=None, help="Set this node's id (saved; the lowest id leads).")
@click.option("--port", type=int, default=7737, show_default=True, help="Control port (0: any).")
@click.option("--interface", default=None, help="Use only this interface (name or IPv4).")
@click.option("--peer", "peers", multiple=True, help="Static peer HOST:PORT (repeatable).")
@_STATE_DIR_OPTION
@click.option(
    "--foreground",
    is_flag=True,
    help="Run in this process (systemd, containers), logging to daemon.log and stderr; "
    "SWARM_LOG=file|stderr|both picks one (under systemd: stderr, the journal, alone).",
)
@click.option("--no-mdns", is_flag=True, help="Do not advertise or browse over mDNS.")
@_seconds_option(
    "--heartbeat", "SWARM_HEARTBEAT_S", TIMINGS.heartbeat_s, "Seconds between heartbeats."
)
@_seconds_option(
    "--failure-timeout",
    "SWARM_FAILURE_TIMEOUT_S",
    TIMINGS.failure_timeout_s,
    "Seconds of silence after which a peer is dead.",
)
@_count_option(
    "--max-waiting-jobs",
    "SWARM_MAX_WAITING_JOBS",
    64,
    "While this node leads: unfinished jobs (pending, placed, running) the swarm holds; "
    "a submission past it is refused, nothing written.",
)
@_count_option(
    "--max-waiting-per-node",
    "SWARM_MAX_WAITING_PER_NODE",
    16,
    "While this node leads: unfinished jobs one node's submissions may hold.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object once it is up.")
def up(
    token,
    token_file,
    code,
    open_swarm,
    new,
    name,
    node_id,
    port,
    interface,
    peers,
    state_dir,
    foreground,
    no_mdns,
    heartbeat,
    failure_timeout,
    max_waiting_jobs,
    max_waiting_per_node,
    as_json,
) -> None:
    """Start this node's daemon: join with a pairing code (--code), a token, or the state dir's
    swarm; on a machine with none it lists the swarms on the LAN (--new starts another).

    A new swarm prints the command that joins another machine, with a one-time pairing code.
    Scripts pass the token in SWARM_TOKEN, --token-file or on stdin (--token -), never in the
    command line, where `ps` shows it."""
    from swarmp2p.client import control
    from swarmp2p.errors import SwarmError
    from swarmp2p.node.api import ApiError
    from swarmp2p.node.config import NodeConfig

    try:
        token = control.read_token(token, token_file, os.environ)
        code = control.read_code(code) if code is not None else None
        # not for the daemon's workers to inherit
        os.environ.pop(control.TOKEN_ENV, None)
        config = NodeConfig(
            state_dir=_state_dir(state_dir),
            name=name,
            node_id=node_id,
            port=port,
            interface=interface,
            peers=tuple(peers),
            mdns=not no_mdns,
            timings=Timings(heartbeat_s=heartbeat, failure_timeout_s=failure_timeout),
            open_swarm=open_swarm,
            max_waiting_jobs=max_waiting_jobs,
            max_waiting_per_submitter=max_waiting_per_node,
        )
        result = control.up(config, token, foreground=foreground, code=code, new=new)
    except (SwarmError, ValueError, PermissionError, ApiError, OSError) as exc:
        _fail(exc)
    if foreground:
        return
    s = result["status"]
    paired = result.get("paired")
    if as_json:
        _echo_json(
            {
                "status": s,
                "created": result["created"],
                "join": result["join"] if result["created"] else None,
                "paired_with": paired.inviter if paired else None,
                "already": result.get("already"),
            }
        )
        return
    already = f" (already: pid {result['already']})" if result.get("already") else ""
    click.echo(
        f"node {s['node_id']} ({s['name']}) is up{already} in swarm {s['swarm_id']}, port "
        f"{s['port']}, key {s.get('key', '-')}"
    )
    note = s.get("dashboard_note") or ""
    if note and not note.startswith("off"):
        click.echo(f"no dashboard: {note}", err=True)
    if paired:
        click.echo(f"paired with node {paired.inviter}: this machine holds the swarm's secret")
    if result["created"]:
        click.echo(f"created a new swarm; on another machine run:\n  {result['join']}")


@main.command()
@_STATE_DIR_OPTION
@click.option("--json", "as_json", is_flag=True, help='Print {"pid", "stopped"}.')
def down(state_dir, as_json) -> None:
    """Stop this node's daemon cleanly (it says goodbye to its peers)."""
    from swarmp2p.client import control
    from swarmp2p.node.api import ApiError

    try:
        pid = control.down(_state_dir(state_dir))
    except (ApiError, OSError) as exc:
        _fail(exc)
    if as_json:
        _echo_json({"pid": pid, "stopped": True})
    else:
        click.echo(f"swarm daemon (pid {pid}) stopped")


@main.command()
@_STATE_DIR_OPTION
@click.option(
    "--rotate",
    is_flag=True,
    help="Give the whole swarm a new secret first: members keep their keys, the old token "
    "admits nobody (after `swarm remove`, so the removed node cannot come back).",
)
@click.option("--json", "as_json", is_flag=True, help='Print {"command", "token", "swarm_id"}.')
def token(state_dir, rotate, as_json) -> None:
    """Print this swarm's token, which joins another machine from a script: there,
    `swarm up --token -` reads it on stdin (e.g. swarm token | ssh HOST swarm up --token -).
    People join with `swarm invite` instead."""
    from swarmp2p.client import control
    from swarmp2p.node.api import ApiError

    try:
        if rotate:
            secret = control.rotate(_state_dir(state_dir))
        else:
            secret = control.token(_state_dir(state_dir))
    except (ValueError, PermissionError, ApiError) as exc:
        _fail(exc)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "command": control.JOIN_COMMAND,
                    "token": secret.token,
                    "swarm_id": secret.swarm_id,
                }
            )
        )
    else:
        # the token alone, for a pipe: swarm token | ssh HOST swarm up --token -
        click.echo(secret.token)


@main.command()
@_STATE_DIR_OPTION
@click.option(
    "--minutes", type=float, default=10.0, show_default=True, help="How long the code is valid."
)
@click.option("--json", "as_json", is_flag=True, help='Print {"code", "expires_in_s", ...}.')
def invite(state_dir, minutes, as_json) -> None:
    """Print a one-time pairing code that joins one more machine on this LAN: there, run
    `swarm up --code WORDS`. Each machine gets three tries; twelve wrong tries in all burn it."""
    from swarmp2p.client import control

    got = _ask(control.invite, _state_dir(state_dir), minutes=minutes)
    if as_json:
        _echo_json(got)
    else:
        click.echo(f"on the new machine run:\n  {control.code_command(got['code'], minutes)}")


@main.command()
@click.argument("node_id")
@_STATE_DIR_OPTION
@click.option("--json", "as_json", is_flag=True, help='Print {"node_id", "key", "version"}.')
def remove(node_id, state_dir, as_json) -> None:
    """Remove NODE_ID from the swarm and revoke its key on every member (a lost or
    compromised machine). Then `swarm token --rotate`, so the token it holds admits nobody."""
    from swarmp2p.client import control

    got = _ask(control.remove, _state_dir(state_dir), node_id)
    if as_json:
        _echo_json(got)
    else:
        click.echo(
            f"node {node_id} removed (key {got['key']} revoked); run `swarm token --rotate` "
            "so the token it holds admits nobody"
        )


@main.command()
@_STATE_DIR_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(state_dir, as_json) -> None:
    """This node, its swarm, the leader, peers and jobs."""
    import json

    from swarmp2p.client import control

    s = _ask(control.status, _state_dir(state_dir))
    if as_json:
        click.echo(json.dumps(s, indent=2))
        return
    click.echo(control.format_status(s))
    for line in health_lines(s):
        click.echo(line)


def no_runtime_message(s: dict) -> str:
    """Why nothing can run (no live node has the torch runtime) and the one command that
    installs it on this machine, for how this copy was installed."""
    from swarmp2p import doctor
    from swarmp2p._install import detect, runtime_fix

    install = detect()
    nodes = ", ".join(doctor.without_runtime(s)) or "-"
    return (
        f"no node of this swarm can run a stage: no torch runtime on {nodes}. This copy was "
        f"installed without it ({install.describe}); install it with:\n  {runtime_fix(install)}"
    )


def health_lines(s: dict) -> list[str]:
    """What `swarm status` adds below the table: nodes on another swarmp2p version, and,
    when no live node can run a stage, the one command that installs the runtime here."""
    from swarmp2p import doctor
    from swarmp2p._install import detect, runtime_fix

    lines = []
    skew = doctor.version_skew(s)
    if skew:
        lines.append(
            f"versions  this node runs {s.get('version')}; "
            + ", ".join(f"{node} runs {v}" for node, v in sorted(skew.items()))
            + ": install one version everywhere (`swarm --version`)"
        )
    missing = doctor.without_runtime(s)
    if missing and not doctor.can_run_stages(s):
        lines.append(
            f"runtime   no node can run a stage: no torch runtime on {', '.join(missing)}; "
            "jobs and served models wait until one can"
        )
        me = next((p for p in s.get("peers", []) if p.get("node_id") == s.get("node_id")), {})
        if not me.get("capabilities"):
            install = detect()
            lines.append(f"fix       ({install.describe}): {runtime_fix(install)}")
    elif missing:
        lines.append(f"runtime   coordinators only (no torch runtime): {', '.join(missing)}")
    return lines


@main.command()
@_STATE_DIR_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list.")
def peers(state_dir, as_json) -> None:
    """The nodes this node sees (itself included)."""
    import json

    from swarmp2p.client import control

    s = _ask(control.status, _state_dir(state_dir))
    click.echo(json.dumps(s["peers"], indent=2) if as_json else control.format_peers(s["peers"]))
