"""Quantized stages equal transformers' own bitsandbytes load; the spec is checked field by field."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from swarmp2p.runtime.torch.model.hf_compat import set_eager_experts
from swarmp2p.runtime.torch.model.loader import load_stage_shard
from swarmp2p.runtime.torch.model.quantization import (
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


def _untied_copy(folder, out):
    """The tied checkpoint ``folder`` saved with its head as a weight of its own (equal to the
    embedding): what a quantized tied head must behave like."""
    from tiny_models import load_whole

    model = load_whole(folder)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # untied, tied head
@pytest.mark.parametrize(
    "raw",
    [
        {"bits": 8, "skip_modules": []},
        {"method": "nf4", "compute_dtype": "float32", "skip_modules": []},
        {"bits": 4, "compute_dtype": "float32", "skip_modules": ["down_proj"]},
    ],
)
def test_a_quantized_head_loads_on_the_last_stage(family, raw, checkpoints, tmp_path):
    """skip_modules without the head: the last stage holds bitsandbytes' head, loaded, equal to
    transformers' own quantized load (a tied head: to its load of the untied copy)."""
    from transformers import AutoModelForCausalLM

    folder = checkpoints(family, wide=True)
    spec = normalize_spec(raw)
    tied = family == "qwen3"
    reference = AutoModelForCausalLM.from_pretrained(
        _untied_copy(folder, tmp_path / "untied") if tied else folder,
        dtype=torch.float32,
        quantization_config=bnb_config(spec, list(spec.skip_modules)),
        device_map="cpu",
    )
    layer = "Linear8bitLt" if spec.bits == 8 else "Linear4bit"
    assert type(reference.lm_head).__name__ == layer
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    first = load_stage_shard(folder, 0, 2, True, False, torch.float32, quantization=raw)
    last = load_stage_shard(folder, 2, 4, False, True, torch.float32, quantization=raw)
    whole = load_stage_shard(folder, 0, 4, True, True, torch.float32, quantization=raw)
    with torch.no_grad():
        expected = reference(ids).logits
        assert torch.equal(last(first(ids)), expected), (family, raw)
        assert torch.equal(whole(ids), expected), (family, raw)
    for stage in (last, whole):
        assert type(stage.head).__name__ == layer
    assert type(whole.embed.weight) is torch.nn.Parameter, "the embedding stays full precision"
    assert whole.head.weight is not whole.embed.weight


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
        ({"bits": 3}, r"quantization.bits: must be 8 or 4 .*got 3"),
        (
            {"method": "gptq"},
            r'quantization.method: must be one of "int8", "nf4", "fp4", "none", got "gptq"',
        ),
        ({"bits": 8, "method": "nf4"}, "method 'nf4' contradicts bits 8"),
        ({"method": "fp4", "quant_type": "nf4"}, "method 'fp4' contradicts quant_type 'nf4'"),
        ({"bits": 4, "compute_dtype": "int8"}, "quantization.compute_dtype: must be one of"),
        ({"bits": 4, "skip_modules": "lm_head"}, "quantization.skip_modules: must be a list"),
        ({"bits": 8, "threshold": -1}, "quantization.threshold: must be a number > 0"),
        ({"bits": 4, "group": 64}, r"quantization.group: unknown key"),
    ],
)
def test_bad_specs_name_the_field(spec, match):
    with pytest.raises(ValueError, match=match):
        normalize_spec(spec)


def _roundtrip(weight, spec):
    """Each expert's matrix quantized and dequantized with bitsandbytes' functional API."""
    import bitsandbytes.functional as F

    out = []
    for matrix in weight:
        if spec.bits == 4:
            packed, state = F.quantize_4bit(
                matrix.contiguous(),
                blocksize=64,
                compress_statistics=spec.double_quant,
                quant_type=spec.quant_type,
            )
            out.append(F.dequantize_4bit(packed, state))
        else:
            # LLM.int8() rounds the weight to float16 before taking its row scales
            codes, scales, _ = F.int8_vectorwise_quant(matrix.contiguous().to(torch.float16))
            out.append(F.int8_vectorwise_dequant(codes, scales))
    return torch.stack(out).to(weight.dtype)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_experts_are_quantized_expert_by_expert(family, checkpoints):
    from transformers import AutoModelForCausalLM

    from swarmp2p.runtime.torch.model.quantization import ExpertStack

    folder = checkpoints(family, wide=True)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    for raw in ({"method": "nf4", "compute_dtype": "float32"}, {"bits": 8}):
        spec = normalize_spec(raw)
        # transformers' own quantized load leaves the fused experts in full precision: give it
        # the experts' quantize-dequantize round trip, and run its experts the eager way
        reference = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=torch.float32,
            quantization_config=bnb_config(spec, ["lm_head"]),
            device_map="cpu",
        )
        set_eager_experts(reference.config)
        full_bytes = 0
        with torch.no_grad():
            for layer in reference.model.layers:
                experts = getattr(layer.mlp, "experts", None)
                if experts is not None:
                    for name in ("gate_up_proj", "down_proj"):
                        weight = getattr(experts, name)
                        full_bytes += weight.numel() * weight.element_size()
                        weight.copy_(_roundtrip(weight, spec))
            expected = reference(ids).logits
        stages = [
            load_stage_shard(folder, 0, 2, True, False, torch.float32, quantization=raw),
            load_stage_shard(folder, 2, 4, False, True, torch.float32, quantization=raw),
        ]
        with torch.no_grad():
            got = stages[1](stages[0](ids))
        assert torch.allclose(got, expected, rtol=0, atol=1e-5), (family, raw)
        stacks = [m for s in stages for m in s.modules() if isinstance(m, ExpertStack)]
        assert stacks, "the fused experts are quantized"
        stack_bytes = sum(p.numel() * p.element_size() for m in stacks for p in m.parameters())
        assert stack_bytes < full_bytes / (6 if spec.bits == 4 else 3)
