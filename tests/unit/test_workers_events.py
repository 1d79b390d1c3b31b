"""The worker events: every kind round-trips through its wire map, a malformed one is refused
naming the kind and the field, and the worker writes the same maps the daemon reads."""

from __future__ import annotations

import json
import math

import pytest

from swarmp2p.schema import SchemaError
from swarmp2p.workers import events as we

STEP = we.StepDone(
    step=3,
    loss=2.5,
    tokens=64,
    tokens_per_s=128.0,
    act_bytes=10,
    grad_bytes=20,
    step_s=0.5,
    peak_memory_bytes=1 << 20,
    loss_scale=1024.0,
    skipped=True,
    forward_s=0.1,
    backward_s=0.2,
    optimizer_s=0.05,
    wait_s=0.15,
    at=1.5e9,
)
EVERY_KIND = [
    we.Phase(name="fetching", done=1 << 20, total=48 << 20),
    we.Phase(name="calibrating"),
    we.Ready(port=5555),
    we.Ready(),
    we.Built(trainable_parameters=12, finetune_mode="lora", lora_fingerprint="ab12"),
    we.Resumed(step=4, snapshot="/s/stage-0/step-00000004.pt"),
    we.Evaluated(name="base", loss=3.0, perplexity=20.1, top1=0.25, tokens=8),
    we.Calibrated(tokens=4096),
    STEP,
    we.SnapshotSaved(step=4, path="/s/x.pt", file="snapshots/x.pt"),
    we.Exported(manifest="/e/manifest.json", manifest_data={"files": {"a": 1}}),
    we.Done(steps=10),
    we.Failure(
        type="NonFiniteError", message="boom", failed_stage=1, step=3, reason="nan", errors=("x",)
    ),
    we.Exited(code=-9, stderr_tail=("a", "b"), error="boom"),
]


@pytest.mark.parametrize("event", EVERY_KIND, ids=lambda e: type(e).__name__)
def test_each_event_round_trips_through_json(event):
    wire = json.loads(json.dumps(we.encode(event, 2)))
    assert wire["event"] == event.KIND and wire["stage"] == 2
    assert we.decode(wire) == event


def test_every_kind_of_the_union_is_covered():
    assert {type(e) for e in EVERY_KIND} == set(we.KINDS.values())


def test_the_wire_keeps_its_names_and_writes_no_nan():
    wire = we.encode(
        we.Evaluated(name="base", loss=math.nan, perplexity=math.inf, top1=0.5, tokens=0), 1
    )
    assert wire["pass"] == "base" and "name" not in wire  # job logs and tools read "pass"
    assert wire["loss"] is None and wire["perplexity"] is None
    json.dumps(wire, allow_nan=False)  # strict JSON
    assert we.decode(wire).loss is None


@pytest.mark.parametrize(
    ("change", "path", "says"),
    [
        ({"loss": "low"}, "loss", 'must be a number, got "low"'),
        ({"step": -1}, "step", "must be an integer >= 0, got -1"),
        ({"act_bytes": None}, "act_bytes", "must be an integer >= 0, got null"),
        ({"tokens": True}, "tokens", "got true"),
        ({"extra": 1}, "extra", "unknown key"),
    ],
)
def test_a_malformed_event_is_refused_naming_the_field(change, path, says):
    wire = {**we.encode(STEP, 1), **change}
    with pytest.raises(SchemaError) as info:
        we.decode(wire)
    assert 'invalid worker event "step"' in str(info.value)
    (error,) = info.value.errors
    assert error.path == path and says in error.message


def test_a_missing_field_and_an_unknown_kind_are_named():
    wire = we.encode(STEP, 1)
    del wire["step_s"]
    with pytest.raises(SchemaError, match="step_s: required"):
        we.decode(wire)
    with pytest.raises(SchemaError, match='event: "steps" is no worker event; known: ready'):
        we.decode({**wire, "event": "steps"})
    with pytest.raises(SchemaError, match="event: null is no worker event"):
        we.decode({"stage": 1})
    with pytest.raises(SchemaError, match="must be an object, got a list of 0"):
        we.decode([])
    with pytest.raises(SchemaError, match="step: must be an integer >= 1, got 0"):
        we.decode({"event": "snapshot", "step": 0, "path": "/x"})


def test_the_worker_writes_what_the_daemon_reads():
    """``runtime.worker``'s emitter writes a line the daemon's decoder turns back into it."""
    from io import StringIO

    from swarmp2p.runtime.worker import _emitter

    out = StringIO()
    emit = _emitter(out, 1)
    for event in EVERY_KIND:
        emit(event)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [we.decode(line) for line in lines] == EVERY_KIND
    assert {line["stage"] for line in lines} == {1}
