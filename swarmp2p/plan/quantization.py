"""Weight quantization specs: normalisation, bytes per parameter, weight estimates.

The spec is the reference's small dict (predecessor-torch-runtime.md, "Weight quantization"):

| key | values | default |
|---|---|---|
| `bits` | 8, 4 (16, 32, None: no quantization) | from `method` |
| `method` | "int8", "nf4", "fp4", "none" | alias for `bits` (+ `quant_type`) |
| `quant_type` | "nf4", "fp4" | "nf4" |
| `double_quant` | bool | true |
| `compute_dtype` | "bfloat16", "float16", "float32" | "bfloat16" |
| `threshold` | number > 0 (LLM.int8() outlier threshold) | 6.0 |
| `cpu_offload` | bool | false |
| `skip_modules` | list of module names, or omitted | omitted: the output head |

Estimates are in GB of 2**30 bytes, the unit the reference's published numbers use
(32e9 parameters: 59.6 GB bfloat16, 31.6 GB at 8 bits, 15.5 GB at 4 bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from swarmp2p.plan.hardware import DTYPE_BYTES
from swarmp2p.schema import FieldError, SchemaError, field, parse, replace_errors, show

GB = 2**30
"""Bytes in the "GB" every message prints (the reference's unit)."""

_METHODS = {"int8": (8, None), "nf4": (4, "nf4"), "fp4": (4, "fp4"), "none": (None, None)}

# Scale overhead per parameter, in bytes. 8 bits: int8 codes plus their float32 scales
# (one per row, and the outlier bookkeeping of LLM.int8()) ~ 0.06 B/param. 4 bits: bitsandbytes'
# blockwise NF4/FP4 keeps one absmax per 64 values; double quantization stores it as 8 bits
# (1/64 B/param) plus float32 second-level scales and the quant state (~0.02 B/param in all),
# without it a float32 absmax per 64 values (4/64 B/param). Calibrated to the reference's
# published estimates: 32e9 params give 31.6 GB (8 bits) and 15.5 GB (4 bits).
_SCALE_BYTES_8BIT = 0.06
_SCALE_BYTES_4BIT_DOUBLE = 0.02
_SCALE_BYTES_4BIT_SINGLE = 4 / 64


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantSpec:
    """A normalised weight-quantization spec (never "no quantization": that is None)."""

    bits: int
    quant_type: str = "nf4"
    double_quant: bool = True
    compute_dtype: str = "bfloat16"
    threshold: float = 6.0
    cpu_offload: bool = False
    skip_modules: tuple[str, ...] | None = None
    """None: the output head stays in full precision; () defers to transformers."""

    @classmethod
    def from_data(cls, value: Any, path: str) -> QuantSpec | None:
        """A job's or spec's ``quantization`` field (None: no quantization)."""
        return parse_quantization(value, path)

    def to_data(self) -> dict[str, Any]:
        return self.to_dict()

    def to_dict(self) -> dict[str, Any]:
        """Every field, in declaration order, ``skip_modules`` as a list."""
        out = {k: getattr(self, k) for k in self.__slots__}
        out["skip_modules"] = None if self.skip_modules is None else list(self.skip_modules)
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class _QuantInput:
    """A quantization spec as a user writes it (``method`` is an alias for ``bits``)."""

    bits: Literal[4, 8, 16, 32] | None = None
    method: Literal["int8", "nf4", "fp4", "none"] | None = None
    quant_type: Literal["nf4", "fp4"] | None = None
    double_quant: bool = True
    compute_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    threshold: float = field(default=6.0, gt=0)
    cpu_offload: bool = False
    skip_modules: tuple[str, ...] | None = field(default=None)

    def __post_init__(self) -> None:
        errors = []
        m_bits, m_type = _METHODS[self.method] if self.method else (None, None)
        if (
            self.method
            and self.bits is not None
            and m_bits != (self.bits if self.bits in (4, 8) else None)
        ):
            errors.append(
                f"method {self.method!r} contradicts bits {self.bits!r}; give one of them"
            )
        if m_type and self.quant_type is not None and self.quant_type != m_type:
            errors.append(f"method {self.method!r} contradicts quant_type {self.quant_type!r}")
        if self.skip_modules is not None and not all(self.skip_modules):
            raise SchemaError(
                [
                    FieldError(
                        path="skip_modules", message="must be a list of non-empty module names"
                    )
                ]
            )
        if errors:
            raise SchemaError([FieldError(path="", message=e) for e in errors])


def _bits_message(errors: list[FieldError], path: str) -> list[FieldError]:
    """The schema's messages, with the one for ``bits`` saying what each value means."""
    out = []
    for e in errors:
        if e.path == f"{path}.bits":
            got = e.message.rsplit(", got ", 1)[-1]
            e = FieldError(
                path=e.path, message=f"must be 8 or 4 (16, 32 or null: no quantization), got {got}"
            )
        out.append(e)
    return out


def parse_quantization(spec: Any, path: str = "quantization") -> QuantSpec | None:
    """The normalised spec, None for no quantization; SchemaError naming every bad key/value."""
    if spec is None or isinstance(spec, QuantSpec):
        return spec
    if not isinstance(spec, dict):
        raise SchemaError(
            [
                FieldError(
                    path=path,
                    message=f'must be an object such as {{"bits": 4}} or null, got {show(spec)}',
                )
            ]
        )
    try:
        q = parse(_QuantInput, spec)
    except SchemaError as exc:
        raise SchemaError(_bits_message(replace_errors(exc, path), path)) from None
    bits, quant_type = q.bits, q.quant_type or "nf4"
    if q.method:
        m_bits, m_type = _METHODS[q.method]
        bits, quant_type = m_bits, m_type or quant_type
    if bits not in (4, 8):
        return None
    return QuantSpec(
        bits=bits,
        quant_type=quant_type,
        double_quant=q.double_quant,
        compute_dtype=q.compute_dtype,
        threshold=q.threshold,
        cpu_offload=q.cpu_offload,
        skip_modules=q.skip_modules,
    )


def normalize(spec: Any, path: str = "quantization") -> QuantSpec | None:
    """The normalised spec, None for no quantization; ValueError naming every bad key/value."""
    try:
        return parse_quantization(spec, path)
    except SchemaError as exc:
        raise ValueError("; ".join(str(e) for e in exc.errors)) from None


def bytes_per_param(spec: QuantSpec | dict | None, dtype: str = "bfloat16") -> float:
    """Bytes one weight takes in memory, scales included; `dtype` when not quantized."""
    q = spec if isinstance(spec, QuantSpec) or spec is None else normalize(spec)
    if q is None:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
        return float(DTYPE_BYTES[dtype])
    if q.bits == 8:
        return 1.0 + _SCALE_BYTES_8BIT
    return 0.5 + (_SCALE_BYTES_4BIT_DOUBLE if q.double_quant else _SCALE_BYTES_4BIT_SINGLE)


def estimate_weights_gb(
    params: float, spec: QuantSpec | dict | None = None, *, dtype: str = "bfloat16"
) -> float:
    """Weight-only memory of `params` parameters in GB (2**30 bytes), scales included.

    Activations, gradients, optimizer state and the KV cache are all on top: fitting here is
    necessary, not sufficient.
    """
    if not (isinstance(params, (int, float)) and params >= 0):
        raise ValueError(f"params: must be a number >= 0, got {params!r}")
    return params * bytes_per_param(spec, dtype) / GB
