"""PCA calibration of a learned bottleneck: both halves start as one principal-component projection.

The stage before the boundary accumulates the mean and covariance of its output in float64 on
the CPU (only a d x d matrix is kept), takes the leading k eigenvectors, and sets its sender to
``down(x) = (x - mean) @ basis``. It sends the mean and the basis to the next stage in frames of
``BASIS_FRAME_ROWS`` rows; that stage sets its receiver to ``up(code) = code @ basis.T + mean``
(reference, "Calibration").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarmp2p.plan.split import DEFAULT_CALIBRATION_TOKENS

BASIS_FRAME_ROWS = 256
"""Rows of the basis per frame sent to the next stage (5 MB frames for a 5120-wide model)."""


class CovarianceAccumulator:
    """Running float64 sum and sum of outer products of the rows of hidden states."""

    def __init__(self, hidden: int) -> None:
        if hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {hidden!r}")
        self.hidden = hidden
        self.count = 0
        self._sum = torch.zeros(hidden, dtype=torch.float64)
        self._outer = torch.zeros(hidden, hidden, dtype=torch.float64)

    def update(self, x: torch.Tensor) -> None:
        """Add every token (row over the last dim) of ``x``."""
        if x.shape[-1] != self.hidden:
            raise ValueError(f"hidden state width {x.shape[-1]} != calibrated width {self.hidden}")
        rows = x.detach().reshape(-1, self.hidden).to(device="cpu", dtype=torch.float64)
        self.count += rows.shape[0]
        self._sum += rows.sum(dim=0)
        self._outer += rows.T @ rows

    def mean(self) -> torch.Tensor:
        """The float64 mean of every row seen."""
        if self.count == 0:
            raise ValueError(
                "no hidden states accumulated; calibration needs calibration_tokens > 0"
            )
        return self._sum / self.count

    def covariance(self) -> torch.Tensor:
        """The float64 (population) covariance of every row seen."""
        mean = self.mean()
        return self._outer / self.count - torch.outer(mean, mean)


@dataclass(frozen=True, kw_only=True, slots=True)
class Projection:
    """A calibrated projection: ``mean`` (d,) and ``basis`` (d, k), float32, orthonormal columns."""

    mean: torch.Tensor
    """The hidden states' mean."""
    basis: torch.Tensor
    """The leading k principal directions as columns, largest variance first."""


def principal_projection(acc: CovarianceAccumulator, k: int) -> Projection:
    """The mean and leading ``k`` eigenvectors of the accumulated covariance.

    Each eigenvector's sign is fixed (its largest-magnitude entry positive) so the basis does not
    depend on the eigen-solver's arbitrary choice.
    """
    if not 0 < k <= acc.hidden:
        raise ValueError(f"k must be in 1..{acc.hidden}, got {k!r}")
    cov = acc.covariance()
    _, vectors = torch.linalg.eigh(cov)  # ascending eigenvalues
    top = vectors[:, -k:].flip(dims=(1,))
    pivot = top.abs().argmax(dim=0)
    signs = torch.sign(top[pivot, torch.arange(k)])
    signs[signs == 0] = 1.0
    top = top * signs
    return Projection(mean=acc.mean().to(torch.float32), basis=top.to(torch.float32).contiguous())


def projection_frames(projection: Projection, rows: int = BASIS_FRAME_ROWS) -> list[torch.Tensor]:
    """The projection as float32 tensors to send: the mean as (1, d), then the basis in chunks of
    ``rows`` rows."""
    basis = projection.basis
    frames = [projection.mean.reshape(1, -1).contiguous()]
    frames += [basis[i : i + rows].contiguous() for i in range(0, basis.shape[0], rows)]
    return frames


def projection_from_frames(frames: list[torch.Tensor], hidden: int, k: int) -> Projection:
    """Reassemble the frames ``projection_frames`` made, checking every shape."""
    if len(frames) < 2:
        raise ValueError(f"a projection needs a mean frame and >= 1 basis frame, got {len(frames)}")
    mean, *chunks = frames
    if tuple(mean.shape) != (1, hidden):
        raise ValueError(f"projection mean frame has shape {tuple(mean.shape)}, want (1, {hidden})")
    for i, chunk in enumerate(chunks):
        if chunk.dim() != 2 or chunk.shape[1] != k:
            raise ValueError(
                f"projection basis frame {i} has shape {tuple(chunk.shape)}, want (rows, {k})"
            )
    basis = torch.cat(chunks, dim=0)
    if basis.shape[0] != hidden:
        raise ValueError(f"projection basis has {basis.shape[0]} rows, want {hidden}")
    return Projection(mean=mean.reshape(hidden).to(torch.float32), basis=basis.to(torch.float32))


def _learned(comp) -> bool:
    from swarmp2p.runtime.torch.train.compression import LearnedBottleneck

    return isinstance(comp, LearnedBottleneck)


def calibrate_stage(
    bundle,
    *,
    learned: list[bool],
    prev=None,
    next=None,
    batches=None,
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS,
) -> int:
    """Calibrate every learned boundary of the pipeline, run on each stage with the same
    ``learned`` (one flag per boundary). Returns the tokens this stage ran forward.

    The first stage runs ``calibration_tokens`` tokens of ``batches`` (``[B, T + 1]`` token
    batches) forward without gradients; each stage up to the last learned boundary forwards its
    raw output on. The stage before a learned boundary sets its sender from the accumulated
    statistics and sends the projection; the stage after it sets its receiver from the frames.
    """
    i, n = bundle.index, bundle.n_stages
    if len(learned) != n - 1:
        raise ValueError(
            f"learned lists {len(learned)} boundaries, a {n}-stage pipeline has {n - 1}"
        )
    if i < n - 1 and _learned(bundle.send_compressor) != learned[i]:
        raise ValueError(f"stage {i}: its send compressor disagrees with learned[{i}]")
    needs_stream = any(learned[i:])
    forwards = i + 1 < n and any(learned[i + 1 :])
    acc = None
    if needs_stream and learned[i]:
        acc = CovarianceAccumulator(bundle.send_compressor.hidden)
    seen = 0
    if needs_stream:
        was_training = bundle.stage.training
        bundle.stage.eval()
        with torch.no_grad():
            for hidden_in in _calibration_inputs(bundle, prev, batches, calibration_tokens):
                out = bundle.stage(bundle.adopt(hidden_in))
                seen += out.shape[0] * out.shape[1]
                if acc is not None:
                    acc.update(out)
                if forwards:
                    next.send_control("calib", [out])
        bundle.stage.train(was_training)
        if forwards:
            next.send_control("calib_end")
    if acc is not None:
        projection = principal_projection(acc, bundle.send_compressor.k)
        bundle.send_compressor.set_sender_projection(projection.mean, projection.basis)
        next.send_control("projection", projection_frames(projection), boundary=i)
    if i > 0 and learned[i - 1]:
        _, frames = prev.recv_control("projection")
        comp = bundle.recv_compressor
        projection = projection_from_frames(frames, comp.hidden, comp.k)
        comp.set_receiver_projection(projection.mean, projection.basis)
    return seen


def _calibration_inputs(bundle, prev, batches, calibration_tokens):
    if bundle.index == 0:
        if batches is None:
            raise ValueError("the first stage needs calibration batches")
        if calibration_tokens < 1:
            raise ValueError(f"calibration_tokens must be >= 1, got {calibration_tokens!r}")
        total = 0
        for tokens in batches:
            ids = tokens[:, :-1]
            yield ids
            total += ids.numel()
            if total >= calibration_tokens:
                return
        if total == 0:
            raise ValueError("no calibration data: the batches were empty")
        return
    while True:
        header, tensors = prev.recv_control_any(("calib", "calib_end"))
        if header["name"] == "calib_end":
            return
        yield tensors[0]
