"""`swarm doctor` and `swarm dashboard`."""

from __future__ import annotations

import json
import sys

import click

from swarmp2p.cli import (
    _STATE_DIR_OPTION,
    _ask,
    _fail,
    _state_dir,
    main,
)

# --- doctor and dashboard ---------------------------------------------------------------------


@main.command()
@_STATE_DIR_OPTION
@click.option("--interface", default=None, help="Check multicast on this interface (name or IPv4).")
@click.option(
    "--no-worker", is_flag=True, help="Skip the worker probe (torch, CUDA, bitsandbytes)."
)
@click.option(
    "--bench", is_flag=True, help="Measure this node's training speed again (seconds per dtype)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def doctor(state_dir, interface, no_worker, bench, as_json) -> None:
    """Check this machine and its swarm; each check PASS, WARN or FAIL with the fix.

    Looks at NVML and the GPUs, the worker environment's torch/CUDA (in a subprocess),
    compute capability and the dtypes it allows, bitsandbytes, multicast on the interface,
    the peers' control ports and clock skew (when a daemon runs), free disk at the model
    caches, and the embedded model. Exit code 1 when any check FAILs. --bench measures the
    devices' training speed per dtype again (the planner's `speed` split reads it; the running
    daemon advertises the new numbers).
    """

    from swarmp2p import doctor as doc

    if bench:
        from swarmp2p.doctor import bench as speed_bench
        from swarmp2p.errors import SwarmError

        try:
            measured = speed_bench.bench(_state_dir(state_dir))
        except (SwarmError, OSError, RuntimeError, ValueError) as exc:
            _fail(exc)
        click.echo(
            json.dumps(measured, indent=2) if as_json else speed_bench.format_bench(measured)
        )
        return

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

    from swarmp2p.client import control

    s = _ask(control.status, _state_dir(state_dir))
    url, note = s.get("dashboard"), s.get("dashboard_note", "")
    if as_json:
        click.echo(json.dumps({"url": url, "note": note}))
    elif url:
        click.echo(url)
    else:
        from swarmp2p.errors import Failed

        _fail(Failed(f"this node serves no dashboard: {note or 'unknown reason'}"))
