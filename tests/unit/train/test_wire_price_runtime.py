"""What a training boundary really sends is what the planner prices (issue 26 item 4): the
stage's own compressor runs its sender half, ``boundary.to_frame`` encodes the payload as a
training step does, and the frame's bytes equal ``Compression.frame_bytes`` for every codec, at
several widths, in float32 (codes cross) and bfloat16 (the payload crosses raw)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from swarmp2p.plan.split import parse_compression  # noqa: E402
from swarmp2p.runtime.torch.train.boundary import to_frame  # noqa: E402
from swarmp2p.runtime.torch.train.compression import compressor_from_spec  # noqa: E402

pytestmark = pytest.mark.torch

SPECS = [
    "none",
    "fp16",
    *(f"fixed_int{n}" for n in range(2, 9)),
    *(
        {"method": "learned_bottleneck", "learned_dim": 64, "code_bits": b}
        for b in (2, 3, 4, 5, 6, 7, 8, 16)
    ),
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("hidden", [576, 577, 2048])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_the_frame_a_stage_sends_has_the_planned_bytes(spec, hidden, dtype):
    plan = parse_compression(spec)
    comp = compressor_from_spec(plan, hidden, 0).to(DTYPES[dtype])
    x = torch.randn(2, 5, hidden, generator=torch.Generator().manual_seed(1)).to(DTYPES[dtype])
    with torch.no_grad():
        frame = to_frame(comp.sender()(x), comp.payload_codec)
        one = to_frame(comp.sender()(x[:1, :1]), comp.payload_codec)
    assert frame.codec == plan.sent_codec(dtype)
    assert frame.nbytes == plan.frame_bytes(10, hidden, dtype)
    assert one.nbytes == plan.bytes_per_token(hidden, dtype)
