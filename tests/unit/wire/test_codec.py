"""Codecs: the documented rule, packing, lossless wire v2 re-encoding, hypothesis round trips."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmp2p.wire import WireError
from swarmp2p.wire.codec import (
    CODECS,
    codec_bits,
    decode_tensor,
    dequantize,
    encode_tensor,
    fake_quantize,
    packed_nbytes,
    quantize,
    wire_nbytes,
)
from swarmp2p.wire.frames import TensorFrame

QUANT = [c for c in CODECS if "int" in c]


def bits_of(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def round_trip(frame: TensorFrame) -> np.ndarray:
    wire = [bytes(memoryview(p)) for p in frame.to_parts()]
    return decode_tensor(TensorFrame.from_parts(wire))


def test_rule_by_hand_int4():
    x = np.array([0.7, -0.7, 0.05, 0.15, -0.25, 0.35], dtype=np.float32)
    codes, scale = quantize(x, 4)
    assert scale.dtype == np.float32 and scale[0] == np.float32(0.7) / np.float32(7)
    # x / scale = 7, -7, 0.5, 1.5, -2.5, 3.5 (in float32) -> half to even: 0, 2, -2, 4
    expect = np.rint(x / scale[0])
    assert codes.tolist() == expect.astype(int).tolist()
    assert codes[2] == 0 or abs(x[2] / scale[0] - 0.5) > 1e-6
    assert np.array_equal(
        bits_of(dequantize(codes, scale)), bits_of(codes.astype(np.float32) * scale[0])
    )


def test_half_to_even_on_exact_halves():
    x = np.array([1.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.0], dtype=np.float32)  # scale = 3/3 = 1
    codes, scale = quantize(x, 3)
    assert scale[0] == 1.0
    assert codes.tolist() == [1, 0, 2, 2, 0, -2, 3]


def test_zero_tensor_scale_is_one_and_decodes_positive_zero():
    codes, scale = quantize(np.zeros(5, np.float32), 8)
    assert scale[0] == 1.0 and not codes.any()
    out = round_trip(encode_tensor(np.zeros(5, np.float32), "int8"))
    assert np.array_equal(bits_of(out), np.zeros(5, np.uint32))


def test_per_token_scales_are_per_row():
    x = np.array([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [100.0, 1.0, -50.0]], dtype=np.float32)
    codes, scale = quantize(x, 8, per_token=True)
    assert scale.tolist() == [np.float32(2.0) / 127, 1.0, np.float32(100.0) / 127]
    assert codes[0, 1] == -127 and codes[2, 0] == 127


def test_non_finite_and_wrong_dtype_are_refused():
    with pytest.raises(ValueError, match="inf or nan"):
        encode_tensor(np.array([1.0, np.inf], np.float32), "int8")
    with pytest.raises(ValueError, match="float32"):
        encode_tensor(np.ones(3, np.float64), "int8")
    with pytest.raises(ValueError, match="not one of"):
        encode_tensor(np.ones(3, np.float32), "int9")
    with pytest.raises(ValueError, match="bfloat16"):
        encode_tensor(np.ones(3, np.uint16))


@pytest.mark.parametrize(("bits", "per_byte"), [(2, 4), (3, 2), (4, 2), (5, 1), (8, 1)])
def test_packing_density(bits, per_byte):
    assert packed_nbytes(9, bits) == -(-9 // per_byte)
    frame = encode_tensor(np.linspace(-1, 1, 9, dtype=np.float32), f"int{bits}")
    assert memoryview(frame.parts[1]).nbytes == -(-9 // per_byte)


def test_int2_packing_bit_layout():
    x = np.array([-1.0, 0.0, 1.0, 1.0, -1.0], dtype=np.float32)  # codes -1,0,1,1,-1 -> u 0,1,2,2,0
    packed = bytes(encode_tensor(x, "int2").parts[1])
    assert packed == bytes([0 | 1 << 2 | 2 << 4 | 2 << 6, 0])


def test_wire_bytes_per_token():
    d, t = 576, 4096
    assert wire_nbytes((1, d), "tokint8") / (4 * d) == (d + 4) / (4 * d)
    assert wire_nbytes((1, d), "int8") / (4 * d) == (d + 4) / (4 * d)
    assert wire_nbytes((t, d), "int4") == 4 + t * d // 2
    assert wire_nbytes((t, d), "fp16") == 2 * t * d


@pytest.mark.parametrize("codec", QUANT)
def test_decoder_rejects_bad_codes_scales_and_padding(codec):
    bits, _ = codec_bits(codec)
    qmax = 2 ** (bits - 1) - 1
    frame = encode_tensor(np.linspace(-1, 1, 7, dtype=np.float32).reshape(1, 7), codec)
    scales, packed = (bytearray(bytes(p)) for p in frame.parts)
    for bad_scale in (0.0, -1.0, np.inf, np.nan):
        s = np.frombuffer(bytes(scales), "<f4").copy()
        s[0] = bad_scale
        with pytest.raises(WireError, match="scale"):
            decode_tensor(
                TensorFrame(
                    shape=frame.shape,
                    dtype="float32",
                    codec=codec,
                    parts=(s.tobytes(), bytes(packed)),
                )
            )
    width = 2 if bits <= 2 else 4 if bits <= 4 else 8
    if 2 * qmax + 1 < 2**width:  # an out-of-range code is representable: it must be refused
        bad = bytearray(packed)
        bad[0] = (bad[0] & ~((1 << width) - 1) & 0xFF) | (2 * qmax + 1)
        with pytest.raises(WireError, match="above"):
            decode_tensor(
                TensorFrame(
                    shape=frame.shape,
                    dtype="float32",
                    codec=codec,
                    parts=(bytes(scales), bytes(bad)),
                )
            )
    if width < 8:  # 7 codes leave padding in the last byte
        bad = bytearray(packed)
        bad[-1] |= 1 << (8 - width)
        with pytest.raises(WireError, match="padding"):
            decode_tensor(
                TensorFrame(
                    shape=frame.shape,
                    dtype="float32",
                    codec=codec,
                    parts=(bytes(scales), bytes(bad)),
                )
            )


# --- hypothesis -------------------------------------------------------------------------------

_shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=9)
_finite = st.floats(width=32, allow_nan=False, allow_infinity=False)


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_round_trips(codec):
    @settings(max_examples=60, deadline=None)
    @given(hnp.arrays(np.float32, _shapes, elements=_finite))
    def check(x):
        out = round_trip(encode_tensor(x, codec))
        assert out.shape == x.shape and out.dtype == np.float32
        if codec == "none":
            expect = x
        elif codec == "fp16":
            with np.errstate(over="ignore"):
                expect = x.astype(np.float16).astype(np.float32)
        else:
            bits, per_token = codec_bits(codec)
            expect = fake_quantize(x, bits, per_token=per_token)
        assert np.array_equal(bits_of(out), bits_of(expect))

    check()


@st.composite
def quantized(draw):
    """A tensor that already holds only quantized values: code * scale for random scales."""
    bits = draw(st.integers(2, 8))
    per_token = draw(st.booleans())
    qmax = 2 ** (bits - 1) - 1
    rows = draw(st.integers(1, 6))
    d = draw(st.integers(1, 20))
    exps = draw(st.lists(st.floats(-35, 35), min_size=rows, max_size=rows))
    mant = draw(st.lists(st.floats(1, 2), min_size=rows, max_size=rows))
    scales = (np.array(mant) * 10.0 ** np.array(exps)).astype(np.float32)
    if not per_token:
        scales[:] = scales[0]
    codes = np.array(
        draw(st.lists(st.integers(-qmax, qmax), min_size=rows * d, max_size=rows * d)),
        dtype=np.float32,
    ).reshape(rows, d)
    top = draw(st.lists(st.sampled_from([-qmax, qmax]), min_size=rows, max_size=rows))
    codes[:, 0] = top  # the rule puts each row's (or the tensor's) max magnitude at ±qmax
    if not per_token:
        codes[1:, 0] = codes[1:, 1] if d > 1 else codes[1:, 0]
    x = (codes * scales[:, None]).astype(np.float32)
    return x, f"{'tok' if per_token else ''}int{bits}"


@settings(max_examples=400, deadline=None)
@given(quantized())
def test_lossless_reencoding_is_exact(case):
    x, codec = case
    frame = encode_tensor(x, codec, exact=True)
    assert frame.codec == codec  # found a scale: codes cross, not floats
    assert np.array_equal(bits_of(round_trip(frame)), bits_of(x))


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(np.float32, _shapes, elements=_finite), st.sampled_from(QUANT))
def test_lossless_of_a_fake_quantized_tensor(x, codec):
    """The realistic input: the training-side quantizer's output, re-encoded on the wire."""
    bits, per_token = codec_bits(codec)
    q = fake_quantize(x, bits, per_token=per_token)
    frame = encode_tensor(q, codec, exact=True)
    assert np.array_equal(bits_of(round_trip(frame)), bits_of(q))
    assert frame.codec == codec or q.size == 0 or not np.isfinite(q).all()  # inf: see codec doc


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(np.float32, _shapes, elements=_finite), st.sampled_from([*QUANT, "fp16"]))
def test_exact_never_loses_anything(x, codec):
    """Whatever the input, exact=True delivers x bit for bit (falling back to plain floats)."""
    frame = encode_tensor(x, codec, exact=True)
    assert frame.codec in (codec, "none")
    assert np.array_equal(bits_of(round_trip(frame)), bits_of(x))


def test_exact_falls_back_on_negative_zero_and_on_unquantized_data():
    q = fake_quantize(np.array([0.3, -1.0, 0.001], np.float32), 8)
    q[2] = -0.0
    assert encode_tensor(q, "int8", exact=True).codec == "none"
    noisy = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    assert encode_tensor(noisy, "int8", exact=True).codec == "none"
