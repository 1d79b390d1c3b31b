"""The prefix cache's bookkeeping on the issuing node: which prompt blocks the ring holds.

A prompt is cut into blocks of ``BLOCK_TOKENS`` tokens, each named by a hash chained over every
block before it (vLLM's block hashing): two prompts share a block's name exactly when they
share every token up to its end. Every stage keeps the keys and values of the blocks this index
says it holds, and nothing else, so the stages never disagree on what is cached: the index
decides for the whole ring and each new session's prefill message carries its decision
(:class:`PrefixPlan`: the blocks to reuse, the blocks to keep after the prefill, the blocks to
drop first). The index is least-recently-used with a block budget (the serve planner prices it
per stage), blocks in use by a running session are never dropped, and a rebuilt ring starts
with an empty index (cold, never wrong). Pure: no torch, no sockets.
"""

from __future__ import annotations

import collections
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

BLOCK_TOKENS = 16
"""Tokens per cached block (vLLM's default block size)."""


def block_hashes(
    tokens: Sequence[int], *, block: int = BLOCK_TOKENS, salt: bytes = b""
) -> list[bytes]:
    """The chained names of ``tokens``' whole blocks (a partial last block has none): block
    i's name hashes block i-1's name and its own tokens; ``salt`` separates models or
    adapters that must not share keys and values."""
    out, previous = [], hashlib.blake2b(salt, digest_size=16).digest()
    for start in range(0, len(tokens) - block + 1, block):
        chunk = struct.pack(f"<{block}q", *tokens[start : start + block])
        previous = hashlib.blake2b(previous + chunk, digest_size=16).digest()
        out.append(previous)
    return out


@dataclass(frozen=True, slots=True)
class PrefixPlan:
    """What one new session does with the cache, as its prefill tells every stage."""

    reuse: tuple[bytes, ...]
    """The leading blocks whose keys and values the stages copy in (``len(reuse) * block``
    positions are not prefilled again)."""
    keep: tuple[bytes, ...]
    """Blocks of this prompt the stages store once the prefill has computed them."""
    drop: tuple[bytes, ...]
    """Blocks the stages free first (least recently used), to make room for ``keep``."""

    @property
    def reused_tokens(self) -> int:
        return len(self.reuse) * BLOCK_TOKENS


class PrefixIndex:
    """The blocks the ring holds, least recently used first, within ``capacity`` blocks."""

    def __init__(self, capacity: int, *, block: int = BLOCK_TOKENS, salt: bytes = b"") -> None:
        if capacity < 0:
            raise ValueError(f"a prefix cache of {capacity} blocks")
        self.capacity = capacity
        self.block = block
        self.salt = salt
        self._blocks: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        """name -> sessions using it now (0: free to drop), oldest use first."""
        self._held: dict[int, tuple[bytes, ...]] = {}
        """session -> the blocks it pins."""
        self.hits = 0
        self.lookups = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def plan(self, sid: int, prompt: Sequence[int]) -> PrefixPlan:
        """The cache's part in session ``sid``'s prefill of ``prompt``: the longest cached run
        of leading blocks to reuse (never the whole prompt: its last token is computed, so the
        last stage has logits to sample from), and the rest of its whole blocks to keep where
        room can be made. The session pins every block it reuses or keeps until
        :meth:`release`."""
        if sid in self._held:
            raise ValueError(f"session {sid} already has a prefix plan")
        names = block_hashes(prompt, block=self.block, salt=self.salt)
        if names and len(names) * self.block >= len(prompt):
            names = names[:-1]  # a prompt of whole blocks: its last block is prefilled
        reuse: list[bytes] = []
        for name in names:
            if name not in self._blocks:
                break
            reuse.append(name)
        self.lookups += 1
        if reuse:
            self.hits += 1
            self.reused_tokens += len(reuse) * self.block
        for name in reuse:
            self._blocks[name] += 1
            self._blocks.move_to_end(name)
        fresh = [n for n in names[len(reuse) :] if n not in self._blocks]
        drop: list[bytes] = []
        free = [n for n, users in self._blocks.items() if users == 0]
        room = self.capacity - len(self._blocks)
        while room < len(fresh) and free:
            name = free.pop(0)
            del self._blocks[name]
            drop.append(name)
            room += 1
        keep = fresh[: max(room, 0)]
        for name in keep:
            self._blocks[name] = 1
        self._held[sid] = tuple(reuse) + tuple(keep)
        return PrefixPlan(reuse=tuple(reuse), keep=tuple(keep), drop=tuple(drop))

    def release(self, sid: int) -> None:
        """Session ``sid`` ended: its blocks stay cached, free to be dropped when room is
        needed (the most recently used last)."""
        for name in self._held.pop(sid, ()):
            if name in self._blocks:
                self._blocks[name] -= 1

    def clear(self) -> None:
        """The ring was rebuilt: its stages hold nothing."""
        self._blocks.clear()
        self._held.clear()

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


__all__ = ["BLOCK_TOKENS", "PrefixIndex", "PrefixPlan", "block_hashes"]
