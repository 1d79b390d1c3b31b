"""The worker processes' timings (training and serving stages, the embedded model's
conversion), each with its unit and reason: the heavy plane's, apart from the light plane's
(``swarmp2p.timings``). Standard library only: a worker imports it before torch. A training
stage's link timeout crosses to it in its ``WorkerSpec`` (``Timings.link_timeout_s``).

A module reads its module-level ``WORKER_TIMINGS``, which a test replaces with a smaller one
(``dataclasses.replace(WORKER_TIMINGS, embedded_lock_s=0.3)``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WORKER_TIMINGS", "WorkerTimings"]


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerTimings:
    """Timings of the stage worker processes, in seconds."""

    serve_connect_s: float = 600.0
    """How long a ready serve worker waits for its connect line (its daemon may first start
    the other stages of the ring, each loading its model)."""
    serve_stats_every_s: float = 5.0
    """How often a working serve stage reports its batch size and load (nothing while idle)."""
    stage_poll_s: float = 0.1
    """How often an idle serve stage looks at its stop event."""
    stage_session_idle_s: float = 300.0
    """A full serve stage evicts a session idle this long to admit a new one."""
    stage_bye_s: float = 5.0
    """How long a training stage waits for the stage before it to confirm the end before
    closing anyway."""
    abort_send_s: float = 1.0
    """How long a failing training stage tries to hand its abort to a neighbour (it may be
    gone)."""
    abort_flush_s: float = 0.05
    """How long a failing stage lets its abort leave before the link closes (and drops it)."""
    embedded_lock_s: float = 900.0
    """How long a caller waits for another process's conversion of the embedded model
    (normally 15-60 s) before failing."""
    embedded_lock_poll_s: float = 0.1
    """How often a waiting caller tries the conversion's lock again."""


WORKER_TIMINGS = WorkerTimings()
"""The defaults."""
