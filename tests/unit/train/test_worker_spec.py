"""Worker spec validation (no torch needed) and the data rule (a batch is a function of the step)."""

from __future__ import annotations

import json
from io import StringIO

import pytest

from swarmp2p.runtime.worker import (
    EXIT_BAD_SPEC,
    WorkerSpecError,
    main,
    parse_worker_spec,
)

GOOD = {
    "stage": 0,
    "n_stages": 3,
    "model": "/m",
    "layers": [0, 2],
    "n_layers": 6,
    "token": "t",
    "next": "tcp://127.0.0.1:5000",
    "compression": ["none", {"method": "learned_bottleneck"}],
}


def test_a_good_spec_parses_with_defaults():
    spec = parse_worker_spec(GOOD)
    assert spec.is_first and not spec.is_last
    assert spec.train.schedule == "1f1b" and spec.train.micro_batches == 1
    assert spec.data.source == "random" and spec.finetune_mode == "full"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"stage": 3}, "stage: must be < n_stages (3), got 3"),
        ({"n_stages": 0}, "n_stages: must be an integer >= 1, got 0"),
        ({"weight_dtype": "int8"}, "weight_dtype: must be one of float16, bfloat16, got 'int8'"),
        ({"train": {"loss_scale": 1024.0}}, "train.loss_scale: applies only to float16 jobs"),
        ({"train": {"loss_scale": 0}}, "train.loss_scale: must be a number > 0.0, got 0"),
        ({"train": {"inject_nan_step": -1}}, "train.inject_nan_step: must be an integer >= 0"),
        ({"layers": [2, 9]}, "layers: must be [start, end) with 0 <= start < end <= n_layers"),
        ({"compression": ["none"]}, "compression: must list one spec per boundary (2)"),
        ({"compression": ["none", "zip"]}, "compression[1]"),
        (
            {"train": {"schedule": "zigzag"}},
            "train.schedule: must be one of gpipe, 1f1b, got 'zigzag'",
        ),
        ({"train": {"lr": 0}}, "train.lr: must be a number > 0.0, got 0"),
        ({"train": {"batch_size": 4, "micro_batches": 3}}, "train.micro_batches: must divide"),
        ({"train": {"steps": -1}}, "train.steps: must be an integer >= 0, got -1"),
        ({"train": {"stpes": 3}}, "train.stpes: unknown field"),
        ({"data": {"source": "tokens"}}, "data.path: is required"),
        ({"lora": {"r": 0}}, "lora.r: must be an integer >= 1, got 0"),
        ({"quantization": {"bits": 3}}, "quantization.bits"),
        ({"next": "udp://x"}, "next: must be a tcp://host:port endpoint"),
        ({"resume": True}, "resume: needs snapshot_dir"),
        ({"model": ""}, "model: must be a non-empty string"),
    ],
)
def test_bad_fields_are_named(change, message):
    with pytest.raises(WorkerSpecError) as info:
        parse_worker_spec({**GOOD, **change})
    assert any(message in e for e in info.value.errors), info.value.errors


def test_a_one_stage_spec_needs_no_next_and_no_compression():
    spec = parse_worker_spec(
        {"stage": 0, "n_stages": 1, "model": "/m", "layers": [0, 6], "n_layers": 6, "token": "t"}
    )
    assert spec.is_first and spec.is_last and spec.compression == () and spec.next is None


def test_half_precision_fields_parse():
    spec = parse_worker_spec(
        {
            **GOOD,
            "dtype": "float16",
            "weight_dtype": "float16",
            "train": {"loss_scale": 1024, "inject_nan_step": 3},
        }
    )
    assert spec.weight_dtype == "float16" and spec.train.loss_scale == 1024.0
    assert spec.train.inject_nan_step == 3
    assert parse_worker_spec(GOOD).weight_dtype is None


def test_every_problem_is_reported_at_once():
    with pytest.raises(WorkerSpecError) as info:
        parse_worker_spec({"stage": 0})
    fields = {e.split(":")[0] for e in info.value.errors}
    assert {"n_stages", "n_layers", "layers", "model", "token", "next"} <= fields


def test_main_reports_a_bad_spec_as_an_event_and_exit_code():
    out = StringIO()
    assert main(StringIO(json.dumps({**GOOD, "stage": "zero"})), out) == EXIT_BAD_SPEC
    (event,) = [json.loads(line) for line in out.getvalue().splitlines()]
    assert event["event"] == "error" and event["type"] == "WorkerSpecError"
    assert "stage: must be an integer >= 0, got 'zero'" in event["message"]
    out = StringIO()
    assert main(StringIO("{not json"), out) == EXIT_BAD_SPEC
    assert "spec is not JSON" in out.getvalue()


@pytest.mark.torch
def test_batches_are_a_function_of_the_step_and_held_out_is_separate(tmp_path):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from swarmp2p.runtime.torch.stage_runner import _load_tokens, eval_batches, train_batch

    spec = parse_worker_spec({**GOOD, "train": {"batch_size": 2, "seq_len": 4, "eval_batches": 3}})
    assert torch.equal(train_batch(spec, 5, 100), train_batch(spec, 5, 100))
    assert not torch.equal(train_batch(spec, 5, 100), train_batch(spec, 6, 100))
    assert train_batch(spec, 0, 100).shape == (2, 5)
    path = tmp_path / "ids.npy"
    np.save(path, np.arange(5 * 40))
    spec = parse_worker_spec(
        {
            **GOOD,
            "data": {"source": "tokens", "path": str(path)},
            "train": {"batch_size": 2, "seq_len": 4, "eval_batches": 3},
        }
    )
    tokens = _load_tokens(spec)
    assert tokens["train"].shape == (38, 5) and tokens["held_out"].shape == (2, 5)
    assert int(tokens["held_out"].min()) > int(tokens["train"].max())  # the last windows
    assert len(eval_batches(spec, 100, tokens)) == 1  # only one batch of 2 is held out
    assert torch.equal(train_batch(spec, 1, 100, tokens), tokens["train"][2:4])
