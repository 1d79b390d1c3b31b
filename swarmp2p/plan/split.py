"""Where a model is cut: boundaries, the compression on each, and each stage's layer range.

A pipeline of N stages has N-1 boundaries; boundary i sits between stage i and stage i+1.
Compression specs: "none", "fp16", "fixed_int2".."fixed_int8", or
`{"method": "learned_bottleneck", "learned_dim": 256, "code_bits": 8}` (code_bits 2..8 or 16;
optional "calibration_tokens", default 16384). The reference's spellings are aliases:
"bottleneck_dim" is learned_dim; "quantized" + "quantization_bits" mean code_bits, and
"quantized": false alone means float16 codes (code_bits 16). A contradiction is refused.

A boundary's link price is the byte count of the frame the wire sends for it
(``swarmp2p.codec_layout``): the codec the runtime asks for, the codec a payload of the compute
dtype actually crosses with, and the codes packed into 2-, 4- or 8-bit slots.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Literal

from swarmp2p.codec_layout import compression_codec, frame_nbytes, sent_codec
from swarmp2p.schema import FieldError, SchemaError, field, parse, replace_errors, show

_FIXED = {f"fixed_int{n}": n for n in range(2, 9)}
DEFAULT_CALIBRATION_TOKENS = 16384
"""Tokens stage 0 runs forward to calibrate the learned boundaries (reference, "Calibration")."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Compression:
    """What crosses one boundary."""

    method: str
    """"none", "fp16", "fixed" or "learned_bottleneck"."""
    bits: int = 0
    """fixed: code width 2..8."""
    learned_dim: int | None = None
    """learned_bottleneck: code width k; None means half the hidden size, a multiple of 64."""
    code_bits: int = 8
    """learned_bottleneck: bits per code value, 2..8, or 16 for float16 codes."""
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS
    """learned_bottleneck: tokens of training data stage 0 runs forward to calibrate it."""

    @classmethod
    def from_data(cls, value: Any, path: str) -> Compression:
        """One boundary's compression as job.json writes it (a string or an object)."""
        return _parse_spec(value, path)

    def to_data(self) -> str | dict[str, Any]:
        return self.spec

    @property
    def spec(self) -> str | dict[str, Any]:
        """The spec as job.json writes it."""
        if self.method == "fixed":
            return f"fixed_int{self.bits}"
        if self.method == "learned_bottleneck":
            spec: dict[str, Any] = {
                "method": "learned_bottleneck",
                "learned_dim": self.learned_dim,
                "code_bits": self.code_bits,
            }
            if self.calibration_tokens != DEFAULT_CALIBRATION_TOKENS:
                spec["calibration_tokens"] = self.calibration_tokens
            return spec
        return self.method

    @property
    def is_learned(self) -> bool:
        return self.method == "learned_bottleneck"

    @property
    def label(self) -> str:
        if self.method == "fixed":
            return f"fixed_int{self.bits}"
        if self.is_learned:
            return f"learned_bottleneck(k={self.learned_dim}, {self.code_bits}-bit)"
        return self.method

    def code_dim(self, hidden: int) -> int:
        """Width of the code a learned bottleneck sends for a model of width `hidden`."""
        if self.learned_dim is not None:
            return self.learned_dim
        return max(64, (hidden // 2) // 64 * 64)

    def wire_codec(self, wire_v2: bool = True) -> str:
        """The codec the runtime asks for on this boundary (its compressor's ``payload_codec``):
        wire v1 sends every payload as its plain floats ("none")."""
        if not wire_v2:
            return "none"
        bits = self.code_bits if self.is_learned else self.bits
        return compression_codec(self.method, bits)

    def payload_width(self, hidden: int) -> int:
        """Values per token that cross: the hidden width, or a learned bottleneck's code width."""
        return self.code_dim(hidden) if self.is_learned else hidden

    def sent_codec(self, dtype: str, wire_v2: bool = True) -> str:
        """The codec the payload crosses with at compute dtype ``dtype`` (a quantizing codec
        takes float32 payloads only; a bfloat16 or float16 payload goes raw)."""
        return sent_codec(self.wire_codec(wire_v2), dtype)

    def frame_bytes(self, tokens: int, hidden: int, dtype: str, wire_v2: bool = True) -> int:
        """Payload bytes of the frame that carries ``tokens`` tokens' activations over this
        boundary: ``swarmp2p.codec_layout.frame_nbytes``, the layout the wire encodes with."""
        codec = self.sent_codec(dtype, wire_v2)
        return frame_nbytes((tokens, self.payload_width(hidden)), dtype, codec)

    def bytes_per_token(self, hidden: int, dtype: str, wire_v2: bool = True) -> int:
        """Bytes of a one-token frame (the gradient crosses at ``dtype``).

        none: hidden x the compute dtype; fp16: 2 x hidden; fixed_intN: the codes in 2-, 4- or
        8-bit slots plus the float32 scale (one a frame: a frame of T tokens has one scale, not
        T); learned: the same over the code width k with one scale a token, or 2 k for 16-bit
        codes. A quantizing codec's payload that is not float32 crosses raw at ``dtype``.
        """
        return self.frame_bytes(1, hidden, dtype, wire_v2)

    def params(self, hidden: int) -> int:
        """Trainable parameters of the whole compressor (0 unless learned): down and up maps."""
        if not self.is_learned:
            return 0
        k = self.code_dim(hidden)
        return 2 * hidden * k + k + hidden


NO_COMPRESSION = Compression(method="none")


@dataclass(frozen=True, kw_only=True, slots=True)
class _LearnedInput:
    """A learned bottleneck as job.json writes it."""

    method: Literal["learned_bottleneck"]
    learned_dim: int | None = field(default=None, ge=1)
    code_bits: Literal[2, 3, 4, 5, 6, 7, 8, 16] | None = None
    """None: 8, unless the reference's aliases say otherwise."""
    calibration_tokens: int = field(default=DEFAULT_CALIBRATION_TOKENS, ge=1, le=2**31 - 1)
    bottleneck_dim: int | None = field(default=None, ge=1)
    """The reference's spelling of learned_dim."""
    quantized: bool | None = None
    """The reference's: false means float16 codes (code_bits 16)."""
    quantization_bits: Literal[2, 3, 4, 5, 6, 7, 8] | None = None
    """The reference's: with quantized (or alone), the same as code_bits."""


def _learned_aliases(spec: _LearnedInput, path: str) -> tuple[int | None, int]:
    """(learned_dim, code_bits) from the canonical keys and the reference's aliases; a
    SchemaError naming both keys for a contradiction."""
    errors: list[FieldError] = []

    def clash(key: str, value: Any, other: str, other_value: Any, why: str = "") -> None:
        errors.append(
            FieldError(
                path=f"{path}.{key}",
                message=f"{show(value)} contradicts {other} {show(other_value)}{why}",
            )
        )

    dim = spec.learned_dim
    if spec.bottleneck_dim is not None:
        if dim is not None and dim != spec.bottleneck_dim:
            clash("bottleneck_dim", spec.bottleneck_dim, "learned_dim", dim, " (one width k)")
        dim = spec.bottleneck_dim if dim is None else dim
    bits = spec.code_bits
    if spec.quantized is False:
        if spec.quantization_bits is not None:
            clash(
                "quantized",
                False,
                "quantization_bits",
                spec.quantization_bits,
                ' ("quantized": false means float16 codes)',
            )
        elif bits is not None and bits != 16:
            clash("quantized", False, "code_bits", bits, ' ("quantized": false means code_bits 16)')
        else:
            bits = 16
    elif spec.quantization_bits is not None:
        if bits is not None and bits != spec.quantization_bits:
            clash("quantization_bits", spec.quantization_bits, "code_bits", bits)
        bits = spec.quantization_bits
    elif spec.quantized is True and bits == 16:
        clash("quantized", True, "code_bits", 16, " (16 means float16 codes, not quantized)")
    if errors:
        raise SchemaError(errors)
    return dim, 8 if bits is None else bits


def _parse_spec(spec: Any, path: str) -> Compression:
    if isinstance(spec, str):
        if spec in _FIXED:
            return Compression(method="fixed", bits=_FIXED[spec])
        if spec in ("none", "fp16"):
            return Compression(method=spec)
        raise SchemaError(
            [
                FieldError(
                    path=path,
                    message='must be "none", "fp16", '
                    f'"fixed_int2".."fixed_int8" or a learned_bottleneck object, got {show(spec)}',
                )
            ]
        )
    if not isinstance(spec, dict):
        raise SchemaError(
            [FieldError(path=path, message=f"must be a string or an object, got {show(spec)}")]
        )
    try:
        learned = parse(_LearnedInput, spec)
    except SchemaError as exc:
        raise SchemaError(replace_errors(exc, path)) from None
    dim, bits = _learned_aliases(learned, path)
    return Compression(
        method="learned_bottleneck",
        learned_dim=dim,
        code_bits=bits,
        calibration_tokens=learned.calibration_tokens,
    )


def parse_compression(spec: Any, path: str = "split.compression") -> Compression:
    """One normalised Compression; ValueError naming the field on bad input."""
    if isinstance(spec, Compression):
        return spec
    try:
        return _parse_spec(spec, path)
    except SchemaError as exc:
        raise ValueError("; ".join(str(e) for e in exc.errors)) from None


def layer_range(i: int, n: int, n_layers: int) -> tuple[int, int]:
    """Stage i's layers [start, end) when `n_layers` are split evenly over n stages."""
    if not 1 <= n <= n_layers:
        raise ValueError(f"stages: must be between 1 and {n_layers} (the layer count), got {n}")
    if not 0 <= i < n:
        raise ValueError(f"stage index must be in [0, {n}), got {i}")
    return i * n_layers // n, (i + 1) * n_layers // n


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitSpec:
    """N-1 boundaries over `n_layers` layers, with the compression on each."""

    n_layers: int
    boundaries: tuple[int, ...]
    """Layer index where each stage after the first starts, strictly increasing."""
    compression: tuple[Compression, ...] = ()
    """One per boundary; () means none everywhere."""

    def __post_init__(self) -> None:
        cuts = (0, *self.boundaries, self.n_layers)
        if any(a >= b for a, b in itertools.pairwise(cuts)):
            raise ValueError(
                f"boundaries: must be strictly increasing inside (0, {self.n_layers}), "
                f"got {list(self.boundaries)}"
            )
        if self.compression and len(self.compression) != len(self.boundaries):
            raise ValueError(
                f"split.compression: {len(self.compression)} spec(s) for "
                f"{len(self.boundaries)} boundary(ies); give one spec or one per boundary"
            )

    @classmethod
    def even(cls, n_layers: int, n: int, compression: tuple[Compression, ...] = ()) -> SplitSpec:
        cuts = tuple(layer_range(i, n, n_layers)[0] for i in range(1, n))
        return cls(n_layers=n_layers, boundaries=cuts, compression=compression)

    @property
    def n_stages(self) -> int:
        return len(self.boundaries) + 1

    def layer_range(self, i: int) -> tuple[int, int]:
        """Stage i's layers [start, end)."""
        if not 0 <= i < self.n_stages:
            raise ValueError(f"stage index must be in [0, {self.n_stages}), got {i}")
        cuts = (0, *self.boundaries, self.n_layers)
        return cuts[i], cuts[i + 1]

    def compression_at(self, boundary: int) -> Compression:
        """The compression on boundary `boundary` (between stages b and b+1)."""
        if not 0 <= boundary < len(self.boundaries):
            raise ValueError(f"boundary must be in [0, {len(self.boundaries)}), got {boundary}")
        return self.compression[boundary] if self.compression else NO_COMPRESSION

    def stage(self, i: int) -> StageSpec:
        start, end = self.layer_range(i)
        return StageSpec(
            stage_index=i,
            n_stages=self.n_stages,
            layer_start=start,
            layer_end=end,
            receive_boundary=i - 1 if i > 0 else None,
            send_boundary=i if i < self.n_stages - 1 else None,
            receive_compression=self.compression_at(i - 1) if i > 0 else None,
            send_compression=self.compression_at(i) if i < self.n_stages - 1 else None,
        )


class StagePosition:
    """Where a stage stands in its pipeline: first, last, both or neither.

    For any record that knows its ``stage_index`` of ``n_stages`` (a split's stage, a worker or
    serve spec, a runtime bundle), so the rule is written once.
    """

    __slots__ = ()
    stage_index: int
    n_stages: int

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.n_stages - 1


class StageOfPlan(StagePosition):
    """A spec of stage ``stage`` of ``plan`` (a training Plan or a ServePlan): what both kinds of
    plan say about that stage, read the same way by a worker spec and a serve spec."""

    __slots__ = ()
    stage: int
    plan: Any

    @property
    def stage_index(self) -> int:
        return self.stage

    @property
    def n_stages(self) -> int:
        return len(self.plan.stages)

    @property
    def planned(self) -> Any:
        """The plan's entry for this stage (a PlannedStage or a ServeStagePlan)."""
        return self.plan.stages[self.stage]

    @property
    def layers(self) -> tuple[int, int]:
        """This stage's blocks ``[start, end)``."""
        return self.planned.layers

    @property
    def dtype(self) -> str:
        """The compute dtype the plan chose."""
        return self.plan.dtype

    def stage_errors(self) -> list[FieldError]:
        """The check both specs start their validation with: ``stage`` is one of the plan's."""
        n = len(self.plan.stages)
        if self.stage < n:
            return []
        return [
            FieldError(path="stage", message=f"must be < the plan's {n} stage(s), got {self.stage}")
        ]


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSpec(StagePosition):
    """One stage of a split: its layers and the boundaries it reads from and writes to."""

    stage_index: int
    n_stages: int
    layer_start: int
    layer_end: int
    receive_boundary: int | None
    """The boundary this stage reads activations from (None on the first stage)."""
    send_boundary: int | None
    """The boundary this stage writes activations to (None on the last stage)."""
    receive_compression: Compression | None = None
    send_compression: Compression | None = None

    @property
    def n_layers(self) -> int:
        return self.layer_end - self.layer_start
