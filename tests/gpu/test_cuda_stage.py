"""A stage on the card: loaded on ``cuda:0`` in bfloat16 and float16 it computes what the CPU
float32 stage computes, within each dtype's tolerance; and slice loading puts only the stage's
tensors on the card (its peak CUDA memory against the planner's price)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _gpu import MARKS, tiny_model

from swarmp2p.plan import Pricing, StagePricer, Workload, load_model_shape

pytestmark = MARKS

TOLERANCE = {"bfloat16": 4e-2, "float16": 5e-3}
"""Largest error allowed, relative to the float32 output's largest magnitude (8 and 11
mantissa bits through 2 blocks)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    # moderate weights here: this compares numbers, not greedy choices
    return tiny_model(tmp_path_factory.mktemp("stage") / "m", initializer_range=0.05)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_stage_on_the_card_equals_the_cpu_float32_stage(model, dtype, where):
    import torch

    from swarmp2p.runtime.torch import load_stage_shard

    first = where == "first"
    layers = (0, 2) if first else (2, 4)
    ref = load_stage_shard(model, *layers, first, not first)
    card = load_stage_shard(model, *layers, first, not first, dtype=dtype, device="cuda:0")
    assert {p.device.type for p in card.parameters()} == {"cuda"}
    assert {p.dtype for p in card.parameters()} == {getattr(torch, dtype)}
    gen = torch.Generator().manual_seed(0)
    if first:
        x = torch.randint(0, ref.config.vocab_size, (2, 16), generator=gen)
        x_card = x.cuda()
    else:
        x = torch.randn(2, 16, ref.config.hidden_size, generator=gen)
        x_card = x.to("cuda:0", getattr(torch, dtype))
    with torch.no_grad():
        want = ref(x)
        got = card(x_card).float().cpu()
    assert got.isfinite().all()
    error = (got - want).abs().max() / want.abs().max()
    assert error < TOLERANCE[dtype], f"{dtype} {where}: relative error {error:.2e}"


def test_slice_loading_puts_only_the_stage_on_the_card(tmp_path):
    """The middle stage of an 8-block model (hidden 512): the CUDA memory loading it peaks at
    is its planned weights within 15%, and about half of the whole model's."""
    import torch

    from swarmp2p.runtime.torch import load_stage_shard

    folder = tiny_model(tmp_path / "m", layers=8, hidden=512)
    shape = load_model_shape(str(folder))
    pricer = StagePricer(shape, Pricing(dtype="bfloat16"), Workload(training=False))
    price = pricer.price(2, 6, first=False, last=False).peak
    whole = pricer.price(0, 8, first=True, last=True).peak
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    stage = load_stage_shard(folder, 2, 6, False, False, dtype="bfloat16", device="cuda:0")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    held = torch.cuda.memory_allocated() - before
    assert abs(peak - price) <= 0.15 * price, f"peak {peak} B vs priced {price} B"
    assert held <= peak and peak < 0.6 * whole, (held, peak, whole)
    del stage
