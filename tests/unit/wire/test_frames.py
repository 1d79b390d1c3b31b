"""TensorFrame: header validation, every length checked, caps before allocation, zero copy."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmp2p.wire import PROTOCOL_VERSION, WireError
from swarmp2p.wire.codec import CODECS, decode_tensor, encode_tensor
from swarmp2p.wire.frames import DTYPES, MAX_DIM, TensorFrame, pack_parts, unpack_parts

NUMPY_OF = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "int64": np.int64,
    "int32": np.int32,
    "uint8": np.uint8,
    "int8": np.int8,
    "bool": np.bool_,
}


def header(**over) -> bytes:
    base = {
        "v": PROTOCOL_VERSION,
        "shape": [2, 3],
        "dtype": "float32",
        "codec": "none",
        "step": 0,
        "micro": 0,
        "flags": 0,
    }
    base.update(over)
    return msgpack.packb(base)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_dtype_round_trips_with_metadata(dtype):
    rng = np.random.default_rng(3)
    x = (
        rng.integers(0, 2, size=(4, 5)).astype(NUMPY_OF[dtype])
        if dtype == "bool"
        else rng.integers(-100, 100, size=(4, 5)).astype(NUMPY_OF[dtype])
    )
    frame = encode_tensor(x, dtype=dtype if dtype == "bfloat16" else None, step=7, micro=3, flags=5)
    assert frame.dtype == dtype
    back = TensorFrame.from_parts([bytes(memoryview(p)) for p in frame.to_parts()])
    assert (back.step, back.micro, back.flags, back.shape, back.dtype) == (7, 3, 5, (4, 5), dtype)
    out = decode_tensor(back)
    assert out.dtype == np.dtype(NUMPY_OF[dtype]) and np.array_equal(out, x)


def test_bfloat16_bits_are_carried_verbatim():
    f32 = np.array([1.0, -2.5, 3.14159, 1e30], np.float32)
    bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16)  # truncation: some bf16 values
    out = decode_tensor(TensorFrame.from_parts(encode_tensor(bf16, dtype="bfloat16").to_parts()))
    assert out.dtype == np.uint16 and np.array_equal(out, bf16)


def test_raw_payload_is_not_copied():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    frame = encode_tensor(x)
    assert np.shares_memory(np.frombuffer(frame.parts[0], np.uint8), x)
    out = decode_tensor(TensorFrame.from_parts(frame.to_parts()))
    assert np.shares_memory(out, x)


@pytest.mark.parametrize(
    ("hdr", "parts", "code", "fragment"),
    [
        (header(), [b"\x00" * 23], "malformed", "part 0 is 23 bytes"),
        (header(), [b"\x00" * 25], "malformed", "part 0 is 25 bytes"),
        (header(), [], "malformed", "1 payload part"),
        (header(), [b"\x00" * 24, b""], "malformed", "got 2"),
        (header(shape=[2, -3]), [b""], "bad_field", "bad dimension"),
        (header(shape=[MAX_DIM + 1]), [b""], "bad_field", "bad dimension"),
        (header(shape=[2**31 - 1] * 3), [b""], "bad_field", "elements"),
        (header(shape=[1] * 9), [b""], "bad_field", "at most 8 dims"),
        (header(shape=[2, "3"]), [b""], "bad_field", "bad dimension"),
        (header(dtype="float64"), [b""], "bad_field", "dtype 'float64'"),
        (header(codec="zip"), [b""], "bad_field", "codec 'zip'"),
        (header(codec="int8", dtype="float16"), [b""], "bad_field", "must use 'none'"),
        (header(step=-1), [b""], "bad_field", "step"),
        (header(flags=1.5), [b""], "bad_field", "flags"),
        (header(v=PROTOCOL_VERSION + 1), [b""], "version", "version"),
        (header(extra=1), [b""], "bad_field", "unknown ['extra']"),
        (msgpack.packb({"v": 1}), [b""], "bad_field", "missing"),
        (msgpack.packb([1, 2]), [b""], "malformed", "map"),
        (header() + b"\x00", [b"\x00" * 24], "malformed", "extra data"),
        (b"\x00" * 2000, [b""], "too_large", "cap"),
    ],
)
def test_bad_frames(hdr, parts, code, fragment):
    with pytest.raises(WireError) as err:
        TensorFrame.from_parts([hdr, *parts])
    assert err.value.code == code
    assert fragment in str(err.value)


def test_bool_payload_must_be_zero_or_one():
    frame = TensorFrame.from_parts([header(dtype="bool", shape=[3]), b"\x00\x01\x02"])
    with pytest.raises(WireError, match="bool"):
        decode_tensor(frame)


def test_pack_parts_round_trip_and_strictness():
    parts = [b"head", b"", b"\x00" * 1000]
    packed = pack_parts(parts)
    assert [bytes(p) for p in unpack_parts(packed)] == parts
    for bad, fragment in [
        (packed + b"x", "trailing"),
        (packed[:-1], "only 999 present"),
        (packed[:6], "cut off"),
        (b"\x00\x00", "4-byte count"),
        (b"\xff\xff\xff\xff", "at most"),
    ]:
        with pytest.raises(WireError, match=fragment):
            unpack_parts(bad)


_shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(DTYPES)), _shapes, st.data())
def test_raw_frames_round_trip(dtype, shape, data):
    x = data.draw(hnp.arrays(NUMPY_OF[dtype], shape))
    frame = encode_tensor(x, dtype="bfloat16" if dtype == "bfloat16" else None)
    wire = pack_parts(frame.to_parts())
    out = decode_tensor(TensorFrame.from_parts(unpack_parts(wire)))
    assert out.shape == x.shape
    assert out.tobytes() == np.ascontiguousarray(x).tobytes()


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(CODECS), st.data())
def test_mutated_and_truncated_frames_give_wire_errors(codec, data):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=5))
    x = data.draw(hnp.arrays(np.float32, shape, elements=st.floats(-100, 100, width=32)))
    wire = bytearray(pack_parts(encode_tensor(x, codec).to_parts()))
    for pos, val in data.draw(
        st.lists(st.tuples(st.integers(0, len(wire) - 1), st.integers(0, 255)), max_size=4)
    ):
        wire[pos] = val
    cut = data.draw(st.integers(0, len(wire)))
    try:
        frame = TensorFrame.from_parts(unpack_parts(bytes(wire[:cut])))
        out = decode_tensor(frame)
    except WireError:
        return
    assert out.shape == frame.shape  # a mutation may still be a valid frame


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=4))
def test_random_parts_give_wire_errors(parts):
    try:
        decode_tensor(TensorFrame.from_parts(parts))
    except WireError:
        pass
