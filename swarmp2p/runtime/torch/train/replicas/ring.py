"""The ring among a stage's replicas: all-reduce, all-gather and broadcast over their own links.

The replicas of stage i form a ring over their own authenticated links (``net.links.Link``:
CURVE ZmqLinks between the stage's nodes): each member sends to the next and receives from the
previous. ``ring_all_reduce`` is reduce-scatter then all-gather (Patarasuk and Yuan 2009):
every member sends ``2 (N - 1) / N`` of the payload (what ``plan.speed.ring_sync_bytes``
prices). Each chunk is summed once, in one order, by the member that owns it, and copied to
the others as it is, so every replica ends with the same bits. ``ring_all_gather`` sends
each member's payload whole (codes that cannot be summed in their own width);
``ring_broadcast`` copies member 0's. Frames are TensorFrames (``step`` and the chunk in
``micro``, the kind in ``flags``), never pickles; a frame of another step, chunk or kind is an
error naming both.
"""

from __future__ import annotations

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


def _check_flat(flat: torch.Tensor, what: str) -> None:
    if flat.dtype != torch.float32 or flat.dim() != 1 or flat.device.type != "cpu":
        raise SyncError(f"{what} takes a 1-D float32 CPU tensor, got {flat.dtype}")


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
    _check_flat(flat, "ring all-reduce")
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
    _check_flat(flat, "a ring broadcast")
    _check_ring(rank, n, to_next, from_prev)
    if n == 1:
        return flat
    data = flat.numpy()
    if rank > 0:
        data[:] = _recv(from_prev, step, 0, data.size, timeout, BROADCAST_FLAG)
    if rank < n - 1:
        _send(to_next, data, step, 0, timeout, BROADCAST_FLAG)
    return flat


__all__ = [
    "BROADCAST_FLAG",
    "GATHER_FLAG",
    "SYNC_FLAG",
    "SyncError",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_broadcast",
]
