"""`swarm up/down/token/status/peers`: the node daemon."""

from __future__ import annotations

import json
import os

import click

from swarmp2p.cli import (
    _STATE_DIR_OPTION,
    _fail,
    _state_dir,
    main,
)

# --- the node daemon: up, down, token, status, peers (issue 6) -------------------------------


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
@click.option("--name", default="", help="Human name of this node (default: host name).")
@click.option("--node-id", default=None, help="Set this node's id (saved; the lowest id leads).")
@click.option("--port", type=int, default=7737, show_default=True, help="Control port (0: any).")
@click.option("--interface", default=None, help="Use only this interface (name or IPv4).")
@click.option("--peer", "peers", multiple=True, help="Static peer HOST:PORT (repeatable).")
@_STATE_DIR_OPTION
@click.option("--foreground", is_flag=True, help="Run in this process, logging to stderr too.")
@click.option("--no-mdns", is_flag=True, help="Do not advertise or browse over mDNS.")
@click.option(
    "--heartbeat",
    type=float,
    default=0.5,
    envvar="SWARM_HEARTBEAT_S",
    show_default=True,
    help="Seconds between heartbeats.",
)
@click.option(
    "--failure-timeout",
    type=float,
    default=3.0,
    envvar="SWARM_FAILURE_TIMEOUT_S",
    show_default=True,
    help="Seconds of silence after which a peer is dead.",
)
def up(
    token,
    token_file,
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
) -> None:
    """Start this node's daemon (creating a swarm when there is no token and no state)."""
    from swarmp2p.node import control
    from swarmp2p.node.api import ApiError
    from swarmp2p.node.config import NodeConfig

    try:
        token = control.read_token(token, token_file, os.environ)
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
            heartbeat_s=heartbeat,
            failure_timeout_s=failure_timeout,
        )
        result = control.up(config, token, foreground=foreground)
    except (ValueError, PermissionError, ApiError, OSError) as exc:
        _fail(exc)
    if foreground:
        return
    s = result["status"]
    click.echo(
        f"node {s['node_id']} ({s['name']}) is up in swarm {s['swarm_id']}, port {s['port']}"
    )
    if result["created"]:
        click.echo(f"created a new swarm; on another machine run:\n  {result['join']}")


@main.command()
@_STATE_DIR_OPTION
def down(state_dir) -> None:
    """Stop this node's daemon cleanly."""
    from swarmp2p.node import control
    from swarmp2p.node.api import ApiError

    try:
        pid = control.down(_state_dir(state_dir))
    except (ApiError, OSError) as exc:
        _fail(exc)
    click.echo(f"swarm daemon (pid {pid}) stopped")


@main.command()
@_STATE_DIR_OPTION
@click.option("--json", "as_json", is_flag=True, help='Print {"command", "token", "swarm_id"}.')
def token(state_dir, as_json) -> None:
    """Print this swarm's token, which joins another machine: there, `swarm up --token -`
    reads it on stdin (e.g. swarm token | ssh HOST swarm up --token -)."""
    from swarmp2p.node import control

    try:
        secret = control.token(_state_dir(state_dir))
    except (ValueError, PermissionError) as exc:
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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(state_dir, as_json) -> None:
    """This node, its swarm, the leader, peers and jobs."""
    import json

    from swarmp2p.node import control
    from swarmp2p.node.api import ApiError

    try:
        s = control.status(_state_dir(state_dir))
    except ApiError as exc:
        _fail(exc)
    click.echo(json.dumps(s, indent=2) if as_json else control.format_status(s))


@main.command()
@_STATE_DIR_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list.")
def peers(state_dir, as_json) -> None:
    """The nodes this node sees (itself included)."""
    import json

    from swarmp2p.node import control
    from swarmp2p.node.api import ApiError

    try:
        s = control.status(_state_dir(state_dir))
    except ApiError as exc:
        _fail(exc)
    click.echo(json.dumps(s["peers"], indent=2) if as_json else control.format_peers(s["peers"]))
