"""The prefix cache's index: chained block names, reuse of the longest cached run, LRU within
a budget, blocks in use never dropped, a rebuilt ring cold."""

from __future__ import annotations

import pytest

from swarmp2p.serve.decoding.prefix import BLOCK_TOKENS, PrefixIndex, block_hashes

B = BLOCK_TOKENS
SYSTEM = list(range(100, 100 + 3 * B))
"""A three-block system prompt every chat shares."""


def test_block_names_are_chained_and_salted():
    a = block_hashes(SYSTEM + [1] * 5)
    assert len(a) == 3  # the partial block has no name
    b = block_hashes([7, *SYSTEM[1:]])  # first token differs: every later name differs
    assert all(x != y for x, y in zip(a, b))
    assert block_hashes(SYSTEM[:B]) == a[:1]
    assert block_hashes(SYSTEM, salt=b"adapter-1") != a  # another adapter shares nothing


def test_a_second_session_reuses_the_shared_prefix_and_prefills_only_the_rest():
    index = PrefixIndex(capacity=64)
    first = index.plan(1, [*SYSTEM, 1, 2, 3])
    assert first.reuse == () and len(first.keep) == 3 and first.drop == ()
    index.stored(1)
    index.release(1)
    second = index.plan(2, [*SYSTEM, 9, 9])
    assert second.reuse == first.keep and second.reused_tokens == 3 * B and second.keep == ()
    assert index.hit_rate == 0.5 and index.reused_tokens == 3 * B


def test_the_last_token_is_always_prefilled():
    index = PrefixIndex(capacity=64)
    index.plan(1, SYSTEM)
    index.stored(1)
    index.release(1)
    again = index.plan(2, SYSTEM)  # the same prompt of whole blocks
    assert len(again.reuse) == 2  # the third block is computed again: logits to sample from


def test_least_recently_used_blocks_go_first_and_blocks_in_use_never():
    index = PrefixIndex(capacity=4)
    a = index.plan(1, list(range(2 * B + 1)))  # 2 blocks, pinned by session 1
    b = index.plan(2, list(range(1000, 1000 + 2 * B + 1)))  # 2 more: full
    assert len(a.keep) == len(b.keep) == 2 and len(index) == 4
    c = index.plan(3, list(range(5000, 5000 + 2 * B + 1)))
    assert c.keep == () and c.drop == ()  # everything is in use: nothing dropped, nothing kept
    for sid in (1, 2, 3):
        index.stored(sid)
        index.release(sid)
    index.plan(4, [*list(range(2 * B)), 7])  # session 1's prefix used again: most recent now
    index.release(4)
    d = index.plan(5, list(range(9000, 9000 + 2 * B + 1)))
    assert set(d.drop) == set(b.keep) and len(d.keep) == 2  # session 2's, the oldest, went
    assert len(index) == 4


def test_a_rebuilt_ring_starts_cold():
    index = PrefixIndex(capacity=8)
    index.plan(1, [*SYSTEM, 1])
    index.stored(1)
    index.clear()
    assert len(index) == 0 and index.plan(2, [*SYSTEM, 1]).reuse == ()


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="-1 blocks"):
        PrefixIndex(capacity=-1)
    index = PrefixIndex(capacity=8)
    index.plan(1, SYSTEM)
    with pytest.raises(ValueError, match="already has a prefix plan"):
        index.plan(1, SYSTEM)


def test_blocks_still_being_written_are_not_reused_nor_kept_twice():
    index = PrefixIndex(capacity=64)
    first = index.plan(1, [*SYSTEM, 1, 2])
    # session 2 arrives while session 1's prefill is still in the ring: it computes the
    # shared blocks itself and keeps none of them (session 1 writes them)
    second = index.plan(2, [*SYSTEM, 3, 4])
    assert second.reuse == () and second.keep == () and index.pending == 3
    index.stored(1)
    third = index.plan(3, [*SYSTEM, 5, 6])
    assert third.reuse == first.keep and index.pending == 0


def test_a_session_that_ends_before_its_blocks_are_written_leaves_them_to_be_dropped():
    index = PrefixIndex(capacity=64)
    first = index.plan(1, [*SYSTEM, 1])
    index.release(1)  # cancelled mid-prefill: some stages may hold its blocks, some not
    assert len(index) == 0
    again = index.plan(2, [*SYSTEM, 1])
    assert again.reuse == () and set(again.drop) == set(first.keep) and again.keep == first.keep


def test_a_chain_is_evicted_from_its_tail():
    index = PrefixIndex(capacity=3)
    chain = index.plan(1, [*SYSTEM, 1])
    index.stored(1)
    index.release(1)
    other = index.plan(2, list(range(7000, 7000 + B + 1)))  # one block: room for it goes
    assert other.drop == chain.keep[-1:]  # the chain's last block, its first two still reusable
    index.stored(2)
    index.release(2)
    assert index.plan(3, [*SYSTEM, 2]).reuse == chain.keep[:2]


def test_stats_count_lookups_hits_and_reused_tokens():
    index = PrefixIndex(capacity=64)
    index.plan(1, [*SYSTEM, 1])
    index.stored(1)
    index.plan(2, [*SYSTEM, 2])
    stats = index.stats()
    assert stats["lookups"] == 2 and stats["hits"] == 1 and stats["hit_rate"] == 0.5
    assert stats["reused_tokens"] == 3 * B and stats["prompt_tokens"] == 2 * (3 * B + 1)
    assert stats["blocks"] == 3 and stats["capacity"] == 64
