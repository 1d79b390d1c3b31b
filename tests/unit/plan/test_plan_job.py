"""job.json version 1: defaults, finetune mode precedence, every error with its path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmp2p.plan import FieldError, JobError, load_job, parse_job

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def errors_of(data) -> list[tuple[str, str]]:
    with pytest.raises(JobError) as info:
        parse_job(data)
    return [(e.path, e.message) for e in info.value.errors]


def test_defaults():
    job = parse_job({"model": {"pretrained": "embedded"}})
    assert job.name == "job" and job.version == 1
    assert job.model.dtype is None and job.model.quantization is None
    assert (
        not job.model.lora.enabled and job.model.lora.r == 8 and job.model.lora.export == "merged"
    )
    assert job.split.stages == "auto" and job.split.mode == "speed"
    assert [c.method for c in job.split.compression] == ["none"]
    assert (job.data.source, job.data.text_field) == ("embedded", "text")
    t = job.train
    assert (t.steps, t.batch_size, t.seq_len, t.lr, t.micro_batches) == (100, 4, 128, 2e-4, 4)
    assert (t.schedule, t.recompute, t.eval_batches, t.seed, t.checkpoint_every) == (
        "auto",
        "auto",
        16,
        0,
        25,
    )
    assert job.finetune_mode == "full"


LEARNED = {"method": "learned_bottleneck", "learned_dim": 256, "code_bits": 8}


@pytest.mark.parametrize(
    ("lora", "freeze", "compression", "mode"),
    [
        (False, False, "none", "full"),
        (False, False, "fixed_int8", "full"),
        (True, False, "none", "lora"),
        (True, True, "fixed_int4", "lora"),  # lora wins over freeze_backbone
        (True, True, LEARNED, "lora"),
        (False, True, LEARNED, "compressor_only"),
        (False, True, "fixed_int4", "none"),  # a quantizer has no parameters
        (False, True, "none", "none"),
        (False, True, ["fixed_int8", LEARNED], "compressor_only"),
    ],
)
def test_finetune_mode_precedence(lora, freeze, compression, mode):
    data = {
        "model": {"pretrained": "x/y", "freeze_backbone": freeze, "lora": {"enabled": lora}},
        "split": {
            "stages": 3 if isinstance(compression, list) else "auto",
            "compression": compression,
        },
    }
    assert parse_job(data).finetune_mode == mode


def test_every_error_is_reported_with_its_path():
    data = {
        "name": "",
        "modle": {},
        "model": {
            "pretrained": "embedded",
            "dtype": "fp8",
            "lora": {"r": 0, "alpha": "x"},
            "quantization": {"bits": 3},
        },
        "split": {"stages": 0, "mode": "fast", "compression": ["fixed_int9", "fp16"]},
        "data": {"source": "", "extra": 1},
        "train": {
            "steps": -3,
            "lr": 0,
            "micro_batches": 64,
            "schedule": "zb",
            "recompute": "sometimes",
            "seed": 1.5,
            "checkpoint_every": True,
        },
    }
    errors = dict(errors_of(data))
    assert errors["train.steps"] == "must be an integer >= 1, got -3"
    expected_paths = {
        "name",
        "modle",
        "model.dtype",
        "model.lora.r",
        "model.lora.alpha",
        "model.quantization.bits",
        "split.stages",
        "split.mode",
        "split.compression[0]",
        "data.source",
        "data.extra",
        "train.steps",
        "train.lr",
        "train.micro_batches",
        "train.schedule",
        "train.recompute",
        "train.seed",
        "train.checkpoint_every",
    }
    assert expected_paths <= set(errors), sorted(set(expected_paths) - set(errors))
    assert "unknown key" in errors["modle"]


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({}, "model"),
        ({"model": {}}, "model.pretrained"),
        ({"model": {"pretrained": "e", "lora": {"enable": True}}}, "model.lora.enable"),
        ({"model": {"pretrained": "e"}, "train": {"step": 3}}, "train.step"),
        ({"model": {"pretrained": "e"}, "split": {"stage": 2}}, "split.stage"),
        ({"model": {"pretrained": "e"}, "version": 2}, "version"),
        (
            {"model": {"pretrained": "e"}, "train": {"batch_size": 6, "micro_batches": 4}},
            "train.micro_batches",
        ),
        (
            {"model": {"pretrained": "e"}, "split": {"stages": 2, "compression": ["fp16"] * 3}},
            "split.compression",
        ),
        ({"model": {"pretrained": "e", "lora": {"dropout": 1.0}}}, "model.lora.dropout"),
        (
            {"model": {"pretrained": "e", "lora": {"target_modules": []}}},
            "model.lora.target_modules",
        ),
        ({"model": {"pretrained": "e", "quantization": {"bits": 4}}}, "model.quantization"),
        (
            {
                "model": {
                    "pretrained": "e",
                    "weight_dtype": "float16",
                    "quantization": {"bits": 4},
                    "lora": {"enabled": True},
                }
            },
            "model.weight_dtype",
        ),
        ({"model": {"pretrained": "e", "freeze_backbone": 1}}, "model.freeze_backbone"),
        ({"model": {"pretrained": "e"}, "train": "fast"}, "train"),
    ],
)
def test_single_errors(data, path):
    paths = [p for p, _ in errors_of(data)]
    assert path in paths


def test_small_batch_adapts_the_default_micro_batches():
    job = parse_job({"model": {"pretrained": "e"}, "train": {"batch_size": 2}})
    assert job.train.micro_batches == 2


def test_not_an_object():
    assert errors_of([1, 2]) == [("(job)", "must be a JSON object")]


def test_load_reports_bad_json(tmp_path):
    path = tmp_path / "job.json"
    path.write_text("{nope")
    with pytest.raises(JobError) as info:
        load_job(path)
    assert "not valid JSON" in info.value.errors[0].message


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("full", "full"),
        ("lora", "lora"),
        ("qlora", "lora"),
        ("compressor_only", "compressor_only"),
        ("none", "none"),
    ],
)
def test_examples_parse_to_their_mode(name, mode):
    assert load_job(EXAMPLES / f"{name}.json").finetune_mode == mode


def test_lora_example_uses_the_embedded_model():
    data = json.loads((EXAMPLES / "lora.json").read_text())
    assert data["model"]["pretrained"] == "embedded"


def test_field_error_str():
    assert str(FieldError(path="train.steps", message="bad")) == "train.steps: bad"


@pytest.mark.parametrize("name", ["full", "lora", "qlora", "compressor_only", "none"])
def test_to_dict_round_trips(name):
    job = load_job(EXAMPLES / f"{name}.json")
    data = job.to_dict()
    assert parse_job(json.loads(json.dumps(data))) == job
    assert set(data) == {"version", "name", "model", "split", "data", "train"}


BAD_VALUES = {
    ("model", "dtype"): "fp8",
    ("model", "freeze_backbone"): "no",
    ("split", "mode"): "fast",
    ("split", "stages"): -1,
    ("data", "text_field"): "",
    ("train", "steps"): 0,
    ("train", "seq_len"): 1.5,
    ("train", "lr"): -1,
    ("train", "schedule"): "zb",
    ("train", "recompute"): "maybe",
    ("train", "eval_batches"): -2,
    ("train", "seed"): "0",
    ("train", "checkpoint_every"): None,
}


@given(st.sets(st.sampled_from(sorted(BAD_VALUES)), min_size=1))
def test_every_bad_field_is_reported_once(bad):
    data = json.loads((EXAMPLES / "lora.json").read_text())
    for section, key in bad:
        data[section][key] = BAD_VALUES[(section, key)]
    paths = [p for p, _ in errors_of(data)]
    assert sorted(paths) == sorted(f"{s}.{k}" for s, k in bad)


def _learned_job(*specs):
    compression = specs[0] if len(specs) == 1 else list(specs)
    return {"model": {"pretrained": "embedded"}, "split": {"compression": compression}}


def test_calibration_tokens_is_a_boundary_setting():
    """Issue 26 item 5: ``calibration_tokens`` (default 16384) on a learned boundary."""
    job = parse_job(_learned_job({**LEARNED, "calibration_tokens": 4096}))
    assert job.split.compression[0].calibration_tokens == 4096
    assert job.split.calibration_tokens == 4096
    again = parse_job(json.loads(json.dumps(job.to_dict())))
    assert again == job and again.split.compression[0].spec["calibration_tokens"] == 4096
    default = parse_job(_learned_job(LEARNED))
    assert default.split.calibration_tokens == 16384
    assert "calibration_tokens" not in default.split.compression[0].spec  # canonical as before


@pytest.mark.parametrize("bad", [0, -5, 1.5, "many", True, None, 2**31])
def test_bad_calibration_tokens_are_named(bad):
    errors = errors_of(_learned_job({**LEARNED, "calibration_tokens": bad}))
    assert [p for p, _ in errors] == ["split.compression.calibration_tokens"], errors
    assert "must be an integer >= 1" in errors[0][1], errors  # a bad value, not an unknown key


def test_learned_boundaries_must_agree_on_calibration_tokens():
    a, b = {**LEARNED, "calibration_tokens": 1024}, {**LEARNED, "calibration_tokens": 2048}
    errors = errors_of(_learned_job(a, "none", b))
    assert len(errors) == 1 and errors[0][0] == "split.compression[2].calibration_tokens"
    assert "compression[0].calibration_tokens 1024" in errors[0][1]
    assert parse_job(_learned_job(a, "none", {**b, "calibration_tokens": 1024}))


BOTTLENECK = {"method": "learned_bottleneck"}


@pytest.mark.parametrize(
    ("spec", "learned_dim", "code_bits"),
    [
        ({"bottleneck_dim": 128}, 128, 8),
        ({"bottleneck_dim": 128, "learned_dim": 128}, 128, 8),
        ({"quantized": False}, None, 16),
        ({"quantized": False, "code_bits": 16}, None, 16),
        ({"quantized": True}, None, 8),
        ({"quantized": True, "quantization_bits": 4}, None, 4),
        ({"quantization_bits": 6}, None, 6),
        ({"quantized": True, "quantization_bits": 5, "code_bits": 5}, None, 5),
        ({"bottleneck_dim": 64, "quantized": False}, 64, 16),
    ],
)
def test_the_reference_spellings_are_aliases(spec, learned_dim, code_bits):
    """Issue 26 item 6: bottleneck_dim, quantized and quantization_bits mean what the reference
    says; the job is stored with the canonical keys."""
    job = parse_job(_learned_job({**BOTTLENECK, **spec}))
    c = job.split.compression[0]
    assert (c.learned_dim, c.code_bits) == (learned_dim, code_bits)
    assert set(c.spec) == {"method", "learned_dim", "code_bits"}
    assert parse_job(json.loads(json.dumps(job.to_dict()))) == job


@pytest.mark.parametrize(
    ("spec", "path", "other"),
    [
        ({"bottleneck_dim": 128, "learned_dim": 64}, "bottleneck_dim", "learned_dim"),
        ({"quantized": False, "quantization_bits": 8}, "quantized", "quantization_bits"),
        ({"quantized": False, "code_bits": 8}, "quantized", "code_bits"),
        ({"quantization_bits": 4, "code_bits": 8}, "quantization_bits", "code_bits"),
        ({"quantized": True, "code_bits": 16}, "quantized", "code_bits"),
    ],
)
def test_contradicting_spellings_are_refused_naming_both(spec, path, other):
    errors = errors_of(_learned_job({**BOTTLENECK, **spec}))
    assert [p for p, _ in errors] == [f"split.compression.{path}"], errors
    assert "contradicts " + other in errors[0][1], errors


@pytest.mark.parametrize(
    ("spec", "path"),
    [
        ({"quantization_bits": 16}, "split.compression.quantization_bits"),
        ({"quantized": "no"}, "split.compression.quantized"),
        ({"bottleneck_dim": 0}, "split.compression.bottleneck_dim"),
    ],
)
def test_bad_alias_values_are_named(spec, path):
    errors = errors_of(_learned_job({**BOTTLENECK, **spec}))
    assert [p for p, _ in errors] == [path]
    assert "unknown key" not in errors[0][1], errors  # a bad value of a known alias
