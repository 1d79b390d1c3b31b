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
@click.option("--json", "as_json", is_flag=True, help='Print {"command", "token", "swarm_id"}.')
def token(state_dir, as_json) -> None:
    """Print the command that joins another machine to this swarm."""
    from swarmp2p.node import control

    try:
        command = control.token(_state_dir(state_dir))
    except (ValueError, PermissionError) as exc:
        _fail(exc)
    if as_json:
        from swarmp2p.net import SwarmSecret

        secret = SwarmSecret.from_token(command.rsplit(" ", 1)[-1])
        click.echo(
            json.dumps({"command": command, "token": secret.token, "swarm_id": secret.swarm_id})
        )
    else:
        click.echo(command)


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


# --- doctor and dashboard (issue 9) ------------------------------------------------------------


@main.command()
@_STATE_DIR_OPTION
@click.option("--interface", default=None, help="Check multicast on this interface (name or IPv4).")
@click.option(
    "--no-worker", is_flag=True, help="Skip the worker probe (torch, CUDA, bitsandbytes)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def doctor(state_dir, interface, no_worker, as_json) -> None:
    """Check this machine and its swarm; each check PASS, WARN or FAIL with the fix.

    Looks at NVML and the GPUs, the worker environment's torch/CUDA (in a subprocess),
    compute capability and the dtypes it allows, bitsandbytes, multicast on the interface,
    the peers' control ports and clock skew (when a daemon runs), free disk at the model
    caches, and the embedded model. Exit code 1 when any check FAILs.
    """
    import json

    from swarmp2p import doctor as doc

    checks = doc.diagnose(_state_dir(state_dir), interface=interface, worker=not no_worker)
    result = doc.report(checks)
    click.echo(json.dumps(result, indent=2) if as_json else doc.format_checks(checks))
    sys.exit(0 if result["ok"] else 1)


@main.command()
@_STATE_DIR_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def dashboard(state_dir, as_json) -> None:
    """Print the URL of this node's web dashboard (served by `swarm up` on 127.0.0.1).

    Its port is SWARM_DASHBOARD_PORT when the daemon starts (default 7738; 0: any free port;
    off: no dashboard). From another machine: ssh -L 7738:127.0.0.1:7738 HOST.
    """
    import json

    from swarmp2p.node import control
    from swarmp2p.node.api import ApiError

    try:
        s = control.status(_state_dir(state_dir))
    except ApiError as exc:
        _fail(exc)
    url, note = s.get("dashboard"), s.get("dashboard_note", "")
    if as_json:
        click.echo(json.dumps({"url": url, "note": note}))
    elif url:
        click.echo(url)
    else:
        _fail(ValueError(f"this node serves no dashboard: {note or 'unknown reason'}"))


# --- swarm generate / swarm chat: thin clients of the OpenAI-compatible API (serve) ----------


def _api_options(fn):
    fn = click.option(
        "--api-key",
        envvar="SWARM_API_KEY",
        default=None,
        help="The API key the server was started with (or SWARM_API_KEY).",
    )(fn)
    fn = click.option(
        "--url",
        envvar="SWARM_API_URL",
        default="http://127.0.0.1:8080",
        show_default=True,
        help="Where `swarm serve` listens (or SWARM_API_URL).",
    )(fn)
    return fn


@main.command("generate")
@click.argument("model")
@click.argument("prompt")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(0, 2), default=0.7, show_default=True)
@click.option("--stream/--no-stream", default=False, help="Print tokens as they come.")
@_api_options
def generate_command(
    model: str, prompt: str, max_tokens: int, temperature: float, stream: bool, url: str, api_key
) -> None:
    """Complete PROMPT with MODEL through the swarm's API."""
    from swarmp2p.serve.client import ApiClientError, complete_text, stream_text

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
    try:
        if stream:
            for piece in stream_text(url, "/v1/completions", body, api_key=api_key):
                click.echo(piece, nl=False)
            click.echo()
        else:
            click.echo(complete_text(url, "/v1/completions", body, api_key=api_key)[0])
    except ApiClientError as e:
        raise click.ClickException(str(e)) from None


@main.command("chat")
@click.argument("model")
@click.option("--system", default=None, help="A system message to start the conversation.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--temperature", type=click.FloatRange(0, 2), default=0.7, show_default=True)
@_api_options
def chat_command(
    model: str, system: str | None, max_tokens: int, temperature: float, url: str, api_key
) -> None:
    """Chat with MODEL through the swarm's API (empty line or end of input quits)."""
    from swarmp2p.serve.client import ApiClientError, stream_text

    messages = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            click.echo("> ", nl=False)
        line = sys.stdin.readline()
        if not line.strip():
            return
        messages.append({"role": "user", "content": line.rstrip("\n")})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        pieces = []
        try:
            for piece in stream_text(url, "/v1/chat/completions", body, api_key=api_key):
                pieces.append(piece)
                click.echo(piece, nl=False)
        except ApiClientError as e:
            raise click.ClickException(str(e)) from None
        click.echo()
        messages.append({"role": "assistant", "content": "".join(pieces)})


# --- training jobs and models: train, jobs, models, export (issue 7) -------------------------

EXIT_JOB_FAILED = 1


def _train_overrides(**flags) -> dict:
    out = dict(flags)
    if out.get("compression") is not None:
        text = out["compression"]
        out["compression"] = json.loads(text) if text.strip()[:1] in "[{" else text
    if out.get("quantization") is not None:
        out["quantization"] = json.loads(out["quantization"])
    return out


@main.command()
@click.argument("job_file", metavar="JOB.json", type=click.Path(dir_okay=False))
@click.option("--plan", "plan_only", is_flag=True, help="Print the live plan; submit nothing.")
@click.option("--detach", is_flag=True, help="Submit and return (no progress bar).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--pretrained", default=None, help="Override model.pretrained.")
@click.option("--steps", type=int, default=None, help="Override train.steps.")
@click.option("--stages", default=None, help='Override split.stages ("auto" or a number).')
@click.option("--compression", default=None, help="Override split.compression (spec or JSON).")
@click.option("--freeze-backbone/--no-freeze-backbone", default=None, help="model.freeze_backbone")
@click.option("--lora/--no-lora", default=None, help="Override model.lora.enabled.")
@click.option("--lora-export", type=click.Choice(["merged", "adapters"]), default=None)
@click.option("--dtype", default=None, help="Override model.dtype.")
@click.option("--weight-dtype", default=None, help="Override model.weight_dtype.")
@click.option(
    "--quantization", default=None, help='Override model.quantization (JSON, {"bits": 4}).'
)
@_STATE_DIR_OPTION
def train(job_file, plan_only, detach, as_json, state_dir, stages, **flags) -> None:
    """Train JOB.json on the swarm: exit 0 completed, 1 failed, 2 invalid job."""
    from swarmp2p.node import control
    from swarmp2p.node.api import ApiError
    from swarmp2p.plan import JobError

    if stages is not None:
        stages = stages if stages == "auto" else (int(stages) if stages.isdigit() else stages)
    try:
        job = control.load_train_job(job_file, _train_overrides(stages=stages, **flags))
    except (JobError, ValueError) as exc:
        errors = getattr(exc, "errors", None)
        rows = (
            [{"path": e.path, "message": e.message} for e in errors]
            if errors
            else [{"path": "(flags)", "message": str(exc)}]
        )
        _print_invalid(rows, as_json)
        sys.exit(EXIT_INVALID)
    sd = _state_dir(state_dir)
    try:
        if plan_only:
            result = control.live_plan(sd, job)
            if as_json:
                click.echo(json.dumps(result, sort_keys=True, indent=2))
            else:
                _print_live_plan(result)
            sys.exit(EXIT_PLANNED if result["status"] == "planned" else EXIT_BLOCKED)
        done = control.submit_train(sd, job)
    except ApiError as exc:
        _fail(exc)
    if detach:
        click.echo(json.dumps({"job_id": done["job_id"]}) if as_json else done["job_id"])
        return
    final = _follow(sd, done["job_id"], as_json)
    sys.exit(0 if final["state"] == "COMPLETED" else EXIT_JOB_FAILED)


def _print_live_plan(result: dict) -> None:
    console = _console()
    if result["status"] != "planned":
        console.print("[bold yellow]blocked[/]: the job cannot be placed on the swarm now")
        console.print(result["reason"], markup=False)
        return
    from rich.table import Table

    t = Table(title=f"live plan: dtype {result['dtype']}, {result['finetune_mode']}")
    for col in ("stage", "node", "devices", "layers", "download GB", "disk free GB"):
        t.add_column(col)
    for s in result["stages"]:
        t.add_row(
            str(s["index"]),
            s["node"],
            ", ".join(s["devices"]),
            f"{s['layers'][0]}-{s['layers'][1] - 1}",
            _gb(s["download"]),
            _gb(s["disk_free"]),
        )
    console.print(t)
    console.print("features: " + (", ".join(result["features"]) or "none"), markup=False)


def _follow(sd, job_id: str, as_json: bool) -> dict:
    """Poll the job until it ends, with a live progress bar; the final view."""
    import time

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from swarmp2p.node import control
    from swarmp2p.node.api import ApiError
    from swarmp2p.node.jobs import eta_s

    console = _console(stderr=True)
    view: dict = {}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        disable=as_json,
    ) as bar:
        task = bar.add_task(job_id, total=None, info="")
        while True:
            try:
                view = control.job(sd, job_id)
            except ApiError as exc:
                bar.update(task, info=f"(daemon: {exc})")
                time.sleep(1.0)
                continue
            m = view["metrics"]
            info = [view["state"]]
            if isinstance(m.get("loss"), (int, float)):
                info.append(f"loss {m['loss']:.4f}")
            if m.get("tokens_per_s"):
                info.append(f"{m['tokens_per_s']:.0f} tok/s")
            for b, r in sorted(m.get("boundaries", {}).items()):
                info.append(f"b{b} {r['act_mb_s']:.2f}/{r['grad_mb_s']:.2f} MB/s")
            eta = eta_s(view["step"], view["steps"] or 0, m.get("step_s"))
            if eta is not None:
                info.append(f"ETA {eta:.0f}s")
            if view["reason"] and view["state"] in ("PENDING", "RESUMING"):
                info.append(view["reason"].splitlines()[0])
            bar.update(task, total=view["steps"], completed=view["step"], info=" · ".join(info))
            if view["state"] in control.JOB_FINAL:
                break
            time.sleep(0.5)
    if as_json:
        click.echo(json.dumps(view, indent=2, sort_keys=True))
    else:
        _print_job_end(view)
    return view


def _print_job_end(view: dict) -> None:
    console = _console()
    console.print(f"job {view['id']} ({view['name']}): [bold]{view['state']}[/]")
    if view["evaluation"]:
        _print_evaluation(view["evaluation"])
    if view["error"]:
        e = view["error"]
        console.print(f"stage {e['stage']} on node {e['node']}: {e['message']}", markup=False)
        for line in e.get("stderr_tail", [])[-15:]:
            console.print(f"  {line}", markup=False)
    if view["model"]:
        console.print(f"model {view['model']['id']} registered (see `swarm models`)")


def _print_evaluation(evaluation: dict) -> None:
    from rich.table import Table

    t = Table(title="evaluation (held-out)", title_justify="left")
    for col in ("pass", "loss", "perplexity", "top-1", "tokens"):
        t.add_column(col)
    order = ["base", "calibrated_boundary", "trained"]
    for name in sorted(evaluation, key=lambda k: (order.index(k) if k in order else 9, k)):
        r = evaluation[name]
        t.add_row(
            name,
            *(
                f"{r[k]:.4f}" if isinstance(r.get(k), (int, float)) else "-"
                for k in ("loss", "perplexity", "top1")
            ),
            str(r.get("tokens", "-")),
        )
    _console().print(t)


@main.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list.")
@_STATE_DIR_OPTION
@click.pass_context
def jobs(ctx, as_json, state_dir) -> None:
    """Training jobs in the swarm (show, cancel, logs)."""
    ctx.ensure_object(dict)
    ctx.obj["state_dir"] = state_dir
    if ctx.invoked_subcommand is not None:
        return
    from swarmp2p.node import control
    from swarmp2p.node.api import ApiError

    try:
        rows = control.jobs(_state_dir(state_dir))
    except ApiError as exc:
        _fail(exc)
    click.echo(json.dumps(rows, indent=2, sort_keys=True) if as_json else control.format_jobs(rows))


def _jobs_state_dir(ctx, state_dir):
    return _state_dir(state_dir or ctx.obj.get("state_dir"))


@jobs.command("show")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_STATE_DIR_OPTION
@click.pass_context
def jobs_show(ctx, job_id, as_json, state_dir) -> None:
    """One job: plan, state history, metrics, evaluation, reason, error."""
    from swarmp2p.node import control
    from swarmp2p.node.api import ApiError

    try:
        view = control.job(_jobs_state_dir(ctx, state_dir), job_id)
    except ApiError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(view, indent=2, sort_keys=True))
        return
    console = _console()
    console.print(
        f"job {view['id']} ({view['name']}): [bold]{view['state']}[/] step {view['step']}/{view['steps']}"
    )
    for s in view["plan"]["stages"]:
        console.print(f"  stage on {s['node']} {s['devices']} layers {s['layers']}", markup=False)
    for h in view["history"]:
        console.print(f"  {h['at']:.3f} {h['state'].upper()}", markup=False)
    if view["reason"]:
        console.print(f"reason: {view['reason']}", markup=False)
    _print_job_end(view)


@jobs.command("cancel")
@click.argument("job_id")
@_STATE_DIR_OPTION
@click.pass_context
def jobs_cancel(ctx, job_id, state_dir) -> None:
    """Stop a job's workers and mark it CANCELLED."""
    from swarmp2p.node import control
    from swarmp2p.node.api import ApiError

    try:
        out = control.cancel_job(_jobs_state_dir(ctx, state_dir), job_id)
    except ApiError as exc:
        _fail(exc)
    click.echo(f"{out['job_id']} {out['state']}")


@jobs.command("logs")
@click.argument("job_id")
@click.option("--stage", type=int, default=None, help="Stage index (default: the last).")
@_STATE_DIR_OPTION
@click.pass_context
def jobs_logs(ctx, job_id, stage, state_dir) -> None:
    """A stage worker's stderr log, fetched from the node that ran it."""
    from swarmp2p.node import control
    from swarmp2p.node.api import ApiError

    try:
        out = control.job_logs(_jobs_state_dir(ctx, state_dir), job_id, stage)
    except ApiError as exc:
        _fail(exc)
    click.echo(out["text"], nl=False)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list.")
@_STATE_DIR_OPTION
def models(as_json, state_dir) -> None:
    """Models trained on the swarm (the registry)."""
    from swarmp2p.node import control
    from swarmp2p.node.api import ApiError

    try:
        rows = control.models(_state_dir(state_dir))
    except ApiError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    for m in rows:
        ev = m["manifest"]["evaluation"].get("trained", {})
        loss = ev.get("loss")
        click.echo(
            f"{m['id']}  job {m['job_id']}  base {m['base']}  "
            f"{len(m['manifest']['stages'])} stage(s)  "
            + (f"trained loss {loss:.4f}" if isinstance(loss, (int, float)) else "")
        )


@main.command("export")
@click.argument("model_id", metavar="MODEL")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output folder.")
@_STATE_DIR_OPTION
def export_command(model_id, out, state_dir) -> None:
    """Gather MODEL's shards over the swarm and write a Hugging Face folder."""
    from pathlib import Path

    from swarmp2p.node import control
    from swarmp2p.node.api import ApiError

    try:
        done = control.export_model(_state_dir(state_dir), model_id, Path(out))
    except (ApiError, ValueError) as exc:
        _fail(exc)
    click.echo(f"exported {done['model']} ({done['kind']}) to {done['out']}")


# --- swarm demo: a 3-node local swarm trains, evaluates, serves and generates (issue 9) ------


def _where(stages: list[dict]) -> str:
    """'demo-1 layers 0-9, demo-2 layers 10-19, ...' for a plan's or a served model's stages."""
    return ", ".join(f"{s['node']} layers {s['layers'][0]}-{s['layers'][1] - 1}" for s in stages)


@main.command("demo")
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=30,
    show_default=True,
    help="Training steps of the LoRA job.",
)
@click.option(
    "--keep",
    is_flag=True,
    help="Leave the swarm and the served model running; print how to reach and stop them.",
)
@click.option(
    "--prompt",
    default=None,
    help='What the served model continues (default: "The capital of France is").',
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object at the end.")
def demo_command(steps: int, keep: bool, prompt: str | None, as_json: bool) -> None:
    """Start 3 daemons on 127.0.0.1, fine-tune the embedded model with a 3-stage LoRA job on
    the embedded corpus, print its evaluation, serve it across the 3 nodes, print a generation
    and stop everything (Ctrl-C or a failure stops everything too; --keep leaves it serving).
    About 2 minutes on a 2-core CPU box with the default 30 steps (measured 107-148 s)."""
    import os
    import time

    from swarmp2p import demo
    from swarmp2p.node.api import ApiError

    settings = demo.DemoSettings(steps=steps, **({"prompt": prompt} if prompt else {}))
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the export's load/save bars
    err = _console(stderr=True)
    say = (
        (lambda text: None)
        if as_json
        else (lambda text: err.print(f"[bold]==>[/] {text}", soft_wrap=True))
    )
    started = time.monotonic()
    step = "starting the swarm"
    swarm = demo.LocalSwarm(nodes=settings.nodes, die_with_demo=not keep)
    try:
        with demo.sigterm_as_interrupt():
            say(f"starting {settings.nodes} nodes on 127.0.0.1 (state under {swarm.root})")
            swarm.start()
            swarm.watch()
            lead = swarm.leader
            say(
                "swarm up: "
                + ", ".join(f"{n.node_id} :{n.port}" for n in swarm.nodes)
                + f"; leader {lead.node_id}"
            )
            step = "training"
            say(f"fine-tuning the embedded model: LoRA, {settings.nodes} stages, {steps} steps")
            follow = None if as_json else (lambda sd, job_id: _follow(sd, job_id, as_json=False))
            view = demo.train(swarm, settings, follow)
            model_id = view["model"]["id"]
            if not as_json:
                _console().print("stages: " + _where(view["plan"]["stages"]), markup=False)
            step = "exporting"
            say(f"exporting {model_id}: its shards gathered from the nodes, sha256-checked")
            folder = demo.export_for_serving(
                lead.state_dir, model_id, swarm.root / "models" / model_id
            )
            step = "serving"
            say(f"serving {model_id} across the swarm ({settings.nodes} stages)")
            served = demo.serve_on_swarm(swarm, folder, name=model_id, stages=settings.nodes)
            url = served["url"]
            if not as_json:
                _console().print(f"serving at {url}/v1: " + _where(served["stages"]), markup=False)
            step = "generating"
            text = demo.generate(url, model_id, settings.prompt, settings.max_tokens)
            result = {
                "job": view,
                "model": model_id,
                "served": served,
                "url": url,
                "prompt": settings.prompt,
                "generation": text,
                "elapsed_s": round(time.monotonic() - started, 1),
                "kept": keep,
                "root": str(swarm.root) if keep else None,
                "stop": [*swarm.stop_commands(), f"rm -rf {swarm.root}"] if keep else [],
            }
            if as_json:
                click.echo(json.dumps(result, indent=2, sort_keys=True))
            else:
                console = _console()
                from rich.text import Text

                console.print("[bold]generation[/]:")
                console.print(Text(settings.prompt) + Text(text, style="bold"), soft_wrap=True)
                say(f"done in {result['elapsed_s']:.0f} s")
            if keep:
                swarm.keep = True
                if not as_json:
                    lines = [
                        f"the swarm keeps serving {model_id} at {url}/v1 (OpenAI-compatible):",
                        f"  swarm generate {model_id} 'Once upon a time' --url {url}",
                        f"  swarm chat {model_id} --url {url}",
                        f"  swarm status --state-dir {lead.state_dir}",
                        f"  swarm dashboard --state-dir {lead.state_dir}   (its web page's URL)",
                        "stop it with:",
                        *(f"  {c}" for c in swarm.stop_commands()),
                        f"  rm -rf {swarm.root}",
                    ]
                    say("\n".join(lines))
    except KeyboardInterrupt:
        if swarm.failure is None:
            err.print(f"interrupted while {step}; stopping the swarm")
            swarm.close()
            sys.exit(130)
        failed: Exception = swarm.failure
    except (demo.DemoError, ApiError, OSError, ValueError, RuntimeError) as exc:
        failed = exc
    else:
        swarm.close()
        return
    err.print(f"[bold red]swarm demo failed while {step}[/]:", soft_wrap=True)
    err.print(str(failed), markup=False, soft_wrap=True)
    for node in swarm.nodes:
        err.print(f"--- {node.node_id} log (last lines):\n{swarm.log_tail(node)}", markup=False)
    swarm.close()
    sys.exit(1)


# --- swarm serve: a model across the swarm behind the OpenAI-compatible API (issue 8) -------


@main.command("serve")
@click.argument("model", required=False)
@click.option("--stop", "stop_model", default=None, metavar="MODEL", help="Stop serving MODEL.")
@click.option("--stages", type=click.IntRange(min=0), default=0, help="Stages (0: one per node).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Where the API listens.")
@click.option("--max-sessions", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--max-context", type=click.IntRange(min=0), default=0, help="0: the model's.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32")
@click.option("--quantization", default=None, help='Quantized base, JSON: {"bits": 4}.')
@click.option("--name", default=None, help="The model name the API answers to (default MODEL).")
@click.option("--api-key", envvar="SWARM_API_KEY", default=None, help="Or SWARM_API_KEY.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_STATE_DIR_OPTION
def serve_command(model, stop_model, state_dir, as_json, quantization, **options) -> None:
    """Serve MODEL (a folder, a cached Hub id, or "embedded") across the swarm.

    The leader places the stages (memory priced with the KV cache of --max-sessions sessions
    of --max-context tokens), each stage loads on its node, and this node answers the
    OpenAI-compatible API until `swarm serve --stop MODEL`.
    """
    from swarmp2p.node import control
    from swarmp2p.node.api import ApiError

    sd = _state_dir(state_dir)
    try:
        if stop_model is not None:
            done = control.serve_stop(sd, stop_model)
            click.echo(json.dumps(done) if as_json else f"stopped serving {done['model']}")
            return
        if not model:
            raise click.UsageError("name a MODEL to serve, or --stop MODEL")
        if quantization is not None:
            try:
                quantization = json.loads(quantization)
            except ValueError as exc:
                raise click.BadParameter(f"not JSON: {exc}", param_hint="--quantization") from None
        view = control.serve(sd, {"model": model, "quantization": quantization, **options})
    except (ApiError, ValueError) as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(view, indent=2))
        return
    where = ", ".join(
        f"{s['node']} [{s['layers'][0]}-{s['layers'][1] - 1}]" for s in view["stages"]
    )
    click.echo(
        f"serving {view['model']} at {view['url']}/v1 on {len(view['stages'])} stage(s): {where}"
    )


if __name__ == "__main__":
    main()
