"""docs/commands.md's command reference, generated from the click commands.

    python -m swarmp2p.cli._reference           rewrite the generated part of docs/commands.md
    python -m swarmp2p.cli._reference --check   exit 1 when it differs from the commands

The generated part lies between two marker lines; the prose around it is written by hand. For
every command it holds the exit codes (`swarmp2p.cli._exit`) and the command's `--help` text
verbatim (options, defaults, environment variables), at a fixed width so the text does not
depend on the terminal. A test fails when the file drifts from the commands.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from swarmp2p.cli import _exit, main

BEGIN = "<!-- BEGIN GENERATED: python -m swarmp2p.cli._reference (edit the commands, not this) -->"
END = "<!-- END GENERATED -->"
WIDTH = 100
"""The width `--help` is rendered at in the reference."""
DOC = Path(__file__).resolve().parents[2] / "docs" / "commands.md"

ENVIRONMENT = (
    (
        "SWARM_DASHBOARD_PORT",
        "`swarm up`",
        "the dashboard's port on 127.0.0.1 (default 7738; `0` any free port; `off` none)",
    ),
    (
        "SWARM_LOG",
        "`swarm up`",
        "where the daemon logs: `file` (daemon.log in the state dir), "
        "`stderr` or `both` (default: both in the foreground, stderr alone under systemd)",
    ),
    (
        "SWARM_FAKE_DEVICES",
        "`swarm up`, `swarm doctor`",
        "tests and demos only: GPUs to "
        "advertise instead of asking NVML, e.g. `A5000:24:8.6,1660S:6:7.5` (name:GiB:capability)",
    ),
    (
        "SWARM_SPEED_PROBE",
        "`swarm up`",
        "`off`: never measure this node's training speed (the "
        "`speed` split then falls back to free memory); measured once per hardware and version and again after a day, "
        "cached in `$XDG_CACHE_HOME/swarmp2p/speed`",
    ),
    ("CUDA_VISIBLE_DEVICES", "`swarm up`", "the GPUs the daemon and its stage workers see"),
    ("XDG_STATE_HOME", "every command", "the default state dir is `$XDG_STATE_HOME/swarmp2p`"),
    (
        "XDG_CACHE_HOME",
        "`swarm up`, `swarm demo`",
        "the embedded model's conversion lives in `$XDG_CACHE_HOME/swarmp2p` (`~/.cache/swarmp2p`)",
    ),
    (
        "HF_HOME, HF_HUB_CACHE",
        "`swarm up`, `swarm plan`",
        "the Hugging Face cache that Hub ids are read from (`hf download ORG/NAME` fills it)",
    ),
    ("NO_COLOR", "every command, install.sh", "no colour in the output (https://no-color.org)"),
    (
        "SWARM_TORCH_VERSION, SWARM_TORCH_CPU_INDEX",
        "install.sh",
        "the torch release it pins (default 2.13.0) and the index of its CPU builds",
    ),
)
"""Variables read outside the options (those of the options are listed from the commands)."""


def commands(group: click.Group = main, prefix: str = "") -> Iterator[tuple[str, click.Command]]:
    """Every command under ``group`` as ("jobs show", command), groups before their commands."""
    for name in sorted(group.commands):
        cmd = group.commands[name]
        path = f"{prefix} {name}".strip()
        yield path, cmd
        if isinstance(cmd, click.Group):
            yield from commands(cmd, path)


def _context(path: str) -> click.Context:
    ctx = click.Context(
        main,
        info_name="swarm",
        terminal_width=WIDTH,
        max_content_width=WIDTH,
        **main.context_settings,
    )
    cmd: click.Command = main
    for name in path.split():
        assert isinstance(cmd, click.Group)
        cmd = cmd.commands[name]
        ctx = click.Context(cmd, info_name=name, parent=ctx, **cmd.context_settings)
    return ctx


def help_text(path: str) -> str:
    """What `swarm PATH --help` prints, at the reference's width."""
    ctx = _context(path)
    return ctx.command.get_help(ctx)


def _first_line(cmd: click.Command) -> str:
    return " ".join(inspect.cleandoc(cmd.help or "").split("\n\n")[0].split())


def _codes(path: str) -> str:
    return ", ".join(f"{c} {_exit.MEANING[c].split(':')[0]}" for c in _exit.COMMAND_CODES[path])


def generated() -> str:
    """The generated part of docs/commands.md, markers included."""
    out = [BEGIN, "", "## Exit codes", "", "| code | meaning |", "|---|---|"]
    out += [f"| {code} | {meaning} |" for code, meaning in _exit.MEANING.items()]
    out += ["", "## Environment variables", "", "| variable | read by | what |", "|---|---|---|"]
    options: dict[str, tuple[list[str], str]] = {}
    for path, cmd in commands():
        for p in cmd.params:
            if isinstance(p, click.Option) and isinstance(p.envvar, str):
                users, _ = options.setdefault(p.envvar, ([], f"as `{p.opts[0]}`"))
                users.append(f"`swarm {path}`")
    for var, (users, what) in sorted(options.items()):
        out.append(f"| `{var}` | {', '.join(users)} | {what} |")
    out += [f"| `{var}` | {users} | {what} |" for var, users, what in ENVIRONMENT]
    out += ["", "## Commands", "", "| command | what it does | exit codes |", "|---|---|---|"]
    for path, cmd in commands():
        out.append(
            f"| [`swarm {path}`](#swarm-{path.replace(' ', '-')}) | "
            f"{_first_line(cmd)} | {', '.join(map(str, _exit.COMMAND_CODES[path]))} |"
        )
    for path, _cmd in commands():
        out += ["", f"### swarm {path}", "", f"Exit codes: {_codes(path)}.", "", "```text"]
        out += [line.rstrip() for line in help_text(path).splitlines()]
        out += ["```"]
    out += ["", END]
    return "\n".join(out)


def render(document: str) -> str:
    """``document`` with its generated part replaced by the current one."""
    try:
        head, rest = document.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
    except ValueError:
        raise ValueError(f"{DOC.name} lacks the marker lines {BEGIN!r} ... {END!r}") from None
    return head + generated() + tail


def main_(argv: list[str]) -> int:
    current = DOC.read_text(encoding="utf-8")
    wanted = render(current)
    if "--check" in argv:
        if wanted != current:
            print(f"{DOC} differs from the commands: python -m swarmp2p.cli._reference")
            return 1
        return 0
    DOC.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main_(sys.argv[1:]))
