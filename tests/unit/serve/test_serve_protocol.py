"""Ring messages and sampling parameters: round trips and precise refusals (stage specs:
``test_serve_spec.py``)."""

from __future__ import annotations

import msgpack
import pytest

from swarmp2p.serve import (
    Decode,
    End,
    Failed,
    Prefill,
    SamplingParams,
    TokenLogprobs,
    Tokens,
    boundary_codec,
    decode_message,
)
from swarmp2p.wire import WireError

FULL = SamplingParams(
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=3,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.2,
    logit_bias=((5, -100.0), (9, 2.5)),
    logprobs=3,
)
ROUND_TRIPS = [
    Prefill(sid=1, pos=0, tokens=(5, 6, 7), sampling=SamplingParams(seed=3)),
    Prefill(sid=2, pos=0, tokens=(1,), sampling=FULL, prompt_len=1, more=True),
    Prefill(sid=2, pos=64, tokens=(4, 4)),
    Decode(group=0, step=1, sids=(2**63 - 1, 4), positions=(9, 3), tokens=(1, 0)),
    Decode(group=2, step=7, sids=(4,), positions=(9,), tokens=(8,), sizes=(1, 1)),
    End(sid=4),
    Tokens(group=-1, step=0, sids=(4,), positions=(3,), tokens=(0,)),
    Tokens(
        group=1,
        step=5,
        sids=(4, 5),
        positions=(3, 8),
        tokens=(0, 7),
        sizes=(2, 2),
        logprobs=(TokenLogprobs(logprob=-0.5, top=((0, -0.5), (3, -1.25))), None),
    ),
    Failed(sids=(4, 9), message="stage [0, 2): boom"),
    Decode(group=0, step=3, sids=(4, 5), positions=(9, 3), tokens=(1, 2), drafts=((7, 8), ())),
    Decode(group=0, step=3, sids=(4,), positions=(9,), spec_off="stage [0, 2): recurrent"),
    Tokens(group=0, step=3, sids=(4, 5), positions=(10, 4), tokens=(3, 6), kept=(2, 0)),
    Tokens(group=0, step=3, sids=(4,), positions=(10,), tokens=(3,), spec_off="recurrent"),
    Decode(group=0, step=3, sids=(4, 5), positions=(9, 3), tokens=(1, 2), asks=(4, 0)),
    Tokens(
        group=0,
        step=3,
        sids=(4, 5),
        positions=(10, 4),
        tokens=(3, 6),
        kept=(2, 0),
        accepted=((7, 8), ()),
    ),
    Tokens(group=-1, step=0, sids=(4, 5), positions=(10, 4), tokens=(3, 6), forced=((), (1, 2))),
]


def test_a_decode_steps_width_is_its_longest_draft_plus_one():
    assert ROUND_TRIPS[-7].width == 3 and ROUND_TRIPS[-6].width == 1


@pytest.mark.parametrize("msg", ROUND_TRIPS, ids=lambda m: m.op)
def test_ring_messages_round_trip(msg):
    assert decode_message(msg.encode()) == msg


def _packed(**body):
    return msgpack.packb(body)


ROWS = dict(group=0, step=1, sids=[1], positions=[0], tokens=[5], sizes=[])
REFUSALS = [
    (b"\xc1", "not a msgpack object"),
    (_packed(op="jump", sid=1), "op: 'jump' is not one of"),
    (_packed(op="end", sid=-1), "sid: -1"),
    (_packed(op="end", sid=2**63), "sid: 9223372036854775808"),
    (_packed(op="decode", **{**ROWS, "positions": [-2]}), "positions: must be a list of integers"),
    (_packed(op="decode", **{**ROWS, "tokens": [2**31]}), "tokens: must be a list of integers"),
    (_packed(op="decode", **{**ROWS, "sids": [1, 2]}), "must be as many"),
    (_packed(op="decode", **{**ROWS, "sampling": {}}), "unexpected field"),
    (_packed(op="decode", group=0), "missing field"),
    (
        _packed(op="prefill", sid=1, pos=0, tokens=[], sampling={"temperature": -1}),
        "temperature: -1",
    ),
    (_packed(op="prefill", sid=1, pos=0, tokens=[], sampling={"warmth": 1}), "unknown field"),
    (_packed(op="prefill", sid=1, pos=3, tokens=[1], prompt_len=1), "first chunk"),
    (_packed(op="prefill", sid=1, pos=0, tokens=[1], more=1), "more: 1"),
    (_packed(op="tokens", **ROWS, logprobs=[[1, []]]), "logprobs"),
    (_packed(op="error", sids=[1], message=3), "message: must be a string"),
    (_packed(op="decode", **ROWS, drafts=[[1], [2]]), "drafts: must be a list of one draft per"),
    (_packed(op="decode", **ROWS, drafts=[[-1]]), "drafts: a draft is a list of at most 64"),
    (_packed(op="decode", **ROWS, drafts=[list(range(65))]), "drafts: a draft is a list"),
    (_packed(op="decode", **ROWS, drafts=5), "drafts: must be a list"),
    (_packed(op="tokens", **ROWS, kept=[65]), "kept: must be a list of integers in"),
    (_packed(op="decode", **ROWS, asks=[65]), "asks: must be a list of integers in"),
    (_packed(op="decode", **ROWS, asks=[1, 1]), "asks: must be a list of one count per row"),
    (_packed(op="decode", **ROWS, asks=[1], drafts=[[3]]), "drafts or asks, not both"),
    (_packed(op="tokens", **ROWS, kept=[1], accepted=[[1, 2]]), "accepted: \\[2\\] ids per row"),
    (_packed(op="tokens", **ROWS, kept=[1], accepted=[[-1]]), "accepted: a draft is a list"),
    (_packed(op="tokens", **ROWS, kept=[1, 1]), "kept: must be a list of one count per row"),
    (_packed(op="tokens", **ROWS, forced=[[1], [2]]), "forced: must be a list of one draft per"),
    (_packed(op="tokens", **ROWS, forced=[list(range(65))]), "forced: a draft is a list"),
    (_packed(op="tokens", **ROWS, spec_off=3), "spec_off: must be a string"),
    (_packed(op="decode", **ROWS, spec_off="x" * 1001), "spec_off: must be a string of at most"),
    (msgpack.packb([1, 2]), "is a map"),
]


@pytest.mark.parametrize(("data", "match"), REFUSALS)
def test_bad_ring_messages_are_refused_naming_the_field(data, match):
    with pytest.raises(WireError, match=match):
        decode_message(data)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0}, "top_p: 0"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": 10**23}, "top_k"),
        ({"seed": -3}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"logit_bias": ((2**40, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_sampling_params_refuse_out_of_range_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_send_only_what_differs_from_the_defaults():
    assert SamplingParams().to_dict() == {}
    assert SamplingParams.from_dict(FULL.to_dict()) == FULL
    assert not SamplingParams().needs_history and FULL.needs_history


def test_greedy_is_temperature_zero_or_too_small_to_divide_by():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-300).greedy
    assert not SamplingParams().greedy
    assert not SamplingParams(temperature=1e-4).greedy


@pytest.mark.parametrize(
    ("compression", "codes", "codec"),
    [
        ("none", True, "none"),
        ("fp16", False, "none"),
        ("fp16", True, "fp16"),
        ("fixed_int8", False, "none"),
        ("fixed_int8", True, "tokint8"),
        ("fixed_int2", True, "tokint2"),
    ],
)
def test_boundary_codec_sends_codes_only_when_declared(compression, codes, codec):
    assert boundary_codec(compression, codes) == codec


def test_boundary_codec_refuses_unknown_compression():
    with pytest.raises(ValueError, match="'fixed_int9' is not one of"):
        boundary_codec("fixed_int9", True)
