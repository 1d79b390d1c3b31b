"""Stage servers on threads: greedy output equals model.generate, boundaries, sessions."""

from __future__ import annotations

import pytest
from ring_helpers import reference_generate, thread_ring

pytestmark = pytest.mark.torch

PROMPT = [5, 17, 99, 3, 64, 21, 8]
NEW = 12


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("cuts", [[2], [1, 3]], ids=["2stages", "3stages"])
def test_greedy_equals_generate(family, cuts, tiny_whole):
    model = tiny_whole(family)
    want = reference_generate(model, PROMPT, NEW)
    with thread_ring(model, cuts) as ring:
        got = ring.generate(PROMPT, max_tokens=NEW, stop_ids=[2], timeout=60)
    assert got == want
