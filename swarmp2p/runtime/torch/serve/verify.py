"""Speculative decoding's verification at the last stage: which drafted tokens to keep.

One lap computed the model's next-token distribution after the prefix and after each drafted
token (``k + 1`` rows). Greedy: keep the drafts that equal the model's argmax, then the argmax
after them: the plain decoding's tokens exactly. Sampling: the standard rejection rule
(Leviathan et al. 2023, Chen et al. 2023): draft ``x`` drawn from ``q`` is kept with
probability ``min(1, p(x) / q(x))``; at the first rejection the token is drawn from the
residual ``max(0, p - q)`` renormalised; if all are kept, one more from the last row. The kept
tokens are distributed exactly as plain sampling from ``p``. A prompt-lookup draft is
deterministic: ``q`` is one-hot at ``x``, so ``x`` is kept with probability ``p(x)`` and the
residual is ``p`` without ``x``. Draws come from the session's seeded generator, so a seed
reproduces a run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarmp2p.serve.decoding.speculate import accepted_prefix


def verify_greedy(scores: torch.Tensor, draft: Sequence[int]) -> tuple[int, int]:
    """``scores``: ``[len(draft) + 1, vocab]`` (logits after the session's processors).
    Returns ``(kept, token)``: how many drafts the argmax confirms, and the argmax after them."""
    check_rows(scores, draft)
    choices = torch.argmax(scores, dim=-1).tolist()
    kept = accepted_prefix(draft, choices)
    return kept, int(choices[kept])


def verify_sampled(
    probs: torch.Tensor,
    draft: Sequence[int],
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[int, int]:
    """``probs``: ``[len(draft) + 1, vocab]``, the model's sampling distribution at each row
    (after temperature, top-k/p); ``draft_probs``: ``[len(draft), vocab]``, the drafter's
    (None: a deterministic draft, one-hot). Returns ``(kept, token)``."""
    check_rows(probs, draft)
    if draft_probs is not None and draft_probs.shape != (len(draft), probs.shape[1]):
        raise ValueError(
            f"draft_probs has shape {tuple(draft_probs.shape)}, not {(len(draft), probs.shape[1])}"
        )
    for i, token in enumerate(draft):
        q_row = draft_probs[i] if draft_probs is not None else None
        resampled = reject_or_keep(probs[i], token, generator, q_row)
        if resampled is not None:
            return i, resampled
    last = probs[len(draft)]
    return len(draft), int(torch.multinomial(last / last.sum(), 1, generator=generator))


def reject_or_keep(
    p: torch.Tensor,
    token: int,
    generator: torch.Generator | None,
    q: torch.Tensor | None = None,
) -> int | None:
    """One drafted ``token`` under the model's distribution ``p`` (``[vocab]``) and the
    drafter's ``q`` (None: a deterministic draft): None when it is kept (probability
    ``min(1, p/q)``), else the token drawn from the residual ``max(0, p - q)`` in its place."""
    p_x = float(p[token])
    q_x = float(q[token]) if q is not None else 1.0
    u = float(torch.rand((), generator=generator))
    if q_x > 0 and u < min(1.0, p_x / q_x):
        return None
    residual = p.clone()
    if q is None:
        residual[token] = 0.0
    else:
        residual = torch.clamp(residual - q, min=0.0)
    total = float(residual.sum())
    if total <= 0.0:  # p == q: a rejection cannot happen; guard against round-off
        residual, total = p.clone(), float(p.sum())
    return int(torch.multinomial(residual / total, 1, generator=generator))


def check_rows(rows: torch.Tensor, draft: Sequence[int]) -> None:
    """ValueError unless ``rows`` is ``[len(draft) + 1, vocab]`` and every draft is an id."""
    if rows.dim() != 2 or rows.shape[0] != len(draft) + 1:
        raise ValueError(
            f"verification needs {len(draft) + 1} rows (the drafts + 1), got shape "
            f"{tuple(rows.shape)}"
        )
    if any(not 0 <= t < rows.shape[1] for t in draft):
        raise ValueError(f"a drafted id is outside the vocabulary of {rows.shape[1]}")


__all__ = ["check_rows", "reject_or_keep", "verify_greedy", "verify_sampled"]
