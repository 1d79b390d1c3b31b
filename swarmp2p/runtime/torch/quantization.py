"""bitsandbytes weight quantization of a stage as it loads: 8-bit, 4-bit NF4/FP4."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from swarmp2p.runtime.torch.introspect import Topology

INSTALL_HINT = "pip install bitsandbytes (or run ./install.sh)"

_KEYS = frozenset(
    {
        "bits",
        "method",
        "quant_type",
        "double_quant",
        "compute_dtype",
        "threshold",
        "cpu_offload",
        "skip_modules",
    }
)
_METHODS = {"int8": (8, None), "nf4": (4, "nf4"), "fp4": (4, "fp4"), "none": (None, None)}
_COMPUTE_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantSpec:
    """A normalised weight-quantization spec (the reference's table)."""

    bits: int
    """8 (LLM.int8()) or 4."""
    quant_type: str = "nf4"
    """4-bit data type: ``nf4`` or ``fp4``."""
    double_quant: bool = True
    """Quantize the 4-bit block scales too."""
    compute_dtype: str = "bfloat16"
    """Dtype the dequantized 4-bit matmul runs in."""
    threshold: float = 6.0
    """LLM.int8() outlier threshold."""
    cpu_offload: bool = False
    skip_modules: tuple[str, ...] | None = None
    """Modules kept in full precision; ``None`` means the output head, found by introspection."""


def normalize_spec(spec: dict | QuantSpec | None) -> QuantSpec | None:
    """A spec dict -> ``QuantSpec``, or ``None`` for no quantization; bad fields are named."""
    if spec is None or isinstance(spec, QuantSpec):
        return spec
    if not isinstance(spec, dict):
        raise TypeError(f"quantization must be a dict like {{'bits': 4}}, got {spec!r}")
    unknown = sorted(set(spec) - _KEYS)
    if unknown:
        raise ValueError(
            f"quantization: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}"
        )
    bits = spec.get("bits")
    quant_type = spec.get("quant_type")
    if "method" in spec:
        if spec["method"] not in _METHODS:
            raise ValueError(
                f"quantization.method {spec['method']!r} is not one of {', '.join(_METHODS)}"
            )
        method_bits, method_type = _METHODS[spec["method"]]
        if bits is not None and bits != method_bits and bits not in (16, 32):
            raise ValueError(f"quantization: bits {bits} contradicts method {spec['method']!r}")
        if quant_type is not None and method_type is not None and quant_type != method_type:
            raise ValueError(
                f"quantization: quant_type {quant_type!r} contradicts method {spec['method']!r}"
            )
        bits, quant_type = method_bits, quant_type or method_type
    if bits in (None, 16, 32):
        return None
    if bits not in (4, 8):
        raise ValueError(f"quantization.bits must be 4, 8, 16, 32 or null, got {bits!r}")
    quant_type = quant_type or "nf4"
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"quantization.quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    compute_dtype = spec.get("compute_dtype", "bfloat16")
    if compute_dtype not in _COMPUTE_DTYPES:
        raise ValueError(
            f"quantization.compute_dtype must be one of {', '.join(_COMPUTE_DTYPES)}, "
            f"got {compute_dtype!r}"
        )
    skip = spec.get("skip_modules")
    if skip is not None and (
        not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip)
    ):
        raise ValueError(f"quantization.skip_modules must be a list of module names, got {skip!r}")
    threshold = spec.get("threshold", 6.0)
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or threshold <= 0:
        raise ValueError(f"quantization.threshold must be a positive number, got {threshold!r}")
    return QuantSpec(
        bits=bits,
        quant_type=quant_type,
        double_quant=bool(spec.get("double_quant", True)),
        compute_dtype=compute_dtype,
        threshold=float(threshold),
        cpu_offload=bool(spec.get("cpu_offload", False)),
        skip_modules=None if skip is None else tuple(skip),
    )


def import_bitsandbytes():
    """bitsandbytes, or an ImportError that says how to install it."""
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError(
            f"weight quantization needs bitsandbytes, which is not importable ({error}); "
            f"{INSTALL_HINT}"
        ) from error
    return bitsandbytes


class _DropCastWarning(logging.Filter):
    """bitsandbytes' 8-bit CPU matmul logs a cast warning on every call (DESIGN pitfall)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("MatMul8bitLt: inputs will be cast")


def silence_cast_warning() -> None:
    """Drop bitsandbytes' per-matmul cast warning (idempotent)."""
    log = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropCastWarning) for f in log.filters):
        log.addFilter(_DropCastWarning())


def bnb_config(spec: QuantSpec, skip: list[str]):
    """The transformers ``BitsAndBytesConfig`` equal to ``spec`` with ``skip`` kept full."""
    from transformers import BitsAndBytesConfig

    if spec.bits == 8:
        return BitsAndBytesConfig(
            load_in_8bit=True,
            llm_int8_threshold=spec.threshold,
            llm_int8_skip_modules=skip,
            llm_int8_enable_fp32_cpu_offload=spec.cpu_offload,
        )
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=spec.quant_type,
        bnb_4bit_use_double_quant=spec.double_quant,
        bnb_4bit_compute_dtype=getattr(torch, spec.compute_dtype),
        llm_int8_skip_modules=skip,
        llm_int8_enable_fp32_cpu_offload=spec.cpu_offload,
    )


def full_precision_modules(topology: Topology, spec: QuantSpec) -> list[str]:
    """Modules left unquantized: the spec's list, or by default the output head."""
    if spec.skip_modules is not None:
        return list(spec.skip_modules)
    return [topology.names["head"]]


class StageQuantizer:
    """Turns an empty model's linear layers into bitsandbytes ones, then quantizes each owned
    weight as it is read, by transformers' own quantize ops (GPT-2 Conv1D turned around first)."""

    def __init__(self, model: nn.Module, topology: Topology, spec: QuantSpec) -> None:
        bnb = import_bitsandbytes()
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear

        silence_cast_warning()
        self.spec = spec
        self.model = model
        self.skip = full_precision_modules(topology, spec)
        self.config = bnb_config(spec, self.skip)
        replace_with_bnb_linear(
            model, modules_to_not_convert=self.skip or None, quantization_config=self.config
        )
        self._layers = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)

    def owns(self, key: str) -> bool:
        module_name, _, name = key.rpartition(".")
        return name == "weight" and isinstance(self.model.get_submodule(module_name), self._layers)

    def quantize(self, key: str, value: torch.Tensor) -> nn.Parameter:
        from transformers.integrations.bitsandbytes import Bnb4bitQuantize, Bnb8bitQuantize

        op = Bnb8bitQuantize(None) if self.spec.bits == 8 else Bnb4bitQuantize(None)
        return op.convert({key: [value]}, model=self.model, full_layer_name=key)[key]


def prepare(model: nn.Module, topology: Topology, spec: QuantSpec) -> StageQuantizer:
    """Get an empty model ready to quantize its owned weights as they load."""
    return StageQuantizer(model, topology, spec)
