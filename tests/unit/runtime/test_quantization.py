"""Quantized stages equal transformers' own bitsandbytes load; the spec is checked field by field."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from swarmp2p.runtime.torch.loader import load_stage_shard
from swarmp2p.runtime.torch.quantization import (
    QuantSpec,
    bnb_config,
    import_bitsandbytes,
    normalize_spec,
    silence_cast_warning,
)

pytestmark = pytest.mark.torch

SPECS = [
    {"method": "nf4", "compute_dtype": "float32"},
    {"bits": 8},
    {"method": "fp4", "double_quant": False, "compute_dtype": "float32"},
]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_quantized_stages_equal_transformers_quantized_load(family, checkpoints):
    from transformers import AutoModelForCausalLM

    folder = checkpoints(family, wide=True)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    for raw in SPECS:
        spec = normalize_spec(raw)
        reference = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=torch.float32,
            quantization_config=bnb_config(spec, ["lm_head"]),
            device_map="cpu",
        )
        stages = [
            load_stage_shard(folder, 0, 2, True, False, torch.float32, quantization=raw),
            load_stage_shard(folder, 2, 4, False, True, torch.float32, quantization=raw),
        ]
        with torch.no_grad():
            expected = reference(ids).logits
            got = stages[1](stages[0](ids))
        assert torch.equal(got, expected), (family, raw)
        kinds = {type(m).__name__ for s in stages for m in s.modules()}
        assert ("Linear8bitLt" if spec.bits == 8 else "Linear4bit") in kinds
        assert type(stages[1].head) is torch.nn.Linear, "the head stays in full precision"
        assert not any(s.training for s in stages), "quantized stages come back in eval mode"


def test_int8_cast_warning_is_silenced(checkpoints, caplog):
    stage = load_stage_shard(
        checkpoints("llama", wide=True), 0, 1, True, False, torch.float32, quantization={"bits": 8}
    )
    log = logging.getLogger("bitsandbytes.autograd._functions")
    ids = torch.tensor([[1, 2, 3]])
    with caplog.at_level(logging.WARNING), torch.no_grad():
        stage(ids)
    assert not [r for r in caplog.records if "will be cast" in r.getMessage()]
    saved = log.filters[:]
    log.filters.clear()  # the check can fail: without the filter bitsandbytes does warn
    try:
        with caplog.at_level(logging.WARNING), torch.no_grad():
            stage(ids)
        assert [r for r in caplog.records if "will be cast" in r.getMessage()]
    finally:
        log.filters[:] = saved
    silence_cast_warning()
    assert len(log.filters) == len(saved), "idempotent"


def test_missing_bitsandbytes_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ImportError, match=r"pip install bitsandbytes \(or run ./install.sh\)"):
        import_bitsandbytes()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, None),
        ({"bits": 16}, None),
        ({"method": "none"}, None),
        ({"bits": 4}, QuantSpec(bits=4)),
        ({"method": "int8"}, QuantSpec(bits=8)),
        (
            {"method": "fp4", "double_quant": False, "compute_dtype": "float16"},
            QuantSpec(bits=4, quant_type="fp4", double_quant=False, compute_dtype="float16"),
        ),
        (
            {"bits": 8, "threshold": 4, "skip_modules": []},
            QuantSpec(bits=8, threshold=4.0, skip_modules=()),
        ),
    ],
)
def test_specs_normalise(spec, expected):
    assert normalize_spec(spec) == expected


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"bits": 3}, r"bits must be 4, 8, 16, 32 or null, got 3"),
        ({"method": "gptq"}, r"method 'gptq' is not one of"),
        ({"bits": 8, "method": "nf4"}, "bits 8 contradicts method 'nf4'"),
        ({"method": "fp4", "quant_type": "nf4"}, "quant_type 'nf4' contradicts method 'fp4'"),
        ({"bits": 4, "compute_dtype": "int8"}, "compute_dtype must be one of"),
        ({"bits": 4, "skip_modules": "lm_head"}, "skip_modules must be a list"),
        ({"bits": 8, "threshold": -1}, "threshold must be a positive number"),
        ({"bits": 4, "group": 64}, r"unknown key\(s\) group"),
    ],
)
def test_bad_specs_name_the_field(spec, match):
    with pytest.raises(ValueError, match=match):
        normalize_spec(spec)
