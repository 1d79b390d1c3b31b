"""DiLoCo's outer step (runtime/torch/train/replicas.py): the algebra, the shared int8 scale."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from swarmp2p.runtime.torch.train.replicas import (  # noqa: E402
    OuterStep,
    decode,
    encode,
    shared_scale,
    sync_replicas,
)

pytestmark = pytest.mark.torch


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _inner_step(model: nn.Module, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_h1_lr1_no_momentum_32_bits_gives_the_mean_of_the_replicas_weights():
    replicas = [_model(0) for _ in range(3)]  # start equal, as after a sync
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in replicas]
    steps = [OuterStep(list(m.parameters()), lr=1.0, momentum=0.0) for m in replicas]
    for sync in range(3):  # H = 1: a sync after every inner step
        for r, (m, opt) in enumerate(zip(replicas, opts)):
            _inner_step(m, opt, seed=100 * sync + r)  # each replica its own data
        locals_ = [list(m.parameters()) for m in replicas]
        mean = [torch.stack([p[i].detach() for p in locals_]).mean(0) for i in range(4)]
        assert not torch.equal(locals_[0][0], locals_[1][0])  # the replicas did drift apart
        anchor = sync_replicas(steps, locals_, bits=32)
        for got, want in zip(anchor, mean):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for m in replicas:  # every replica goes on from the new anchor
            with torch.no_grad():
                for p, a in zip(m.parameters(), anchor):
                    p.copy_(a)
        assert all(torch.equal(a, b) for s in steps for a, b in zip(s.anchor, steps[0].anchor))


def test_the_outer_step_is_torchs_nesterov_sgd_on_the_averaged_change():
    torch.manual_seed(1)
    start = [torch.randn(5, 3), torch.randn(7)]
    outer = OuterStep(start, lr=0.7, momentum=0.9)
    ref = [nn.Parameter(t.clone()) for t in start]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(4):
        change = [torch.randn_like(t) * 0.01 for t in start]
        outer.apply(change)
        for p, g in zip(ref, change):
            p.grad = g.clone()
        sgd.step()
        for a, p in zip(outer.anchor, ref):
            torch.testing.assert_close(a, p.detach(), rtol=0, atol=1e-6)


def test_int8_codes_share_one_scale_and_err_by_half_a_step_at_most():
    torch.manual_seed(2)
    deltas = [torch.randn(1000) * s for s in (0.01, 0.03)]  # the second replica moved further
    scale = shared_scale(deltas, 8)
    assert scale == pytest.approx(max(float(d.abs().max()) for d in deltas) / 127)
    for d in deltas:
        codes = encode(d, 8, scale)
        assert codes.dtype == torch.int8 and int(codes.abs().max()) <= 127
        assert float((decode(codes, 8, scale) - d).abs().max()) <= scale / 2 + 1e-9
    assert int(encode(deltas[1], 8, scale).abs().max()) == 127  # the largest change is full scale
    assert shared_scale([torch.zeros(4)], 8) == 1.0  # nothing changed: codes 0, no 0/0
    with pytest.raises(ValueError, match="not finite"):
        shared_scale([torch.tensor([1.0, float("nan")])], 8)
    with pytest.raises(ValueError, match="bits must be one of"):
        shared_scale(deltas, 4)


def test_an_int8_sync_lands_near_the_exact_one_and_the_same_on_every_replica():
    replicas = [_model(3) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in replicas]
    for r, (m, opt) in enumerate(zip(replicas, opts)):
        for k in range(5):  # H = 5 inner steps alone
            _inner_step(m, opt, seed=10 * r + k)
    locals_ = [list(m.parameters()) for m in replicas]
    exact = sync_replicas(
        [OuterStep(list(_model(3).parameters()), 0.7, 0.9) for _ in replicas], locals_, 32
    )
    steps8 = [OuterStep(list(_model(3).parameters()), 0.7, 0.9) for _ in replicas]
    got = sync_replicas(steps8, locals_, 8)
    for a, b in zip(got, exact):
        assert float((a - b).abs().max()) < 0.7 * float(b.abs().max() + 1) / 127
    assert all(torch.equal(a, b) for a, b in zip(steps8[0].anchor, steps8[1].anchor))


def test_a_non_finite_average_fails_loudly():
    outer = OuterStep([torch.zeros(3)], lr=0.7, momentum=0.9)
    with pytest.raises(ValueError, match="not finite"):
        outer.apply([torch.tensor([0.0, float("inf"), 0.0])])
    with pytest.raises(ValueError, match="momentum"):
        OuterStep([torch.zeros(1)], lr=0.7, momentum=1.0)
