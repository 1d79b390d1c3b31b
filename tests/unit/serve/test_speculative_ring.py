"""Speculative decoding across a ring of stage servers: greedy output is plain decoding's token
for token at 1, 2 and 3 stages; sampled output keeps its distribution (chi-square) and its
seed; every stage drops the rejected drafts; a recurrent model declines with its reason."""

from __future__ import annotations

import collections

import pytest
from ring_helpers import reference_generate, thread_ring

from swarmp2p.net import InProcLink
from swarmp2p.serve import GREEDY, Decode, Prefill, SamplingParams, decode_message

pytestmark = pytest.mark.torch

LOOP = [5, 17, 99, 3, 64, 21, 8] * 3 + [5, 17]
"""A prompt that repeats itself: prompt lookup finds drafts in it at once."""
NEW = 30
CUTS = {"1stage": [], "2stages": [2], "3stages": [1, 3]}


@pytest.mark.parametrize("cuts", list(CUTS.values()), ids=list(CUTS))
@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "qwen3_moe"])
def test_greedy_speculation_gives_plain_decodings_tokens(family, cuts, tiny_whole):
    """A dense model, one with a tied head (qwen3) and two MoEs: the ring with ngram and auto
    speculation gives the tokens of plain decoding (the ring without it, whose tokens
    model.generate's are: test_serve_stage_server); drafts were sent and some kept."""
    model = tiny_whole(family)
    with thread_ring(model, cuts) as ring:
        want = ring.generate(LOOP, max_tokens=NEW, timeout=60)
    for mode in ("ngram", "auto"):
        with thread_ring(model, cuts, speculate=mode) as ring:
            got = ring.generate(LOOP, max_tokens=NEW, timeout=60)
            stats = ring.spec_stats()
            drafted = [s.drafted for s in ring.servers]
        assert got == want, mode
        assert stats["drafted"] > 0 and stats["accepted"] > 0, stats
        assert stats["tokens_per_lap"] > 1.0, stats
        assert all(d > 0 for d in drafted), drafted  # every stage ran the drafted positions


def test_sessions_with_drafts_of_different_lengths_share_one_step(tiny_whole):
    """Several sessions in one group, some drafting and some not (padded to the longest
    draft): each gets its own plain decoding's tokens."""
    model = tiny_whole("llama")
    prompts = [LOOP, [9, 4, 33, 71, 2, 6], LOOP[3:], [12, 13, 12, 13, 12]]
    want = [reference_generate(model, p, 20) for p in prompts]
    with thread_ring(model, [2], speculate="ngram", groups=1) as ring:
        sessions = [ring.submit(p, max_tokens=20, stop_ids=[2]) for p in prompts]
        got = [s.result(60) for s in sessions]
        stats = ring.spec_stats()
        peak = [s.peak_batch for s in ring.servers]
    assert got == want
    assert stats["drafted"] > stats["accepted"] > 0, stats
    assert max(peak) > 1  # rows did share steps


def test_max_tokens_and_the_context_bound_the_drafts(tiny_whole):
    """A session near its max_tokens or the context gets no more tokens than plain decoding."""
    model = tiny_whole("llama")
    with thread_ring(model, [2], speculate="ngram", max_context=len(LOOP) + 9) as ring:
        short = ring.generate(LOOP, max_tokens=3, timeout=60)
        full = ring.generate(LOOP, max_tokens=40, timeout=60)
    with thread_ring(model, [2], max_context=len(LOOP) + 9) as ring:
        assert short == ring.generate(LOOP, max_tokens=3, timeout=60)
        assert full == ring.generate(LOOP, max_tokens=40, timeout=60)
    assert len(short) == 3 and len(full) == 9


@pytest.mark.parametrize("cuts", [[], [2]], ids=["1stage", "2stages"])
def test_a_hybrid_linear_attention_model_declines_with_its_reason(cuts, tiny_whole):
    """Qwen3.5's Gated DeltaNet blocks cannot take drafts back: the first such stage drops
    the drafts, the ring stops drafting and says why; the tokens are plain decoding's."""
    model = tiny_whole("qwen3_5")
    with thread_ring(model, cuts) as ring:
        want = ring.generate(LOOP, max_tokens=NEW, timeout=60)
    with thread_ring(model, cuts, speculate="auto") as ring:
        got = ring.generate(LOOP, max_tokens=NEW, timeout=60)
        assert "linear-attention" in ring.spec_off
        assert ring.spec_stats()["accepted"] == 0
        again = ring.generate(LOOP, max_tokens=NEW, timeout=60)
        assert ring.spec_stats()["drafted"] <= len(LOOP)  # it stopped drafting at once
    assert got == want == again


def test_a_session_can_turn_speculation_off(tiny_whole):
    """``speculate=False`` on submit (the seam a grammar-constrained session uses) and a
    session asking for log-probabilities never draft."""
    model = tiny_whole("llama")
    with thread_ring(model, [], speculate="ngram") as ring:
        off = ring.generate(LOOP, max_tokens=NEW, speculate=False, timeout=60)
        lp = ring.generate(
            LOOP, max_tokens=NEW, sampling=SamplingParams(temperature=0, logprobs=0), timeout=60
        )
        assert ring.spec_stats()["drafted"] == 0
        on = ring.generate(LOOP, max_tokens=NEW, timeout=60)
        assert ring.spec_stats()["drafted"] > 0
    assert off == lp == on


def _chi_square(a: collections.Counter, b: collections.Counter) -> tuple[float, int]:
    """Pearson's statistic of homogeneity of two samples' counts (categories whose expected
    count is under 5 pooled into one), and its degrees of freedom."""
    na, nb = sum(a.values()), sum(b.values())
    big, rest = [], (0, 0)
    for key in set(a) | set(b):
        pair = (a[key], b[key])
        if min(sum(pair) * na, sum(pair) * nb) / (na + nb) < 5:
            rest = (rest[0] + pair[0], rest[1] + pair[1])
        else:
            big.append(pair)
    if sum(rest):
        big.append(rest)
    stat = 0.0
    for x, y in big:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(big) - 1


def _chi2_999(df: int) -> float:
    """The chi-square distribution's 0.999 quantile (Wilson-Hilferty; within 2% from 1 degree
    of freedom up)."""
    z = 3.0902  # the standard normal's 0.999 quantile
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.slow
def test_sampled_tokens_keep_their_distribution_and_their_seed(tiny_whole):
    """400 seeded sessions with and without speculation: at each of the first positions the
    tokens' distribution is the same (chi-square homogeneity at p = 0.001, fixed seeds), and
    differs from top_k 2's (the test tells distributions apart), a
    seed reproduces its session's tokens, and drafts were verified (kept and rejected)."""
    model = tiny_whole("llama")
    runs = 400
    positions = 10
    # the prompt holds its own likely continuation: LOOP, what greedy decoding adds to it,
    # LOOP again; the lookup drafts that continuation
    prompt = LOOP + reference_generate(model, LOOP, 12) + LOOP

    def sample(mode, top_k=3):
        with thread_ring(
            model, [], speculate=mode, max_sessions=16, max_queue=runs, max_context=128
        ) as ring:
            sessions = [
                ring.submit(
                    prompt,
                    max_tokens=positions,
                    sampling=SamplingParams(temperature=0.7, top_k=top_k, seed=seed),
                )
                for seed in range(runs)
            ]
            return [s.result(120) for s in sessions], ring.spec_stats()

    plain, _ = sample("none")
    spec, stats = sample("ngram")
    assert stats["drafted"] > stats["accepted"] >= 20, stats
    # position-keyed draws: a seed's tokens are plain sampling's, drafts or none (a session
    # may differ only where a k+1-row forward's round-off moves a draw across a boundary)
    differ = [seed for seed, (a, b) in enumerate(zip(plain, spec)) if a != b]
    assert len(differ) <= runs // 200, differ
    for pos in range(1, positions):  # the first token comes from the prefill: never drafted
        stat, df = _chi_square(
            collections.Counter(t[pos] for t in plain), collections.Counter(t[pos] for t in spec)
        )
        assert df >= 1 and stat < _chi2_999(df), (pos, stat, df)
    again, _ = sample("ngram")
    assert again == spec
    hotter = sample("none", top_k=2)[0]
    worst = max(
        _chi_square(
            collections.Counter(t[pos] for t in plain), collections.Counter(t[pos] for t in hotter)
        )[0]
        / _chi2_999(max(1, len({t[pos] for t in plain + hotter}) - 1))
        for pos in range(1, positions)
    )
    assert worst > 1  # another distribution is told apart


def _two_stages(model):
    """Two stage servers of ``model`` and ``lap(msg)``: one message round both, by hand."""
    from swarmp2p.runtime.torch import build_stage
    from swarmp2p.runtime.torch.serve.server import StageServer

    stages = [build_stage(model, 0, 2), build_stage(model, 2, 4)]
    links = [InProcLink.pair() for _ in range(3)]
    servers = [
        StageServer(s, inbound=links[i][1], outbound=links[i + 1][0], max_context=64)
        for i, s in enumerate(stages)
    ]

    def lap(msg):
        parts = servers[0].handle([msg.encode()])
        assert len(parts) == 1
        if decode_message(parts[0][0]).op == "error":
            return decode_message(parts[0][0])
        (reply,) = servers[1].handle(parts[0])
        return decode_message(reply[0])

    return servers, lap


def test_every_stage_drops_rejected_drafts(tiny_whole):
    """A step with drafts the model rejects is answered with kept 0 and plain decoding's
    token; the last stage holds only the kept positions at once, the first learns it from the
    next step's position, and that step's token is plain decoding's too."""
    model = tiny_whole("llama")
    want = reference_generate(model, LOOP, 3)
    servers, lap = _two_stages(model)
    first = lap(Prefill(sid=1, pos=0, tokens=tuple(LOOP), sampling=GREEDY))
    assert first.tokens == (want[0],)
    p = len(LOOP)
    wrong = tuple((want[1] + d) % 100 + 3 for d in (1, 2, 3))
    assert wrong[0] != want[1]
    step = lap(
        Decode(group=0, step=1, sids=(1,), positions=(p,), tokens=(want[0],), drafts=(wrong,))
    )
    assert step.kept == (0,) and step.tokens == (want[1],)
    assert servers[1].sessions[1].length == p + 1  # at once
    assert servers[0].sessions[1].length == p + 4  # not yet: it wrote 1 + 3 positions
    nxt = lap(Decode(group=0, step=2, sids=(1,), positions=(p + 1,), tokens=(want[1],)))
    assert nxt.tokens == (want[2],) and nxt.kept == ()
    assert [s.sessions[1].length for s in servers] == [p + 2, p + 2]


def test_a_stage_rolls_back_no_further_than_the_speculative_step_wrote(tiny_whole):
    """A step at a position before the speculative step's first kept one (its newest token)
    is a lost message, not a rollback: the row is refused with the positions named."""
    model = tiny_whole("llama")
    _, lap = _two_stages(model)
    token = lap(Prefill(sid=1, pos=0, tokens=tuple(LOOP), sampling=GREEDY)).tokens[0]
    p = len(LOOP)
    lap(Decode(group=0, step=1, sids=(1,), positions=(p,), tokens=(token,), drafts=((4, 5),)))
    err = lap(Decode(group=0, step=2, sids=(1,), positions=(p,), tokens=(token,)))
    assert err.op == "error" and err.sids == (1,)
    assert f"position {p}, but the cache holds {p + 3}" in err.message
