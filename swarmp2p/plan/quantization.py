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

import math
from dataclasses import dataclass
from typing import Any

from swarmp2p.plan.precision import DTYPE_BYTES

GB = 2**30
"""Bytes in the "GB" every message prints (the reference's unit)."""

_KEYS = (
    "bits",
    "method",
    "quant_type",
    "double_quant",
    "compute_dtype",
    "threshold",
    "cpu_offload",
    "skip_modules",
)
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "quant_type": self.quant_type,
            "double_quant": self.double_quant,
            "compute_dtype": self.compute_dtype,
            "threshold": self.threshold,
            "cpu_offload": self.cpu_offload,
            "skip_modules": None if self.skip_modules is None else list(self.skip_modules),
        }


def quantization_errors(spec: Any, path: str = "quantization") -> list[str]:
    """Every problem with `spec`, each prefixed with its field path; [] when valid."""
    if spec is None:
        return []
    if not isinstance(spec, dict):
        return [f'{path}: must be an object such as {{"bits": 4}} or null, got {spec!r}']
    errors = [
        f"{path}.{k}: unknown key; known keys: {', '.join(_KEYS)}" for k in spec if k not in _KEYS
    ]
    bits = spec.get("bits")
    if "bits" in spec and (isinstance(bits, bool) or bits not in (4, 8, 16, 32, None)):
        errors.append(
            f"{path}.bits: must be 8 or 4 (16, 32 or null: no quantization), got {bits!r}"
        )
    method = spec.get("method")
    if "method" in spec and method not in _METHODS:
        errors.append(f"{path}.method: must be one of {', '.join(_METHODS)}, got {method!r}")
    elif method in _METHODS and "bits" in spec and bits in (4, 8, 16, 32, None):
        m_bits = _METHODS[method][0]
        if (m_bits or None) != (bits if bits in (4, 8) else None):
            errors.append(f"{path}: method {method!r} contradicts bits {bits!r}; give one of them")
    qt = spec.get("quant_type")
    if "quant_type" in spec and qt not in ("nf4", "fp4"):
        errors.append(f'{path}.quant_type: must be "nf4" or "fp4", got {qt!r}')
    elif method in ("nf4", "fp4") and "quant_type" in spec and qt != method:
        errors.append(f"{path}: method {method!r} contradicts quant_type {qt!r}")
    for key in ("double_quant", "cpu_offload"):
        if key in spec and not isinstance(spec[key], bool):
            errors.append(f"{path}.{key}: must be true or false, got {spec[key]!r}")
    cd = spec.get("compute_dtype")
    if "compute_dtype" in spec and cd not in DTYPE_BYTES:
        errors.append(f"{path}.compute_dtype: must be one of {', '.join(DTYPE_BYTES)}, got {cd!r}")
    th = spec.get("threshold")
    if "threshold" in spec and not (
        isinstance(th, (int, float)) and not isinstance(th, bool) and math.isfinite(th) and th > 0
    ):
        errors.append(f"{path}.threshold: must be a number > 0, got {th!r}")
    sm = spec.get("skip_modules")
    if "skip_modules" in spec and not (
        sm is None or (isinstance(sm, list) and all(isinstance(m, str) and m for m in sm))
    ):
        errors.append(f"{path}.skip_modules: must be a list of module names, got {sm!r}")
    return errors


def normalize(spec: Any, path: str = "quantization") -> QuantSpec | None:
    """The normalised spec, None for no quantization; ValueError naming every bad key/value."""
    errors = quantization_errors(spec, path)
    if errors:
        raise ValueError("; ".join(errors))
    if spec is None:
        return None
    bits = spec.get("bits")
    quant_type = spec.get("quant_type", "nf4")
    if "method" in spec:
        m_bits, m_type = _METHODS[spec["method"]]
        bits = m_bits
        quant_type = m_type or quant_type
    if bits not in (4, 8):
        return None
    sm = spec.get("skip_modules")
    return QuantSpec(
        bits=bits,
        quant_type=quant_type,
        double_quant=spec.get("double_quant", True),
        compute_dtype=spec.get("compute_dtype", "bfloat16"),
        threshold=float(spec.get("threshold", 6.0)),
        cpu_offload=spec.get("cpu_offload", False),
        skip_modules=None if sm is None else tuple(sm),
    )


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
