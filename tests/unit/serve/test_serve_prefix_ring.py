"""The prefix cache across a ring of stage servers: warm sessions give the cold sessions'
tokens at 1, 2 and 3 stages, eviction under a small cache keeps the index and every stage's
store in agreement, sessions sharing a prefix at once are correct, a rebuilt ring starts cold,
and a stage refuses a plan naming a block it does not hold."""

from __future__ import annotations

import pytest
from ring_helpers import reference_generate, thread_ring, thread_stages

from swarmp2p.serve import Prefill, RingClient, decode_message
from swarmp2p.serve.decoding.prefix import BLOCK_TOKENS, PrefixPlan
from swarmp2p.wire import WireError

pytestmark = pytest.mark.torch

SYSTEM = [(7 * i + 3) % 90 + 5 for i in range(2 * BLOCK_TOKENS + 3)]
"""Two whole blocks and a bit that every session's prompt starts with."""
ASKS = ([11, 12, 13], [21, 22], [31, 32, 33, 34], [41])
NEW = 8


def _agree(ring) -> None:
    """Every stage holds exactly the blocks the index says the ring holds."""
    index = ring._scheduler.prefix
    for server in ring.servers:
        assert set(server.prefix.blocks) == set(index._blocks) or index.pending


@pytest.mark.parametrize("cuts", [[], [2], [1, 3]], ids=["1stage", "2stages", "3stages"])
def test_warm_sessions_give_the_cold_sessions_tokens(cuts, tiny_whole):
    model = tiny_whole("llama")
    with thread_ring(model, cuts, max_context=128, prefix_blocks=64) as ring:
        for ask in ASKS:
            prompt = SYSTEM + ask
            got = ring.generate(prompt, max_tokens=NEW, timeout=60)
            assert got == reference_generate(model, prompt, NEW)
        stats = ring.prefix_stats
        assert stats["hits"] == len(ASKS) - 1
        assert stats["reused_tokens"] == (len(ASKS) - 1) * 2 * BLOCK_TOKENS
        _agree(ring)
        assert all(len(s.prefix.blocks) == 2 for s in ring.servers)


def test_eviction_under_a_small_cache_stays_correct_and_in_agreement(tiny_whole):
    model = tiny_whole("llama")
    prompts = [[base + i for i in range(2 * BLOCK_TOKENS + 2)] for base in (5, 40, 5, 70, 40)]
    with thread_ring(model, [2], max_context=128, prefix_blocks=3) as ring:
        for prompt in prompts:
            assert ring.generate(prompt, max_tokens=NEW, timeout=60) == reference_generate(
                model, prompt, NEW
            )
            _agree(ring)
            assert all(len(s.prefix.blocks) <= 3 for s in ring.servers)
        assert ring.prefix_stats["hits"] >= 1


def test_sessions_sharing_a_prefix_at_once_are_correct(tiny_whole):
    model = tiny_whole("llama")
    with thread_ring(model, [2], max_context=128, prefix_blocks=64) as ring:
        ring.generate([*SYSTEM, 9], max_tokens=2, timeout=60)  # the prefix is cached
        sessions = [ring.submit(SYSTEM + ask, max_tokens=NEW) for ask in ASKS]
        # and three more arrive while none of those has its first token: they compute the
        # blocks a cold one of them keeps, and reuse none not yet written
        cold = [ring.submit([3, *SYSTEM, *ask], max_tokens=NEW) for ask in ASKS[:3]]
        for session, ask in zip(sessions, ASKS):
            assert session.result(60) == reference_generate(model, SYSTEM + ask, NEW)
        for session, ask in zip(cold, ASKS):
            assert session.result(60) == reference_generate(model, [3, *SYSTEM, *ask], NEW)
        assert ring.prefix_stats["hits"] >= len(ASKS)
        _agree(ring)


def test_a_rebuilt_ring_starts_cold_and_is_correct(tiny_whole):
    model = tiny_whole("llama")
    prompt = SYSTEM + ASKS[0]
    want = reference_generate(model, prompt, NEW)
    with thread_stages(model, [2], max_context=128) as (first, last, _):
        client = RingClient(first, last, max_context=128, prefix_blocks=64).start()
        try:
            assert client.generate(prompt, max_tokens=NEW, timeout=60) == want
            assert client.prefix_stats["blocks"] == 2
            with thread_stages(model, [2], max_context=128) as (first2, last2, _):
                client.reroute(first2, last2)
                assert client.prefix_stats["blocks"] == 0  # the new stages hold nothing
                assert client.generate(prompt, max_tokens=NEW, timeout=60) == want
                assert client.generate(prompt, max_tokens=NEW, timeout=60) == want
                assert client.prefix_stats["hits"] == 1  # the third session, on the new ring
        finally:
            client.close()


def test_a_stage_refuses_a_block_it_does_not_hold(tiny_whole):
    model = tiny_whole("llama")
    servers: list = []
    with thread_stages(model, [], max_context=128, servers=servers):
        server = servers[0]
        plan = PrefixPlan(reuse=(b"\x01" * 16,), keep=(), drop=())
        msg = Prefill(sid=5, pos=BLOCK_TOKENS, tokens=(1, 2, 3), prefix=plan)
        (reply,) = server.handle([msg.encode()])
    failed = decode_message(reply[0])
    assert failed.sids == (5,) and "is not cached on this stage" in failed.message


@pytest.mark.parametrize(
    ("prefix", "field"),
    [
        ({"reuse": [b"x" * 15]}, "prefix.reuse"),
        ({"keep": [b"x" * 16, b"x" * 16]}, "prefix.keep"),
        ({"drop": "all"}, "prefix.drop"),
        ({"reuse": [], "evict": []}, "prefix"),
        ([], "prefix"),
        ({"reuse": [b"y" * 16], "keep": [b"y" * 16]}, "prefix.keep"),
    ],
)
def test_bad_prefix_plans_are_refused_naming_the_field(prefix, field):
    import msgpack

    pos = BLOCK_TOKENS if isinstance(prefix, dict) and prefix.get("reuse") else 0
    body = {"op": "prefill", "sid": 1, "pos": pos, "tokens": [1], "prefix": prefix}
    with pytest.raises(WireError, match=rf"^.*{field}:"):
        decode_message(msgpack.packb(body, use_bin_type=True))


def test_a_prefix_plan_goes_with_the_chunk_after_its_reused_tokens():
    import msgpack

    body = {"op": "prefill", "sid": 1, "pos": 0, "tokens": [1], "prefix": {"reuse": [b"z" * 16]}}
    with pytest.raises(WireError, match="prefix: reuses 16 tokens"):
        decode_message(msgpack.packb(body, use_bin_type=True))
    plan = PrefixPlan(reuse=(b"z" * 16,), keep=(b"k" * 16,), drop=(b"d" * 16,))
    msg = Prefill(sid=1, pos=BLOCK_TOKENS, tokens=(1,), prefix=plan)
    assert decode_message(msg.encode()) == msg
