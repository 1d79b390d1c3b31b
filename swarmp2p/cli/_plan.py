"""`swarm plan`: the shared planner offline."""

from __future__ import annotations

import json
import sys

import click

from swarmp2p.cli import (
    EXIT_BLOCKED,
    EXIT_INVALID,
    EXIT_PLANNED,
    _console,
    _gb,
    _print_invalid,
    main,
)


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
        errors += [{"path": e.path, "message": e.message} for e in exc.errors]
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


def _print_blocked(blocked) -> None:
    console = _console(stderr=True)
    console.print("[bold yellow]blocked[/]: the job cannot be placed on this cluster now")
    console.print(blocked.placement_blocked_reason, markup=False)


def _print_plan(plan) -> None:
    from rich.table import Table

    console = _console()
    m = plan.model
    console.print(
        f"[bold green]planned[/] {plan.job}: {m['name']} ({m['n_layers']} layers, "
        f"{m['params'] / 1e6:.1f}M params) over {len(plan.stages)} stage(s)"
    )
    console.print(
        f"dtype {plan.dtype} · finetune {plan.finetune_mode} · weights {plan.weight_storage} · "
        f"{plan.split_mode} split"
    )
    stages = Table(title="stages (GB = 2**30 bytes)", title_justify="left")
    for col in (
        "stage",
        "node",
        "device",
        "layers",
        "weights",
        "train state",
        "activations",
        "peak",
        "free",
        "download",
        "predicted s/step",
    ):
        stages.add_column(col, justify="right" if col not in ("node", "device") else "left")
    timing = plan.to_dict().get("timing") or {}
    times = timing.get("stages") or []
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
            _predicted(
                times[s.index] if s.index < len(times) else None,
                s.index == timing.get("bottleneck"),
            ),
        )
    console.print(stages)
    for line in replica_lines(plan.to_dict()):
        console.print(line, markup=False)
    if timing:
        console.print(_timing_line(timing), markup=False)
    if plan.boundaries:
        bounds = Table(title="boundaries", title_justify="left")
        for col in ("boundary", "compression", "codec", "bytes/token"):
            bounds.add_column(col)
        for b in plan.boundaries:
            comp = b.compression.label
            bounds.add_row(f"{b.index} -> {b.index + 1}", comp, b.codec, str(b.bytes_per_token))
        console.print(bounds)
    s = plan.schedule
    console.print(
        f"schedule {s.kind}, {s.micro_batches} micro-batch(es), bubble fraction "
        f"{s.bubble_fraction:.3f} · recompute {'on' if plan.recompute else 'off'} · "
        f"eval batches {plan.eval_batches}"
    )
    if s.predicted:
        from swarmp2p.schema import to_data

        console.print(schedules_line(to_data(s)), markup=False)
    console.print("features: " + (", ".join(plan.features) or "none"), markup=False)
    for note in plan.notes:
        console.print(f"note: {note}", markup=False)


def replica_lines(plan: dict) -> list[str]:
    """One line per replica of a replicated plan (as data; none for one pipeline): its
    stages' nodes and devices and its predicted step."""
    replicas = plan.get("replicas") or []
    if not replicas:
        return []
    rows = [{"index": 0, "stages": plan["stages"], "timing": plan.get("timing")}, *replicas]
    out = [f"replicas: {len(rows)} (stage i of each holds the same layers)"]
    for r in rows:
        where = ", ".join(
            f"{s['index']}: {s['node']} {'/'.join(s['devices'])}" for s in r["stages"]
        )
        step = (r.get("timing") or {}).get("step_s")
        out.append(f"  replica {r['index']}: {where}" + (f" · {step:.3f} s/step" if step else ""))
    return out


def schedules_line(s: dict) -> str:
    """How the schedule was chosen (a plan's ``schedule`` as data): each one priced, with its
    predicted bubble and step."""
    how = "chosen (auto)" if s.get("requested", "auto") == "auto" else f"forced ({s['requested']})"
    parts = []
    for p in s.get("predicted") or []:
        text = f"{p['kind']} bubble {p['bubble']:.3f}"
        if p.get("step_s") is not None:
            text += f" step {p['step_s']:.3g} s"
        if not p.get("fits", True):
            text += " (does not fit)"
        parts.append(text + (" <- chosen" if p["kind"] == s["kind"] else ""))
    return f"schedule {s['kind']} {how}; predicted: " + "; ".join(parts)


def _predicted(stage: dict | None, bottleneck: bool) -> str:
    """A stage's predicted seconds per step (compute + link), "bottleneck" on the slowest."""
    if not stage or stage.get("step_s") is None:
        return "-"
    text = f"{stage['step_s']:.3g} ({stage['compute_s']:.3g} + link {stage['link_s']:.2g})"
    return text + (" bottleneck" if bottleneck else "")


def _timing_line(timing: dict) -> str:
    """The predicted pipeline step, or why there is none."""
    if timing.get("step_s") is None:
        return (
            "predicted step: unknown (no measured speed on "
            + ", ".join(timing.get("unmeasured") or ["some device"])
            + ")"
        )
    return (
        f"predicted step {timing['step_s']:.3g} s (bubble included); the bottleneck is stage "
        f"{timing['bottleneck']}"
    )
