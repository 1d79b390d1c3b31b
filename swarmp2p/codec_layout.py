"""The codec layout: which codec a boundary sends with, how its codes are packed, and how many
bytes a frame of it has. Standard library only.

One source for both sides of a boundary's price: the planner (``swarmp2p.plan``) prices a
boundary's link traffic with :func:`frame_nbytes`, and the wire (``swarmp2p.wire.frames`` and
``swarmp2p.wire.codec``) lays out and packs the very frames it sends with the same functions, so
a planned byte count is the byte count of a real frame (tests/unit/plan/test_wire_price.py).

Packing: an N-bit code sits in a 2-, 4- or 8-bit slot (:func:`slot_bits`): four codes a byte up
to 2 bits, two up to 4 bits, one a byte above. ``fixed_int3`` therefore costs what ``fixed_int4``
costs, and ``fixed_int5``..``fixed_int7`` what ``fixed_int8`` costs.
"""

from __future__ import annotations

DTYPES: dict[str, tuple[str, int]] = {
    "float32": ("<f4", 4),
    "float16": ("<f2", 2),
    "bfloat16": ("<u2", 2),
    "int64": ("<i8", 8),
    "int32": ("<i4", 4),
    "uint8": ("|u1", 1),
    "int8": ("|i1", 1),
    "bool": ("|b1", 1),
}
"""Wire dtype name -> (numpy dtype string, item size). bfloat16 is carried as uint16."""

CODECS = (
    "none",
    "fp16",
    *(f"int{n}" for n in range(2, 9)),
    *(f"tokint{n}" for n in range(2, 9)),
)
"""Every codec name a TensorFrame may carry."""

SCALE_BYTES = 4
"""A quantizing codec's scale is one float32 (one a frame for intN, one a token for tokintN)."""


def codec_bits(codec: str) -> tuple[int, bool]:
    """``("int4") -> (4, False)``, ``("tokint8") -> (8, True)``; ValueError for other names."""
    for prefix, per_token in (("tokint", True), ("int", False)):
        if codec.startswith(prefix) and codec[len(prefix) :].isdigit():
            bits = int(codec[len(prefix) :])
            if 2 <= bits <= 8 and codec == f"{prefix}{bits}":
                return bits, per_token
    raise ValueError(f"codec {codec!r} is not a quantizing codec; use one of {list(CODECS[2:])}")


def slot_bits(bits: int) -> int:
    """The slot an N-bit code is packed into: 2 (N <= 2), 4 (N <= 4) or 8 bits."""
    if not 2 <= bits <= 8:
        raise ValueError(f"code bits must be in 2..8, got {bits!r}")
    return 2 if bits <= 2 else 4 if bits <= 4 else 8


def codes_per_byte(bits: int) -> int:
    """How many N-bit codes one byte holds (8 over the slot width)."""
    return 8 // slot_bits(bits)


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` packed ``bits``-bit codes (the last byte zero-padded)."""
    per = codes_per_byte(bits)
    return -(-numel // per)


def rows_of(shape: tuple[int, ...]) -> int:
    """Rows over the last dimension (the tokens of an activation); a per-token codec's scales."""
    if not shape:
        raise ValueError("a per-token codec needs a tensor with at least one dimension")
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows


def part_sizes(shape: tuple[int, ...], dtype: str, codec: str) -> list[int]:
    """Payload part sizes for a frame; ValueError naming the bad dtype/codec pair."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    numel = 1
    for d in shape:
        numel *= d
    if codec == "none":
        return [numel * DTYPES[dtype][1]]
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r} is not one of {list(CODECS)}")
    if dtype != "float32":
        raise ValueError(
            f"codec {codec} decodes to float32; a frame with dtype {dtype} must use 'none'"
        )
    if codec == "fp16":
        return [numel * 2]
    bits, per_token = codec_bits(codec)
    rows = rows_of(shape) if per_token else 1
    return [rows * SCALE_BYTES, packed_nbytes(numel, bits)]


def frame_nbytes(shape: tuple[int, ...], dtype: str, codec: str) -> int:
    """Payload bytes of a frame (header excluded): what the planner prices a boundary at."""
    return sum(part_sizes(tuple(shape), dtype, codec))


def compression_codec(method: str, bits: int = 0) -> str:
    """The codec a boundary compression's payload crosses with on wire v2.

    ``method`` "none", "fp16", "fixed" (``bits`` 2..8: one scale a tensor, ``intN``) or
    "learned_bottleneck" (``bits`` the code bits: 2..8 ``tokintN``, one scale a token; 16
    ``fp16``). The runtime's compressors and the planner both name their codec with this.
    """
    if method in ("none", "fp16"):
        return method
    if method == "fixed":
        slot_bits(bits)  # refuses a width the wire has no codec for
        return f"int{bits}"
    if method == "learned_bottleneck":
        if bits == 16:
            return "fp16"
        slot_bits(bits)
        return f"tokint{bits}"
    raise ValueError(
        f"compression method {method!r} is not none, fp16, fixed or learned_bottleneck"
    )


def sent_codec(codec: str, dtype: str) -> str:
    """The codec a payload of ``dtype`` actually crosses with when ``codec`` is asked for: the
    quantizing codecs and fp16 take float32 tensors, so a payload of any other dtype (a bfloat16
    or float16 stage's) goes as its raw values ("none")."""
    if codec != "none" and dtype != "float32":
        return "none"
    return codec
