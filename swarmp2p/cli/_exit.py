"""The `swarm` exit codes: one table, read by every command and by docs/commands.md.

A script tells the outcomes apart by the code alone: the command's own "no" (a job that failed,
a doctor check that failed) is 1; a request that never reached a daemon is 4, never 1.
"""

from __future__ import annotations

import click

from swarmp2p.errors import EXIT_CODES

OK = 0
FAILED = 1
"""The command ran and its answer is no: a job ended FAILED or CANCELLED, a doctor check
FAILed, the daemon refused the request (its message says why)."""
INVALID = 2
"""Bad input: an unknown option, an invalid job or cluster file (click's usage errors are 2)."""
BLOCKED = 3
"""The plan is blocked: the job cannot be placed on these nodes now (the reason names each)."""
NO_DAEMON = 4
"""Not now: no daemon answers for the state directory (not started, another --state-dir,
stopped), or the swarm cannot do it now (no leader yet, no quorum on this side of a network
partition): the same command may succeed later."""
NO_RUNTIME = 5
"""No node can run a stage: this copy (or every node) lacks the torch runtime; the message
prints the one command that installs it."""
INTERNAL = 70
"""A bug or an unexpected state in swarmp2p (EX_SOFTWARE); the message says where to look."""
INTERRUPTED = 130
"""Ctrl-C or SIGTERM (128 + SIGINT)."""

MEANING = {
    OK: "success",
    FAILED: "failed: a job FAILED or was CANCELLED, a check FAILed, or the daemon refused",
    INVALID: "invalid input (options, job or cluster file)",
    BLOCKED: "blocked: the plan cannot be placed now",
    NO_DAEMON: "not now: no daemon answers, or no leader/quorum on this side",
    NO_RUNTIME: "no node can run a stage (the torch runtime is missing)",
    INTERNAL: "internal error in swarmp2p (a bug; see daemon.log)",
    INTERRUPTED: "interrupted (Ctrl-C, SIGTERM)",
}
assert tuple(EXIT_CODES[k] for k in ("failed", "user", "unavailable", "internal")) == (
    FAILED,
    INVALID,
    NO_DAEMON,
    INTERNAL,
), "swarmp2p.errors.EXIT_CODES and this table disagree"

COMMAND_CODES: dict[str, tuple[int, ...]] = {
    "up": (OK, FAILED, INVALID, NO_DAEMON),
    "down": (OK, FAILED, NO_DAEMON),
    "token": (OK, FAILED, NO_DAEMON),
    "invite": (OK, FAILED, INVALID, NO_DAEMON),
    "remove": (OK, FAILED, INVALID, NO_DAEMON),
    "status": (OK, NO_DAEMON),
    "peers": (OK, NO_DAEMON),
    "plan": (OK, INVALID, BLOCKED),
    "train": (OK, FAILED, INVALID, BLOCKED, NO_DAEMON, NO_RUNTIME, INTERNAL),
    "jobs": (OK, FAILED, NO_DAEMON),
    "jobs show": (OK, FAILED, NO_DAEMON),
    "jobs cancel": (OK, FAILED, NO_DAEMON),
    "jobs logs": (OK, FAILED, NO_DAEMON),
    "models": (OK, NO_DAEMON),
    "export": (OK, FAILED, NO_DAEMON, NO_RUNTIME),
    "serve": (OK, FAILED, INVALID, NO_DAEMON),
    "generate": (OK, FAILED),
    "chat": (OK, FAILED),
    "doctor": (OK, FAILED),
    "dashboard": (OK, FAILED, NO_DAEMON),
    "demo": (OK, FAILED, NO_RUNTIME, INTERRUPTED),
}
"""Which codes each command can end with (docs/commands.md lists them; a test checks that
every command is here)."""


class CliExit(click.ClickException):
    """An error printed as ``Error: MESSAGE`` that exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code
