"""A stage's prefix blocks: a warm session (its prefix's keys and values copied in, only the
rest prefilled) gives the cold session's logits, alone and beside others in one padded prefill,
two sessions sharing one prefix at once included."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from swarmp2p.runtime.torch import build_stage  # noqa: E402
from swarmp2p.runtime.torch.model.introspect import introspect  # noqa: E402
from swarmp2p.runtime.torch.serve.session_cache import PrefixStore  # noqa: E402

BLOCK = 4
SYSTEM = [5, 9, 3, 7, 11, 13, 2, 6]
"""Two blocks every session shares."""
ASKS = ([21, 22, 23], [31, 32], [41, 42, 43, 44, 45])


def _stage(tiny_whole, family):
    model = tiny_whole(family)
    return build_stage(model, 0, introspect(model).num_blocks)


def _prefill(stage, batch, rows):
    """One padded prefill of ``rows`` (each a list of new tokens); each row's last logits."""
    width = max(len(r) for r in rows)
    batch.expect([len(r) for r in rows])
    x = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    hidden = stage(x, cache=batch, hidden_only=True)
    last = torch.tensor([len(r) - 1 for r in rows])
    return stage.logits(hidden[torch.arange(len(rows)), last])


def _cold(stage, prompt, then):
    """A session alone and cold: its prompt's last logits, then the next step's."""
    batch = stage.new_batch([1], max_context=64)
    first = _prefill(stage, batch, [prompt])[0]
    nxt = stage.logits(stage(torch.tensor([[then]]), cache=batch, hidden_only=True))[0, -1]
    return first, nxt


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_warm_sessions_give_the_cold_sessions_logits(tiny_whole, family):
    stage = _stage(tiny_whole, family)
    store = PrefixStore()
    names = [b"sys0", b"sys1"]
    with torch.inference_mode():
        seed = stage.new_batch([1], max_context=64)
        _prefill(stage, seed, [SYSTEM + ASKS[0]])
        store.put(names, seed.read_blocks(0, 0, 2, BLOCK))
        assert store.nbytes > 0
        # rows 0 and 1 share the cached prefix at once; row 2 is a cold session beside them
        batch = stage.new_batch([2, 3, 4], max_context=64)
        batch.load_prefix(0, store.get(names))
        batch.load_prefix(1, store.get(names))
        assert batch.lengths == [8, 8, 0]
        warm = _prefill(stage, batch, [ASKS[0], ASKS[1], SYSTEM + ASKS[2]])
        nxt = stage.logits(stage(torch.tensor([[50], [51], [52]]), cache=batch, hidden_only=True))
        for row, then in enumerate((50, 51, 52)):
            first, after = _cold(stage, SYSTEM + ASKS[row], then)
            torch.testing.assert_close(warm[row], first, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(nxt[row, -1], after, atol=1e-5, rtol=1e-4)


def test_blocks_are_dropped_by_name_and_a_missing_one_is_named(tiny_whole):
    stage = _stage(tiny_whole, "llama")
    store = PrefixStore()
    with torch.inference_mode():
        batch = stage.new_batch([1], max_context=64)
        _prefill(stage, batch, [SYSTEM])
        store.put([b"a", b"b"], batch.read_blocks(0, 0, 2, BLOCK))
    full = store.nbytes
    store.drop([b"a"])
    assert store.nbytes == full // 2 and list(store.blocks) == [b"b"]
    with pytest.raises(KeyError, match="prefix block 61 is not cached"):
        store.get([b"a"])
    with pytest.raises(ValueError, match="holds 8 tokens, not 12"):
        batch.read_blocks(0, 0, 3, BLOCK)
    with pytest.raises(ValueError, match="already holds 8 tokens"):
        batch.load_prefix(0, store.get([b"b"]))


def test_a_recurrent_model_has_no_prefix_blocks(tiny_whole):
    stage = _stage(tiny_whole, "qwen3_5")
    with torch.inference_mode():
        batch = stage.new_batch([1], max_context=64)
        _prefill(stage, batch, [SYSTEM])
    with pytest.raises(ValueError, match="cannot be cached by prefix blocks"):
        batch.read_blocks(0, 0, 1, BLOCK)
