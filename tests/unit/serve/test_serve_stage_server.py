"""Stage servers on threads: greedy output equals model.generate, boundaries, sessions."""

from __future__ import annotations

import threading
import time

import pytest
from ring_helpers import reference_generate, thread_ring, thread_stages

from swarmp2p.net import InProcLink, Link
from swarmp2p.serve import (
    GREEDY,
    Decode,
    End,
    GenerationError,
    Prefill,
    RingClient,
    SamplingParams,
    decode_message,
)

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


@pytest.mark.parametrize(
    ("family", "spec"),
    [("llama", "fixed_int8"), ("qwen3_5", "fixed_int8"), ("llama", "fixed_int2")],
)
def test_fixed_int_boundaries_equal_generate_with_the_same_quantization(family, spec, tiny_whole):
    """Boundary 0 crosses as codes, boundary 1 is quantized in the graph: both match one
    process applying the same per-token quantization at both cuts."""
    model = tiny_whole(family)
    cuts, compression = [1, 3], [spec, spec]
    want = reference_generate(model, PROMPT, NEW, cuts=cuts, compression=compression)
    if spec == "fixed_int2":  # coarse enough to change the text: the reference applies it
        assert want != reference_generate(model, PROMPT, NEW)
    with thread_ring(model, cuts, compression=compression, codes=[True, False]) as ring:
        got = ring.generate(PROMPT, max_tokens=NEW, sampling=GREEDY, stop_ids=[2], timeout=60)
    assert got == want


@pytest.mark.parametrize("compression", ["fixed_int8", "fixed_int4", "fp16"])
def test_both_boundary_paths_give_the_same_tokens_and_codes_are_smaller(compression, tiny_whole):
    model = tiny_whole("llama")
    results = {}
    for codes in (False, True):
        with thread_ring(model, [2], compression=[compression], codes=[codes]) as ring:
            results[codes] = ring.generate(PROMPT, max_tokens=NEW, sampling=GREEDY, timeout=60)
            results[codes, "bytes"] = ring.boundary_bytes()
    assert results[True] == results[False]
    assert results[True, "bytes"][0] < results[False, "bytes"][0]


def test_four_concurrent_sessions_each_produce_their_solo_output(tiny_whole):
    model = tiny_whole("qwen3_5")
    prompts = [PROMPT, [9, 8, 7], [100, 1, 50, 60, 70, 80, 90, 11, 12], [42]]
    samplings = [GREEDY, GREEDY, SamplingParams(temperature=0.9, seed=7), GREEDY]
    with thread_ring(model, [1, 3]) as ring:
        solo = [
            ring.generate(p, max_tokens=NEW, sampling=s, timeout=60)
            for p, s in zip(prompts, samplings)
        ]
        sessions = [ring.submit(p, max_tokens=NEW, sampling=s) for p, s in zip(prompts, samplings)]
        together = [s.result(60) for s in sessions]
        assert ring.active == 0
    assert together == solo
    assert len({tuple(t) for t in solo}) == 4


PROMPTS = [[5 + i * 7 % 100 for i in range(n)] for n in (1, 3, 14, 6, 9, 2, 11, 5)]
BUDGETS = [10, 6, 12, 8, 4, 11, 7, 9]
"""Eight sessions of different prompt lengths and lengths of output: they leave at different
steps."""


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3_5", "qwen3_moe"])
@pytest.mark.parametrize("cuts", [[], [2], [1, 3]], ids=["1stage", "2stages", "3stages"])
def test_eight_batched_sessions_each_produce_their_solo_output(family, cuts, tiny_whole):
    """Greedy parity under continuous batching: five sessions start together, three more join
    while they decode, all leave at different steps; a seeded sampled one is its solo self too."""
    model = tiny_whole(family)
    samplings = [GREEDY] * 8
    samplings[3] = SamplingParams(temperature=0.9, seed=11)
    with thread_ring(model, cuts) as ring:
        solo = [
            ring.generate(p, max_tokens=n, sampling=s, timeout=60)
            for p, n, s in zip(PROMPTS, BUDGETS, samplings)
        ]
        first = [
            ring.submit(p, max_tokens=n, sampling=s)
            for p, n, s in zip(PROMPTS[:5], BUDGETS[:5], samplings[:5])
        ]
        while len(first[0].tokens) < 3 and not first[0].done.is_set():
            first[0].done.wait(0.002)
        later = [
            ring.submit(p, max_tokens=n, sampling=s)
            for p, n, s in zip(PROMPTS[5:], BUDGETS[5:], samplings[5:])
        ]
        together = [s.result(60) for s in first + later]
        peaks = [server.peak_batch for server in ring.servers]
        groups = len(ring.group_sizes)
        assert ring.active == 0
    assert together == solo
    assert solo[0] == reference_generate(model, PROMPTS[0], BUDGETS[0])
    assert max(peaks) >= 3, peaks  # the sessions really ran batched
    assert groups == len(cuts) + 1  # one group per stage, so every stage computes


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "qwen3_moe", "mixtral"])
def test_packed_stages_answer_as_generate_alone_and_batched(family, tiny_whole):
    """A CPU serve worker packs its linear layers for oneDNN: each session's greedy output is
    still model.generate's on the plain model, alone and with seven others batched."""
    model = tiny_whole(family)
    want = [reference_generate(model, p, n) for p, n in zip(PROMPTS, BUDGETS)]
    with thread_ring(model, [2], pack=True) as ring:
        solo = [
            ring.generate(p, max_tokens=n, sampling=GREEDY, timeout=60)
            for p, n in zip(PROMPTS, BUDGETS)
        ]
        streams = [ring.submit(p, max_tokens=n, sampling=GREEDY) for p, n in zip(PROMPTS, BUDGETS)]
        together = [s.result(60) for s in streams]
        peaks = [server.peak_batch for server in ring.servers]
    assert solo == want
    assert together == want
    assert max(peaks) >= 3, peaks


def test_sampling_seed_repeats_and_differs(tiny_whole):
    model = tiny_whole("llama")
    hot = SamplingParams(temperature=1.5, seed=3)
    with thread_ring(model, [2]) as ring:
        a = ring.generate(PROMPT, max_tokens=NEW, sampling=hot, timeout=60)
        b = ring.generate(PROMPT, max_tokens=NEW, sampling=hot, timeout=60)
        c = ring.generate(
            PROMPT, max_tokens=NEW, sampling=SamplingParams(temperature=1.5, seed=4), timeout=60
        )
        greedy = ring.generate(PROMPT, max_tokens=NEW, sampling=GREEDY, timeout=60)
        top1 = ring.generate(
            PROMPT, max_tokens=NEW, sampling=SamplingParams(top_k=1, seed=5), timeout=60
        )
        nucleus = ring.generate(
            PROMPT, max_tokens=NEW, sampling=SamplingParams(top_p=1e-6, seed=6), timeout=60
        )
    assert a == b
    assert a != c
    assert top1 == greedy == nucleus


def test_stop_rule_max_tokens_and_context(tiny_whole):
    model = tiny_whole("llama")
    with thread_ring(model, [2], max_context=12) as ring:
        full = ring.generate(PROMPT, max_tokens=3, timeout=60)
        assert len(full) == 3
        session = ring.submit(PROMPT, max_tokens=3, stop=lambda toks: toks[-1] == full[1])
        assert session.result(60) == full[:2]
        assert session.finish_reason == "stop"
        session = ring.submit(PROMPT, max_tokens=50)
        assert len(session.result(60)) == 12 - len(PROMPT)
        assert session.finish_reason == "length"
        session = ring.submit(PROMPT, max_tokens=50, stop_ids=[full[0]])
        assert session.result(60) == full[:1]
        assert session.finish_reason == "stop"
        with pytest.raises(ValueError, match="prompt: 12 tokens, the context holds 12"):
            ring.submit(list(range(3, 15)), max_tokens=1)


def test_a_stage_refusing_a_step_fails_the_request_with_its_reason(tiny_whole):
    model = tiny_whole("llama")
    with thread_ring(model, [2]) as ring:
        ring.max_context = 1000  # the manager lets it through; the stages hold 64
        session = ring.submit(list(range(3, 73)), max_tokens=2)
        with pytest.raises(GenerationError, match=r"stage \[0, 2\).*over max_context 64"):
            session.result(60)
        ring.max_context = 64
        assert ring.generate(PROMPT, max_tokens=2, timeout=60)  # the ring still serves


def test_silent_ring_fails_within_the_step_timeout():
    to_stage0, stage0_in = InProcLink.pair()
    _from_last, manager_in = InProcLink.pair()
    with RingClient(to_stage0, manager_in, max_context=64, step_timeout=0.3) as ring:
        session = ring.submit(PROMPT, max_tokens=2)
        with pytest.raises(GenerationError, match=r"no token from the ring within 0\.3 s"):
            session.result(5)
        assert stage0_in.recv(1)  # the prefill went out; nobody answered
        to_stage0.close()
        with pytest.raises(GenerationError, match="cannot reach stage 0"):
            ring.submit(PROMPT, max_tokens=2).result(5)


class _DyingLink(Link):
    """The manager's link to a stage host that dies after ``alive`` messages: later sends
    vanish, as they do into a SIGKILLed host's socket."""

    def __init__(self, link: Link, alive: int) -> None:
        self.link, self.alive = link, alive
        self.bytes_sent = self.bytes_received = 0

    def send(self, parts, timeout=None):
        self.alive -= 1
        if self.alive >= 0:
            self.link.send(parts, timeout)

    def recv(self, timeout):
        return self.link.recv(timeout)

    def close(self):
        self.link.close()


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_reroute_replays_sessions_onto_a_new_ring_with_the_same_greedy_output(family, tiny_whole):
    model = tiny_whole(family)
    want = reference_generate(model, PROMPT, NEW)
    with thread_stages(model, [2]) as (first, last, _):
        ring = RingClient(_DyingLink(first, alive=4), last, max_context=64, step_timeout=30)
        with ring:
            session = ring.submit(PROMPT, max_tokens=NEW, stop_ids=[2])
            deadline = time.monotonic() + 30
            while len(session.tokens) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)
            assert len(session.tokens) == 4 and not session.done.is_set()  # stalled
            with thread_stages(model, [1, 3]) as (first2, last2, _):  # re-placed, cut elsewhere
                ring.reroute(first2, last2)
                assert session.result(30) == want


def test_bfloat16_stages_equal_generate_in_bfloat16(tiny_checkpoint):
    import torch
    from tiny_models import load_whole

    model = load_whole(tiny_checkpoint("llama"), dtype=torch.bfloat16)
    want = reference_generate(model, PROMPT, NEW)
    with thread_ring(model, [1, 3]) as ring:  # bfloat16 hidden states cross as raw 16 bits
        assert ring.generate(PROMPT, max_tokens=NEW, stop_ids=[2], timeout=60) == want
    cuts, compression = [1, 3], ["fixed_int8", "fixed_int8"]
    want = reference_generate(model, PROMPT, NEW, cuts=cuts, compression=compression)
    with thread_ring(model, cuts, compression=compression, codes=[True, False]) as ring:
        assert ring.generate(PROMPT, max_tokens=NEW, stop_ids=[2], timeout=60) == want


def _ask(first, last, message, payload=()):
    first.send([message.encode(), *payload])
    return decode_message(last.recv(30)[0])


def _step(sid, pos, token, *, group=0, step=1):
    return Decode(group=group, step=step, sids=(sid,), positions=(pos,), tokens=(token,))


def test_the_protocol_at_the_stages_sessions_positions_and_room(tiny_whole):
    model = tiny_whole("llama")
    with thread_stages(model, [2], max_sessions=2) as (first, last, _):
        greedy = SamplingParams(temperature=0)
        a = _ask(first, last, Prefill(sid=1, tokens=(5, 6), sampling=greedy))
        assert (a.op, a.sids, a.positions, a.group) == ("tokens", (1,), (2,), -1)
        b = _ask(first, last, Prefill(sid=2, tokens=(7,), sampling=greedy))
        assert b.op == "tokens"
        full = _ask(first, last, Prefill(sid=3, tokens=(7,)))
        assert full.op == "error" and "already holds 2 sessions (max_sessions 2)" in full.message
        lost = _ask(first, last, _step(1, 5, a.tokens[0]))
        assert (
            lost.op == "error" and "the cache holds 2 tokens (a message was lost)" in lost.message
        )
        gone = _ask(first, last, _step(1, 2, a.tokens[0]))
        assert gone.op == "error" and "session 1 is not open here" in gone.message
        first.send([End(sid=2).encode()])
        again = _ask(first, last, Prefill(sid=3, tokens=(7,), sampling=greedy))
        assert again.op == "tokens" and again.tokens == b.tokens  # same prompt, same token
        wild = _ask(first, last, _step(3, 1, 500))
        assert (
            wild.op == "error"
            and "token id 500 is outside the vocabulary (128 ids)" in wild.message
        )
        c = _ask(first, last, Prefill(sid=4, tokens=(9, 9, 9), sampling=greedy))
        d = _ask(first, last, Prefill(sid=5, tokens=(9,), sampling=greedy))
        assert (c.op, d.op) == ("tokens", "tokens")
        # one step of a group: a row the stages do not hold fails alone, the others go on
        both = Decode(
            group=1,
            step=4,
            sids=(4, 99, 5),
            positions=(3, 0, 1),
            tokens=(c.tokens[0], 1, d.tokens[0]),
        )
        first.send([both.encode()])
        replies = [decode_message(last.recv(30)[0]) for _ in range(2)]
        error = next(r for r in replies if r.op == "error")
        step = next(r for r in replies if r.op == "tokens")
        assert error.sids == (99,) and "session 99 is not open here" in error.message
        assert (step.group, step.step, step.sids, step.positions) == (1, 4, (4, 5), (4, 2))
        assert step.sizes == (2, 2)  # each stage ran the two rows as one batch


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(tiny_whole):
    """A 40-token prompt goes through in 8-token chunks; a running session's decode steps
    keep going meanwhile, and every output equals its solo run."""
    model = tiny_whole("llama")
    long_prompt = [(7 * i) % 120 + 3 for i in range(40)]
    with thread_ring(model, [2], max_context=64, prefill_chunk=8) as ring:
        before = ring.servers[0].steps
        solo_long = ring.generate(long_prompt, max_tokens=6, timeout=60)
        assert ring.servers[0].steps - before == 40 // 8 + 5  # 5 chunks, then 5 decode steps
        solo_short = ring.generate(PROMPT, max_tokens=NEW, timeout=60)
        short = ring.submit(PROMPT, max_tokens=NEW)
        while len(short.tokens) < 2:
            short.done.wait(0.01)
        long = ring.submit(long_prompt, max_tokens=6)
        assert long.result(60) == solo_long
        assert short.result(60) == solo_short
    assert solo_long == reference_generate(model, long_prompt, 6)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_caches_grow_past_their_first_capacity_in_a_batch(family, tiny_whole):
    """Sessions outgrow the first 64-token allocation while batched (the rows are copied into
    a larger capacity), prompts go in 16-token chunks, and Mistral's 4-token sliding window
    masks each row at its own position: every output equals generate's."""
    model = tiny_whole(family)
    long_prompt = [(11 * i) % 120 + 3 for i in range(58)]
    with thread_ring(model, [2], max_context=128, prefill_chunk=16, groups=1) as ring:
        sessions = [ring.submit(long_prompt, max_tokens=20), ring.submit(PROMPT, max_tokens=20)]
        got = [s.result(60) for s in sessions]
        assert [server.peak_batch for server in ring.servers] == [2, 2]
    assert got[0] == reference_generate(model, long_prompt, 20)
    assert got[1] == reference_generate(model, PROMPT, 20)


@pytest.mark.parametrize(("family", "rows", "forwards"), [("llama", 4, 1), ("qwen3_5", 2, 3)])
def test_prompts_waiting_together_prefill_as_one_forward_and_decode_as_if_alone(
    family, rows, forwards, tiny_whole
):
    """Four new sessions' prompts (7, 3, 9 and 3 tokens) wait at the stages together: an
    attention model prefills all four as ONE forward per stage, padded on the right; a hybrid
    batches only prompts of one width (padding would enter its recurrent state). Then the four
    decode as one group in the batch their prefill left, padding and all: every session's
    tokens equal generate's for it alone."""
    model = tiny_whole(family)
    prompts = [PROMPT, [9, 8, 7], [100, 1, 50, 60, 70, 80, 90, 11, 12], [42, 43, 44]]
    servers: list = []
    hold = threading.Event()
    with thread_stages(model, [2], servers=servers, hold=hold) as (first, last, _):
        for sid, prompt in enumerate(prompts, 1):
            first.send([Prefill(sid=sid, tokens=tuple(prompt), sampling=GREEDY).encode()])
        hold.set()
        replies = [decode_message(last.recv(30)[0]) for _ in prompts]
        assert [r.op for r in replies] == ["tokens"] * 4, replies
        got = {r.sids[0]: list(r.tokens) for r in replies}
        assert [s.steps for s in servers] == [forwards, forwards]
        assert [s.peak_prefill_rows for s in servers] == [rows, rows]
        sids = (1, 2, 3, 4)
        for step in range(1, NEW):
            positions = tuple(len(p) + step - 1 for p in prompts)
            first.send(
                [
                    Decode(
                        group=0,
                        step=step,
                        sids=sids,
                        positions=positions,
                        tokens=tuple(got[sid][-1] for sid in sids),
                    ).encode()
                ]
            )
            reply = decode_message(last.recv(30)[0])
            assert (reply.op, reply.sids, reply.sizes) == ("tokens", sids, (4, 4)), reply
            for sid, token in zip(sids, reply.tokens):
                got[sid].append(token)
    for sid, prompt in zip(sids, prompts):
        want = reference_generate(model, prompt, NEW)  # ends at the end-of-sequence id
        assert got[sid][: len(want)] == want, sid


@pytest.mark.parametrize(("min_rows", "sizes"), [(1, [2, 3]), (4, [1, 4])])
def test_a_group_fills_to_min_group_rows_before_the_next_starts(min_rows, sizes, tiny_whole):
    """Five sessions on two groups: spread over both by default, four in one first when a
    group must hold four rows before the next starts (stages sharing one machine)."""
    model = tiny_whole("llama")
    with thread_ring(model, [2], groups=2, min_group_rows=min_rows) as ring:
        solo = ring.generate(PROMPT, max_tokens=30, timeout=60)
        sessions = [ring.submit(PROMPT, max_tokens=30) for _ in range(5)]
        deadline = time.monotonic() + 60
        while sum(ring.group_sizes) < 5 and time.monotonic() < deadline:
            time.sleep(0.002)
        assert sorted(ring.group_sizes) == sizes
        assert [s.result(60) for s in sessions] == [solo] * 5
