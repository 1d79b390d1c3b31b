"""The `swarm` command line: parse, call one library function, print."""

from __future__ import annotations

import json
import sys

import click

from swarmp2p import __version__

EXIT_PLANNED = 0
EXIT_INVALID = 2
EXIT_BLOCKED = 3


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="swarm")
def main() -> None:
    """swarmp2p: train and serve causal LMs across the machines of a LAN."""


def _console(stderr: bool = False):
    from rich.console import Console

    width = None if sys.stdout.isatty() else 120
    return Console(stderr=stderr, width=width, highlight=False)


@main.command("plan")
@click.argument("job_file", metavar="JOB.json", type=click.Path(dir_okay=False))
@click.option(
    "--cluster",
    "cluster_file",
    required=True,
    metavar="CLUSTER.json",
    type=click.Path(dir_okay=False),
    help="The nodes to plan on (the format `swarm up` advertises; see docs/job.md).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def plan_command(job_file: str, cluster_file: str, as_json: bool) -> None:
    """Plan JOB.json on CLUSTER.json offline: exit 0 planned, 3 blocked, 2 invalid."""
    from swarmp2p.plan import ClusterError, JobError, load_cluster, load_job, plan_job

    errors: list[dict[str, str]] = []
    job = cluster = None
    try:
        job = load_job(job_file)
    except JobError as exc:
        errors += [{"path": e.path, "message": e.message} for e in exc.errors]
    try:
        cluster = load_cluster(cluster_file)
    except ClusterError as exc:
        errors += [_split_error(e) for e in exc.errors]
    result = None
    if not errors:
        try:
            result = plan_job(job, cluster)
        except JobError as exc:
            errors += [{"path": e.path, "message": e.message} for e in exc.errors]
        except ValueError as exc:  # the model could not be read (not in the cache, bad config)
            errors.append(_split_error(str(exc), default_path="model.pretrained"))
    if errors:
        _print_invalid(errors, as_json)
        sys.exit(EXIT_INVALID)
    assert result is not None
    if as_json:
        click.echo(json.dumps(result.to_dict(), sort_keys=True, indent=2))
    elif result.status == "blocked":
        _print_blocked(result)
    else:
        _print_plan(result)
    sys.exit(EXIT_PLANNED if result.status == "planned" else EXIT_BLOCKED)


def _split_error(text: str, default_path: str = "cluster") -> dict[str, str]:
    path, sep, message = text.partition(": ")
    if not sep or " " in path.strip():
        return {"path": default_path, "message": text}
    return {"path": path, "message": message}


def _print_invalid(errors: list[dict[str, str]], as_json: bool) -> None:
    if as_json:
        out = {"status": "invalid", "dtype": None, "stages": [], "reason": None, "errors": errors}
        click.echo(json.dumps(out, sort_keys=True, indent=2))
        return
    console = _console(stderr=True)
    console.print(f"[bold red]invalid[/]: {len(errors)} error(s)")
    for e in errors:
        console.print(f"  {e['path']}: {e['message']}", markup=False)


def _print_blocked(blocked) -> None:
    console = _console(stderr=True)
    console.print("[bold yellow]blocked[/]: the job cannot be placed on this cluster now")
    console.print(blocked.placement_blocked_reason, markup=False)


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f}"


def _print_plan(plan) -> None:
    from rich.table import Table

    console = _console()
    m = plan.model
    console.print(
        f"[bold green]planned[/] {plan.job_name}: {m['name']} ({m['n_layers']} layers, "
        f"{m['params'] / 1e6:.1f}M params) over {len(plan.stages)} stage(s)"
    )
    console.print(
        f"dtype {plan.dtype} · finetune {plan.finetune_mode} · weights {plan.weight_storage} · "
        f"{plan.split_mode} split"
    )
    stages = Table(title="stages (GB = 2**30 bytes)", title_justify="left")
    for col in ("stage", "node", "device", "layers", "weights", "train state", "activations",
                "peak", "free", "download"):  # fmt: skip
        stages.add_column(col, justify="right" if col not in ("node", "device") else "left")
    for s in plan.stages:
        mem = s.memory
        stages.add_row(
            str(s.index),
            s.node_name,
            ", ".join(f"{d} {n}" for d, n in zip(s.devices, s.device_names)),
            f"{s.layer_start}-{s.layer_end - 1}",
            _gb(mem.weights),
            _gb(mem.trainable_state),
            _gb(mem.activations + mem.loss + mem.transient),
            _gb(mem.peak),
            _gb(s.device_free),
            _gb(s.download),
        )
    console.print(stages)
    if plan.boundaries:
        bounds = Table(title="boundaries", title_justify="left")
        for col in ("boundary", "compression", "codec", "bytes/token"):
            bounds.add_column(col)
        for b in plan.boundaries:
            comp = b.compression if isinstance(b.compression, str) else json.dumps(b.compression)
            bounds.add_row(f"{b.index} -> {b.index + 1}", comp, b.codec, str(b.bytes_per_token))
        console.print(bounds)
    console.print(
        f"schedule {plan.schedule}, {plan.micro_batches} micro-batch(es), bubble fraction "
        f"{plan.bubble_fraction:.3f} · recompute {'on' if plan.recompute else 'off'} · "
        f"eval batches {plan.eval_batches}"
    )
    console.print("features: " + (", ".join(plan.features) or "none"), markup=False)
    for note in plan.notes:
        console.print(f"note: {note}", markup=False)


# --- the node daemon: up, down, token, status, peers (issue 6) -------------------------------

_STATE_DIR_OPTION = click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=str),
    default=None,
    envvar="SWARM_STATE_DIR",
    help="State directory (default: $XDG_STATE_HOME/swarmp2p, ~/.local/state/swarmp2p).",
)


def _state_dir(value: str | None):
    from pathlib import Path

    from swarmp2p.node.state import default_state_dir

    return Path(value) if value else default_state_dir()


def _fail(exc: Exception) -> None:
    raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--token", default=None, envvar="SWARM_TOKEN", help="Join the swarm of this token.")
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
def token(state_dir) -> None:
    """Print the command that joins another machine to this swarm."""
    from swarmp2p.node import control

    try:
        click.echo(control.token(_state_dir(state_dir)))
    except (ValueError, PermissionError) as exc:
        _fail(exc)


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


if __name__ == "__main__":
    main()
