"""Ring messages and sampling parameters: round trips and precise refusals (stage specs:
``test_serve_spec.py``)."""

from __future__ import annotations

import msgpack
import pytest

from swarmp2p.serve import RingMessage, SamplingParams, boundary_codec
from swarmp2p.wire import WireError

ROUND_TRIPS = [
    RingMessage(op="prefill", sid=1, pos=0, tokens=(5, 6, 7), sampling=SamplingParams(seed=3)),
    RingMessage(op="prefill", sid=2, pos=0, sampling=SamplingParams(temperature=0.0)),
    RingMessage(op="decode", sid=2**63 - 1, pos=9, tokens=(1,)),
    RingMessage(op="decode", sid=4, pos=9),
    RingMessage(op="end", sid=4),
    RingMessage(op="token", sid=4, pos=3, token=0),
    RingMessage(op="error", sid=4, message="stage [0, 2): boom"),
]


@pytest.mark.parametrize("msg", ROUND_TRIPS, ids=lambda m: m.op)
def test_ring_messages_round_trip(msg):
    assert RingMessage.decode(msg.encode()) == msg


def _packed(**body):
    return msgpack.packb(body)


REFUSALS = [
    (b"\xc1", "not a msgpack object"),
    (_packed(op="jump", sid=1), "op: 'jump' is not one of"),
    (_packed(op="decode", sid=-1, pos=0), "sid: -1"),
    (_packed(op="decode", sid=1, pos=-2), "pos: -2"),
    (_packed(op="decode", sid=1, pos=0, tokens=[1, -5]), "tokens: must be a list"),
    (_packed(op="decode", sid=1, pos=0, sampling={}), "unexpected field"),
    (_packed(op="prefill", sid=1, pos=0, sampling={"temperature": -1}), "temperature: -1"),
    (_packed(op="prefill", sid=1, pos=0, sampling={"warmth": 1}), "unknown field"),
    (_packed(op="token", sid=1, pos=0), "token: -1"),
    (_packed(op="error", sid=1, message=3), "message: must be a string"),
    (msgpack.packb([1, 2]), "is a map"),
]


@pytest.mark.parametrize(("data", "match"), REFUSALS)
def test_bad_ring_messages_are_refused_naming_the_field(data, match):
    with pytest.raises(WireError, match=match):
        RingMessage.decode(data)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0}, "top_p: 0"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"seed": -3}, "seed"),
        ({"seed": 2**63}, "seed"),
    ],
)
def test_sampling_params_refuse_out_of_range_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_greedy_is_temperature_zero():
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams().greedy


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
