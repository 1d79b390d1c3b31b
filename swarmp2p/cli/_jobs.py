"""`swarm train`, `swarm jobs`, `swarm models`, `swarm export`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from swarmp2p.cli import (
    _STATE_DIR_OPTION,
    EXIT_BLOCKED,
    EXIT_INVALID,
    EXIT_PLANNED,
    _ask,
    _console,
    _echo_json,
    _exit,
    _fail,
    _gb,
    _print_invalid,
    _state_dir,
    main,
)
from swarmp2p.cli._exit import CliExit
from swarmp2p.timings import TIMINGS

# --- training jobs and models: train, jobs, models, export -----------------------------------

EXIT_JOB_FAILED = _exit.FAILED


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
@click.option(
    "--eval-batches",
    type=int,
    default=None,
    help="Override train.eval_batches (held-out batches of each evaluation; 0: none).",
)
@click.option("--stages", default=None, help='Override split.stages ("auto" or a number).')
@click.option("--compression", default=None, help="Override split.compression (spec or JSON).")
@click.option("--freeze-backbone/--no-freeze-backbone", default=None, help="model.freeze_backbone")
@click.option("--lora/--no-lora", default=None, help="Override model.lora.enabled.")
@click.option(
    "--lora-export",
    type=click.Choice(["merged", "adapters"]),
    default=None,
    help="Override model.lora.export: one merged model, or PEFT adapters beside the base.",
)
@click.option("--dtype", default=None, help="Override model.dtype.")
@click.option("--weight-dtype", default=None, help="Override model.weight_dtype.")
@click.option(
    "--quantization", default=None, help='Override model.quantization (JSON, {"bits": 4}).'
)
@_STATE_DIR_OPTION
def train(job_file, plan_only, detach, as_json, state_dir, stages, **flags) -> None:
    """Train JOB.json on the swarm, with a progress bar until the job ends.

    Exit 0 completed, 1 failed or cancelled, 2 invalid job, 3 blocked (--plan), 4 no daemon,
    5 no live node can run a stage (nothing is submitted; --detach submits anyway and the job
    waits PENDING). A job that waits PENDING prints its reason whenever it changes."""
    from swarmp2p.client import jobs as job_commands
    from swarmp2p.client.control import status as node_status
    from swarmp2p.node.api import ApiError
    from swarmp2p.plan import JobError

    if stages is not None:
        stages = stages if stages == "auto" else (int(stages) if stages.isdigit() else stages)
    try:
        job = job_commands.load_train_job(job_file, _train_overrides(stages=stages, **flags))
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
            result = job_commands.live_plan(sd, job)
            if as_json:
                click.echo(json.dumps(result, sort_keys=True, indent=2))
            else:
                _print_live_plan(result)
                if result["status"] != "planned":
                    _warn_no_runtime(node_status(sd), fatal=False)
            sys.exit(EXIT_PLANNED if result["status"] == "planned" else EXIT_BLOCKED)
        _warn_no_runtime(node_status(sd), fatal=not detach)
        done = job_commands.submit_train(sd, job)
    except ApiError as exc:
        _fail(exc)
    if detach:
        click.echo(json.dumps({"job_id": done["job_id"]}) if as_json else done["job_id"])
        return
    final = _follow(sd, done["job_id"], as_json)
    sys.exit(0 if final["state"] == "COMPLETED" else EXIT_JOB_FAILED)


def _warn_no_runtime(status: dict, *, fatal: bool) -> None:
    """When no live node can run a stage: exit 5 with the fix (``fatal``), else say so on
    stderr. A job submitted anyway waits PENDING until a node with the runtime joins."""
    from swarmp2p.cli._node import no_runtime_message
    from swarmp2p.doctor import can_run_stages

    if can_run_stages(status):
        return
    message = no_runtime_message(status)
    if fatal:
        raise CliExit(
            f"{message}\n(--detach submits it anyway: it waits PENDING)", _exit.NO_RUNTIME
        )
    _console(stderr=True).print(message, markup=False, soft_wrap=True)


def _print_live_plan(result: dict) -> None:
    console = _console()
    if result["status"] != "planned":
        console.print("[bold yellow]blocked[/]: the job cannot be placed on the swarm now")
        console.print(result["reason"], markup=False)
        return
    from rich.table import Table

    t = Table(
        title=f"live plan: dtype {result['dtype']}, {result['finetune_mode']}, {result['split_mode']} split"
    )
    from swarmp2p.cli._plan import _predicted, _timing_line, replica_lines, schedules_line

    timing = result.get("timing") or {}
    times = timing.get("stages") or []
    for col in (
        "stage",
        "node",
        "devices",
        "layers",
        "download GB",
        "disk free GB",
        "predicted s/step",
    ):
        t.add_column(col)
    for s in result["stages"]:
        i = s["index"]
        t.add_row(
            str(i),
            s["node"],
            ", ".join(s["devices"]),
            f"{s['layers'][0]}-{s['layers'][1] - 1}",
            _gb(s["download"]),
            _gb(s["disk_free"]),
            _predicted(times[i] if i < len(times) else None, i == timing.get("bottleneck")),
        )
    console.print(t)
    for line in replica_lines(result):
        console.print(line, markup=False)
    if timing:
        console.print(_timing_line(timing), markup=False)
    if result.get("schedule"):
        console.print(schedules_line(result["schedule"]), markup=False)
    for note in result.get("notes") or []:
        console.print(f"note: {note}", markup=False)
    console.print("features: " + (", ".join(result["features"]) or "none"), markup=False)


def plan_table(view: dict):
    """The placed job's plan as `swarm train` prints it once: a row per stage (node, devices,
    layers, predicted seconds per step; with replicas, every replica's), titled with its
    dtype, mode and predicted step."""
    from rich.table import Table

    plan = view["plan"]
    step_s = plan.get("predicted_step_s")
    replicas = plan.get("replicas") or [{"replica": 0, "stages": plan["stages"]}]
    t = Table(
        title=f"plan: dtype {plan.get('dtype')}, {plan.get('finetune_mode')}"
        + (f", {len(replicas)} replicas" if len(replicas) > 1 else "")
        + (f", predicted {step_s:.2f} s/step" if isinstance(step_s, (int, float)) else ""),
        title_justify="left",
    )
    for col in ("stage", "node", "devices", "layers", "predicted s/step"):
        t.add_column(col)
    rows = [(r["replica"], i, s) for r in replicas for i, s in enumerate(r["stages"])]
    for r, i, s in rows:
        predicted = s.get("predicted_s")
        mark = " (slowest)" if r == 0 and i == plan.get("bottleneck") else ""
        t.add_row(
            f"{i}" if len(replicas) == 1 else f"{i} (replica {r})",
            s.get("node_name") or s["node"],
            ", ".join(s["devices"]),
            f"{s['layers'][0]}-{s['layers'][1] - 1}",
            (f"{predicted:.3f}" if isinstance(predicted, (int, float)) else "-") + mark,
        )
    return t


def progress_bar(console, *, disable: bool = False):
    """The live line of `swarm train`: job, bar, step/steps, ETA, elapsed, then what is going
    on. Only the last column gives way to a narrow terminal (cut with an ellipsis), so at 80
    columns the bar, the step count and the ETA stay."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Column

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=16),
        TextColumn("{task.fields[steps]}"),
        TextColumn("{task.fields[eta]}"),
        TimeElapsedColumn(),
        TextColumn(
            "{task.fields[info]}",
            table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1),
        ),
        console=console,
        disable=disable,
        expand=True,
    )


def progress_fields(view: dict) -> dict:
    """What the live line shows for one job view: ``steps`` (``12/30``; ``-/30`` before the
    first step is known), ``eta`` (``ETA 45s``, blank while unknown) and ``info`` (the state,
    the loss of the last step, tokens/s, boundary rates, a PENDING job's reason)."""
    from swarmp2p.node.views import eta_s

    m = view.get("metrics") or {}
    info = [view["state"]]
    if isinstance(m.get("loss"), (int, float)):
        info.append(f"loss {m['loss']:.4f}")
    if m.get("tokens_per_s"):
        info.append(f"{m['tokens_per_s']:.0f} tok/s")
    for b, r in sorted((m.get("boundaries") or {}).items()):
        info.append(f"b{b} {r['act_mb_s']:.2f}/{r['grad_mb_s']:.2f} MB/s")
    if view.get("reason") and view["state"] in ("PENDING", "RESUMING"):
        info.append(view["reason"].splitlines()[0])
    if view["state"] in ("PLACED", "RUNNING") and not m.get("tokens_per_s"):
        info += phase_words(m.get("phases"), view.get("attempt"))
    steps = view.get("steps")
    step = view.get("step") or 0
    eta = eta_s(step, steps or 0, m.get("step_s"))
    return {
        "steps": f"{step if step or view['state'] == 'RUNNING' else '-'}/{steps or '?'}",
        "eta": f"ETA {eta:.0f}s" if eta is not None else "",
        "info": " · ".join(info),
    }


def phase_words(phases: dict | None, attempt: int | None) -> list[str]:
    """What each stage of the attempt does before its first step (the leader's
    ``metrics["phases"]``), one word each: ``s0 fetching 12/48 MB``, ``s1 loading weights``;
    a stage that trains already says nothing."""
    if not isinstance(phases, dict) or phases.get("attempt") != attempt:
        return []
    out = []
    for stage, p in sorted((phases.get("stages") or {}).items(), key=lambda kv: int(kv[0])):
        if p.get("phase") == "training":
            continue
        word = f"s{stage} {p.get('phase')}"
        if p.get("total"):
            word += f" {p['done'] / 1e6:.0f}/{p['total'] / 1e6:.0f} MB"
        out.append(word)
    return out


def _follow(sd, job_id: str, as_json: bool) -> dict:
    """Poll the job until it ends, with a live progress bar; the plan once it is placed; the
    final view."""
    import time

    from swarmp2p.client import jobs as job_commands
    from swarmp2p.node.api import ApiError, NoDaemon

    console = _console(stderr=True)
    view: dict = {}
    said = ""
    shown_plan = False
    unreachable_since: float | None = None
    registered_by = 0.0
    with progress_bar(console, disable=as_json) as bar:
        task = bar.add_task(job_id, total=None, steps="-/?", eta="", info="")
        while True:
            try:
                view = job_commands.job(sd, job_id)
            except ApiError as exc:
                if isinstance(exc, NoDaemon):
                    unreachable_since = unreachable_since or time.monotonic()
                    if time.monotonic() - unreachable_since > TIMINGS.no_daemon_grace_s:
                        raise CliExit(
                            f"{exc}; job {job_id} goes on in the swarm: `swarm jobs show "
                            f"{job_id}` once a daemon runs here",
                            _exit.NO_DAEMON,
                        ) from None
                bar.update(task, info=f"(daemon: {exc})")
                time.sleep(1.0)
                continue
            unreachable_since = None
            if not shown_plan and view["plan"]["stages"] and not as_json:
                shown_plan = True  # above the bar, once: where each stage runs
                bar.console.print(plan_table(view))
            waiting = view["state"] in ("PENDING", "RESUMING")
            if view["reason"] and waiting and view["reason"] != said and not as_json:
                said = view["reason"]  # every line, above the bar
                bar.console.print(f"{view['state']}: {said}", markup=False, soft_wrap=True)
            bar.update(task, total=view["steps"], completed=view["step"], **progress_fields(view))
            if view["state"] in job_commands.JOB_FINAL:
                # a completed job's model is registered by the table's next event: the view
                # this prints names it (`swarm serve` right after must find it)
                if view["state"] == "COMPLETED" and view.get("model") is None:
                    registered_by = registered_by or time.monotonic() + TIMINGS.register_wait_s
                    if time.monotonic() < registered_by:
                        time.sleep(0.2)
                        continue
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
    from swarmp2p.client import jobs as job_commands

    rows = _ask(job_commands.jobs, _state_dir(state_dir))
    click.echo(
        json.dumps(rows, indent=2, sort_keys=True) if as_json else job_commands.format_jobs(rows)
    )


def _jobs_state_dir(ctx, state_dir):
    return _state_dir(state_dir or ctx.obj.get("state_dir"))


def _job_command(name: str, json_help: str, *options):
    """`swarm jobs NAME JOB_ID [OPTIONS] [--json] [--state-dir DIR]`: the command gets the
    click context, the job id, ``options``' values, as_json and state_dir."""

    def add(fn):
        for decorator in reversed(
            (
                jobs.command(name),
                click.argument("job_id"),
                *options,
                click.option("--json", "as_json", is_flag=True, help=json_help),
                _STATE_DIR_OPTION,
                click.pass_context,
            )
        ):
            fn = decorator(fn)
        return fn

    return add


@_job_command("show", "Print one JSON object.")
def jobs_show(ctx, job_id, as_json, state_dir) -> None:
    """One job: plan, state history, metrics, evaluation, reason, error."""
    from swarmp2p.client import jobs as job_commands

    view = _ask(job_commands.job, _jobs_state_dir(ctx, state_dir), job_id)
    if as_json:
        click.echo(json.dumps(view, indent=2, sort_keys=True))
        return
    console = _console()
    console.print(
        f"job {view['id']} ({view['name']}): [bold]{view['state']}[/] step {view['step']}/{view['steps']}"
    )
    plan = view["plan"]
    if plan.get("replicas"):
        _print_replicas(console, plan)
    for i, s in enumerate(plan["stages"] if not plan.get("replicas") else ()):
        line = f"  stage {i} on {s['node']} {s['devices']} layers {s['layers']}"
        line += _times(s) + (" (bottleneck)" if i == plan.get("bottleneck") else "")
        console.print(line, markup=False)
    for h in view["history"]:
        why = f"  {h['reason']}" if h.get("reason") else ""
        console.print(f"  {when(h['at'])}  {h['state'].upper()}{why}", markup=False)
    if view["reason"]:
        console.print(f"reason: {view['reason']}", markup=False)
    _print_job_end(view)


def _print_replicas(console, plan: dict) -> None:
    """A replicated job's replicas, each with its tokens/s and its stages' compute and sync."""
    sync = plan.get("sync") or {}
    console.print(
        f"  {len(plan['replicas'])} replicas, synced {sync.get('mode', '?')}", markup=False
    )
    for rep in plan["replicas"]:
        rate = rep.get("tokens_per_s")
        head = f"  replica {rep['replica']}: step {rep.get('step') or 0}"
        console.print(head + (f", {rate:.0f} tok/s" if rate else ""), markup=False)
        for i, s in enumerate(rep["stages"]):
            line = f"    stage {i} on {s['node']} {s['devices']} layers {s['layers']}" + _times(s)
            if s.get("sync_bytes") is not None:
                line += f", sync {s['sync_bytes']} B in {s.get('sync_s') or 0:.3g} s"
            console.print(line + (" (done)" if s.get("done") else ""), markup=False)


def _times(stage: dict) -> str:
    """ ": compute 0.41 s/step predicted, 0.55 measured (+0.10 waiting)"", what is known."""
    predicted, measured, wait = (
        stage.get("predicted_s"),
        stage.get("measured_s"),
        stage.get("wait_s"),
    )
    if predicted is None and measured is None:
        return ""
    parts = [f"{predicted:.3g} s/step predicted" if predicted is not None else "not predicted"]
    if measured is not None:
        parts.append(f"{measured:.3g} measured" + (f" (+{wait:.2g} waiting)" if wait else ""))
    return ": compute " + ", ".join(parts)


def when(epoch: float) -> str:
    """An epoch time as this machine's local date and time, to the second."""
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(epoch))


@_job_command("cancel", 'Print {"job_id", "state"}.')
def jobs_cancel(ctx, job_id, as_json, state_dir) -> None:
    """Stop a job's workers and mark it CANCELLED."""
    from swarmp2p.client import jobs as job_commands

    out = _ask(job_commands.cancel_job, _jobs_state_dir(ctx, state_dir), job_id)
    if as_json:
        _echo_json(out)
    else:
        click.echo(f"{out['job_id']} {out['state']}")


@_job_command(
    "logs",
    "Print one JSON object (the log in text).",
    click.option("--stage", type=int, default=None, help="Stage index (default: the last)."),
    click.option("--replica", type=int, default=0, help="Replica index (split.replicas)."),
)
def jobs_logs(ctx, job_id, stage, replica, as_json, state_dir) -> None:
    """A stage worker's stderr log, fetched from the node that ran it."""
    from swarmp2p.client import jobs as job_commands

    out = _ask(job_commands.job_logs, _jobs_state_dir(ctx, state_dir), job_id, stage, replica)
    if as_json:
        _echo_json(out)
    else:
        click.echo(out["text"], nl=False)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list.")
@_STATE_DIR_OPTION
def models(as_json, state_dir) -> None:
    """Models trained on the swarm (the registry)."""
    from swarmp2p.client import jobs as job_commands

    rows = _ask(job_commands.models, _state_dir(state_dir))
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    if rows:
        click.echo(job_commands.format_models(rows))


@main.command("export")
@click.argument("model_id", metavar="MODEL")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output folder.")
@click.option(
    "--mode",
    "file_mode",
    default="0644",
    show_default=True,
    help="Permissions of the exported files, octal (0600: readable by you alone).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_STATE_DIR_OPTION
def export_command(model_id, out, file_mode, as_json, state_dir) -> None:
    """Gather MODEL's shards over the swarm and write a Hugging Face folder.

    A merged model loads with transformers' from_pretrained; an adapters export (a LoRA job
    with lora.export "adapters") with PEFT's PeftModel.from_pretrained on the base its
    adapter_config.json names (a Hub id; the embedded model's is
    HuggingFaceTB/SmolLM2-135M-Instruct, see swarm-model.json). Needs the torch runtime here."""
    from swarmp2p.client import jobs as job_commands
    from swarmp2p.node.api import ApiError

    try:
        mode = int(file_mode, 8)
        if not 0 <= mode <= 0o777 or not mode & 0o400:
            raise ValueError
    except ValueError:
        raise click.BadParameter(
            f"{file_mode!r} is not an octal file mode readable by its owner, such as 0644",
            param_hint="--mode",
        ) from None
    try:
        done = job_commands.export_model(_state_dir(state_dir), model_id, Path(out), file_mode=mode)
    except ModuleNotFoundError as exc:
        from swarmp2p._install import detect, runtime_fix

        raise CliExit(
            f"swarm export builds the model with the torch runtime, which this copy lacks "
            f"({exc}); install it with: {runtime_fix(detect(), embedded=False)}",
            _exit.NO_RUNTIME,
        ) from None
    except (ApiError, ValueError) as exc:
        _fail(exc)
    if as_json:
        _echo_json(done)
    else:
        click.echo(f"exported {done['model']} ({done['kind']}) to {done['out']}")
