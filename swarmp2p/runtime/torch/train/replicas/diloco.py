"""DiLoCo's outer step (Douillard et al. 2023), pure: each replica takes H inner steps alone
from the synchronised weights (the anchor), then every replica's change ``anchor - local`` (the
outer gradient) is averaged across the replicas, sent ``bits`` wide with one scale all replicas
share (INTELLECT-1's int8 all-reduce: the scale is the largest change any replica holds, so
every code means the same on every replica), and the anchor takes one Nesterov SGD step on that
average. With lr 1, momentum 0 and 32 bits the new anchor is the replicas' mean weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

WIRE_BITS = (8, 16, 32)


def shared_scale(deltas: Sequence[torch.Tensor], bits: int) -> float:
    """The one scale of a ``bits``-wide integer code every replica uses: the largest absolute
    change across all of them over the largest code (1.0 when nothing changed, or not an
    integer width)."""
    if bits not in WIRE_BITS:
        raise ValueError(f"bits must be one of {WIRE_BITS}, got {bits}")
    if bits != 8:
        return 1.0
    peak = max((float(d.abs().max()) for d in deltas if d.numel()), default=0.0)
    if peak != peak or peak in (float("inf"), float("-inf")):
        raise ValueError(f"a replica's parameter change is not finite ({peak}): the job fails")
    return peak / 127 if peak > 0 else 1.0


def encode(delta: torch.Tensor, bits: int, scale: float) -> torch.Tensor:
    """What crosses the wire for one change: int8 codes at ``scale``, bfloat16, or float32."""
    if bits == 8:
        return torch.clamp(torch.round(delta.float() / scale), -127, 127).to(torch.int8)
    if bits == 16:
        return delta.to(torch.bfloat16)
    return delta.float()


def decode(payload: torch.Tensor, bits: int, scale: float) -> torch.Tensor:
    """The float32 change a payload stands for."""
    return payload.float() * scale if bits == 8 else payload.float()


def mean_change(deltas: Sequence[torch.Tensor], bits: int, scale: float) -> torch.Tensor:
    """The replicas' average change as the all-reduce computes it: each encoded, decoded, summed
    in float32 in replica order, divided by the count."""
    if not deltas:
        raise ValueError("no replica changes to average")
    total = torch.zeros_like(deltas[0], dtype=torch.float32)
    for d in deltas:
        total += decode(encode(d, bits, scale), bits, scale)
    return total / len(deltas)


class OuterStep:
    """The outer optimiser over one stage's trained parameters: Nesterov SGD on the averaged
    change, as ``torch.optim.SGD(lr, momentum, nesterov=True)`` steps a gradient."""

    def __init__(self, anchor: Sequence[torch.Tensor], lr: float, momentum: float) -> None:
        if not lr > 0 or not 0 <= momentum < 1:
            raise ValueError(f"outer lr must be > 0 and momentum in [0, 1), got {lr}, {momentum}")
        self.lr, self.momentum = lr, momentum
        self.anchor = [a.detach().float().clone() for a in anchor]
        self.buffers: list[torch.Tensor | None] = [None] * len(self.anchor)

    def changes(self, local: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This replica's outer gradient per parameter: ``anchor - local``."""
        if len(local) != len(self.anchor):
            raise ValueError(f"{len(local)} parameters for an anchor of {len(self.anchor)}")
        return [a - p.detach().float() for a, p in zip(self.anchor, local)]

    @torch.no_grad()
    def apply(self, averaged: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Step the anchor by the replicas' averaged changes; the new anchor (every replica
        copies it into its parameters)."""
        for i, g in enumerate(averaged):
            g = g.float()
            if not bool(torch.isfinite(g).all()):
                raise ValueError(f"parameter {i}'s averaged change is not finite: the job fails")
            if self.momentum:
                buf = self.buffers[i]
                buf = g.clone() if buf is None else buf.mul_(self.momentum).add_(g)
                self.buffers[i] = buf
                g = g.add(buf, alpha=self.momentum)
            self.anchor[i].add_(g, alpha=-self.lr)
        return self.anchor


def sync_replicas(
    steps: Sequence[OuterStep], local: Sequence[Sequence[torch.Tensor]], bits: int
) -> list[torch.Tensor]:
    """One outer step of every replica of a stage in one process (what the ring computes on
    each member): the shared scale, the averaged changes, the same new anchor on each."""
    changes = [s.changes(p) for s, p in zip(steps, local)]
    out = []
    for i in range(len(changes[0])):
        column = [c[i] for c in changes]
        scale = shared_scale(column, bits)
        out.append(mean_change(column, bits, scale))
    anchors = [s.apply(out) for s in steps]
    return anchors[0]


__all__ = [
    "WIRE_BITS",
    "OuterStep",
    "decode",
    "encode",
    "mean_change",
    "shared_scale",
    "sync_replicas",
]
