"""The `swarm` command line: parse, call one library function, print.

One module per group of commands; this one holds the group and the helpers they share."""

from __future__ import annotations

import json
import sys

import click

from swarmp2p import PROTOCOL_VERSION, __commit__, __version__
from swarmp2p.cli import _exit
from swarmp2p.cli._exit import CliExit

EXIT_PLANNED = _exit.OK
EXIT_INVALID = _exit.INVALID
EXIT_BLOCKED = _exit.BLOCKED


def version_text() -> str:
    """What `swarm --version` prints: the release, the commit it was built from, the protocol."""
    return f"swarm {__version__} (commit {__commit__ or 'unknown'}, protocol {PROTOCOL_VERSION})"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(__version__, prog_name="swarm", message=version_text())
def main() -> None:
    """swarmp2p: train and serve causal LMs across the machines of a LAN.

    Every command takes -h/--help; docs/commands.md lists every option, environment variable
    and exit code."""


def _console(stderr: bool = False):
    from rich.console import Console

    width = None if sys.stdout.isatty() else 120
    return Console(stderr=stderr, width=width, highlight=False)


_STATE_DIR_OPTION = click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=str),
    default=None,
    envvar="SWARM_STATE_DIR",
    show_envvar=True,
    help="State directory (default: $XDG_STATE_HOME/swarmp2p, ~/.local/state/swarmp2p).",
)


def _state_dir(value: str | None):
    from pathlib import Path

    from swarmp2p.node.state import default_state_dir

    return Path(value) if value else default_state_dir()


API_KEY_ENV = "SWARM_API_KEY"
"""Where `swarm serve`, `generate` and `chat` read an API key from the environment (the same
name as ``swarmp2p.serve.api.API_KEY_ENV``, not imported: that module loads aiohttp)."""


def _api_key_options(what: str):
    """``--api-key -`` (stdin) and ``--api-key-file FILE``; with ``$SWARM_API_KEY`` the ways
    :func:`_read_api_key` takes an API key. Never the key in argv, where `ps` shows it."""

    def add(fn):
        fn = click.option(
            "--api-key-file",
            default=None,
            type=click.Path(dir_okay=False),
            help=f"{what}: read from this file (mode 0600).",
        )(fn)
        return click.option(
            "--api-key",
            default=None,
            metavar="-",
            help=f"{what}: read from stdin ('-'). The key also comes from ${API_KEY_ENV} or "
            "--api-key-file; never in the command line, where `ps` shows it.",
        )(fn)

    return add


def _read_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The API key given by :func:`_api_key_options` or ``$SWARM_API_KEY`` (None: none); a
    key typed in argv, given twice or in a file others may read exits 2 naming the fix."""
    import os

    from swarmp2p.net.security import read_secret

    try:
        return read_secret(
            "the API key",
            option=api_key,
            file=api_key_file,
            env=os.environ,
            flag="--api-key",
            file_flag="--api-key-file",
            env_name=API_KEY_ENV,
        )
    except (ValueError, PermissionError) as exc:
        raise CliExit(str(exc), _exit.INVALID) from None


def _fail(exc: Exception) -> None:
    """Print ``exc`` as the command's error and exit with its code: a SwarmError's kind decides
    (``swarmp2p.errors.EXIT_CODES``: the request 2, unavailable (no daemon, no leader, no
    quorum) 4, failed 1, internal 70); a plain ValueError is the input (2); else failed (1)."""
    from swarmp2p.errors import SwarmError

    if isinstance(exc, SwarmError):
        code = exc.exit_code
    elif isinstance(exc, ValueError):
        code = _exit.INVALID
    else:
        code = _exit.FAILED
    raise CliExit(str(exc), code) from None


def _ask(request, *args, **kwargs):
    """``request(*args, **kwargs)``: one request to the local daemon (``node.control``,
    ``node.job_commands``); its ApiError fails the command (`_fail`)."""
    from swarmp2p.node.api import ApiError

    try:
        return request(*args, **kwargs)
    except ApiError as exc:
        _fail(exc)


def _echo_json(value) -> None:
    """One JSON document on stdout (what every --json prints)."""
    click.echo(json.dumps(value, indent=2, sort_keys=True))


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
