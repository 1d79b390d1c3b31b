"""Speculative decoding with a draft model at stage 0: greedy output is plain decoding's token
for token at 1, 2 and 3 stages (a dense model and a tied head), a seed's sampled tokens are
plain sampling's, the draft model's cache rolls back with the stages' after rejections, a
draft model with another vocabulary is refused by name, and recurrent stages decline."""

from __future__ import annotations

import copy
import json

import pytest
from ring_helpers import reference_generate, thread_ring

from swarmp2p.serve import SamplingParams

pytestmark = pytest.mark.torch

PROMPT = [5, 17, 99, 3, 64, 21, 8, 40, 11, 77]
"""An open-ended prompt: prompt lookup finds nothing to draft in it, a draft model does."""
NEW = 24
CUTS = {"1stage": [], "2stages": [2], "3stages": [1, 3]}


def _drafter(model):
    from swarmp2p.runtime.torch.serve.draft import DraftModel

    return DraftModel(model, name="tiny-draft")


def _weaker(model, layers=1):
    from swarmp2p.runtime.torch.serve.draft import truncated_copy

    return truncated_copy(model, layers)


@pytest.mark.parametrize("cuts", list(CUTS.values()), ids=list(CUTS))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_output_with_a_draft_model_is_plain_decodings(family, cuts, tiny_whole):
    """The model drafting for itself (every draft kept) and another random model of the same
    vocabulary (an untied llama: a tiny tied head repeats its input, which a tied drafter would
    guess; drafts rejected, so every cache rolls back) give plain decoding's tokens; every
    stage ran the drafted positions."""
    from tiny_models import build_model

    model = tiny_whole(family)
    want = reference_generate(model, PROMPT, NEW)
    for draft, full in ((copy.deepcopy(model), True), (build_model("llama", seed=7), False)):
        drafter = _drafter(draft)
        with thread_ring(model, cuts, speculate="draft", drafter=drafter) as ring:
            got = ring.generate(PROMPT, max_tokens=NEW, timeout=60)
            stats = ring.spec_stats()
            drafted = [s.drafted for s in ring.servers]
        assert got == want, (family, full)
        assert stats["drafted"] > 0 and all(d > 0 for d in drafted), (stats, drafted)
        if full:
            assert stats["accepted"] == stats["drafted"], stats
            assert stats["tokens_per_lap"] > 2.0, stats
        else:
            assert stats["accepted"] < stats["drafted"], stats
        assert drafter.drafted == stats["drafted"]


def test_auto_uses_the_draft_model_and_ngram_ignores_it(tiny_whole):
    """``auto`` with a draft model drafts with it (an open-ended prompt: prompt lookup would
    find nothing); ``ngram`` keeps prompt lookup and leaves the draft model idle."""
    model = tiny_whole("llama")
    want = reference_generate(model, PROMPT, NEW)
    drafter = _drafter(copy.deepcopy(model))
    with thread_ring(model, [2], speculate="auto", drafter=drafter) as ring:
        assert ring.generate(PROMPT, max_tokens=NEW, timeout=60) == want
        assert ring.spec_stats()["accepted"] > 0
    used = drafter.drafted
    assert used > 0
    with thread_ring(model, [2], speculate="ngram", drafter=drafter) as ring:
        assert ring.generate(PROMPT, max_tokens=NEW, timeout=60) == want
    assert drafter.drafted == used


def test_sessions_of_one_group_draft_apart_and_roll_back(tiny_whole):
    """Four sessions in one group, two of them sharing a prompt, with a weak drafter (drafts
    rejected at different points per row): each gets its own plain decoding's tokens, and the
    draft model holds no session once they ended."""
    model = tiny_whole("llama")
    prompts = [PROMPT, [9, 4, 33, 71, 2, 6], PROMPT, [12, 13, 12, 13, 12]]
    want = [reference_generate(model, p, 20) for p in prompts]
    drafter = _drafter(_weaker(model, 2))
    with thread_ring(model, [2], speculate="draft", drafter=drafter, groups=1) as ring:
        sessions = [ring.submit(p, max_tokens=20, stop_ids=[2]) for p in prompts]
        got = [s.result(60) for s in sessions]
        stats = ring.spec_stats()
    assert got == want
    assert stats["drafted"] > stats["accepted"] > 0, stats
    assert not drafter.rows


def test_the_draft_cache_after_rejections_equals_a_fresh_one(tiny_whole):
    """After drafts the target rejects, the draft model's cache of a session is cropped to
    the kept tokens: its next draft equals the draft of a draft model that never drafted."""
    model = tiny_whole("llama")
    weak = _weaker(model)
    drafter = _drafter(weak)
    drafter.open(1, None)
    drafter.extend(1, 0, PROMPT)
    p = len(PROMPT)
    first = drafter.propose(1, p, 7, 5)  # writes positions p .. p + 4 into its cache
    # the target kept one draft and then picked 30: the next step is at p + 2 with token 30
    again = drafter.propose(1, p + 2, 30, 4)
    fresh = _drafter(copy.deepcopy(weak))
    fresh.open(1, None)
    fresh.extend(1, 0, [*PROMPT, 7, first[0]])
    assert again == fresh.propose(1, p + 2, 30, 4)
    row = drafter.rows[1]  # p + 2 tokens, 30 and the first 3 of its 4 drafts
    assert row.cached == row.cache.get_seq_length() == p + 2 + 1 + 3


def test_seeded_sampling_with_a_draft_model_is_plain_samplings(tiny_whole):
    """Position-keyed draws: with a draft model a seed's sampled tokens are plain sampling's
    token for token (the draft's rows shift no draw), and they repeat under the seed."""
    model = tiny_whole("llama")
    drafter = _drafter(copy.deepcopy(model))
    params = [SamplingParams(temperature=0.8, top_k=5, seed=s) for s in range(6)]
    with thread_ring(model, [2]) as ring:
        plain = [ring.generate(PROMPT, max_tokens=16, sampling=p, timeout=60) for p in params]
    with thread_ring(model, [2], speculate="draft", drafter=drafter) as ring:
        spec = [ring.generate(PROMPT, max_tokens=16, sampling=p, timeout=60) for p in params]
        stats = ring.spec_stats()
        again = ring.generate(PROMPT, max_tokens=16, sampling=params[0], timeout=60)
    assert stats["drafted"] > stats["accepted"] > 0, stats  # greedy drafts vs sampled tokens
    assert spec == plain
    assert again == spec[0]


def test_a_stage_0_without_a_draft_model_declines_by_name(tiny_whole):
    """A ring told its stage 0 drafts, whose stage 0 has no draft model: the first step says
    so in spec_off, drafting stops, and the tokens are plain decoding's."""
    model = tiny_whole("llama")
    want = reference_generate(model, PROMPT, NEW)
    with thread_ring(model, [2], speculate="draft", draft_model=True) as ring:
        assert ring.generate(PROMPT, max_tokens=NEW, timeout=60) == want
        assert "no draft model at stage 0" in ring.spec_off
        assert ring.spec_stats()["drafted"] == 0


def test_draft_mode_needs_a_draft_model():
    from swarmp2p.serve.scheduler import Scheduler

    with pytest.raises(ValueError, match="--draft MODEL"):
        Scheduler(
            max_context=64, max_sessions=1, step_timeout=1, queue_timeout=1, speculate="draft"
        )


def test_recurrent_stages_decline_with_their_reason(tiny_whole):
    """Qwen3.5's linear-attention blocks cannot take rejected drafts back: the ring stops
    drafting with that reason, whatever drafts them, and the tokens are plain decoding's."""
    model = tiny_whole("qwen3_5")
    with thread_ring(model, [2]) as ring:
        want = ring.generate(PROMPT, max_tokens=NEW, timeout=60)
    drafter = _drafter(_weaker(tiny_whole("llama")))
    with thread_ring(model, [2], speculate="draft", drafter=drafter) as ring:
        got = ring.generate(PROMPT, max_tokens=NEW, timeout=60)
        assert "linear-attention" in ring.spec_off
        assert ring.spec_stats()["accepted"] == 0
    assert got == want


def _folder(tmp_path, name, vocab, words):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    tok = {"model": {"vocab": {w: i for i, w in enumerate(words)}}, "added_tokens": []}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return folder


def test_a_draft_model_with_another_vocabulary_is_refused_by_name(tmp_path):
    from swarmp2p.serve.decoding.draft import check_draft_compatible

    target = _folder(tmp_path, "target", 4, ["a", "b", "c", "d"])
    same = _folder(tmp_path, "same", 4, ["a", "b", "c", "d"])
    other = _folder(tmp_path, "other", 4, ["a", "b", "d", "c"])
    check_draft_compatible(target, same)
    with pytest.raises(ValueError, match=r"draft model .*other.* tokenizer of .*target"):
        check_draft_compatible(target, other)
    bare_t, bare_d = tmp_path / "bare_t", tmp_path / "bare_d"
    bare_t.mkdir(), bare_d.mkdir()
    (bare_t / "config.json").write_text(json.dumps({"vocab_size": 128}))
    (bare_d / "config.json").write_text(json.dumps({"vocab_size": 256}))
    with pytest.raises(ValueError, match=r"vocab_size 256.*bare_t.*vocab_size 128"):
        check_draft_compatible(bare_t, bare_d)


def test_a_warm_prefix_cache_session_drafts_from_its_reused_blocks_ids(tiny_whole):
    """A session whose prompt starts with cached blocks prefills only the rest, yet the draft
    model sees its whole prompt (the blocks' ids are kept beside the stage's keys and values,
    by name): every draft kept (the model drafts for itself), tokens plain decoding's; the
    ids leave with the blocks."""
    model = tiny_whole("llama")
    system = [(7 * i + 3) % 120 + 3 for i in range(2 * 16)]  # two whole 16-token blocks
    drafter = _drafter(copy.deepcopy(model))
    with thread_ring(
        model, [2], speculate="draft", drafter=drafter, max_context=128, prefix_blocks=64
    ) as ring:
        for ask in ([9, 4, 33], [12, 13, 14, 15]):
            prompt = system + ask
            got = ring.generate(prompt, max_tokens=NEW, timeout=60)
            assert got == reference_generate(model, prompt, NEW)
        assert ring.prefix_stats["hits"] == 1
        stats = ring.spec_stats()
        blocks = set(ring.servers[0].prefix.blocks)
    assert stats["drafted"] > 0 and stats["accepted"] == stats["drafted"], stats
    assert set(drafter.block_ids) == blocks and len(blocks) == 2


def test_a_row_its_draft_model_cannot_draft_fails_alone(tiny_whole):
    """A step asking drafts for two rows, one of which the draft model does not hold (its
    state was lost): that session fails with the draft model's reason, the other row's step
    runs and gets plain decoding's token."""
    from swarmp2p.net import InProcLink
    from swarmp2p.runtime.torch import build_stage
    from swarmp2p.runtime.torch.serve.server import StageServer
    from swarmp2p.serve import GREEDY, Decode, Prefill, decode_message

    model = tiny_whole("llama")
    drafter = _drafter(copy.deepcopy(model))
    server = StageServer(
        build_stage(model, 0, 4),
        inbound=InProcLink.pair()[1],
        outbound=InProcLink.pair()[0],
        max_context=64,
        drafter=drafter,
    )
    firsts = {}
    for sid in (1, 2):
        (reply,) = server.handle(
            [Prefill(sid=sid, pos=0, tokens=tuple(PROMPT), sampling=GREEDY).encode()]
        )
        firsts[sid] = decode_message(reply[0]).tokens[0]
    drafter.rows[2].ids.clear()  # the draft model lost session 2
    p = len(PROMPT)
    step = Decode(
        group=0, step=1, sids=(1, 2), positions=(p, p), tokens=(firsts[1], firsts[2]), asks=(3, 3)
    )
    replies = [decode_message(r[0]) for r in server.handle([step.encode()])]
    (failed,) = [r for r in replies if r.op == "error"]
    (tokens,) = [r for r in replies if r.op == "tokens"]
    assert failed.sids == (2,) and "session 2 drafts at position" in failed.message
    assert tokens.sids == (1,) and tokens.kept == (3,)
    want = reference_generate(model, PROMPT, 5)
    assert [firsts[1], *tokens.accepted[0], *tokens.tokens] == want
    assert 2 not in server.sessions and 1 in server.sessions
