"""PCA calibration: float64 statistics, top-k principal directions, frames of 256 rows."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from swarmp2p.runtime.torch.train.calibration import (  # noqa: E402
    CovarianceAccumulator,
    principal_projection,
    projection_frames,
    projection_from_frames,
)
from swarmp2p.runtime.torch.train.compression import LearnedBottleneck  # noqa: E402

pytestmark = pytest.mark.torch


def _low_rank_data(n: int, d: int, rank: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    factors = torch.randn(n, rank, generator=gen) * torch.tensor([8.0, 4.0, 2.0, 1.0][:rank])
    mixing, _ = torch.linalg.qr(torch.randn(d, rank, generator=gen))
    return factors @ mixing.T + 3.0 + 1e-3 * torch.randn(n, d, generator=gen)


def test_running_statistics_match_the_whole_batch():
    x = _low_rank_data(600, 40, 4)
    acc = CovarianceAccumulator(40)
    for chunk in x.reshape(6, 10, 10, 40):  # batches of (batch, seq, hidden)
        acc.update(chunk)
    x64 = x.to(torch.float64)
    assert acc.count == 600
    torch.testing.assert_close(acc.mean(), x64.mean(0))
    torch.testing.assert_close(acc.covariance(), torch.cov(x64.T, correction=0))


def test_projection_keeps_the_principal_subspace():
    x = _low_rank_data(2000, 48, 4)
    acc = CovarianceAccumulator(48)
    acc.update(x)
    proj = principal_projection(acc, 4)
    assert proj.basis.shape == (48, 4) and proj.basis.dtype == torch.float32
    torch.testing.assert_close(proj.basis.T @ proj.basis, torch.eye(4), atol=1e-5, rtol=0)
    comp = LearnedBottleneck(48, 4, 16, boundary_index=0)
    comp.set_projection(proj.mean, proj.basis)
    err = (comp(x) - x).pow(2).mean() / (x - x.mean(0)).pow(2).mean()
    assert err < 1e-4  # rank-4 data through a 4-wide calibrated bottleneck
    random_err = (LearnedBottleneck(48, 4, 16, boundary_index=0)(x) - x).pow(2).mean()
    assert random_err > 100 * (comp(x) - x).pow(2).mean()


def test_projection_sign_is_canonical():
    x = _low_rank_data(500, 16, 3)
    a, b = CovarianceAccumulator(16), CovarianceAccumulator(16)
    a.update(x)
    b.update(-x + 6.0)  # same covariance, mirrored
    pa, pb = principal_projection(a, 3), principal_projection(b, 3)
    torch.testing.assert_close(pa.basis, pb.basis, atol=1e-5, rtol=0)
    pivot = pa.basis.abs().argmax(dim=0)
    assert (pa.basis[pivot, torch.arange(3)] > 0).all()


def test_frames_are_256_rows_and_round_trip():
    acc = CovarianceAccumulator(600)
    acc.update(torch.randn(700, 600, dtype=torch.float64))
    proj = principal_projection(acc, 8)
    frames = projection_frames(proj)
    assert [tuple(f.shape) for f in frames] == [(1, 600), (256, 8), (256, 8), (88, 8)]
    back = projection_from_frames(frames, 600, 8)
    assert torch.equal(back.mean, proj.mean) and torch.equal(back.basis, proj.basis)


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([torch.zeros(1, 4)], "needs a mean frame"),
        ([torch.zeros(1, 5), torch.zeros(4, 2)], r"mean frame has shape \(1, 5\)"),
        ([torch.zeros(1, 4), torch.zeros(4, 3)], r"basis frame 0 has shape \(4, 3\)"),
        ([torch.zeros(1, 4), torch.zeros(3, 2)], "basis has 3 rows, want 4"),
    ],
)
def test_bad_frames_are_refused(frames, message):
    with pytest.raises(ValueError, match=message):
        projection_from_frames(frames, 4, 2)


def test_empty_accumulator_and_bad_k_are_refused():
    acc = CovarianceAccumulator(4)
    with pytest.raises(ValueError, match="calibration_tokens > 0"):
        principal_projection(acc, 2)
    acc.update(torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"k must be in 1\.\.4, got 5"):
        principal_projection(acc, 5)
    with pytest.raises(ValueError, match="width 5 != calibrated width 4"):
        acc.update(torch.randn(3, 5))
