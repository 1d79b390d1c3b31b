"""Speculative steps on a stage's batched decode state: rows with history take k + 1 tokens at
once, and a rejected draft is taken back (SessionBatch.rollback); the next step's logits equal
those of a run that never drafted."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from swarmp2p.runtime.torch import build_stage  # noqa: E402
from swarmp2p.runtime.torch.model.introspect import introspect  # noqa: E402

PROMPTS = ([5, 9, 3, 7, 11], [4, 8, 15])
DRAFTS = ([21, 22, 23], [31, 32, 33])
"""Each row's lap: its last real token, then three drafts (k = 3)."""
KEPT = (2, 0)
"""How many drafts each row keeps: row 0 two, row 1 none."""


def _whole_stage(tiny_whole, family):
    model = tiny_whole(family)
    return build_stage(model, 0, introspect(model).num_blocks)


def _reference(stage, tokens):
    """Logits after each of ``tokens`` for one session that never drafted (one row, one token
    a step after its prompt)."""
    batch = stage.new_batch([9], max_context=64)
    out = []
    with torch.inference_mode():
        for token in tokens:
            hidden = stage(torch.tensor([[token]]), cache=batch, hidden_only=True)
            out.append(stage.logits(hidden)[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3", "mixtral"])
def test_a_verification_step_and_its_rollback_leave_the_plain_runs_logits(tiny_whole, family):
    stage = _whole_stage(tiny_whole, family)
    batch = stage.new_batch([1, 2], max_context=64)
    width = max(len(p) for p in PROMPTS)
    with torch.inference_mode():
        batch.expect([len(p) for p in PROMPTS])
        padded = torch.tensor([p + [0] * (width - len(p)) for p in PROMPTS])
        stage(padded, cache=batch, hidden_only=True)
        # one lap: every row takes its draft (k + 1 = 4 positions, each at its own offset)
        lap = stage.logits(stage(torch.tensor(DRAFTS), cache=batch, hidden_only=True))
        for row, (prompt, draft) in enumerate(zip(PROMPTS, DRAFTS)):
            plain = _reference(stage, prompt + draft)[len(prompt) :]
            torch.testing.assert_close(lap[row], plain, atol=1e-5, rtol=1e-4)
        for row, (prompt, kept) in enumerate(zip(PROMPTS, KEPT)):
            batch.rollback(row, len(prompt) + 1 + kept)  # the first token, then `kept` drafts
        after = stage.logits(stage(torch.tensor([[40], [41]]), cache=batch, hidden_only=True))
    for row, (prompt, draft, kept, nxt) in enumerate(zip(PROMPTS, DRAFTS, KEPT, (40, 41))):
        plain = _reference(stage, prompt + draft[: 1 + kept] + [nxt])[-1]
        torch.testing.assert_close(after[row, -1], plain, atol=1e-5, rtol=1e-4)


def test_a_rollback_past_what_a_row_holds_is_refused(tiny_whole):
    stage = _whole_stage(tiny_whole, "llama")
    batch = stage.new_batch([1], max_context=64)
    with torch.inference_mode():
        stage(torch.tensor([[5, 6, 7]]), cache=batch, hidden_only=True)
    with pytest.raises(ValueError, match="holds 3 tokens, not 4"):
        batch.rollback(0, 4)


def test_a_recurrent_model_refuses_speculation_with_its_reason(tiny_whole):
    stage = _whole_stage(tiny_whole, "qwen3_5")
    batch = stage.new_batch([1, 2], max_context=64)
    with torch.inference_mode():
        batch.expect([3, 3])
        stage(torch.tensor([[5, 6, 7], [8, 9, 10]]), cache=batch, hidden_only=True)
        with pytest.raises(ValueError, match="recurrent blocks steps one token each"):
            stage(torch.tensor([[1, 2], [3, 4]]), cache=batch, hidden_only=True)
    with pytest.raises(ValueError, match="speculative decoding is off for this model"):
        batch.rollback(0, 2)
