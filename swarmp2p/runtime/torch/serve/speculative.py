"""A stage server's half of speculative decoding (``serve.protocol``, "Speculative decoding"):
stage 0's input of a step with drafts, the last stage's verification of each row, and the
rollback an earlier stage makes when the row's next step says how many drafts were kept, and
stage 0's draft model's drafts in place of a step's asks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from swarmp2p.runtime.torch.model.introspect import LINEAR_ATTENTION
from swarmp2p.runtime.torch.serve.session_cache import SessionBatch
from swarmp2p.serve.decoding.speculate import MAX_DRAFT


def no_speculation(stage) -> str:
    """Why ``stage`` cannot run drafts (empty: it can): a recurrent block's state cannot take
    rejected tokens back."""
    if LINEAR_ATTENTION not in stage.block_types:
        return ""
    return (
        f"stage [{stage.layer_start}, {stage.layer_end}) has linear-attention (recurrent) "
        "blocks, whose state cannot take rejected drafts back: speculative decoding is off "
        "for this model"
    )


def draft_ids(
    tokens: Sequence[int], drafts: Sequence[Sequence[int]], vocab: int | None, device
) -> torch.Tensor:
    """Stage 0's ids of a step with drafts, ``[rows, 1 + longest draft]``: each row's newest
    token, its draft, then its newest token again as padding (rejected like a wrong draft)."""
    wide = 1 + max(len(d) for d in drafts)
    ids = [[t, *d, *([t] * (wide - 1 - len(d)))] for t, d in zip(tokens, drafts)]
    top = max(max(row) for row in ids)
    if vocab is not None and top >= vocab:
        raise ValueError(f"token id {top} is outside the vocabulary ({vocab} ids)")
    return torch.tensor(ids, dtype=torch.long, device=device)


def verify_rows(samplers, logits: torch.Tensor, drafts, positions, batch: SessionBatch, width):
    """The last stage: each row's token after its kept drafts (``logits``: ``[rows, width,
    V]``), as ``(rows, failed, forced)``: ``(row, token, logprobs, kept)`` per row that picked,
    ``(row, message)`` per row whose pick failed (its grammar allowed nothing, its sampling
    was not finite): such a row fails alone, not its group; and per picked row the ids its
    grammar forces next (its next draft). The rows' caches keep only the kept positions."""
    rows, failed, forced = [], [], []
    for row, sampler in enumerate(samplers):
        draft = drafts[row] if drafts else ()
        try:
            if draft:
                n, token, lp = sampler.verify(logits[row, : len(draft) + 1], draft)
            else:
                n, (token, lp) = 0, sampler.pick(logits[row, 0])
            sampler.observe((token,))
        except ValueError as e:
            failed.append((row, str(e)))
            continue
        if width > 1:  # the rejected drafts (and a shorter row's padding) leave the cache
            batch.rollback(row, positions[row] + 1 + n)
        rows.append((row, token, lp, n))
        forced.append(forced_ids(sampler))
    return rows, failed, forced


def forced_ids(sampler) -> tuple[int, ...]:
    """The ids a session's grammar forces after its last token (at most a draft's worth);
    () when it forces none or has no grammar. A matcher that cannot say forces nothing: the
    session's next pick reports the grammar's error."""
    try:
        return sampler.forced(MAX_DRAFT)
    except ValueError:
        return ()


def draft_step(drafter, sessions, msg):
    """Stage 0's draft model on a step that ``asks``: the step with each row's ``asks[i]``
    greedy drafts in their place, less the rows it cannot draft, and ``(sid, why)`` for those
    (a session not open or still prefilling drafts nothing: the stage refuses it next)."""
    rows, drafts, failed = [], [], []
    for i, (sid, pos, token, k) in enumerate(zip(msg.sids, msg.positions, msg.tokens, msg.asks)):
        session = sessions.get(sid)
        try:
            if session is None or session.prefilling:
                draft: tuple[int, ...] = ()
            else:
                draft = drafter.propose(sid, pos, token, k)
        except ValueError as e:
            failed.append((sid, str(e)))
            continue
        rows.append(i)
        drafts.append(draft)
    step = replace(
        msg,
        sids=tuple(msg.sids[i] for i in rows),
        positions=tuple(msg.positions[i] for i in rows),
        tokens=tuple(msg.tokens[i] for i in rows),
        asks=(),
        drafts=tuple(drafts) if rows else (),
    )
    return step, failed


def take_back(session, pos: int) -> None:
    """A row's step after a speculative one at an earlier stage: its position says how many of
    the tokens that step wrote the last stage kept; drop the rest, never past the floor (the
    row's newest token then)."""
    if session is None or session.floor is None:
        return
    floor, session.floor = session.floor, None
    if session.batch is not None and floor <= pos < session.length:
        session.batch.rollback(session.row, pos)


__all__ = ["draft_ids", "draft_step", "forced_ids", "no_speculation", "take_back", "verify_rows"]
