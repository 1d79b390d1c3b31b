"""Ring all-reduce of one stage's flat float32 gradients (or DiLoCo changes) among its replicas.

The replicas of stage i form a ring over their own authenticated links (``net.links.Link``:
CURVE ZmqLinks between the stage's nodes): each member sends to the next and receives from the
previous. Reduce-scatter then all-gather (Patarasuk and Yuan 2009): every member sends
``2 (N - 1) / N`` of the payload (what ``plan.speed.ring_sync_bytes`` prices). Each chunk is
summed once, in one order, by the member that owns it, and copied to the others as it is, so
every replica ends with the same bits. Frames are TensorFrames (``step`` and the chunk in
``micro``), never pickles; a frame of another step or chunk is an error naming both.
"""

from __future__ import annotations

import numpy as np
import torch

from swarmp2p.net.links import Link
from swarmp2p.wire import TensorFrame, decode_tensor, encode_tensor

SYNC_FLAG = 1 << 8
"""``TensorFrame.flags`` of a replica sync frame (the stage links' own flags sit below)."""


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


def _send(link: Link, chunk: np.ndarray, step: int, k: int, timeout: float) -> None:
    frame = encode_tensor(chunk, "none", step=step, micro=k, flags=SYNC_FLAG)
    link.send(frame.to_parts(), timeout=timeout)


def _recv(link: Link, step: int, k: int, size: int, timeout: float) -> np.ndarray:
    frame = TensorFrame.from_parts(link.recv(timeout))
    if (frame.step, frame.micro, frame.flags) != (step, k, SYNC_FLAG) or frame.shape != (size,):
        raise SyncError(
            f"replica sync of step {step}: expected chunk {k} of {size} values, got step "
            f"{frame.step} chunk {frame.micro} shape {list(frame.shape)} flags {frame.flags}"
        )
    return decode_tensor(frame)


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
    if not 0 <= rank < n:
        raise SyncError(f"rank {rank} outside a ring of {n}")
    if n == 1:
        return flat
    if to_next is None or from_prev is None:
        raise SyncError(f"a ring of {n} needs links to the next and from the previous member")
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


__all__ = ["SYNC_FLAG", "SyncError", "ring_all_reduce"]
