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


def test_the_boundary_sends_a_card_tensor_through_pinned_memory_and_backpropagates():
    import torch

    from swarmp2p.net import InProcLink
    from swarmp2p.runtime.torch.train.boundary import Channel, HostCopy, send_through

    a, b = InProcLink.pair()
    up, down = Channel(a, timeout=10), Channel(b, timeout=10)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    payload = x @ w
    host = HostCopy()(payload)
    assert host.is_pinned() and host.device.type == "cpu" and torch.equal(host, payload.cpu())
    sent = send_through(up, payload, step=0, micro=0, labels=torch.zeros(4, dtype=torch.long))
    got, _ = down.recv_activation(0, 0)
    assert torch.equal(got, payload.detach().cpu())
    down.send_reply(0, 0, torch.ones(4, 64), 1.0)
    sent.backward()  # a CPU gradient from the wire, back on the card for autograd
    assert w.grad.device == w.device and w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(w.grad, x.t() @ torch.ones_like(payload))


def test_nothing_synchronises_the_card_per_block(tmp_path):
    """A training stage's forward and backward on the card (8 blocks, bfloat16): fewer
    synchronising calls than blocks (``torch.cuda.set_sync_debug_mode``'s warnings)."""
    import warnings

    import torch

    from swarmp2p.runtime.torch import load_stage_shard

    folder = tiny_model(tmp_path / "m", layers=8, initializer_range=0.05)
    stage = load_stage_shard(folder, 0, 8, True, False, dtype="bfloat16", device="cuda:0")
    stage.train()
    x = torch.randint(0, stage.config.vocab_size, (2, 64), device="cuda")
    stage(x).float().square().mean().backward()  # warm-up: lazy inits may synchronise
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            stage(x).float().square().mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) < 8, syncs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_mask_limits_a_pick_from_card_logits(temperature):
    """A GPU last stage's logits are on the card and a grammar's mask is made on the CPU: the
    pick takes only allowed ids (greedy and sampled), not a device mismatch."""
    import numpy as np
    import torch

    from swarmp2p.runtime.torch.serve.sampling import SessionSampler
    from swarmp2p.serve.protocol import SamplingParams

    vocab, allowed = 50, {3, 17, 20}
    bits = np.zeros(64, dtype=np.uint8)
    bits[list(allowed)] = 1
    mask = np.packbits(bits, bitorder="little").tobytes()
    logits = torch.arange(vocab, dtype=torch.float32, device="cuda")  # argmax 49: not allowed
    sampler = SessionSampler(SamplingParams(temperature=temperature, seed=7), vocab)
    picks = set()
    for _ in range(50):
        picks.add(sampler.pick(logits, mask)[0])
        sampler.observe((0,))
    assert picks <= allowed and (picks == {20} if temperature == 0 else len(picks) > 1)
