"""Prefill work waiting at a stage server: prompt chunks in arrival order, and which of them
run together as one forward.

A session's prompt reaches a stage as chunks (at most ``PREFILL_CHUNK_TOKENS`` each, cut by
stage 0). :meth:`PrefillQueue.take` hands out the next chunk and, when it is a session's first,
the first chunks of other new sessions waiting behind it, as many as fit ``batch_tokens``
padded (rows x the widest): they run as ONE forward padded on the right
(:func:`pad_right`). Stages with a recurrent block batch only chunks of one width, since the
padding would enter its state.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from swarmp2p.wire import TensorFrame, WireError


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    """Prefill work waiting at a stage: one chunk of one session's tokens (``payload``: the
    hidden state's frame parts, at stages after the first)."""

    sid: int
    pos: int
    tokens: tuple[int, ...]
    more: bool
    payload: list = field(default_factory=list)


class PrefillQueue:
    """The chunks waiting at one stage, in arrival order."""

    def __init__(self, *, batch_tokens: int, reads_ids: bool, one_width: bool) -> None:
        if type(batch_tokens) is not int or batch_tokens < 1:
            raise ValueError(f"prefill_batch_tokens: {batch_tokens!r} is not an integer >= 1")
        self.batch_tokens = batch_tokens
        self._reads_ids = reads_ids
        self._one_width = one_width
        self._chunks: collections.deque[tuple[Chunk, int | None]] = collections.deque()
        """Each waiting chunk with its width (read once, when it arrives)."""

    def __len__(self) -> int:
        return len(self._chunks)

    def append(self, chunk: Chunk) -> None:
        self._chunks.append((chunk, self.width(chunk)))

    def drop(self, sid: int) -> None:
        """Forget a session's waiting chunks (it ended, failed or starts over)."""
        if any(c.sid == sid for c, _ in self._chunks):
            self._chunks = collections.deque(item for item in self._chunks if item[0].sid != sid)

    def take(self) -> list[Chunk]:
        """The next chunk, with the first chunks of other new sessions that fit beside it
        when it is a first chunk too; the rest keep their order."""
        first, width = self._chunks.popleft()
        if first.pos != 0 or width is None or 2 * width > self.batch_tokens:
            return [first]
        taken, rest = [first], collections.deque()
        for chunk, w in self._chunks:
            fits = chunk.pos == 0 and w is not None
            fits = fits and max(width, w) * (len(taken) + 1) <= self.batch_tokens
            if fits and (not self._one_width or w == width):
                taken.append(chunk)
                width = max(width, w)
            else:
                rest.append((chunk, w))
        self._chunks = rest
        return taken

    def width(self, chunk: Chunk) -> int | None:
        """Tokens of a chunk (None when its hidden state is not one row's ``[1, T, H]``)."""
        if self._reads_ids:
            return len(chunk.tokens) or None
        try:
            shape = TensorFrame.from_parts(chunk.payload).shape
        except (WireError, ValueError, IndexError):
            return None
        return shape[1] if len(shape) == 3 and shape[0] == 1 and shape[1] > 0 else None


def pad_right(rows: list[torch.Tensor]) -> torch.Tensor:
    """One batch of single rows (``[1, T]`` ids or ``[1, T, H]`` hidden states) padded on the
    right to the widest (ids with 0, hidden states with zeros)."""
    width = max(x.shape[1] for x in rows)
    pads = [
        (0, width - x.shape[1]) if x.dim() == 2 else (0, 0, 0, width - x.shape[1]) for x in rows
    ]
    return torch.cat([torch.nn.functional.pad(x, pad) for x, pad in zip(rows, pads)])
