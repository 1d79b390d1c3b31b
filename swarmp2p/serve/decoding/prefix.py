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
BLOCK_NAME_BYTES = 16
"""A block name's digest size (BLAKE2b-128: collisions are out of reach at any cache size)."""


def block_hashes(
    tokens: Sequence[int], *, block: int = BLOCK_TOKENS, salt: bytes = b""
) -> list[bytes]:
    """The chained names of ``tokens``' whole blocks (a partial last block has none): block
    i's name hashes block i-1's name and its own tokens; ``salt`` separates models or
    adapters that must not share keys and values."""
    out, previous = [], hashlib.blake2b(salt, digest_size=BLOCK_NAME_BYTES).digest()
    for start in range(0, len(tokens) - block + 1, block):
        chunk = struct.pack(f"<{block}q", *tokens[start : start + block])
        previous = hashlib.blake2b(previous + chunk, digest_size=BLOCK_NAME_BYTES).digest()
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
    """The blocks the ring holds, least recently used first, within ``capacity`` blocks.

    A block a session keeps is *pending* until that session's prefill has run on every stage
    (:meth:`stored`: its first token is back); only stored blocks are reused, so no session
    ever asks a stage for a block an earlier session's prefill has not written yet (it
    computes those positions itself, and keeps nothing they would duplicate). A chain's
    blocks are ordered tail first (a use of a block is a use of every block before it), so
    least-recently-used eviction takes a chain's last blocks before its first ones."""

    def __init__(self, capacity: int, *, block: int = BLOCK_TOKENS, salt: bytes = b"") -> None:
        if type(capacity) is not int or capacity < 0:
            raise ValueError(f"a prefix cache of {capacity} blocks")
        self.capacity = capacity
        self.block = block
        self.salt = salt
        self._blocks: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        """name -> sessions using it now (0: free to drop), oldest use first."""
        self._pending: dict[bytes, int] = {}
        """name -> the session whose prefill writes it (not on every stage yet)."""
        self._held: dict[int, tuple[bytes, ...]] = {}
        """session -> the blocks it pins."""
        self._keeps: dict[int, tuple[bytes, ...]] = {}
        """session -> the blocks it keeps that are still pending."""
        self._stale: list[bytes] = []
        """Blocks forgotten while pending (their session ended before its prefill ran
        everywhere): some stages may have written them, so the next plan drops them."""
        self.hits = 0
        self.lookups = 0
        self.reused_tokens = 0
        self.prompt_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, name: bytes) -> bool:
        return name in self._blocks

    def plan(self, sid: int, prompt: Sequence[int]) -> PrefixPlan:
        """The cache's part in session ``sid``'s prefill of ``prompt``: the longest stored run
        of leading blocks to reuse (never the whole prompt: its last token is computed, so the
        last stage has logits to sample from), and the uncached blocks right after it to keep
        where room can be made. The session pins every block it reuses or keeps until
        :meth:`release`."""
        if sid in self._held:
            raise ValueError(f"session {sid} already has a prefix plan")
        names = block_hashes(prompt, block=self.block, salt=self.salt)
        if names and len(names) * self.block >= len(prompt):
            names = names[:-1]  # a prompt of whole blocks: its last block is prefilled
        reuse: list[bytes] = []
        for name in names:
            if name not in self._blocks or name in self._pending:
                break
            reuse.append(name)
        self.lookups += 1
        self.prompt_tokens += len(prompt)
        if reuse:
            self.hits += 1
            self.reused_tokens += len(reuse) * self.block
        fresh: list[bytes] = []
        for name in names[len(reuse) :]:
            if name in self._blocks:
                break  # pending (another session writes it): what follows it is not kept
            fresh.append(name)
        drop, self._stale = self._stale, []
        free = [n for n, users in self._blocks.items() if users == 0 and n not in reuse]
        room = self.capacity - len(self._blocks)
        while room < len(fresh) and free:
            name = free.pop(0)
            del self._blocks[name]
            drop.append(name)
            room += 1
        keep = fresh[: max(room, 0)]
        for name in reversed(keep):  # tail first: the chain's last block is dropped first
            self._blocks[name] = 1
            self._pending[name] = sid
        for name in reversed(reuse):
            self._blocks[name] += 1
            self._blocks.move_to_end(name)
        self._held[sid] = tuple(reuse) + tuple(keep)
        if keep:
            self._keeps[sid] = tuple(keep)
        return PrefixPlan(reuse=tuple(reuse), keep=tuple(keep), drop=tuple(drop))

    def stored(self, sid: int) -> None:
        """Session ``sid``'s prefill ran on every stage: the blocks it keeps may be reused."""
        for name in self._keeps.pop(sid, ()):
            if self._pending.get(name) == sid:
                del self._pending[name]

    def release(self, sid: int) -> None:
        """Session ``sid`` ended: its stored blocks stay cached, free to be dropped when room
        is needed (the most recently used last); blocks still pending are forgotten (and
        dropped by the next plan, wherever a stage wrote them)."""
        for name in self._keeps.pop(sid, ()):
            if self._pending.get(name) == sid:
                del self._pending[name]
                self._blocks.pop(name, None)
                self._stale.append(name)
        for name in self._held.pop(sid, ()):
            if name in self._blocks:
                self._blocks[name] -= 1

    def clear(self) -> None:
        """The ring was rebuilt: its stages hold nothing."""
        self._blocks.clear()
        self._held.clear()
        self._keeps.clear()
        self._pending.clear()
        self._stale.clear()

    @property
    def pending(self) -> int:
        """Blocks kept by prefills that have not run on every stage yet."""
        return len(self._pending)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def stats(self) -> dict[str, int | float]:
        """What ``swarm status`` and the metrics endpoint show of the cache."""
        return {
            "blocks": len(self._blocks),
            "capacity": self.capacity,
            "lookups": self.lookups,
            "hits": self.hits,
            "hit_rate": round(self.hit_rate, 4),
            "reused_tokens": self.reused_tokens,
            "prompt_tokens": self.prompt_tokens,
        }


__all__ = ["BLOCK_NAME_BYTES", "BLOCK_TOKENS", "PrefixIndex", "PrefixPlan", "block_hashes"]
