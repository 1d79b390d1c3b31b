"""Quantization spec normalisation and the reference's weight estimates."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmp2p.plan import QuantSpec, bytes_per_param, estimate_weights_gb, normalize_quantization


@pytest.mark.parametrize(
    ("spec", "dtype", "gb"),
    [
        (None, "bfloat16", 59.6),
        ({"bits": 8}, "bfloat16", 31.6),
        ({"bits": 4}, "bfloat16", 15.5),
        ({"method": "int8"}, "bfloat16", 31.6),
        ({"method": "nf4"}, "bfloat16", 15.5),
        (None, "float32", 119.2),
    ],
)
def test_reference_estimates_for_32e9_params(spec, dtype, gb):
    assert round(estimate_weights_gb(32e9, spec, dtype=dtype), 1) == gb


def test_single_quantized_scales_cost_more_than_double_quantized():
    assert bytes_per_param({"bits": 4, "double_quant": False}) > bytes_per_param({"bits": 4})


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, None),
        ({"bits": 16}, None),
        ({"bits": None}, None),
        ({"method": "none"}, None),
        ({"bits": 8}, QuantSpec(bits=8)),
        ({"method": "fp4"}, QuantSpec(bits=4, quant_type="fp4")),
        (
            {"bits": 4, "double_quant": False, "compute_dtype": "float16", "skip_modules": []},
            QuantSpec(bits=4, double_quant=False, compute_dtype="float16", skip_modules=()),
        ),
        (
            {"bits": 8, "threshold": 4, "cpu_offload": True},
            QuantSpec(bits=8, threshold=4.0, cpu_offload=True),
        ),
    ],
)
def test_normalize(spec, expected):
    assert normalize_quantization(spec) == expected


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ({"bits": 3}, "quantization.bits: must be 8 or 4"),
        ({"bitz": 4}, "quantization.bitz: unknown key"),
        ({"method": "gptq"}, 'quantization.method: must be one of "int8", "nf4", "fp4", "none"'),
        ({"method": "int8", "bits": 4}, "method 'int8' contradicts bits 4"),
        ({"bits": 4, "quant_type": "int4"}, "quantization.quant_type"),
        ({"bits": 4, "double_quant": "yes"}, "quantization.double_quant: must be true or false"),
        ({"bits": 8, "threshold": -1}, "quantization.threshold: must be a number > 0"),
        ({"bits": 4, "compute_dtype": "fp8"}, "quantization.compute_dtype"),
        ({"bits": 4, "skip_modules": "lm_head"}, "quantization.skip_modules"),
        ("4bit", "must be an object"),
    ],
)
def test_bad_specs_name_the_key(spec, fragment):
    with pytest.raises(ValueError, match=None) as info:
        normalize_quantization(spec)
    assert fragment in str(info.value)


@given(
    bits=st.sampled_from([4, 8]),
    quant_type=st.sampled_from(["nf4", "fp4"]),
    double_quant=st.booleans(),
    compute_dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
    threshold=st.floats(0.5, 10),
    skip=st.none() | st.lists(st.sampled_from(["lm_head", "router"]), max_size=2),
)
def test_normalize_is_idempotent(bits, quant_type, double_quant, compute_dtype, threshold, skip):
    spec = {
        "bits": bits,
        "quant_type": quant_type,
        "double_quant": double_quant,
        "compute_dtype": compute_dtype,
        "threshold": threshold,
    }
    if skip is not None:
        spec["skip_modules"] = skip
    once = normalize_quantization(spec)
    assert normalize_quantization(once.to_dict()) == once
