"""The last stage's loss runs the head chunk by chunk and equals the whole-logits loss."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.torch

torch = pytest.importorskip("torch")

from train_models import VOCAB, build_model  # noqa: E402

from swarmp2p.runtime.torch.model.stage import build_stage  # noqa: E402
from swarmp2p.runtime.torch.train.loss import chunked_head_loss, chunked_loss  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("backward_next", [False, True])
def test_chunked_head_loss_equals_the_whole_logits_loss(family, chunk, backward_next):
    torch.manual_seed(0)
    model = build_model(family)
    stage = build_stage(model, 2, 4)
    hidden = torch.randn(3, 11, model.config.hidden_size, requires_grad=True)
    labels = torch.randint(0, VOCAB, (3, 11))

    whole = chunked_loss(stage(hidden), labels, 10**6)
    whole.backward()
    expected = [hidden.grad.clone()] + [p.grad.clone() for p in stage.parameters()]
    for p in [hidden, *stage.parameters()]:
        p.grad = None

    loss = chunked_head_loss(
        stage.logits, stage(hidden, hidden_only=True), labels, chunk, backward_next=backward_next
    )
    loss.backward()
    got = [hidden.grad] + [p.grad for p in stage.parameters()]
    assert torch.allclose(loss, whole, atol=1e-6, rtol=0)
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("chunk", "backward_next", "chunks", "passes"),
    [(1000, True, 1, 1), (1000, False, 1, 2), (7, True, 5, 2), (7, False, 5, 2)],
)
def test_the_head_runs_again_in_backward_unless_one_chunk_is_backed_at_once(
    chunk, backward_next, chunks, passes
):
    """One chunk whose backward comes next keeps its logits (the head runs once); several
    chunks, or a backward that waits (GPipe), recompute each chunk's head in backward."""
    torch.manual_seed(0)
    stage = build_stage(build_model("llama"), 2, 4)
    hidden = torch.randn(3, 11, stage.config.hidden_size, requires_grad=True)  # 33 rows
    labels = torch.randint(0, VOCAB, (3, 11))
    calls = []
    head = lambda h: calls.append(h.shape[0]) or stage.logits(h)  # noqa: E731
    chunked_head_loss(head, hidden, labels, chunk, backward_next=backward_next).backward()
    assert len(calls) == chunks * passes and sum(calls) == 33 * passes


def test_logits_to_keep_is_the_last_rows_of_the_whole_head():
    torch.manual_seed(0)
    model = build_model("llama")
    stage = build_stage(model, 2, 4)
    hidden = torch.randn(2, 9, model.config.hidden_size)
    with torch.no_grad():
        full = stage(hidden)
        last = stage(hidden, logits_to_keep=1)
        two = stage(hidden, logits_to_keep=2)
    assert last.shape == (2, 1, VOCAB) and two.shape == (2, 2, VOCAB)
    # a matmul over fewer rows may block differently: equal to float32 round-off
    assert torch.allclose(last, full[:, -1:], atol=1e-6, rtol=0)
    assert torch.allclose(two, full[:, -2:], atol=1e-6, rtol=0)


def test_a_stage_without_the_head_refuses_logits():
    model = build_model("llama")
    stage = build_stage(model, 0, 2)
    with pytest.raises(RuntimeError, match="is not the last; it has no head"):
        stage.logits(torch.zeros(1, 1, model.config.hidden_size))
