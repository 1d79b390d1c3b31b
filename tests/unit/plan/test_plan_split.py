"""Boundaries, per-boundary compression and layer ranges."""

from __future__ import annotations

import pytest

from swarmp2p.plan import Compression, SplitSpec, layer_range, parse_compression


@pytest.mark.parametrize(
    ("n", "layers", "ranges"),
    [
        (1, 30, [(0, 30)]),
        (2, 30, [(0, 15), (15, 30)]),
        (4, 30, [(0, 7), (7, 15), (15, 22), (22, 30)]),
        (3, 3, [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_layer_range(n, layers, ranges):
    assert [layer_range(i, n, layers) for i in range(n)] == ranges


@pytest.mark.parametrize(("i", "n", "layers"), [(0, 4, 3), (2, 2, 8), (0, 0, 8)])
def test_layer_range_rejects(i, n, layers):
    with pytest.raises(ValueError):
        layer_range(i, n, layers)


@pytest.mark.parametrize(
    ("spec", "hidden", "dtype", "expected"),
    [
        ("none", 576, "float32", 4 * 576),
        ("none", 576, "bfloat16", 2 * 576),
        ("fp16", 576, "float32", 2 * 576),
        ("fixed_int8", 576, "float32", 576 + 4),
        ("fixed_int4", 576, "float32", 288 + 4),
        ("fixed_int2", 576, "float32", 144 + 4),
        ("fixed_int3", 577, "float32", 289 + 4),  # 3-bit codes in 4-bit slots, 2 a byte
        ("fixed_int5", 576, "float32", 576 + 4),  # 5-bit codes in 8-bit slots
        ("fixed_int8", 576, "bfloat16", 2 * 576),  # a bfloat16 payload crosses raw
        ({"method": "learned_bottleneck", "learned_dim": 256, "code_bits": 8}, 576, "float32", 260),
        (
            {"method": "learned_bottleneck", "learned_dim": 256, "code_bits": 16},
            576,
            "float32",
            512,
        ),
        ({"method": "learned_bottleneck"}, 5120, "float32", 2560 + 4),
    ],
)
def test_bytes_per_token(spec, hidden, dtype, expected):
    assert parse_compression(spec).bytes_per_token(hidden, dtype) == expected


def test_int8_is_about_a_quarter_of_float32():
    d = 4096
    ratio = parse_compression("fixed_int8").bytes_per_token(d, "float32") / (4 * d)
    assert 0.25 < ratio < 0.251


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("fixed_int9", "fixed_int2"),
        ("int8", "must be"),
        (
            {"method": "learned_bottleneck", "code_bits": 9},
            "code_bits: must be one of 2, 3, 4, 5, 6, 7, 8, 16",
        ),
        ({"method": "learned_bottleneck", "learned_dim": 0}, "learned_dim"),
        ({"method": "learned_bottleneck", "dim": 64}, ".dim: unknown key"),
        ({"method": "pca"}, "method: must be"),
        (8, "must be a string or an object"),
    ],
)
def test_bad_compression(spec, fragment):
    with pytest.raises(ValueError) as info:
        parse_compression(spec, "split.compression")
    assert fragment in str(info.value)
    assert str(info.value).startswith("split.compression")


def test_split_spec_stages_and_compression():
    comp = (parse_compression("fixed_int8"), parse_compression("fp16"))
    spec = SplitSpec(n_layers=10, boundaries=(3, 7), compression=comp)
    assert spec.n_stages == 3
    assert [spec.layer_range(i) for i in range(3)] == [(0, 3), (3, 7), (7, 10)]
    assert spec.compression_at(1).method == "fp16"
    middle = spec.stage(1)
    assert (middle.receive_boundary, middle.send_boundary) == (0, 1)
    assert middle.receive_compression == comp[0] and middle.send_compression == comp[1]
    first, last = spec.stage(0), spec.stage(2)
    assert first.is_first and first.receive_boundary is None
    assert last.is_last and last.send_boundary is None


def test_split_spec_defaults_to_no_compression():
    spec = SplitSpec.even(8, 2)
    assert spec.boundaries == (4,)
    assert spec.compression_at(0) == Compression(method="none")


@pytest.mark.parametrize(
    ("boundaries", "compression"),
    [((5, 3), ()), ((0,), ()), ((10,), ()), ((4,), (Compression(method="fp16"),) * 2)],
)
def test_split_spec_rejects(boundaries, compression):
    with pytest.raises(ValueError):
        SplitSpec(n_layers=10, boundaries=boundaries, compression=compression)
