"""The last stage's loss: mean next-token cross-entropy in float32, a chunk of tokens at a time.

Each chunk is recomputed in backward (``torch.utils.checkpoint``), so scoring holds one chunk's
float32 logits, never the whole sequence's (reference, "Long sequences").
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _chunked_mean(
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rows: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    *,
    what: str,
    recompute: bool,
) -> torch.Tensor:
    """The float32 mean over tokens of ``score(rows chunk, labels chunk)`` (a chunk's loss sum),
    ``chunk_tokens`` rows at a time; ``recompute``: each chunk under checkpoint."""
    flat = rows.reshape(-1, rows.shape[-1])
    flat_labels = labels.reshape(-1).to(flat.device)
    if flat.shape[0] != flat_labels.shape[0]:
        raise ValueError(f"{flat.shape[0]} {what} rows but {flat_labels.shape[0]} labels")
    total = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], chunk_tokens):
        part = flat[start : start + chunk_tokens]
        part_labels = flat_labels[start : start + chunk_tokens]
        if recompute:
            total = total + checkpoint(score, part, part_labels, use_reentrant=False)
        else:
            total = total + score(part, part_labels)
    return total / flat.shape[0]


def _chunk_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float(), labels, reduction="sum")


def chunked_loss(logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Mean next-token cross-entropy, scored ``chunk_tokens`` at a time in float32 (each chunk
    recomputed in backward), returned in the logits' dtype."""
    mean = _chunked_mean(
        _chunk_loss_sum,
        logits,
        labels,
        chunk_tokens,
        what="logits",
        recompute=logits.requires_grad,
    )
    return mean.to(logits.dtype)


def _head_loss_sum(head, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(head(hidden).float(), labels, reduction="sum")


def chunked_head_loss(
    head,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    *,
    backward_next: bool = False,
) -> torch.Tensor:
    """The float32 mean of ``chunked_loss`` of ``head(hidden)`` without ever holding the whole
    logits tensor: each chunk of ``chunk_tokens`` tokens runs the head and its float32 loss under
    checkpoint, so forward and backward keep one chunk's logits at a time (the reference's head
    loss; a 248k-token vocabulary at 4x2048 tokens is 8 GB of float32 logits otherwise). It stays
    float32 so a float16 stage can scale it before backward without overflowing.

    ``backward_next``: the caller runs this loss's backward before any other forward (the last
    stage under 1F1B). A loss of one chunk then keeps its logits for that backward instead of
    recomputing them: the recompute would rebuild the same chunk's logits in backward, so the
    peak is the same and the head's second forward is saved."""
    rows = hidden.numel() // max(hidden.shape[-1], 1)
    return _chunked_mean(
        functools.partial(_head_loss_sum, head),
        hidden,
        labels,
        chunk_tokens,
        what="hidden",
        recompute=torch.is_grad_enabled() and not (backward_next and rows <= chunk_tokens),
    )
