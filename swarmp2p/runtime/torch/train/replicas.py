"""How a stage's replicas stay equal: the ring all-reduce among them and DiLoCo's outer step.

**Ring all-reduce.** The replicas of stage i form a ring over their own authenticated links
(``net.links.Link``: CURVE ZmqLinks between the stage's nodes): each member sends to the next
and receives from the previous. Reduce-scatter then all-gather (Patarasuk and Yuan 2009): every
member sends ``2 (N - 1) / N`` of the payload (what ``plan.speed.ring_sync_bytes`` prices).
Each chunk is summed once, in one order, by the member that owns it, and copied to the others
as it is, so every replica ends with the same bits. Frames are TensorFrames (``step`` and the
chunk in ``micro``), never pickles; a frame of another step or chunk is an error naming both.

**DiLoCo** (Douillard et al. 2023), pure: each replica takes H inner steps alone from the
synchronised weights (the anchor), then every replica's change ``anchor - local`` (the outer
gradient) is averaged across the replicas, sent ``bits`` wide with one scale all replicas
share (INTELLECT-1's int8 all-reduce: the scale is the largest change any replica holds, so
every code means the same on every replica), and the anchor takes one Nesterov SGD step on
that average. With lr 1, momentum 0 and 32 bits the new anchor is the replicas' mean weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from swarmp2p.net.links import Link
from swarmp2p.wire import TensorFrame, decode_tensor, encode_tensor

SYNC_FLAG = 1 << 8
"""``TensorFrame.flags`` of a replica sync frame (the stage links' own flags sit below)."""
GATHER_FLAG = SYNC_FLAG | 1 << 9
"""``TensorFrame.flags`` of an all-gather frame (DiLoCo's codes, each member's own)."""
BROADCAST_FLAG = SYNC_FLAG | 1 << 10
"""``TensorFrame.flags`` of a broadcast frame (replica 0's weights at the start)."""


class SyncError(RuntimeError):
    """A replica sync went wrong (a frame of another step or chunk, a bad size)."""


def _bounds(numel: int, n: int) -> list[tuple[int, int]]:
    base, extra = divmod(numel, n)
    out, at = [], 0
    for k in range(n):
        size = base + (1 if k < extra else 0)
        out.append((at, at + size))
        at += size
    return out


def _send(
    link: Link,
    chunk: np.ndarray,
    step: int,
    k: int,
    timeout: float,
    flags: int = SYNC_FLAG,
    dtype: str | None = None,
) -> None:
    frame = encode_tensor(chunk, "none", step=step, micro=k, flags=flags, dtype=dtype)
    link.send(frame.to_parts(), timeout=timeout)


def _recv(
    link: Link,
    step: int,
    k: int,
    size: int,
    timeout: float,
    flags: int = SYNC_FLAG,
    dtype: str = "float32",
) -> np.ndarray:
    frame = TensorFrame.from_parts(link.recv(timeout))
    got = (frame.step, frame.micro, frame.flags, frame.shape, frame.dtype)
    if got != (step, k, flags, (size,), dtype):
        raise SyncError(
            f"replica sync of step {step}: expected chunk {k} of {size} {dtype} values (flags "
            f"{flags}), got step {frame.step} chunk {frame.micro} shape {list(frame.shape)} "
            f"{frame.dtype} flags {frame.flags}"
        )
    return decode_tensor(frame)


def _check_ring(rank: int, n: int, to_next: Link | None, from_prev: Link | None) -> None:
    if not 0 <= rank < n:
        raise SyncError(f"rank {rank} outside a ring of {n}")
    if n > 1 and (to_next is None or from_prev is None):
        raise SyncError(f"a ring of {n} needs links to the next and from the previous member")


def ring_all_reduce(
    flat: torch.Tensor,
    rank: int,
    n: int,
    to_next: Link | None,
    from_prev: Link | None,
    *,
    step: int,
    timeout: float,
    mean: bool = True,
) -> torch.Tensor:
    """The sum (``mean``: the average) of ``flat`` (1-D float32, on the CPU) over the ``n``
    members of a ring, in place; ``rank`` is this member's place. Every member gets the same
    bits."""
    if flat.dtype != torch.float32 or flat.dim() != 1 or flat.device.type != "cpu":
        raise SyncError(f"ring all-reduce takes a 1-D float32 CPU tensor, got {flat.dtype}")
    _check_ring(rank, n, to_next, from_prev)
    if n == 1:
        return flat
    data = flat.numpy()
    bounds = _bounds(data.size, n)
    for s in range(n - 1):  # reduce-scatter: chunk (rank - s - 1) gathers one more addend
        k_out, k_in = (rank - s) % n, (rank - s - 1) % n
        a, b = bounds[k_out]
        _send(to_next, data[a:b], step, k_out, timeout)
        a, b = bounds[k_in]
        data[a:b] += _recv(from_prev, step, k_in, b - a, timeout)
    if mean:  # each owner divides its own finished chunk once
        a, b = bounds[(rank + 1) % n]
        data[a:b] /= n
    for s in range(n - 1):  # all-gather: the owners' chunks go round unchanged
        k_out, k_in = (rank + 1 - s) % n, (rank - s) % n
        a, b = bounds[k_out]
        _send(to_next, data[a:b], step, k_out, timeout)
        a, b = bounds[k_in]
        data[a:b] = _recv(from_prev, step, k_in, b - a, timeout)
    return flat


def ring_all_gather(
    mine: np.ndarray,
    rank: int,
    n: int,
    to_next: Link | None,
    from_prev: Link | None,
    *,
    dtype: str,
    step: int,
    timeout: float,
) -> list[np.ndarray]:
    """Every member's ``mine`` (1-D, the same size on each), in rank order, on every member:
    each sends ``N - 1`` payloads round the ring. What cannot be summed in its own width
    (int8 codes, bfloat16) crosses this way, and each member then sums the same values in the
    same order. ``dtype``: the wire dtype ("int8", "bfloat16" for a uint16 view, "float32")."""
    _check_ring(rank, n, to_next, from_prev)
    mine = np.ascontiguousarray(mine).reshape(-1)
    out: list[np.ndarray] = [mine] * n
    for s in range(n - 1):  # pass on what came in last round: member (rank - s)'s payload
        k_out, k_in = (rank - s) % n, (rank - s - 1) % n
        _send(to_next, out[k_out], step, k_out, timeout, GATHER_FLAG, dtype)
        out[k_in] = _recv(from_prev, step, k_in, mine.size, timeout, GATHER_FLAG, dtype)
    return out


def ring_broadcast(
    flat: torch.Tensor,
    rank: int,
    n: int,
    to_next: Link | None,
    from_prev: Link | None,
    *,
    step: int,
    timeout: float,
) -> torch.Tensor:
    """Member 0's ``flat`` (1-D float32, on the CPU) copied into every member's, in place: it
    goes once round the ring (so replicas start from the same weights, whatever each loaded)."""
    if flat.dtype != torch.float32 or flat.dim() != 1 or flat.device.type != "cpu":
        raise SyncError(f"a ring broadcast takes a 1-D float32 CPU tensor, got {flat.dtype}")
    _check_ring(rank, n, to_next, from_prev)
    if n == 1:
        return flat
    data = flat.numpy()
    if rank > 0:
        data[:] = _recv(from_prev, step, 0, data.size, timeout, BROADCAST_FLAG)
    if rank < n - 1:
        _send(to_next, data, step, 0, timeout, BROADCAST_FLAG)
    return flat


# --- DiLoCo's outer step ----------------------------------------------------------------------

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
    "BROADCAST_FLAG",
    "GATHER_FLAG",
    "SYNC_FLAG",
    "WIRE_BITS",
    "OuterStep",
    "SyncError",
    "decode",
    "encode",
    "mean_change",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_broadcast",
    "shared_scale",
    "sync_replicas",
]
