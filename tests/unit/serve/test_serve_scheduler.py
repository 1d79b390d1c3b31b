"""The ring's scheduler as tables: plain records and messages in, the messages for stage 0 and
each session's events out, a clock passed in; no sockets, no threads."""

from __future__ import annotations

import pytest

from swarmp2p.serve.protocol import (
    GREEDY,
    Decode,
    End,
    Failed,
    Prefill,
    SamplingParams,
    TokenLogprobs,
    Tokens,
)
from swarmp2p.serve.scheduler import (
    Outcome,
    Scheduler,
    SessionState,
    check_request,
    next_stage_work,
)

PROMPT = (5, 6, 7)


def _scheduler(**kw) -> Scheduler:
    kw = {"max_context": 64, "max_sessions": 4, "step_timeout": 10.0, "queue_timeout": 5.0} | kw
    return Scheduler(**kw)


def _session(sid: int, **kw) -> SessionState:
    kw = {"prompt": PROMPT, "max_tokens": 8, "sampling": GREEDY} | kw
    return SessionState(sid=sid, **kw)


def _sends(out: Outcome) -> list[tuple]:
    """Each message for stage 0, briefly: ("prefill", sid, tokens), ("decode", group, step,
    sids, positions, tokens), ("end", sid)."""
    brief = []
    for msg, _ in out.sends:
        if isinstance(msg, Prefill):
            brief.append(("prefill", msg.sid, msg.tokens))
        elif isinstance(msg, Decode):
            brief.append(("decode", msg.group, msg.step, msg.sids, msg.positions, msg.tokens))
        elif isinstance(msg, End):
            brief.append(("end", msg.sid))
        else:
            raise AssertionError(f"unexpected message {msg}")
    return brief


def _events(out: Outcome) -> list[tuple]:
    return [(s.sid, kind, value) for s, kind, value in out.events]


def _first_token(sched: Scheduler, session: SessionState, token: int, now: float) -> Outcome:
    """The last stage's answer to a session's prefill."""
    reply = Tokens(
        group=-1, step=0, sids=(session.sid,), positions=(session.expect,), tokens=(token,)
    )
    return sched.on_tokens(reply, now)


def _answer(sched: Scheduler, out: Outcome, tokens, now: float, sizes=()) -> Outcome:
    """The last stage's answer to the (only) decode step in ``out``."""
    (step,) = [m for m, _ in out.sends if isinstance(m, Decode)]
    reply = Tokens(
        group=step.group,
        step=step.step,
        sids=step.sids,
        positions=tuple(p + 1 for p in step.positions),
        tokens=tuple(tokens),
        sizes=sizes,
    )
    return sched.on_tokens(reply, now)


# --- admission -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_sessions", "max_queue", "submitted", "running", "queued", "refused"),
    [
        (2, 1, 1, 1, 0, 0),
        (2, 1, 2, 2, 0, 0),
        (2, 1, 3, 2, 1, 0),
        (2, 1, 4, 2, 1, 1),
        (1, 0, 3, 1, 0, 2),
        (3, 2, 7, 3, 2, 2),
    ],
)
def test_admission_runs_up_to_the_bound_queues_up_to_the_queue_then_refuses(
    max_sessions, max_queue, submitted, running, queued, refused
):
    sched = _scheduler(max_sessions=max_sessions, max_queue=max_queue)
    outs = [sched.submit(_session(sid), now=0.0) for sid in range(1, submitted + 1)]
    assert (sched.active, sched.queue_depth) == (running, queued)
    assert [o.refused is not None for o in outs] == [False] * (submitted - refused) + [
        True
    ] * refused
    prefills = [s for o in outs for s in _sends(o)]
    assert prefills == [("prefill", sid, PROMPT) for sid in range(1, running + 1)]
    if refused:
        assert outs[-1].refused == (
            f"all {max_sessions} session slots are taken and {queued} requests wait for one; "
            "retry later"
        )
    assert sorted(sched.sessions) == list(range(1, running + queued + 1))


def test_the_queue_defaults_to_four_per_slot_and_bad_limits_are_named():
    assert _scheduler(max_sessions=3).max_queue == 12
    for kw, match in (
        ({"max_sessions": 0}, "max_sessions: 0 is not an integer >= 1"),
        ({"groups": 0}, "groups: 0 is not an integer >= 1 or None"),
        ({"min_group_rows": 1.5}, "min_group_rows: 1.5 is not an integer >= 1"),
    ):
        with pytest.raises(ValueError, match=match):
            _scheduler(**kw)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "match"),
    [
        ((), 2, "at least one token"),
        ((2**31,), 2, r"token id 2147483648 is not an integer in \[0, 2147483647\]"),
        ((True,), 2, "token id True"),
        (tuple(range(64)), 2, "64 tokens, the context holds 64"),
        (PROMPT, 0, "max_tokens: 0 is not an integer >= 1"),
        (PROMPT, 2.0, "max_tokens: 2.0"),
    ],
)
def test_bad_requests_are_named(prompt, max_tokens, match):
    with pytest.raises(ValueError, match=match):
        check_request(prompt, max_tokens, 64)
    assert check_request([5, 6], 1, 64) == (5, 6)


@pytest.mark.parametrize(("waited", "failed"), [(4.9, False), (5.0, False), (5.1, True)])
def test_a_request_that_waits_past_the_queue_timeout_fails_as_busy(waited, failed):
    sched = _scheduler(max_sessions=1)
    sched.submit(_session(1), now=0.0)
    queued = _session(2)
    sched.submit(queued, now=1.0)
    out = sched.tick(now=1.0 + waited)
    if not failed:
        assert out.events == [] and queued.state == "queued"
        return
    assert _events(out) == [(2, "error", "waited 5 s for a session slot (all 1 busy); retry later")]
    assert queued.busy and queued.retry_after >= 1 and sched.queue_depth == 0
    assert _sends(out) == []  # it never reached the ring: nothing to free


def test_an_ending_session_frees_its_slot_for_the_first_waiting():
    sched = _scheduler(max_sessions=1)
    running, first, second = _session(1), _session(2), _session(3)
    for s in (running, first, second):
        sched.submit(s, now=0.0)
    out = sched.cancel(running, "enough", now=1.0)
    assert _events(out) == [(1, "error", "enough")]
    assert _sends(out) == [("end", 1), ("prefill", 2, PROMPT)]
    assert (first.state, second.state, first.admitted_at) == ("prefill", "queued", 1.0)
    assert sched.cancel(running, "again", now=2.0) == Outcome()  # finished: a no-op


def test_a_closed_scheduler_admits_nobody():
    sched = _scheduler(max_sessions=1)
    running, queued = _session(1), _session(2)
    sched.submit(running, 0.0)
    sched.submit(queued, 0.0)
    sched.close()
    assert sched.submit(_session(3), 0.0).refused == "the ring client was closed"
    out = sched.cancel(running, "bye", 1.0)
    assert _sends(out) == [("end", 1)] and queued.state == "queued"


# --- groups ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("groups", "min_rows", "sessions", "sizes", "steps"),
    [
        (1, 1, 3, (3,), [(0, (1,))]),
        (2, 1, 3, (2, 1), [(0, (1,)), (1, (2,))]),
        (3, 1, 3, (1, 1, 1), [(0, (1,)), (1, (2,)), (2, (3,))]),
        (2, 2, 3, (2, 1), [(0, (1,)), (1, (3,))]),
        (2, 8, 4, (4, 0), [(0, (1,))]),
        (2, 2, 5, (3, 2), [(0, (1,)), (1, (3,))]),
    ],
)
def test_sessions_join_the_smallest_group_filling_to_min_group_rows(
    groups, min_rows, sessions, sizes, steps
):
    """Each session's first token comes back while the groups' first steps are in the ring:
    an idle group steps at once with its joiner; a running one takes it at its next step."""
    sched = _scheduler(max_sessions=8, groups=groups, min_group_rows=min_rows)
    _learn_stages(sched, 2)
    sent = []
    for sid in range(1, sessions + 1):
        session = _session(sid)
        sched.submit(session, 0.0)
        sent += _sends(_first_token(sched, session, 100 + sid, 0.1))
    assert sched.group_sizes == sizes
    assert sent == [
        # group 0's first step was the warm-up session's
        ("decode", g, 2 if g == 0 else 1, sids, (3,) * len(sids), tuple(100 + s for s in sids))
        for g, sids in steps
    ]


def _learn_stages(sched: Scheduler, stages: int) -> None:
    """One session of two tokens goes round a ring of ``stages`` and ends (groups are made
    once a step's ``sizes`` tell the stages)."""
    warm = _session(1000, max_tokens=2)
    sched.submit(warm, 0.0)
    _answer(sched, _first_token(sched, warm, 1, 0.0), [2], 0.0, sizes=(1,) * stages)
    assert warm.finish_reason == "length"


def test_groups_grow_to_as_many_as_the_stages_a_step_went_through():
    sched = _scheduler()
    a, b = _session(1), _session(2)
    sched.submit(a, 0.0)
    first = _first_token(sched, a, 9, 0.1)
    assert sched.group_sizes == (1,) and sched.stages == 0
    _answer(sched, first, [10], 0.2, sizes=(1, 1, 1))
    assert (sched.stages, sched.stage_batch_sizes, sched.group_sizes) == (3, (1, 1, 1), (1, 0, 0))
    sched.submit(b, 0.3)
    out = _first_token(sched, b, 11, 0.4)
    assert _sends(out) == [("decode", 1, 1, (2,), (3,), (11,))]  # the idle group, at once


def test_a_joiner_waits_for_its_groups_next_step_and_steps_at_its_position():
    sched = _scheduler(groups=1)
    a, b = _session(1), _session(2, prompt=(1, 2, 3, 4, 5))
    sched.submit(a, 0.0)
    sched.submit(b, 0.0)
    step1 = _first_token(sched, a, 20, 0.1)
    assert _sends(_first_token(sched, b, 30, 0.1)) == []  # group 0 is in the ring
    step2 = _answer(sched, step1, [21], 0.2)
    assert _sends(step2) == [("decode", 0, 2, (1, 2), (4, 5), (21, 30))]
    assert _events(step2) == [(1, "token", 21)]
    step3 = _answer(sched, step2, [22, 31], 0.3)
    assert _sends(step3) == [("decode", 0, 3, (1, 2), (5, 6), (22, 31))]
    assert (a.tokens, b.tokens) == ([20, 21, 22], [30, 31])


def test_logprobs_and_times_are_kept_per_token():
    sched = _scheduler()
    a = _session(1)
    sched.submit(a, 1.0)
    lp = TokenLogprobs(logprob=-0.5, top=((4, -0.5),))
    reply = Tokens(group=-1, step=0, sids=(1,), positions=(3,), tokens=(4,), logprobs=(lp,))
    out = sched.on_tokens(reply, 2.5)
    _answer(sched, out, [5], 3.0)
    assert a.logprobs == [lp, None]
    assert (a.started, a.admitted_at, a.first_token_at, a.last_activity) == (1.0, 1.0, 2.5, 3.0)


# --- finish rules ------------------------------------------------------------------------------


def _explode(tokens):
    return 1 / 0


@pytest.mark.parametrize(
    ("kw", "max_context", "feed", "tokens", "last_events"),
    [
        ({"stop_ids": frozenset({9})}, 64, [4, 9, 5], [4, 9], [("token", 9), ("done", "stop")]),
        ({"stop": lambda t: t[-1] == 7}, 64, [4, 7, 5], [4, 7], [("token", 7), ("done", "stop")]),
        ({"max_tokens": 2}, 64, [4, 5, 6], [4, 5], [("token", 5), ("done", "length")]),
        ({"max_tokens": 20}, 6, [4, 5, 6, 7], [4, 5, 6], [("token", 6), ("done", "length")]),
        ({"max_tokens": 1}, 64, [4], [4], [("token", 4), ("done", "length")]),
        (
            {"stop_ids": frozenset({4}), "max_tokens": 1},  # both: the stop id says why
            64,
            [4],
            [4],
            [("token", 4), ("done", "stop")],
        ),
        (
            {"stop": _explode},
            64,
            [4, 5],
            [4],
            [("error", "the stop rule failed: ZeroDivisionError: division by zero")],
        ),
    ],
)
def test_each_finish_rule_ends_the_session_after_its_token(
    kw, max_context, feed, tokens, last_events
):
    """The rules in order after every token: a stop id, the stop rule, then max_tokens or the
    context; the session leaves its group, its caches are freed, its last event says why."""
    sched = _scheduler(max_context=max_context)
    session = _session(1, **kw)
    sched.submit(session, 0.0)
    events, sends = [], []
    out = _first_token(sched, session, feed[0], 0.1)
    for token in feed[1:]:
        events += _events(out)
        sends += _sends(out)
        if session.state == "done":
            break
        out = _answer(sched, out, [token], 0.2)
    else:
        events += _events(out)
        sends += _sends(out)
    assert session.tokens == tokens
    assert [(kind, value) for _, kind, value in events][-len(last_events) :] == last_events
    assert sends[-1] == ("end", 1)
    assert sched.active == 0 and sched.group_sizes == (0,)
    reason = last_events[-1][1] if last_events[-1][0] == "done" else None
    assert session.finish_reason == reason and session.state == "done"


# --- deadlines, cancel, failures -----------------------------------------------------------------


@pytest.mark.parametrize(("silent", "failed"), [(9.9, False), (10.0, False), (10.5, True)])
def test_a_silent_session_fails_after_the_step_timeout(silent, failed):
    sched = _scheduler()
    session = _session(1)
    sched.submit(session, 0.0)
    step = _first_token(sched, session, 4, 1.0)  # a token resets the clock
    out = sched.tick(1.0 + silent)
    if not failed:
        assert out == Outcome() and session.state == "decode"
        return
    assert _events(out) == [
        (1, "error", "no token from the ring within 10 s; a stage is down or overloaded")
    ]
    assert _sends(out) == [("end", 1)]
    assert _answer(sched, step, [5], 12.0) == Outcome()  # its late answer is dropped


def test_cancelling_one_of_a_group_leaves_the_others_stepping():
    sched = _scheduler(groups=1)
    a, b = _session(1), _session(2)
    for s in (a, b):
        sched.submit(s, 0.0)
    step = _first_token(sched, a, 4, 0.1)
    _first_token(sched, b, 6, 0.1)
    step = _answer(sched, step, [5], 0.2)  # b joined: (1, 2) in the ring
    out = sched.cancel(b, "the client left", 0.3)
    assert (_sends(out), _events(out)) == ([("end", 2)], [(2, "error", "the client left")])
    nxt = _answer(sched, step, [7, 8], 0.4)  # b's row in the answer is dropped
    assert _sends(nxt) == [("decode", 0, 3, (1,), (5,), (7,))]
    assert b.tokens == [6] and a.tokens == [4, 5, 7]


def test_a_stage_failure_fails_the_sessions_it_names():
    sched = _scheduler()
    a, b = _session(1), _session(2)
    for s in (a, b):
        sched.submit(s, 0.0)
    out = sched.on_message(Failed(sids=(2, 99), message="stage [0, 2): out of memory"), 1.0)
    assert _events(out) == [(2, "error", "stage [0, 2): out of memory")]
    assert _sends(out) == [("end", 2)] and a.state == "prefill"


@pytest.mark.parametrize("notify", [True, False])
def test_failing_all_fails_queued_and_running_and_frees_only_the_running(notify):
    sched = _scheduler(max_sessions=1)
    running, queued = _session(1), _session(2)
    for s in (running, queued):
        sched.submit(s, 0.0)
    sched.close()
    out = sched.fail_all("the ring client was closed", 1.0, notify=notify)
    assert _events(out) == [(1, "error", "the ring client was closed")] * 1 + [
        (2, "error", "the ring client was closed")
    ]
    assert _sends(out) == ([("end", 1)] if notify else [])
    assert (sched.active, sched.queue_depth, sched.sessions) == (0, 0, {})


@pytest.mark.parametrize(
    "reply",
    [
        Tokens(group=0, step=7, sids=(1,), positions=(4,), tokens=(9,)),  # an old step
        Tokens(group=5, step=1, sids=(1,), positions=(4,), tokens=(9,)),  # no such group
        Tokens(group=-1, step=0, sids=(1,), positions=(4,), tokens=(9,)),  # not prefilling
        Tokens(group=-1, step=0, sids=(42,), positions=(3,), tokens=(9,)),  # no such session
    ],
)
def test_answers_that_match_no_step_are_dropped(reply):
    sched = _scheduler()
    session = _session(1)
    sched.submit(session, 0.0)
    _first_token(sched, session, 4, 0.1)  # group 0, step 1 in the ring, at position 3
    assert sched.on_tokens(reply, 0.2) == Outcome()
    assert session.tokens == [4]


# --- failover ------------------------------------------------------------------------------------


def test_reroute_replays_prompt_and_generated_tokens_and_goes_on():
    sched = _scheduler(max_sessions=2)
    a, waiting = _session(1), _session(2, prompt=(1,))
    sched.submit(a, 0.0)
    old = _answer(sched, _first_token(sched, a, 4, 0.1), [5], 0.2)  # step 2 in the old ring
    sched.max_sessions = 1
    sched.submit(waiting, 0.3)
    out = sched.reroute(now=5.0)
    ((replay, served),) = out.sends
    assert replay == Prefill(sid=1, pos=0, tokens=(5, 6, 7, 4, 5), sampling=GREEDY, prompt_len=3)
    assert served == (a,)
    assert (a.state, a.group, a.last_activity, waiting.state) == ("prefill", None, 5.0, "queued")
    assert _answer(sched, old, [6], 5.1) == Outcome()  # the old ring's late answer
    resumed = _first_token(sched, a, 6, 5.2)
    assert _sends(resumed) == [("decode", 0, 3, (1,), (5,), (6,))]
    assert a.tokens == [4, 5, 6]


def test_a_replayed_session_still_finishes_by_its_limits():
    sched = _scheduler()
    a = _session(1, max_tokens=2)
    sched.submit(a, 0.0)
    _first_token(sched, a, 4, 0.1)
    sched.reroute(1.0)
    out = _first_token(sched, a, 5, 1.1)
    assert _events(out) == [(1, "token", 5), (1, "done", "length")]
    assert _sends(out) == [("end", 1)]


# --- the stage server's choice ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("decodes", "prefills", "turn", "want"),
    [
        (0, 0, True, (None, True)),
        (0, 0, False, (None, False)),
        (1, 0, True, ("decode", False)),
        (1, 0, False, ("decode", False)),
        (0, 1, True, ("prefill", True)),
        (0, 1, False, ("prefill", True)),
        (2, 3, True, ("decode", False)),
        (2, 3, False, ("prefill", True)),
    ],
)
def test_a_stage_alternates_decode_steps_and_prefill_chunks_while_both_wait(
    decodes, prefills, turn, want
):
    assert next_stage_work(decodes=decodes, prefills=prefills, decode_turn=turn) == want


def test_taking_turns_a_prompt_never_waits_behind_more_than_one_step():
    """Three decode steps and two prefill batches waiting: they run interleaved."""
    decodes, prefills, turn, ran = 3, 2, True, []
    while True:
        kind, turn = next_stage_work(decodes=decodes, prefills=prefills, decode_turn=turn)
        if kind is None:
            break
        ran.append(kind)
        decodes, prefills = decodes - (kind == "decode"), prefills - (kind == "prefill")
    assert ran == ["decode", "prefill", "decode", "prefill", "decode"]


# -- speculative decoding ------------------------------------------------------------------------

LOOPED = (5, 6, 7, 8, 5, 6, 7, 8, 5, 6)
"""A prompt whose suffix (5, 6) occurred before, followed by 7, 8, 5, 6."""


def _decoding(sched, session, first=7):
    """Submit ``session`` and answer its prefill with ``first``: the decode step it joins."""
    sched.submit(session, 0.0)
    out = sched.on_tokens(
        Tokens(group=-1, step=0, sids=(session.sid,), positions=(session.expect,), tokens=(first,)),
        0.0,
    )
    (step,) = [m for m, _ in out.sends if isinstance(m, Decode)]
    return step


def test_a_speculating_session_drafts_what_followed_its_suffix_and_takes_the_kept_tokens():
    sched = _scheduler(speculate="ngram")
    session = _session(1, prompt=LOOPED, max_tokens=20)
    step = _decoding(sched, session)
    assert step.drafts == ((8, 5, 6, 7),)  # what followed (8, 5, 6, 7) last time: 7 taken now
    answer = Tokens(
        group=0, step=step.step, sids=(1,), positions=(len(LOOPED) + 1,), tokens=(9,), kept=(3,)
    )
    out = sched.on_tokens(answer, 1.0)
    assert session.tokens == [7, 8, 5, 6, 9]
    assert [v for _, kind, v in out.events if kind == "token"] == [8, 5, 6, 9]
    assert sched.spec.to_dict() | {} == {
        "laps": 1,
        "tokens": 4,
        "drafted": 4,
        "accepted": 3,
        "acceptance": 0.75,
        "tokens_per_lap": 4.0,
    }
    (nxt,) = [m for m, _ in out.sends if isinstance(m, Decode)]
    assert nxt.positions == (len(LOOPED) + 4,) and nxt.tokens == (9,)


def test_drafts_never_pass_max_tokens_or_the_context_and_a_stop_ends_the_lap():
    sched = _scheduler(speculate="ngram", max_context=len(LOOPED) + 4)
    session = _session(1, prompt=LOOPED, max_tokens=20, stop_ids=frozenset({5}))
    step = _decoding(sched, session)
    assert step.drafts == ((8, 5, 6),)  # the context holds 3 more tokens after 7
    out = sched.on_tokens(
        Tokens(
            group=0, step=step.step, sids=(1,), positions=(len(LOOPED) + 1,), tokens=(9,), kept=(3,)
        ),
        1.0,
    )
    assert session.tokens == [7, 8, 5] and session.finish_reason == "stop"
    assert ("end", 1) in _sends(out)
    short = _scheduler(speculate="ngram")
    assert _decoding(short, _session(2, prompt=LOOPED, max_tokens=3)).drafts == ((8,),)
    assert (
        _decoding(_scheduler(speculate="ngram"), _session(3, prompt=LOOPED, max_tokens=2)).drafts
        == ()
    )


def test_a_last_stage_that_keeps_more_than_was_drafted_fails_the_session():
    sched = _scheduler(speculate="ngram")
    session = _session(1, prompt=LOOPED, max_tokens=20)
    step = _decoding(sched, session)
    sched.on_tokens(
        Tokens(
            group=0, step=step.step, sids=(1,), positions=(len(LOOPED) + 1,), tokens=(9,), kept=(9,)
        ),
        1.0,
    )
    assert "accepted 9 drafted tokens of the 4 sent" in session.error


def test_a_ring_that_declines_stops_every_sessions_drafting_and_says_why():
    sched = _scheduler(speculate="auto")
    session = _session(1, prompt=LOOPED, max_tokens=20)
    step = _decoding(sched, session)
    assert step.drafts
    out = sched.on_tokens(
        Tokens(
            group=0,
            step=step.step,
            sids=(1,),
            positions=(len(LOOPED) + 1,),
            tokens=(8,),
            spec_off="stage [0, 2) has linear-attention blocks",
        ),
        1.0,
    )
    assert sched.spec_off == "stage [0, 2) has linear-attention blocks"
    (nxt,) = [m for m, _ in out.sends if isinstance(m, Decode)]
    assert nxt.drafts == ()
    later = _session(2, prompt=LOOPED, max_tokens=9)
    sched.submit(later, 2.0)
    sched.on_tokens(Tokens(group=-1, step=0, sids=(2,), positions=(len(LOOPED),), tokens=(7,)), 2.0)
    assert later.state == "decode" and later.drafter is None


@pytest.mark.parametrize(
    ("mode", "session_kw"),
    [
        ("none", {}),
        ("ngram", {"speculate": False}),
        ("ngram", {"sampling": SamplingParams(temperature=0, logprobs=1)}),
    ],
    ids=["ring-off", "session-off", "logprobs"],
)
def test_speculation_is_off_per_ring_and_per_session(mode, session_kw):
    sched = _scheduler(speculate=mode)
    assert _decoding(sched, _session(1, prompt=LOOPED, max_tokens=20, **session_kw)).drafts == ()


def test_an_unknown_speculation_mode_is_refused():
    with pytest.raises(
        ValueError, match="speculate: 'eagle' is not one of auto, ngram, draft, none"
    ):
        _scheduler(speculate="eagle")
    with pytest.raises(ValueError, match="'draft' needs a draft model at stage 0"):
        _scheduler(speculate="draft")


def _drafted_answer(sched, step, kept, accepted):
    """The last stage's answer to a one-row step stage 0 drafted for: ``kept`` of its drafts
    (``accepted``, their ids), then token 9."""
    reply = Tokens(
        group=0,
        step=step.step,
        sids=(1,),
        positions=(len(PROMPT) + 1,),
        tokens=(9,),
        kept=(kept,),
        accepted=(accepted,),
    )
    return sched.on_tokens(reply, 1.0)


@pytest.mark.parametrize("mode", ["draft", "auto"])
def test_with_a_draft_model_a_step_asks_stage_0_and_takes_the_accepted_ids(mode):
    """A ring with a draft model at stage 0 (draft, or auto with one loaded): a step carries
    ``asks`` (no drafts of its own; an open-ended prompt), the answer's accepted ids and token
    are the session's tokens in order, and the adaptive length records the lap."""
    sched = _scheduler(speculate=mode, draft_model=True, draft_cost=0.1, max_context=128)
    session = _session(1, prompt=PROMPT, max_tokens=20)
    step = _decoding(sched, session)
    assert step.drafts == () and len(step.asks) == 1 and step.asks[0] >= 1
    k = step.asks[0]
    kept = min(2, k)
    out = _drafted_answer(sched, step, kept, (11, 12)[:kept])
    assert session.tokens == [7, *(11, 12)[:kept], 9]
    if mode == "auto":  # adaptive, priced at the draft cost; "draft" asks MAX_DRAFT
        assert session.draft_len.drafted == k and session.draft_len.accepted == kept
        assert session.draft_len.lap_cost == 0.1
    else:
        assert session.draft_len is None and k == 10
    assert sched.spec.to_dict()["tokens"] == kept + 1
    (nxt,) = [m for m, _ in out.sends if isinstance(m, Decode)]
    assert nxt.positions == (session.expect - 1,) and nxt.tokens == (9,)


def test_an_answer_whose_accepted_ids_disagree_with_its_kept_count_fails_the_session():
    sched = _scheduler(speculate="draft", draft_model=True)
    session = _session(1, prompt=PROMPT, max_tokens=20)
    step = _decoding(sched, session)
    k = step.asks[0]
    _drafted_answer(sched, step, k + 1, tuple(range(k + 1)))
    assert f"accepted {k + 1} drafted tokens ({k + 1} ids) of the {k}" in session.error


def test_ngram_mode_ignores_a_loaded_draft_model():
    sched = _scheduler(speculate="ngram", draft_model=True)
    step = _decoding(sched, _session(1, prompt=LOOPED, max_tokens=20))
    assert step.drafts and step.asks == ()


def _forced_decoding(sched, session, forced=(21, 22, 23)):
    """Submit ``session``; its prefill's answer: token 7 and the ids its grammar forces next."""
    sched.submit(session, 0.0)
    first = Tokens(
        group=-1,
        step=0,
        sids=(session.sid,),
        positions=(session.expect,),
        tokens=(7,),
        forced=(forced,),
    )
    out = sched.on_tokens(first, 0.0)
    (step,) = [m for m, _ in out.sends if isinstance(m, Decode)]
    return step


@pytest.mark.parametrize("mode", ["auto", "ngram"])
def test_ids_a_grammar_forces_are_the_rows_next_draft_ahead_of_prompt_lookup(mode):
    """The last stage names the ids a row's grammar forces after its token: the next step
    drafts exactly those (not the prompt lookup's guess), and the adaptive length does not
    learn from a lap of them; a lap without forced ids drafts by lookup again."""
    sched = _scheduler(speculate=mode)
    session = _session(1, prompt=LOOPED, max_tokens=20)
    step = _forced_decoding(sched, session)
    assert step.drafts == ((21, 22, 23),)
    answer = Tokens(
        group=0, step=step.step, sids=(1,), positions=(len(LOOPED) + 1,), tokens=(24,), kept=(3,)
    )
    out = sched.on_tokens(answer, 1.0)
    assert session.tokens == [7, 21, 22, 23, 24]
    assert sched.spec.to_dict()["drafted"] == 3 and sched.spec.to_dict()["accepted"] == 3
    if mode == "auto":
        assert session.draft_len.drafted == 0  # learned nothing of the lookup's guessing
    (nxt,) = [m for m, _ in out.sends if isinstance(m, Decode)]
    assert nxt.drafts != ((21, 22, 23),)  # consumed: the lookup drafts (or nothing) now


@pytest.mark.parametrize(
    ("mode", "session_kw", "room"),
    [
        ("none", {}, 20),
        ("ngram", {"speculate": False}, 20),
        ("ngram", {"sampling": SamplingParams(temperature=0, logprobs=1)}, 20),
        ("ngram", {}, 3),
    ],
    ids=["ring-off", "session-off", "logprobs", "max-tokens"],
)
def test_forced_ids_obey_the_same_rules_as_any_draft(mode, session_kw, room):
    sched = _scheduler(speculate=mode)
    session = _session(1, prompt=PROMPT, max_tokens=room, **session_kw)
    step = _forced_decoding(sched, session)
    assert step.drafts == (((21,),) if room == 3 else ())  # room for one: 7 taken, 1 left


def test_a_step_that_asks_the_draft_model_sends_no_forced_ids():
    """Drafts and stage 0's asks do not share a step: a row whose grammar forces ids drafts
    nothing when another row asks the draft model, and is not asked itself."""
    sched = _scheduler(speculate="draft", draft_model=True, max_context=128)
    asking = _session(1, prompt=PROMPT, max_tokens=20)
    sched.submit(asking, 0.0)
    forced = _session(2, prompt=PROMPT, max_tokens=20)
    sched.submit(forced, 0.0)
    reply = Tokens(
        group=-1,
        step=0,
        sids=(1, 2),
        positions=(len(PROMPT), len(PROMPT)),
        tokens=(7, 7),
        forced=((), (21, 22)),
    )
    out = sched.on_tokens(reply, 0.0)
    (first,) = [m for m, _ in out.sends if isinstance(m, Decode)]
    assert first.sids == (1,)  # 2 joins the group at its next step
    answer = Tokens(
        group=first.group,
        step=first.step,
        sids=(1,),
        positions=(len(PROMPT) + 1,),
        tokens=(9,),
        kept=(0,),
        accepted=((),),
    )
    out = sched.on_tokens(answer, 1.0)
    (step,) = [m for m, _ in out.sends if isinstance(m, Decode)]
    assert step.sids == (1, 2) and step.drafts == ()
    assert step.asks[0] >= 1 and step.asks[1] == 0
    assert forced.draft == () and not forced.draft_forced
