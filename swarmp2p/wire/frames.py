"""TensorFrame: a small msgpack header plus raw payload parts, sent as one ZeroMQ multipart.

Multipart layout: ``[header, part 0, part 1, ...]``. The header is a msgpack map
``{"v", "shape", "dtype", "codec", "step", "micro", "flags"}``; the number and the length of
the parts follow from (shape, dtype, codec) alone, see :func:`swarmp2p.wire.codec.part_sizes`,
and :meth:`TensorFrame.from_parts` checks every one against the bytes present before anything
is allocated. All numbers are little-endian. bfloat16 travels as its raw 2-byte values
(numpy has no bfloat16: the array side is a ``uint16`` view).

:func:`pack_parts` / :func:`unpack_parts` put a multipart message into one buffer
(``!I count``, then ``!I length`` + bytes per part) for transports without framing; the
unpacker validates every length and rejects trailing bytes.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from typing import Any

import msgpack

from swarmp2p.codec_layout import (
    CODECS,
    DTYPES,
    codec_bits,
    codes_per_byte,
    packed_nbytes,
    part_sizes,
    rows_of,
)
from swarmp2p.wire.messages import PROTOCOL_VERSION, WireError, unpack_plain

# the layout (codec names, bit widths, slots, part sizes) lives in swarmp2p.codec_layout, which
# the planner prices boundaries with; re-exported here
__all__ = [
    "CODECS",
    "DTYPES",
    "TensorFrame",
    "codec_bits",
    "codes_per_byte",
    "pack_parts",
    "packed_nbytes",
    "part_sizes",
    "rows_of",
    "unpack_parts",
]

Buffer = bytes | bytearray | memoryview

MAX_HEADER_BYTES = 1024
"""Largest frame header; a header is a few dozen bytes."""
MAX_NDIM = 8
MAX_DIM = 2**31 - 1
MAX_ELEMENTS = 2**33
"""Caps on a frame's shape, checked before the payload is looked at."""
MAX_PARTS = 8
MAX_U64 = 2**64 - 1

_HEADER_KEYS = frozenset({"v", "shape", "dtype", "codec", "step", "micro", "flags"})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorFrame:
    """One tensor on a data link: its header fields and its payload parts (not copied)."""

    shape: tuple[int, ...]
    dtype: str
    """Wire dtype of the decoded tensor (a key of :data:`DTYPES`)."""
    codec: str = "none"
    """How the payload encodes it: "none", "fp16", "int2".."int8", "tokint2".."tokint8"."""
    step: int = 0
    micro: int = 0
    """Micro-batch id within the step; replies are matched by (step, micro)."""
    flags: int = 0
    """Bits the runtime defines (e.g. forward/backward/eval); carried, not interpreted."""
    parts: tuple[Buffer, ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Payload bytes (excluding the header)."""
        return sum(memoryview(p).nbytes for p in self.parts)

    def header(self) -> bytes:
        """The msgpack header."""
        return msgpack.packb(
            {
                "v": PROTOCOL_VERSION,
                "shape": list(self.shape),
                "dtype": self.dtype,
                "codec": self.codec,
                "step": self.step,
                "micro": self.micro,
                "flags": self.flags,
            },
            use_bin_type=True,
        )

    def to_parts(self) -> list[Buffer]:
        """``[header, *payload parts]``, ready for ``send_multipart(copy=False)``."""
        return [self.header(), *self.parts]

    @classmethod
    def from_parts(cls, parts: Sequence[Any]) -> TensorFrame:
        """Parse and validate ``[header, *payload]``; raises WireError on anything wrong.

        Parts may be bytes, memoryviews or ``zmq.Frame`` objects (their buffer is used
        without copying).
        """
        if not 1 <= len(parts) <= MAX_PARTS + 1:
            raise WireError(
                "malformed", f"a tensor frame has 1..{MAX_PARTS + 1} parts, got {len(parts)}"
            )
        views = [_view(p) for p in parts]
        fields = _parse_header(views[0])
        try:
            expected = part_sizes(fields["shape"], fields["dtype"], fields["codec"])
        except ValueError as e:
            raise WireError("bad_field", str(e)) from None
        payload = views[1:]
        if len(payload) != len(expected):
            raise WireError(
                "malformed",
                f"codec {fields['codec']} carries {len(expected)} payload part(s), got {len(payload)}",
            )
        for i, (view, size) in enumerate(zip(payload, expected)):
            if view.nbytes != size:
                raise WireError(
                    "malformed",
                    f"payload part {i} is {view.nbytes} bytes, shape {list(fields['shape'])} "
                    f"{fields['dtype']} with codec {fields['codec']} needs {size}",
                )
        return cls(**fields, parts=tuple(payload))


def _view(part: Any) -> memoryview:
    buf = getattr(part, "buffer", part)  # zmq.Frame
    try:
        view = memoryview(buf)
    except TypeError:
        raise WireError(
            "malformed", f"a frame part must be a buffer, got {type(part).__name__}"
        ) from None
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def _parse_header(view: memoryview) -> dict[str, Any]:
    obj = unpack_plain(bytes(view), max_bytes=MAX_HEADER_BYTES)
    if type(obj) is not dict:
        raise WireError("malformed", f"a frame header is a msgpack map, got {type(obj).__name__}")
    keys = set(obj)
    if keys != _HEADER_KEYS:
        missing, extra = sorted(_HEADER_KEYS - keys), sorted(map(str, keys - _HEADER_KEYS))
        raise WireError("bad_field", f"frame header: missing {missing}, unknown {extra}")
    version = obj["v"]
    if type(version) is not int or not 1 <= version <= PROTOCOL_VERSION:
        raise WireError(
            "version",
            f"frame is protocol version {version!r}, this node speaks 1..{PROTOCOL_VERSION}",
        )
    shape = obj["shape"]
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise WireError(
            "bad_field", f"frame shape must be a list of at most {MAX_NDIM} dims, got {shape!r:.80}"
        )
    numel = 1
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_DIM:
            raise WireError("bad_field", f"frame shape {shape!r:.80} has a bad dimension {d!r:.20}")
        numel *= d
    if numel > MAX_ELEMENTS:
        raise WireError(
            "bad_field", f"frame shape {shape!r} holds {numel} elements, over {MAX_ELEMENTS}"
        )
    for key in ("dtype", "codec"):
        if type(obj[key]) is not str:
            raise WireError("bad_field", f"frame {key} must be a string, got {obj[key]!r:.40}")
    if obj["dtype"] not in DTYPES:
        raise WireError(
            "bad_field", f"frame dtype {obj['dtype']!r:.40} is not one of {sorted(DTYPES)}"
        )
    for key in ("step", "micro", "flags"):
        if type(obj[key]) is not int or not 0 <= obj[key] <= MAX_U64:
            raise WireError(
                "bad_field", f"frame {key} must be an integer in 0..2**64-1, got {obj[key]!r:.40}"
            )
    return {
        "shape": tuple(shape),
        "dtype": obj["dtype"],
        "codec": obj["codec"],
        "step": obj["step"],
        "micro": obj["micro"],
        "flags": obj["flags"],
    }


_COUNT = struct.Struct("!I")


def pack_parts(parts: Sequence[Buffer]) -> bytes:
    """One buffer: ``!I count``, then ``!I length`` + bytes for each part."""
    out = [_COUNT.pack(len(parts))]
    for p in parts:
        view = memoryview(p).cast("B") if memoryview(p).ndim != 1 else memoryview(p)
        out.append(_COUNT.pack(view.nbytes))
        out.append(bytes(view))
    return b"".join(out)


def unpack_parts(data: Buffer, max_parts: int = MAX_PARTS + 1) -> list[memoryview]:
    """Inverse of :func:`pack_parts`; every length checked against the bytes present."""
    view = memoryview(data).cast("B") if memoryview(data).ndim != 1 else memoryview(data)
    if view.nbytes < 4:
        raise WireError("malformed", f"packed parts need a 4-byte count, got {view.nbytes} bytes")
    (count,) = _COUNT.unpack_from(view, 0)
    if count > max_parts:
        raise WireError(
            "malformed", f"packed message has {count} parts, at most {max_parts} allowed"
        )
    pos, parts = 4, []
    for i in range(count):
        if pos + 4 > view.nbytes:
            raise WireError("malformed", f"packed part {i}: length cut off at byte {pos}")
        (size,) = _COUNT.unpack_from(view, pos)
        pos += 4
        if pos + size > view.nbytes:
            raise WireError(
                "malformed",
                f"packed part {i} claims {size} bytes, only {view.nbytes - pos} present",
            )
        parts.append(view[pos : pos + size])
        pos += size
    if pos != view.nbytes:
        raise WireError(
            "malformed", f"{view.nbytes - pos} trailing bytes after {count} packed parts"
        )
    return parts
