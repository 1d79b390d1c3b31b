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
@click.option(
    "--open",
    "open_browser",
    is_flag=True,
    help="Open the dashboard in this machine's web browser (a one-time link: the key stays out "
    "of the browser's command line); where no browser can start, print the URL instead.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def dashboard(state_dir, open_browser, as_json) -> None:
    """Print the URL of this node's web dashboard (served by `swarm up` on 127.0.0.1), with
    its key: open it in a browser on this machine, or run `swarm dashboard --open`.

    Its port is SWARM_DASHBOARD_PORT when the daemon starts (default 7738; 0: any free port;
    off: no dashboard). From another machine: ssh -L 7738:127.0.0.1:7738 HOST, then open the
    printed URL there.
    """

    from swarmp2p.client import control

    s = _ask(control.status, _state_dir(state_dir))
    url, note = s.get("dashboard"), s.get("dashboard_note", "")
    if not url and not as_json:
        from swarmp2p.errors import Failed

        _fail(Failed(f"this node serves no dashboard: {note or 'unknown reason'}"))
    why_not = _open_in_browser(url) if open_browser and url else None
    if as_json:
        tried = (
            {"opened": why_not is None, "why_not": why_not or ""} if open_browser and url else {}
        )
        click.echo(json.dumps({"url": url, "note": note, **tried}))
    elif not open_browser:
        click.echo(url)
    elif why_not is None:
        click.echo(f"opened the dashboard in the browser ({url.split('?', 1)[0]})")
    else:
        click.echo(f"no browser opened: {why_not}; open this URL on this machine:", err=True)
        click.echo(url)


def _open_in_browser(url: str) -> str | None:
    """Start a browser on a one-time link to the dashboard at ``url``; why not, or None."""
    import os
    import time
    import webbrowser

    from swarmp2p.dashboard.server import open_url

    graphical = any(os.environ.get(v) for v in ("DISPLAY", "WAYLAND_DISPLAY", "BROWSER"))
    if sys.platform.startswith("linux") and not graphical:
        # webbrowser would fall back to a text browser (lynx, w3m) in this terminal
        return "no graphical session here (DISPLAY, WAYLAND_DISPLAY and BROWSER are unset)"
    try:
        opened = webbrowser.open(open_url(url, now=time.time()))
    except (webbrowser.Error, OSError, ValueError) as exc:
        return f"the browser did not start ({exc})"
    return None if opened else "no web browser found here"
