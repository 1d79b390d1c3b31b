"""Token windows: rows tokenised into one stream, cut into fixed windows, batched by (seed, step).

The stream is every row's tokens followed by the tokenizer's EOS (no BOS or other special
tokens are added). It is cut into consecutive, non-overlapping windows of `seq_len + 1`
tokens; a window gives inputs `w[:-1]` and labels `w[1:]` — the labels are already shifted,
so hand them to a loss directly, not to a Hugging Face model's `labels=` (which shifts again).
Tokens left over after the last whole window are dropped.

Batch `step` takes samples `step * batch_size ...` of an endless sequence of epochs; each
epoch visits every window once, in an order that is a keyed pseudo-random permutation of
(seed, epoch). It is a pure function of (seed, step) built on blake2b only, so a resumed run —
on another machine, with another numpy — gets the same batches, and a run longer than the
data wraps around into a freshly shuffled epoch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_TOKENIZE_CHUNK = 256
"""Rows tokenised per tokenizer call (fast tokenizers batch well; the cap stops early)."""

_FEISTEL_ROUNDS = 4
"""Four rounds of a keyed pseudo-random function make a pseudo-random permutation (Luby-Rackoff)."""


def tokens_needed(*, steps: int, batch_size: int, seq_len: int) -> int:
    """Tokens a schedule consumes without repeating a window: `steps x batch_size x (seq_len + 1)`."""
    for name, value in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len)):
        _check_positive(name, value)
    return steps * batch_size * (seq_len + 1)


def tokenize_rows(
    rows: Sequence[str],
    tokenizer: Any,
    *,
    eos_id: int | None = None,
    max_tokens: int | None = None,
) -> np.ndarray:
    """One int32 token stream: each row's tokens, then EOS; cut at `max_tokens` if given.

    `tokenizer` is a Hugging Face tokenizer (called as `tokenizer(texts,
    add_special_tokens=False)["input_ids"]`); `eos_id` defaults to its `eos_token_id`.
    """
    if eos_id is None:
        eos_id = getattr(tokenizer, "eos_token_id", None)
        if eos_id is None:
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has no eos_token_id; pass eos_id to "
                "separate documents"
            )
    if not isinstance(eos_id, int) or isinstance(eos_id, bool) or eos_id < 0:
        raise ValueError(f"eos_id must be a non-negative integer, got {eos_id!r}")
    if max_tokens is not None:
        _check_positive("max_tokens", max_tokens)
    pieces: list[np.ndarray] = []
    total = 0
    eos = np.array([eos_id], dtype=np.int32)
    for start in range(0, len(rows), _TOKENIZE_CHUNK):
        chunk = list(rows[start : start + _TOKENIZE_CHUNK])
        for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]:
            pieces.append(np.asarray(ids, dtype=np.int32))
            pieces.append(eos)
            total += len(ids) + 1
        if max_tokens is not None and total >= max_tokens:
            break
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    return stream[:max_tokens] if max_tokens is not None else stream


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class TokenWindows:
    """A token stream cut into windows of `seq_len + 1`, served as deterministic batches."""

    tokens: np.ndarray
    """The token stream (1-D, int32, read-only)."""
    seq_len: int
    """Tokens per input row of a batch; a window holds one more (the last label)."""

    def __post_init__(self) -> None:
        _check_positive("seq_len", self.seq_len)
        tokens = np.array(self.tokens, dtype=np.int32, copy=True)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if len(tokens) < self.seq_len + 1:
            raise ValueError(
                f"{len(tokens)} tokens do not fill one window of seq_len + 1 = {self.seq_len + 1}; "
                "use more data or a shorter seq_len"
            )
        tokens.setflags(write=False)
        object.__setattr__(self, "tokens", tokens)

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[str],
        tokenizer: Any,
        *,
        seq_len: int,
        eos_id: int | None = None,
        max_tokens: int | None = None,
    ) -> TokenWindows:
        """Tokenise rows (see `tokenize_rows`) and cut the stream into windows."""
        stream = tokenize_rows(rows, tokenizer, eos_id=eos_id, max_tokens=max_tokens)
        return cls(tokens=stream, seq_len=seq_len)

    @property
    def num_windows(self) -> int:
        """Whole windows in the stream: one epoch."""
        return len(self.tokens) // (self.seq_len + 1)

    def window(self, index: int) -> np.ndarray:
        """Window `index` (0-based): `seq_len + 1` consecutive tokens."""
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window {index} out of range: there are {self.num_windows}")
        start = index * (self.seq_len + 1)
        return self.tokens[start : start + self.seq_len + 1]

    def window_index(self, sample: int, seed: int | None) -> int:
        """Which window the `sample`-th sample (counting across epochs) reads.

        `seed=None` reads the windows in order (for evaluation); an int shuffles each epoch.
        """
        if sample < 0:
            raise ValueError(f"sample must be >= 0, got {sample}")
        epoch, position = divmod(sample, self.num_windows)
        if seed is None:
            return position
        return _permute(position, self.num_windows, _epoch_key(seed, epoch))

    def batch(self, step: int, batch_size: int, seed: int | None) -> tuple[np.ndarray, np.ndarray]:
        """`(ids, labels)`, both int64 `[batch_size, seq_len]`, for step `step` (0-based)."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        _check_positive("batch_size", batch_size)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {seed!r}")
        first = step * batch_size
        windows = np.stack(
            [self.window(self.window_index(first + j, seed)) for j in range(batch_size)]
        ).astype(np.int64)
        return windows[:, :-1], windows[:, 1:]


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _epoch_key(seed: int, epoch: int) -> bytes:
    return hashlib.blake2b(f"swarmp2p.data:{seed}:{epoch}".encode(), digest_size=32).digest()


def _permute(index: int, size: int, key: bytes) -> int:
    """A keyed bijection of `range(size)`: a balanced Feistel network with cycle-walking.

    The network permutes `range(4**half)`, the smallest even power of two covering `size`
    (at most 4x larger); re-encrypting until the value falls below `size` stays within
    `index`'s cycle, so the result is a permutation of `range(size)`.
    """
    if size == 1:
        return 0
    half = ((size - 1).bit_length() + 1) // 2
    mask = (1 << half) - 1
    value = index
    while True:
        left, right = value >> half, value & mask
        for round_ in range(_FEISTEL_ROUNDS):
            digest = hashlib.blake2b(
                round_.to_bytes(1, "little") + right.to_bytes(8, "little"), key=key, digest_size=8
            ).digest()
            left, right = right, left ^ (int.from_bytes(digest, "little") & mask)
        value = (left << half) | right
        if value < size:
            return value
