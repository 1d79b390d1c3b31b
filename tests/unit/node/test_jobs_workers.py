"""Stage worker subprocesses: events drained, stderr tail kept, exit code and signal reported."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from swarmp2p.net import SwarmSecret
from swarmp2p.workers import WorkerProcess, exit_message

pytestmark = pytest.mark.slow


def _spec(**extra):
    from swarmp2p.plan import from_config, parse_job
    from swarmp2p.plan.worker_spec import local_plan, worker_spec

    config = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 64,
    }
    job = parse_job({"model": {"pretrained": "/nonexistent/model"}, "data": {"source": "random"}})
    plan = local_plan(job, from_config(config), cuts=[1])
    spec = worker_spec(job, plan, 1, token=SwarmSecret.generate().token).to_dict()
    spec.update(extra)
    return spec


async def _run(spec, kill_after_ready=False):
    events, exits = [], []
    done = asyncio.Event()

    def on_exit(code, tail):
        exits.append((code, tail))
        done.set()

    w = WorkerProcess(
        job_id="j", attempt=1, stage=1, spec=spec, on_event=events.append, on_exit=on_exit
    )
    await w.start()
    try:
        if kill_after_ready:
            ready = await w.wait_ready(60)
            assert ready["port"] > 0
            os.kill(w.proc.pid, signal.SIGKILL)
        await asyncio.wait_for(done.wait(), 120)
    finally:
        await w.stop()
    return events, exits


def test_a_bad_spec_exits_2_with_the_field_named():
    events, exits = asyncio.run(_run(_spec(stage=2)))
    assert exits[0][0] == 2
    assert events[-1]["event"] == "error" and "stage: must be <" in events[-1]["message"]


def test_a_worker_that_fails_after_ready_reports_its_error_and_stderr_tail():
    events, exits = asyncio.run(_run(_spec()))
    kinds = [e["event"] for e in events]
    assert kinds[0] == "ready" and kinds[-1] == "error"
    code, tail = exits[0]
    assert code == 1
    assert any("nonexistent" in line for line in tail), tail  # the traceback on stderr


def test_the_signal_a_worker_died_of_is_reported():
    _, exits = asyncio.run(_run(_spec(), kill_after_ready=True))
    assert exit_message(exits[0][0]) == "killed by SIGKILL"


def test_a_worker_that_reads_its_stdin_is_stopped_by_the_end_of_input():
    """A serve worker keeps stdin open for its ops; ``stop`` closes it first, so the worker
    ends cleanly (here ``python -m json.tool``, which echoes what it read and exits 0)."""
    exits, events = [], []

    async def run():
        w = WorkerProcess(
            job_id="s",
            attempt=1,
            stage=0,
            spec={"event": "ready", "endpoint": "x"},
            on_event=events.append,
            on_exit=lambda c, t: exits.append(c),
            module="json.tool",
            keep_stdin=True,
        )
        await w.start()
        await w.stop()
        return w.proc.returncode

    assert asyncio.run(run()) == 0  # not -SIGTERM
    assert exits == []  # a stop is no exit to report
