"""One exception base with stable codes, carried through RPC and the local API to the CLI.

Every refusal a user can see is a :class:`SwarmError` with a ``code`` (a stable, machine-readable
word: ``invalid_job``, ``no_quorum``...) and a ``kind`` that decides how the CLI ends:

- ``user``: the request itself is wrong (a bad field, an unknown job); fix the input. Exit 2.
- ``unavailable``: the swarm cannot do it now (no leader yet, no quorum, a node is down); the
  same request may succeed later. Exit 4.
- ``failed``: it was tried and did not work (a job failed, a stage could not start). Exit 1.
- ``internal``: a bug or an unexpected state in swarmp2p; the message says where to look. Exit 70
  (EX_SOFTWARE).

A code crosses the wire as ``ErrorReply(code, detail)`` and the local API as ``{"code",
"kind", "error"}``; :func:`from_code` rebuilds the same exception on the other side, so the
CLI never matches message substrings.
"""

from __future__ import annotations

from typing import ClassVar

KINDS = ("user", "unavailable", "failed", "internal")
EXIT_CODES = {"user": 2, "unavailable": 4, "failed": 1, "internal": 70}
"""How `swarm` ends for each kind of error (docs/commands.md lists them)."""

CODES: dict[str, str] = {
    # user
    "bad_request": "user",
    "bad_field": "user",
    "invalid_job": "user",
    "no_job": "user",
    "no_model": "user",
    "final": "user",
    "exists": "user",
    "not_served": "user",
    # a peer's request the daemon refuses (wire and protocol)
    "malformed": "user",
    "unknown_type": "user",
    "too_large": "user",
    "version": "user",
    "wrong_swarm": "user",
    "unknown_peer": "user",
    "node_id_taken": "user",
    "not_member": "user",
    "forbidden": "user",
    "refused": "user",
    "bad_code": "user",
    "no_invite": "user",
    "unexpected": "user",
    "bad_model": "user",
    "bad_data": "user",
    "data_too_large": "user",
    "not_listed": "user",
    "not_applied": "user",
    # unavailable (retry later)
    "no_leader": "unavailable",
    "not_leader": "unavailable",
    "not_ready": "unavailable",
    "no_quorum": "unavailable",
    "joining": "unavailable",
    "no_peer": "unavailable",
    "timeout": "unavailable",
    "stopping": "unavailable",
    "no_daemon": "unavailable",
    "slow_down": "unavailable",
    "job_cap": "unavailable",
    "job_rate": "unavailable",
    # failed
    "blocked": "failed",
    "plan_mismatch": "failed",
    "worker_failed": "failed",
    "stage_failed": "failed",
    "no_snapshot": "failed",
    "no_file": "failed",
    "input_missing": "failed",
    "input_changed": "failed",
    "not_durable": "failed",
    "failed": "failed",
    # internal
    "internal": "internal",
}
"""Every stable code and its kind; an unknown code from a newer peer is ``failed``."""


class SwarmError(Exception):
    """A refusal with a stable ``code``; ``kind`` follows from the code (see CODES)."""

    default_code: ClassVar[str] = "failed"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code or self.default_code
        self.message = message

    @property
    def kind(self) -> str:
        return CODES.get(self.code, "failed")

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.kind]

    def __str__(self) -> str:
        return self.message


class UserError(SwarmError, ValueError):
    """The request is wrong; the message names the field and what to do."""

    default_code = "bad_request"


class NotApplied(UserError):
    """A table event that does not follow from the table as it is now (the job or member it
    names moved on meanwhile): the leader writes nothing of the batch it was in."""

    default_code = "not_applied"


class Unavailable(SwarmError):
    """The swarm cannot do it now; retrying may succeed."""

    default_code = "not_ready"


class Failed(SwarmError):
    """It was tried and did not work."""

    default_code = "failed"


class Internal(SwarmError):
    """A bug or an unexpected state."""

    default_code = "internal"


_BY_KIND: dict[str, type[SwarmError]] = {
    "user": UserError,
    "unavailable": Unavailable,
    "failed": Failed,
    "internal": Internal,
}


def from_code(code: str, message: str) -> SwarmError:
    """The exception a peer or the daemon raised, rebuilt from its code and message."""
    return _BY_KIND[CODES.get(code, "failed")](message, code=code)


__all__ = [
    "CODES",
    "EXIT_CODES",
    "KINDS",
    "Failed",
    "Internal",
    "SwarmError",
    "Unavailable",
    "UserError",
    "from_code",
]
