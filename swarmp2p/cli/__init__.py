"""The `swarm` command line: parse, call one library function, print.

One module per group of commands; this one holds the group and the helpers they share."""

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
    """End the command with ``exc``'s message and its exit code: a SwarmError's kind decides
    (user 2, unavailable 4, failed 1, internal 70: ``swarmp2p.errors.EXIT_CODES``); a plain
    ValueError is the user's input (2); anything else failed (1)."""
    from swarmp2p.errors import EXIT_CODES, SwarmError

    err = click.ClickException(str(exc))
    if isinstance(exc, SwarmError):
        err.exit_code = exc.exit_code
    elif isinstance(exc, ValueError):
        err.exit_code = EXIT_CODES["user"]
    raise err from None


def _print_invalid(errors: list[dict[str, str]], as_json: bool) -> None:
    if as_json:
        out = {"status": "invalid", "dtype": None, "stages": [], "reason": None, "errors": errors}
        click.echo(json.dumps(out, sort_keys=True, indent=2))
        return
    console = _console(stderr=True)
    console.print(f"[bold red]invalid[/]: {len(errors)} error(s)")
    for e in errors:
        console.print(f"  {e['path']}: {e['message']}", markup=False)


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f}"


# the commands register themselves on `main` when their modules are imported
from swarmp2p.cli import _client, _demo, _jobs, _node, _plan, _serve, _ux  # noqa: E402, F401

__all__ = ["main"]
