"""`swarm demo`."""

from __future__ import annotations

import json
import sys

import click

from swarmp2p.cli import (
    _console,
    _exit,
    main,
)
from swarmp2p.cli._exit import CliExit
from swarmp2p.cli._jobs import _follow

# --- swarm demo: a 3-node local swarm trains, evaluates, serves and generates ----------------


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
    """The whole tour on this machine: 3 daemons train, evaluate, serve and answer.

    Starts 3 daemons on 127.0.0.1, fine-tunes the embedded model with a 3-stage LoRA job on
    the embedded corpus, prints its evaluation, serves it across the 3 nodes, prints a
    generation and stops everything (Ctrl-C or a failure stops everything too; --keep leaves
    it serving). About 2 minutes on a 2-core CPU box with the default 30 steps (measured
    107-148 s); the first run also converts the embedded model (once). A copy installed
    without the torch runtime exits 5 at once, printing the command that installs it."""
    import os
    import time

    from swarmp2p import demo
    from swarmp2p.node.api import ApiError

    settings = demo.DemoSettings(steps=steps, **({"prompt": prompt} if prompt else {}))
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' load bars
    err = _console(stderr=True)
    say = (
        (lambda text: None)
        if as_json
        else (lambda text: err.print(f"[bold]==>[/] {text}", soft_wrap=True))
    )
    missing = demo.missing_parts()
    if missing:  # a light install: say so at once, with the one command that fixes it
        from swarmp2p._install import detect, runtime_fix

        install = detect()
        raise CliExit(
            f"swarm demo runs its stages on this machine, and this copy lacks {missing} "
            f"(installed by {install.describe}); install it with:\n  {runtime_fix(install)}",
            _exit.NO_RUNTIME,
        )
    started = time.monotonic()
    step = "converting the embedded model"
    from swarmp2p.models import embedded_ready, ensure_embedded

    if not embedded_ready():
        say("converting the embedded model to safetensors (once; cached in ~/.cache/swarmp2p)")
        try:
            ensure_embedded()
        except (RuntimeError, ImportError) as exc:
            raise CliExit(f"swarm demo failed while {step}: {exc}", _exit.FAILED) from None
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
            step = "serving"
            say(f"serving {model_id} in place: each stage loads its trained shard where it lives")
            served = demo.serve_on_swarm(swarm, model_id, name=model_id)
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
            sys.exit(_exit.INTERRUPTED)
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
    sys.exit(_exit.FAILED)
