"""The stage worker: ``python -m swarmp2p.runtime.worker`` runs one pipeline stage.

It reads a worker spec (one JSON object) on stdin, validates it (a bad field exits with code 2
and an ``error`` event naming it), binds the link to the stage before it (port 0: any free
port) and dials the stage after it, then writes its events on stdout, one JSON line each: the records of
``swarmp2p.workers.events`` (``ready`` once its link is bound, ``built``, ``eval``, ``step``,
``snapshot``, ``exported``, then ``done`` and exit code 0, or ``error`` and exit code 1; a spec
refused names every bad field in an ``error`` and exits 2).

The spec is a ``swarmp2p.plan.worker_spec.WorkerSpec`` (the job, its plan, the stage and what
only this node knows), built by ``worker_spec()`` wherever a stage is started. Parsing it imports
no torch; running a stage does.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import TextIO

from swarmp2p.plan.worker_spec import WorkerSpec, WorkerSpecError, parse_worker_spec
from swarmp2p.runtime._process import exit_now, keep_bitsandbytes_out
from swarmp2p.workers.events import Failure, WorkerEvent, encode

EXIT_BAD_SPEC = 2
EXIT_FAILED = 1


Emit = Callable[[WorkerEvent], None]
"""How a stage reports: one typed event at a time."""


def _emitter(out: TextIO, stage: int | None) -> Emit:
    def emit(event: WorkerEvent) -> None:
        out.write(json.dumps(encode(event, stage)) + "\n")
        out.flush()

    return emit


def main(
    stdin: TextIO | None = None, stdout: TextIO | None = None, *, own_process: bool = False
) -> int:
    """Run one stage from the spec on stdin; return the exit code. ``own_process``: this is
    the worker's process (``python -m``), so an unquantized stage leaves bitsandbytes out."""
    import faulthandler

    faulthandler.enable()
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    try:
        raw = json.loads(stdin.read())
    except ValueError as exc:
        _emitter(stdout, None)(Failure(type="WorkerSpecError", message=f"spec is not JSON: {exc}"))
        return EXIT_BAD_SPEC
    stage = raw.get("stage") if isinstance(raw, dict) else None
    emit = _emitter(stdout, stage if isinstance(stage, int) else None)
    try:
        spec = parse_worker_spec(raw)
    except WorkerSpecError as exc:
        errors = tuple(str(e) for e in exc.errors)
        emit(Failure(type="WorkerSpecError", message=str(exc), errors=errors))
        return EXIT_BAD_SPEC
    if own_process:
        keep_bitsandbytes_out(spec.quantization)
    try:
        from swarmp2p.runtime.stage_links import open_stage_links

        links = open_stage_links(spec, emit)  # ready before torch loads (see stage_links)
        try:
            from swarmp2p.runtime.torch.train.stage_runner import run_stage
        except BaseException:
            links.close()
            raise
        run_stage(spec, emit, links)
    except Exception as exc:
        if not getattr(exc, "cause_printed", False):  # the stage printed it before its abort
            import traceback

            traceback.print_exc(file=sys.stderr)
        extra = getattr(exc, "event_fields", None)
        emit(Failure(type=type(exc).__name__, message=str(exc), **(extra or {})))
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    exit_now(main(own_process=True))


__all__ = [
    "EXIT_BAD_SPEC",
    "EXIT_FAILED",
    "Emit",
    "WorkerSpec",
    "WorkerSpecError",
    "main",
    "parse_worker_spec",
]
