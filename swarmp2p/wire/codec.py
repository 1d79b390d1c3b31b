"""Tensor codecs: ``none``, ``fp16``, ``int2``..``int8`` and ``tokint2``..``tokint8``.

The quantization rule (the training-side quantizer must match it bit for bit)
---------------------------------------------------------------------------
For N in 2..8 bits, on a float32 tensor ``x`` (every operation in float32)::

    qmax  = 2**(N-1) - 1
    m     = max(|x|)                         # intN: over the whole tensor
                                             # tokintN: per row over the last dimension
    scale = float32(m) / float32(qmax)       # float32 division
    if scale == 0: scale = 1.0               # all zeros (or m so small it underflows)
    code  = clip(rint(x / scale), -qmax, qmax)   # float32 division, round half to even
                                                 # (numpy.rint; torch.round matches)
    x_hat = float32(code) * scale            # the decoded value; code 0 gives +0.0

``x_hat`` may overflow to inf when ``max|x|`` is within an ulp or so of float32's
largest value (the same happens in torch). ``code`` is an integer, so a zero code decodes to
``+0.0``: a float implementation must
normalise ``-0.0`` (``torch.round(x / scale) + 0.0``) to stay bit-identical. Non-finite
input is refused.

Packing: ``u = code + qmax`` (unsigned, ``0..2*qmax``); N <= 2: four codes per byte, N <= 4:
two per byte, else one per byte; element ``i`` of a byte sits at bits ``i*w .. i*w+w-1``
(``w`` = 2, 4 or 8), the flattened tensor in C order, the last byte zero-padded. Payload:
part 0 = the float32 scale(s) (one, or one per row), part 1 = the packed codes. Decoding
rejects codes above ``2*qmax``, non-zero padding and scales that are not finite and positive.

``fp16`` casts float32 to float16 (round to nearest even, overflow to inf, as a cast does)
and back to float32. ``none``
sends the raw little-endian bytes of any dtype in :data:`~swarmp2p.wire.frames.DTYPES`.

Lossless re-encoding (wire v2): ``encode_tensor(x, codec, exact=True)`` is for a tensor that
already holds quantized values ``x_hat``. It recovers the scale (``max|x| / qmax``, then its
neighbouring floats, since ``fl(fl(qmax*s)/qmax)`` may miss ``s`` by an ulp), re-derives the
codes, decodes them, and compares bitwise with ``x``; if any row is not exact it sends the
plain float32 tensor (codec ``none``), so the receiver always gets exactly ``x``.
"""

from __future__ import annotations

import numpy as np

from swarmp2p.wire.frames import (
    CODECS,
    DTYPES,
    TensorFrame,
    codec_bits,
    codes_per_byte,
    packed_nbytes,
    part_sizes,
    rows_of,
)
from swarmp2p.wire.messages import WireError

# the frame layout (codec names, bit widths, part sizes) lives in swarmp2p.codec_layout (via
# frames); re-exported here
__all__ = [
    "CODECS",
    "SCALE_SEARCH_ULPS",
    "codec_bits",
    "decode_tensor",
    "dequantize",
    "encode_tensor",
    "fake_quantize",
    "packed_nbytes",
    "part_sizes",
    "quantize",
    "wire_nbytes",
]

SCALE_SEARCH_ULPS = 4
"""How far (in float32 ulps) lossless encoding searches around the recomputed scale."""


# --- the rule ---------------------------------------------------------------------------------


def _as_rows(x: np.ndarray, per_token: bool) -> np.ndarray:
    if x.dtype != np.float32:
        raise ValueError(f"quantizing codecs take float32 tensors, got {x.dtype}; cast first")
    if per_token:
        if x.ndim == 0:
            raise ValueError("a per-token codec needs a tensor with at least one dimension")
        return x.reshape(-1, x.shape[-1]) if x.shape[-1] else x.reshape(rows_of(x.shape), 0)
    return x.reshape(1, -1)


def _scales(rows: np.ndarray, qmax: int) -> np.ndarray:
    if rows.shape[1] == 0:
        return np.ones(rows.shape[0], dtype=np.float32)
    m = np.maximum(rows.max(axis=1), -rows.min(axis=1))  # max|x| without a temporary
    if not np.all(np.isfinite(m)):
        raise ValueError("cannot quantize a tensor holding inf or nan")
    scale = m / np.float32(qmax)
    scale[scale == 0] = np.float32(1.0)
    return scale.astype(np.float32, copy=False)


def _codes(rows: np.ndarray, scale: np.ndarray, qmax: int) -> np.ndarray:
    q = np.rint(rows / scale[:, None])
    np.clip(q, -qmax, qmax, out=q)
    q += np.float32(0.0)  # codes are integers: -0.0 becomes +0.0, as the decoder produces
    return q


def quantize(x: np.ndarray, bits: int, *, per_token: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The rule: ``(codes as int8, same shape as x; float32 scales, one per row or one)``."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be in 2..8, got {bits}")
    qmax = 2 ** (bits - 1) - 1
    rows = _as_rows(np.ascontiguousarray(x), per_token)
    scale = _scales(rows, qmax)
    codes = _codes(rows, scale, qmax).astype(np.int8)
    return codes.reshape(x.shape), scale


@np.errstate(over="ignore")  # code*scale near float32's max is inf, as in torch
def dequantize(codes: np.ndarray, scale: np.ndarray, *, per_token: bool = False) -> np.ndarray:
    """``float32(code) * scale``; ``scale`` is one value, or one per row of the last dimension."""
    c = codes.astype(np.float32)
    if c.size == 0:
        return c
    if per_token:
        return (c.reshape(-1, codes.shape[-1]) * scale.astype(np.float32)[:, None]).reshape(
            codes.shape
        )
    return c * np.float32(scale.reshape(-1)[0])


def fake_quantize(x: np.ndarray, bits: int, *, per_token: bool = False) -> np.ndarray:
    """``dequantize(quantize(x))``: the floats a quantized boundary hands the next block."""
    codes, scale = quantize(x, bits, per_token=per_token)
    return dequantize(codes, scale, per_token=per_token)


# --- packing ----------------------------------------------------------------------------------


def _pack(u: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes (uint8, flat) ``per_byte`` to a byte."""
    per = codes_per_byte(bits)
    if per == 1:
        return u
    width = 8 // per
    pad = (-u.size) % per
    if pad:
        u = np.concatenate([u, np.zeros(pad, dtype=np.uint8)])
    g = u.reshape(-1, per)
    out = g[:, 0].copy()
    for i in range(1, per):
        out |= g[:, i] << np.uint8(i * width)
    return out


def _unpack(packed: np.ndarray, numel: int, bits: int, qmax: int) -> np.ndarray:
    per = codes_per_byte(bits)
    if per == 1:
        u = packed
    else:
        width = 8 // per
        mask = np.uint8((1 << width) - 1)
        u = np.empty((packed.size, per), dtype=np.uint8)
        for i in range(per):
            u[:, i] = (packed >> np.uint8(i * width)) & mask
        u = u.reshape(-1)
        if np.any(u[numel:]):
            raise WireError("malformed", "non-zero padding after the last packed code")
        u = u[:numel]
    if u.size and int(u.max()) > 2 * qmax:
        raise WireError("malformed", f"a {bits}-bit code is above {2 * qmax}")
    return u


# --- frames -----------------------------------------------------------------------------------


def _unsigned(rows: np.ndarray, scale: np.ndarray, qmax: int) -> np.ndarray:
    """``code + qmax`` as uint8, in place on one temporary (the rule, for the lossy path)."""
    q = rows / scale[:, None]
    np.rint(q, out=q)
    np.clip(q, -qmax, qmax, out=q)
    q += np.float32(qmax)
    return q.astype(np.uint8).reshape(-1)


def _quantized_frame(
    x: np.ndarray, bits: int, per_token: bool, u: np.ndarray, scale: np.ndarray, meta: dict
) -> TensorFrame:
    codec = f"{'tok' if per_token else ''}int{bits}"
    return TensorFrame(
        shape=tuple(x.shape),
        dtype="float32",
        codec=codec,
        parts=(scale.astype("<f4").tobytes(), _pack(u, bits).data),
        **meta,
    )


@np.errstate(over="ignore", invalid="ignore")  # trial scales may overflow; verified below
def _recover(rows: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Scales and codes that decode to exactly ``rows`` (bitwise), or None."""
    target = rows.view(np.uint32)
    base = _scales(rows, qmax)
    scale = base.copy()
    codes = _codes(rows, scale, qmax)
    ok = np.all((codes * scale[:, None]).view(np.uint32) == target, axis=1)
    if ok.all():
        return scale, codes
    bad = np.flatnonzero(~ok)
    for step in range(1, SCALE_SEARCH_ULPS + 1):
        for direction in (np.float32(np.inf), np.float32(0)):
            if not bad.size:
                break
            trial = base[bad]
            for _ in range(step):
                trial = np.nextafter(trial, direction).astype(np.float32)
            usable = np.isfinite(trial) & (trial > 0)
            trial[~usable] = np.float32(1.0)
            c = _codes(rows[bad], trial, qmax)
            hit = np.all((c * trial[:, None]).view(np.uint32) == target[bad], axis=1)
            hit &= usable
            if hit.any():
                scale[bad[hit]] = trial[hit]
                codes[bad[hit]] = c[hit]
                bad = bad[~hit]
    return (scale, codes) if not bad.size else None


@np.errstate(over="ignore")  # code*scale near float32's max is inf, as in torch
def encode_tensor(
    x: np.ndarray,
    codec: str = "none",
    *,
    dtype: str | None = None,
    exact: bool = False,
    step: int = 0,
    micro: int = 0,
    flags: int = 0,
) -> TensorFrame:
    """Encode ``x`` as a TensorFrame with ``codec``.

    ``dtype`` names the wire dtype when the array's own is not it (``"bfloat16"`` for a
    ``uint16`` view). ``exact=True`` (wire v2) sends codes only if they decode to exactly
    ``x``, else the plain tensor with codec "none"; ``exact=False`` applies the rule (lossy).
    The payload of codec "none" is ``x``'s own memory when it is C-contiguous little-endian.
    """
    meta = {"step": step, "micro": micro, "flags": flags}
    x = np.asarray(x)
    if dtype is None:
        dtype = next(
            (
                name
                for name, (np_t, _) in DTYPES.items()
                if np.dtype(np_t) == x.dtype.newbyteorder("<") and name != "bfloat16"
            ),
            None,
        )
        if dtype is None:
            raise ValueError(
                f"numpy dtype {x.dtype} has no wire dtype (one of {sorted(DTYPES)}); "
                'pass dtype="bfloat16" with a uint16 view of a bfloat16 tensor'
            )
    elif dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    elif np.dtype(DTYPES[dtype][0]) != x.dtype.newbyteorder("<"):
        raise ValueError(
            f"wire dtype {dtype} needs a numpy {np.dtype(DTYPES[dtype][0])} array, got {x.dtype}"
        )
    if codec == "none":
        raw = np.ascontiguousarray(x, dtype=DTYPES[dtype][0])
        return TensorFrame(
            shape=tuple(x.shape),
            dtype=dtype,
            codec="none",
            parts=(raw.reshape(-1).view(np.uint8).data,),
            **meta,
        )
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r} is not one of {list(CODECS)}")
    if dtype != "float32":
        raise ValueError(
            f"codec {codec} takes float32 tensors, got {dtype}; cast first or use 'none'"
        )
    x = np.ascontiguousarray(x, dtype="<f4")
    if codec == "fp16":
        with np.errstate(over="ignore"):  # like a cast: past 65504 becomes inf
            half = x.astype("<f2")
        if exact and not np.array_equal(half.astype(np.float32).view(np.uint32), x.view(np.uint32)):
            return encode_tensor(x, "none", **meta)
        return TensorFrame(
            shape=tuple(x.shape),
            dtype="float32",
            codec="fp16",
            parts=(half.reshape(-1).view(np.uint8).data,),
            **meta,
        )
    bits, per_token = codec_bits(codec)
    qmax = 2 ** (bits - 1) - 1
    rows = _as_rows(x, per_token)
    if exact:
        if not np.all(np.isfinite(rows)):
            return encode_tensor(x, "none", **meta)
        found = _recover(rows, qmax)
        if found is None:
            return encode_tensor(x, "none", **meta)
        scale, codes = found
        u = (codes.reshape(-1) + np.float32(qmax)).astype(np.uint8)
    else:
        scale = _scales(rows, qmax)
        u = _unsigned(rows, scale, qmax)
    return _quantized_frame(x, bits, per_token, u, scale, meta)


@np.errstate(over="ignore")  # code*scale near float32's max is inf, as in torch
def decode_tensor(frame: TensorFrame) -> np.ndarray:
    """The tensor a frame carries (float32 for every codec but "none").

    Codec "none" returns a view of the payload (no copy; read-only when the payload is); bfloat16 comes back as
    ``uint16``. Raises WireError for bad scales or codes.
    """
    sizes = part_sizes(frame.shape, frame.dtype, frame.codec)
    views = [
        memoryview(p).cast("B") if memoryview(p).ndim != 1 else memoryview(p) for p in frame.parts
    ]
    if [v.nbytes for v in views] != sizes:
        raise WireError(
            "malformed", f"payload sizes {[v.nbytes for v in views]} do not match {sizes}"
        )
    if frame.codec == "none":
        arr = np.frombuffer(views[0], dtype=DTYPES[frame.dtype][0])
        if frame.dtype == "bool" and arr.size and int(arr.view(np.uint8).max()) > 1:
            raise WireError("malformed", "a bool tensor holds bytes other than 0 and 1")
        return arr.reshape(frame.shape)
    if frame.codec == "fp16":
        return np.frombuffer(views[0], dtype="<f2").astype(np.float32).reshape(frame.shape)
    bits, per_token = codec_bits(frame.codec)
    qmax = 2 ** (bits - 1) - 1
    scale = np.frombuffer(views[0], dtype="<f4")
    if scale.size and not (np.all(np.isfinite(scale)) and np.all(scale > 0)):
        raise WireError("malformed", "a codec scale is not a finite positive float")
    numel = frame.numel
    u = _unpack(np.frombuffer(views[1], dtype=np.uint8), numel, bits, qmax)
    codes = np.arange(256, dtype=np.float32) - np.float32(qmax)  # u -> code, exact
    if not per_token:
        # one gather: table[u] = fl(code * scale), the same float32 product as the rule's
        return (codes * scale[0])[u].reshape(frame.shape)
    d = frame.shape[-1]
    if d == 0:
        return codes[u].reshape(frame.shape)
    return (codes[u].reshape(-1, d) * scale[:, None]).reshape(frame.shape)


def wire_nbytes(shape: tuple[int, ...], codec: str) -> int:
    """Payload bytes of a float32 tensor of ``shape`` under ``codec`` (header excluded)."""
    return sum(part_sizes(tuple(shape), "float32", codec))
