"""Boundary compressors: what training sees of a stage boundary, split into sender and receiver.

A compressor is an ``nn.Module`` whose ``forward`` is the whole boundary (sender then receiver,
as a single process would run it). ``sender()`` is the half the stage before the boundary runs
(its output is the payload that crosses the link); ``receiver()`` is the half the stage after it
runs on that payload. ``payload_codec`` names the wire codec that carries the payload losslessly.

The rounding rule is shared bit for bit with the wire codecs (``swarmp2p.wire``):
``qmax = 2**(N-1) - 1``; ``scale = max|x| / qmax`` in float32 (1.0 when that is 0);
``code = clamp(round_half_even(x / scale), -qmax, qmax)`` (a zero code is +0.0); the value is
``code * scale``.
``intN`` has one scale per tensor, ``tokintN`` one per token (row over the last dim).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from swarmp2p.codec_layout import compression_codec
from swarmp2p.plan.split import parse_compression

BOTTLENECK_SEED = 0x5A4D_B077
"""Base of the private seed a learned bottleneck draws its initial weights from (plus the
boundary index), so the two stages of a boundary build the same one without talking."""

RETIRED_BOTTLENECK_KEYS = ("down_norm", "up_norm")
"""State keys of the retired LayerNorm bottleneck (see the reference, "The learned bottleneck")."""

_QUANT_BITS = range(2, 9)
_LEARNED_EXTRA = ("bottleneck_dim", "quantized", "quantization_bits", "calibration_tokens")
"""A learned spec's keys besides learned_dim and code_bits: the reference's aliases (resolved by
``plan.split.parse_compression``) and the calibration's token count (not the module's)."""


def quantize(x: torch.Tensor, bits: int, *, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (float32, integral values) and float32 scale(s) of ``x`` by the shared rounding rule.

    ``per_token`` gives one scale per row of the last dimension (shape ``x.shape[:-1] + (1,)``);
    otherwise one 0-dim scale for the whole tensor.
    """
    if bits not in _QUANT_BITS:
        raise ValueError(f"quantization bits must be 2..8, got {bits!r}")
    x32 = x.detach().to(torch.float32)
    qmax = torch.tensor(float(2 ** (bits - 1) - 1), dtype=torch.float32, device=x32.device)
    amax = x32.abs().amax(dim=-1, keepdim=True) if per_token else x32.abs().amax()
    # tensor / tensor (never tensor / python scalar): some kernels turn a scalar divisor into a
    # multiplication by its reciprocal, which would break bit-exactness with the numpy codec.
    scale = amax / qmax
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # zeros, or m underflowed
    # + 0.0 turns a -0.0 code into +0.0: codes are integers on the wire (swarmp2p.wire.codec)
    codes = torch.clamp(torch.round(x32 / scale), -qmax, qmax) + 0.0
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values the codes stand for: ``codes * scale``."""
    return codes.to(torch.float32) * scale


def fake_quantize(x: torch.Tensor, bits: int, *, per_token: bool) -> torch.Tensor:
    """Quantize-then-dequantize ``x`` (no gradient); the result has ``x``'s dtype."""
    codes, scale = quantize(x, bits, per_token=per_token)
    return dequantize(codes, scale).to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward returns a precomputed rounded tensor exactly; backward passes the gradient on."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
        return rounded

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded`` in the forward pass, the identity's gradient in the backward pass."""
    return _StraightThrough.apply(x, rounded.detach())


class _Round(nn.Module):
    """Straight-through rounding of a tensor: intN, tokintN or float16."""

    def __init__(self, bits: int, *, per_token: bool) -> None:
        super().__init__()
        self.bits = bits
        self.per_token = per_token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bits == 16:
            rounded = x.detach().to(torch.float16).to(x.dtype)
        else:
            rounded = fake_quantize(x, self.bits, per_token=self.per_token)
        return straight_through(x, rounded)

    def extra_repr(self) -> str:
        return f"bits={self.bits}, per_token={self.per_token}"


class Compressor(nn.Module):
    """Base class: ``forward(x) == receiver()(sender()(x))``."""

    payload_codec: str = "none"
    """Wire codec that carries ``sender()``'s output losslessly."""

    def sender(self) -> nn.Module:
        """The half the stage before the boundary runs; its output crosses the link."""
        raise NotImplementedError

    def receiver(self) -> nn.Module:
        """The half the stage after the boundary runs on the payload."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.receiver()(self.sender()(x))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign=False):
        """Load a compressor state, refusing the retired LayerNorm bottleneck."""
        check_compressor_state(state_dict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


class _SenderRounds(Compressor):
    """A boundary whose sender half rounds the hidden state (or passes it on, ``send`` None) and
    whose receiver half is the identity: the payload is already the hidden state's values."""

    def __init__(self, send: nn.Module | None = None) -> None:
        super().__init__()
        self._identity = nn.Identity()
        self._send = self._identity if send is None else send

    def sender(self) -> nn.Module:
        return self._send

    def receiver(self) -> nn.Module:
        return self._identity


class NoCompression(_SenderRounds):
    """The boundary sends the hidden state as it is."""

    payload_codec = "none"


class HalfPrecision(_SenderRounds):
    """The boundary rounds the hidden state to float16 (straight-through)."""

    payload_codec = compression_codec("fp16")

    def __init__(self) -> None:
        super().__init__(_Round(16, per_token=False))


class FixedQuantization(_SenderRounds):
    """``fixed_intN``: one float32 scale per tensor, N-bit codes, straight-through estimator."""

    def __init__(self, bits: int) -> None:
        if bits not in _QUANT_BITS:
            raise ValueError(
                f"fixed_int bits must be 2..8, got {bits!r}; use fixed_int2..fixed_int8"
            )
        super().__init__(_Round(bits, per_token=False))
        self.bits = bits
        self.payload_codec = compression_codec("fixed", bits)


class LearnedBottleneck(Compressor):
    """``up(round_per_token(down(x)))``: a linear projection to ``k`` dims and back.

    ``code_bits`` 2..8 rounds each token's code with its own scale (tokintN); 16 rounds it to
    float16. Initial weights come from a private generator seeded by ``boundary_index`` so both
    stages of the boundary build the same bottleneck; calibration then replaces them.
    """

    def __init__(self, hidden: int, k: int, code_bits: int = 8, *, boundary_index: int) -> None:
        super().__init__()
        if not 0 < k <= hidden:
            raise ValueError(f"learned_dim must be in 1..{hidden} (the hidden width), got {k!r}")
        if code_bits not in (*_QUANT_BITS, 16):
            raise ValueError(f"code_bits must be 2..8 or 16 (float16 codes), got {code_bits!r}")
        if boundary_index < 0:
            raise ValueError(f"boundary_index must be >= 0, got {boundary_index!r}")
        self.hidden, self.k, self.code_bits = hidden, k, code_bits
        self.boundary_index = boundary_index
        self.payload_codec = compression_codec("learned_bottleneck", code_bits)
        self.down = nn.Linear(hidden, k)
        self.up = nn.Linear(k, hidden)
        self._round = _Round(code_bits, per_token=True)
        # not registered as a child: its modules already are, and the state keeps one name each
        object.__setattr__(self, "_sender", nn.Sequential(self.down, self._round))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the initial weights from the boundary's private generator."""
        gen = torch.Generator().manual_seed(BOTTLENECK_SEED + self.boundary_index)
        with torch.no_grad():
            for linear in (self.down, self.up):
                bound = 1.0 / math.sqrt(linear.in_features)
                for p in (linear.weight, linear.bias):
                    fresh = torch.rand(p.shape, generator=gen, dtype=torch.float32) * 2 - 1
                    p.copy_(fresh * bound)

    def set_projection(self, mean: torch.Tensor, basis: torch.Tensor) -> None:
        """Both halves from one projection: ``down(x) = (x - mean) @ basis``,
        ``up(code) = code @ basis.T + mean`` (``basis`` is hidden x k, orthonormal columns)."""
        if basis.shape != (self.hidden, self.k) or mean.shape != (self.hidden,):
            raise ValueError(
                f"projection must be mean ({self.hidden},) and basis ({self.hidden}, {self.k}), "
                f"got {tuple(mean.shape)} and {tuple(basis.shape)}"
            )
        self.set_sender_projection(mean, basis)
        self.set_receiver_projection(mean, basis)

    def set_sender_projection(self, mean: torch.Tensor, basis: torch.Tensor) -> None:
        """``down(x) = (x - mean) @ basis``."""
        basis64, mean64 = basis.to(torch.float64), mean.to(torch.float64)
        with torch.no_grad():
            self.down.weight.copy_(basis64.T.to(self.down.weight.dtype))
            self.down.bias.copy_((-(mean64 @ basis64)).to(self.down.bias.dtype))

    def set_receiver_projection(self, mean: torch.Tensor, basis: torch.Tensor) -> None:
        """``up(code) = code @ basis.T + mean``."""
        with torch.no_grad():
            self.up.weight.copy_(basis.to(self.up.weight.dtype))
            self.up.bias.copy_(mean.to(self.up.bias.dtype))

    def sender(self) -> nn.Module:
        return self._sender

    def receiver(self) -> nn.Module:
        return self.up

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, k={self.k}, code_bits={self.code_bits}, "
            f"boundary_index={self.boundary_index}"
        )


def check_compressor_state(state: Mapping[str, Any]) -> None:
    """Refuse a state saved by the retired LayerNorm bottleneck."""
    retired = sorted(k for k in state if any(part in k for part in RETIRED_BOTTLENECK_KEYS))
    if retired:
        raise ValueError(
            "compressor state holds the retired LayerNorm bottleneck "
            f"({', '.join(retired)}); it cannot be loaded: retrain the model"
        )


def default_learned_dim(hidden: int) -> int:
    """Half the hidden width, a multiple of 64 where the width allows (the reference's default)."""
    half = hidden // 2
    return max(64, half - half % 64) if hidden >= 128 else max(1, half)


def compressor_from_spec(spec: Any, hidden: int, boundary_index: int) -> Compressor:
    """The compressor a boundary's compression spec asks for.

    ``spec``: ``None``/``"none"``, ``"fp16"``, ``"fixed_int2"``..``"fixed_int8"``, or a mapping
    ``{"method": "learned_bottleneck", "learned_dim": k, "code_bits": 8}`` (also the string
    ``"learned_bottleneck"`` for the defaults); a mapping ``{"method": "fixed_int8"}`` works too,
    and so does a ``plan.split.Compression``.
    """
    if spec is None:
        return NoCompression()
    if not isinstance(spec, (str, Mapping)) and hasattr(spec, "spec"):
        spec = spec.spec  # a plan.split.Compression: its job.json form
    if isinstance(spec, Mapping):
        method = spec.get("method")
        extra = {k: v for k, v in spec.items() if k != "method" and v is not None}
    else:
        method, extra = spec, {}
    if not isinstance(method, str):
        raise ValueError(f"compression method must be a string, got {method!r}")
    if method == "learned_bottleneck":
        unknown = sorted(set(extra) - {"learned_dim", "code_bits", *_LEARNED_EXTRA})
        if unknown:
            raise ValueError(
                f"unknown learned_bottleneck setting(s) {unknown}; use learned_dim, code_bits "
                "(or the reference's bottleneck_dim, quantized, quantization_bits), "
                "calibration_tokens"
            )
        if set(extra) & set(_LEARNED_EXTRA):  # the aliases mean what plan/split.py says
            resolved = parse_compression({"method": method, **extra}, "compression")
            extra = {"learned_dim": resolved.learned_dim, "code_bits": resolved.code_bits}
            extra = {k: v for k, v in extra.items() if v is not None}
        k = extra.get("learned_dim", default_learned_dim(hidden))
        return LearnedBottleneck(
            hidden, k, extra.get("code_bits", 8), boundary_index=boundary_index
        )
    if extra:
        raise ValueError(f"compression {method!r} takes no settings, got {sorted(extra)}")
    if method == "none":
        return NoCompression()
    if method == "fp16":
        return HalfPrecision()
    if method.startswith("fixed_int") and method[len("fixed_int") :].isdigit():
        bits = int(method[len("fixed_int") :])
        if bits in _QUANT_BITS:
            return FixedQuantization(bits)
    raise ValueError(
        f"unknown compression {method!r}; use none, fp16, fixed_int2..fixed_int8 or "
        '{"method": "learned_bottleneck", "learned_dim": k, "code_bits": 8}'
    )
