"""Compressors: the shared rounding rule bit for bit, straight-through gradients, bottleneck
seeding and halves, spec parsing, refusal of the retired LayerNorm bottleneck."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from swarmp2p.runtime.torch.train.compression import (  # noqa: E402
    FixedQuantization,
    HalfPrecision,
    LearnedBottleneck,
    NoCompression,
    compressor_from_spec,
    fake_quantize,
    quantize,
)

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("per_token", [False, True])
def test_quantizer_matches_the_wire_codec_bit_for_bit(bits, per_token):
    from swarmp2p.wire import decode_tensor, encode_tensor

    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(3, 7, 33, generator=gen) * 5
    x[0, 0, :] = 0.0  # an all-zero token takes scale 1.0
    x[1, 2, 3] = 1e4  # an outlier channel
    x[2, 1, :] = 1e-45  # m / qmax underflows to 0: scale 1.0
    x[2, 2, :5] = -1e-3  # tiny negatives round to a zero code, which decodes to +0.0
    codec = f"tokint{bits}" if per_token else f"int{bits}"
    got = fake_quantize(x, bits, per_token=per_token).numpy()
    want = decode_tensor(encode_tensor(x.numpy(), codec))
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # and the wire carries what training computed, losslessly, as codes
    frame = encode_tensor(got, codec, exact=True)
    assert frame.codec == codec
    assert np.array_equal(decode_tensor(frame).view(np.uint32), got.view(np.uint32))


def test_quantize_rounds_half_to_even_and_clamps():
    # max 2.0 at 2 bits: qmax 1, scale 2.0; 1.0/2.0 = 0.5 rounds to 0, 3.0/2 = 1.5 would be 2
    codes, scale = quantize(torch.tensor([1.0, -1.0, 2.0, -2.0]), 2, per_token=False)
    assert scale.item() == 2.0
    assert codes.tolist() == [0.0, 0.0, 1.0, -1.0]
    assert not torch.signbit(codes).tolist()[1]  # +0.0, as the wire decodes a zero code
    codes, scale = quantize(torch.zeros(4), 8, per_token=False)
    assert scale.item() == 1.0 and codes.abs().sum().item() == 0


def test_quantize_rejects_bits_outside_2_to_8():
    with pytest.raises(ValueError, match=r"bits must be 2\.\.8, got 9"):
        quantize(torch.ones(2), 9, per_token=False)


def test_fixed_quantization_is_straight_through():
    x = torch.randn(4, 16, requires_grad=True)
    comp = FixedQuantization(4)
    y = comp(x)
    assert torch.equal(y, fake_quantize(x, 4, per_token=False))
    assert torch.unique(y.detach()).numel() <= 2**4 - 1
    (y * torch.arange(16.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(16.0).expand(4, 16))
    assert comp.payload_codec == "int4"
    assert list(comp.parameters()) == []


def test_half_precision_rounds_to_float16():
    x = torch.randn(5, 8) * 1000
    y = HalfPrecision()(x)
    assert torch.equal(y, x.half().float())
    assert HalfPrecision.payload_codec == "fp16"


def test_learned_bottleneck_seeded_by_boundary_index():
    a = LearnedBottleneck(48, 16, 8, boundary_index=1)
    torch.manual_seed(123)  # the process RNG plays no part
    b = LearnedBottleneck(48, 16, 8, boundary_index=1)
    c = LearnedBottleneck(48, 16, 8, boundary_index=2)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    assert not torch.equal(a.down.weight, c.down.weight)
    assert sorted(a.state_dict()) == ["down.bias", "down.weight", "up.bias", "up.weight"]


@pytest.mark.parametrize("code_bits", [4, 8, 16])
def test_learned_bottleneck_halves_compose_and_code_is_rounded(code_bits):
    comp = LearnedBottleneck(32, 8, code_bits, boundary_index=0)
    x = torch.randn(2, 5, 32)
    code = comp.sender()(x)
    assert code.shape == (2, 5, 8)
    raw = comp.down(x).detach()
    if code_bits == 16:
        assert torch.equal(code, raw.half().float())
        assert comp.payload_codec == "fp16"
    else:
        assert torch.equal(code, fake_quantize(raw, code_bits, per_token=True))
        assert comp.payload_codec == f"tokint{code_bits}"
    assert torch.equal(comp(x), comp.receiver()(code))
    assert {id(p) for p in comp.sender().parameters()} == {id(comp.down.weight), id(comp.down.bias)}
    assert {id(p) for p in comp.receiver().parameters()} == {id(comp.up.weight), id(comp.up.bias)}


def test_learned_bottleneck_gradient_reaches_both_halves():
    comp = LearnedBottleneck(32, 8, 8, boundary_index=0)
    x = torch.randn(3, 32, requires_grad=True)
    comp(x).pow(2).sum().backward()
    for p in [*comp.parameters(), x]:
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_set_projection_is_pca_reconstruction():
    comp = LearnedBottleneck(6, 6, 16, boundary_index=0)
    basis, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64))
    mean = torch.randn(6, dtype=torch.float64)
    comp.set_projection(mean, basis)
    x = torch.randn(10, 6)
    # full-rank orthonormal basis: reconstruction up to float16 code rounding
    torch.testing.assert_close(comp(x), x, atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match=r"basis \(6, 6\)"):
        comp.set_projection(mean, basis[:, :3])


def test_retired_layernorm_bottleneck_is_refused():
    comp = LearnedBottleneck(16, 8, 8, boundary_index=0)
    state = dict(comp.state_dict())
    state["down_norm.weight"] = torch.ones(16)
    with pytest.raises(ValueError, match="retrain the model"):
        comp.load_state_dict(state)
    comp.load_state_dict(LearnedBottleneck(16, 8, 8, boundary_index=3).state_dict())


@pytest.mark.parametrize(
    ("spec", "kind", "codec"),
    [
        (None, NoCompression, "none"),
        ("none", NoCompression, "none"),
        ("fp16", HalfPrecision, "fp16"),
        ("fixed_int2", FixedQuantization, "int2"),
        ("fixed_int8", FixedQuantization, "int8"),
        ({"method": "fixed_int4"}, FixedQuantization, "int4"),
        (
            {"method": "learned_bottleneck", "learned_dim": 16, "code_bits": 4},
            LearnedBottleneck,
            "tokint4",
        ),
        ("learned_bottleneck", LearnedBottleneck, "tokint8"),
    ],
)
def test_compressor_from_spec(spec, kind, codec):
    comp = compressor_from_spec(spec, 64, 0)
    assert type(comp) is kind and comp.payload_codec == codec


def test_default_learned_dim_is_half_width():
    assert compressor_from_spec("learned_bottleneck", 576, 0).k == 256
    assert compressor_from_spec("learned_bottleneck", 64, 0).k == 32


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("fixed_int9", "unknown compression 'fixed_int9'"),
        ("zstd", "unknown compression 'zstd'"),
        ({"method": "learned_bottleneck", "learned_dim": 0}, r"learned_dim must be in 1\.\.64"),
        ({"method": "learned_bottleneck", "code_bits": 12}, r"code_bits must be 2\.\.8 or 16"),
        (
            {"method": "learned_bottleneck", "dim": 3},
            r"unknown learned_bottleneck setting\(s\) \['dim'\]",
        ),
        ({"method": "fp16", "code_bits": 3}, "takes no settings"),
        ({"learned_dim": 3}, "method must be a string"),
    ],
)
def test_compressor_from_spec_rejects_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        compressor_from_spec(spec, 64, 0)


@pytest.mark.parametrize(
    ("spec", "kind", "codec"),
    [
        ("fixed_int4", FixedQuantization, "int4"),
        ("fp16", HalfPrecision, "fp16"),
        (
            {"method": "learned_bottleneck", "learned_dim": 64, "code_bits": 16},
            LearnedBottleneck,
            "fp16",
        ),
    ],
)
def test_compressor_from_a_plan_compression(spec, kind, codec):
    from swarmp2p.plan import parse_compression

    comp = compressor_from_spec(parse_compression(spec), 128, 1)
    assert type(comp) is kind and comp.payload_codec == codec


def test_the_runtime_reads_the_reference_spellings_and_calibration_tokens():
    """Issue 26 items 5 and 6: a learned spec with the reference's aliases or a
    calibration_tokens builds the bottleneck the canonical keys build."""
    spec = {"method": "learned_bottleneck", "bottleneck_dim": 16, "quantized": False}
    comp = compressor_from_spec(spec, 64, 0)
    assert (comp.k, comp.code_bits, comp.payload_codec) == (16, 16, "fp16")
    bits = {"method": "learned_bottleneck", "quantization_bits": 4, "calibration_tokens": 99}
    assert compressor_from_spec(bits, 64, 0).code_bits == 4
    with pytest.raises(ValueError, match="quantization_bits"):
        compressor_from_spec({**bits, "quantized": False}, 64, 0)
