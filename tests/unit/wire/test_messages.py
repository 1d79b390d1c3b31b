"""Control messages: registry, strict decode with field-naming errors, hypothesis round trips."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmp2p.schema import field
from swarmp2p.wire import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    Message,
    WireError,
    common_version,
    decode,
    encode,
    message,
    message_types,
    shared_capabilities,
)
from swarmp2p.wire.messages import MAX_PLAIN_DEPTH


@message("test.everything")
class Everything(Message):
    s: str
    i: int
    f: float
    b: bool
    raw: bytes
    ints: list[int]
    names: tuple[str, ...] = ()
    table: dict[str, float] = dataclasses.field(default_factory=dict)
    maybe: int | None = None
    mode: Literal["train", "serve"] = "train"
    record: dict = dataclasses.field(default_factory=dict)
    rows: list = dataclasses.field(default_factory=list)
    anything: Any = None


def _packed(**body) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "id": 5, **body}, use_bin_type=True)


def test_envelope_layout():
    data = encode(ErrorReply(id=9, code="busy", detail="later"))
    assert msgpack.unpackb(data) == {
        "v": PROTOCOL_VERSION,
        "t": "error",
        "id": 9,
        "code": "busy",
        "detail": "later",
    }


def test_registry_holds_the_builtin_types():
    types = message_types()
    assert types["hello"] is Hello and types["error"] is ErrorReply
    assert Hello.TYPE == "hello"


def test_registration_errors_are_precise():
    with pytest.raises(ValueError, match="already registered by Hello"):

        @message("hello")
        class Again(Message):
            x: int

    with pytest.raises(TypeError, match="unsupported field type"):

        @message("test.bad_type")
        class BadType(Message):
            x: set

    with pytest.raises(TypeError, match="str keys"):

        @message("test.bad_key")
        class BadKey(Message):
            x: dict[int, int]

    with pytest.raises(ValueError, match="reserved"):

        @message("test.reserved")
        class Reserved(Message):
            t: str


@pytest.mark.parametrize(
    ("body", "code", "fragment"),
    [
        ({"t": "test.everything"}, "bad_field", "missing field 's'"),
        (
            dict(t="test.everything", s=1, i=1, f=1.0, b=True, raw=b"", ints=[]),
            "bad_field",
            "test.everything.s must be a string, got 1",
        ),
        (
            dict(t="test.everything", s="", i=True, f=1.0, b=True, raw=b"", ints=[]),
            "bad_field",
            ".i must be an integer, got true",
        ),
        (
            dict(t="test.everything", s="", i=1, f="x", b=True, raw=b"", ints=[]),
            "bad_field",
            ".f must be a number",
        ),
        (
            dict(t="test.everything", s="", i=1, f=1.0, b=1, raw=b"", ints=[]),
            "bad_field",
            ".b must be true or false",
        ),
        (
            dict(t="test.everything", s="", i=1, f=1.0, b=True, raw="x", ints=[]),
            "bad_field",
            ".raw must be bytes",
        ),
        (
            dict(t="test.everything", s="", i=1, f=1.0, b=True, raw=b"", ints=[1, "2"]),
            "bad_field",
            ".ints[1] must be an integer",
        ),
        (
            dict(t="test.everything", s="", i=1, f=1.0, b=True, raw=b"", ints=[], table={"a": "b"}),
            "bad_field",
            ".table.a must be a number",
        ),
        (
            dict(t="test.everything", s="", i=1, f=1.0, b=True, raw=b"", ints=[], mode="eval"),
            "bad_field",
            'one of "train", "serve"',
        ),
        (
            dict(t="test.everything", s="", i=1, f=1.0, b=True, raw=b"", ints=[], extra=1),
            "bad_field",
            "has no field 'extra'",
        ),
        (
            dict(t="test.everything", s="", i=1, f=1.0, b=True, raw=b"", ints=[], record=[1]),
            "bad_field",
            ".record must be an object",
        ),
        (
            dict(
                t="test.everything",
                s="",
                i=1,
                f=1.0,
                b=True,
                raw=b"",
                ints=[],
                record={"a": {b"k": 1}},
            ),
            "bad_field",
            "non-string key",
        ),
        (dict(t="nope"), "unknown_type", "unknown message type 'nope'"),
        (dict(t=3), "malformed", "'t' must be a string"),
    ],
)
def test_bad_fields_name_the_field(body, code, fragment):
    with pytest.raises(WireError) as err:
        decode(_packed(**body))
    assert err.value.code == code
    assert fragment in err.value.detail
    assert err.value.msg_id == 5


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"", "malformed"),
        (b"\xc1", "malformed"),
        (msgpack.packb([1, 2]), "malformed"),
        (msgpack.packb({"v": 1, "t": "error", "id": -1, "code": "a", "detail": "b"}), "malformed"),
        (
            msgpack.packb({"v": 1, "t": "error", "id": 2**64 - 1, "code": "a", "detail": "b"}),
            "malformed",
        ),
        (msgpack.packb({"v": PROTOCOL_VERSION + 1, "t": "error", "id": 1}), "version"),
        (msgpack.packb({"v": 0, "t": "error", "id": 1}), "version"),
        (msgpack.packb({"v": "1", "t": "error", "id": 1}), "malformed"),
        (msgpack.packb({1: 1}), "malformed"),
        (
            msgpack.packb({"v": 1, "t": "error", "id": 1, "code": "a", "detail": "b"}) + b"\x00",
            "malformed",
        ),
        (msgpack.packb(msgpack.ExtType(1, b"xx")), "malformed"),
        (b"\x00" * (MAX_MESSAGE_BYTES + 1), "too_large"),
    ],
)
def test_bad_envelopes(data, code):
    with pytest.raises(WireError) as err:
        decode(data)
    assert err.value.code == code


def test_plain_data_depth_is_capped():
    deep: Any = 1
    for _ in range(MAX_PLAIN_DEPTH + 2):
        deep = [deep]
    data = _packed(t="test.everything", s="", i=1, f=1.0, b=True, raw=b"", ints=[], rows=deep)
    with pytest.raises(WireError, match="deeper than"):
        decode(data)


def test_int_widens_to_float_and_tuples_come_back_as_tuples():
    got = decode(
        _packed(t="test.everything", s="", i=1, f=2, b=True, raw=b"", ints=[], names=["a"])
    )
    assert got.f == 2.0 and type(got.f) is float
    assert got.names == ("a",)


def test_encode_refuses_what_decode_would_refuse():
    with pytest.raises(WireError, match="ints\\[0\\] must be an integer"):
        encode(Everything(s="", i=1, f=1.0, b=True, raw=b"", ints=["x"]))  # type: ignore[list-item]
    with pytest.raises(WireError) as err:
        encode(ErrorReply(code="x", detail="y" * MAX_MESSAGE_BYTES))
    assert err.value.code == "too_large"

    @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    class Unregistered(Message):
        pass

    with pytest.raises(WireError, match="not registered"):
        encode(Unregistered())


def test_hello_validation_and_negotiation():
    with pytest.raises(WireError, match="versions must be a non-empty"):
        decode(_packed(t="hello", node_id="a", name="b", versions=[], capabilities=[]))
    a = Hello(node_id="a", name="x", versions=[1, 2, 3], capabilities=["wire-v2", "serve-codec"])
    b = Hello(node_id="b", name="y", versions=[1, 2], capabilities=["wire-v2"])
    assert common_version(a.versions, b.versions) == 2
    assert shared_capabilities(a, b) == {"wire-v2"}
    with pytest.raises(ValueError, match=r"this node speaks \[3\], the peer \[1, 2\]"):
        common_version([3], [1, 2])


# --- hypothesis round trips: every registered type ------------------------------------------

_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
)
_plain = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_ids = st.integers(0, 2**63 - 1)

STRATEGIES = {
    "error": st.builds(
        ErrorReply, id=_ids, code=st.text(max_size=20), detail=st.text(max_size=200)
    ),
    "hello": st.builds(
        Hello,
        id=_ids,
        node_id=st.text(min_size=1, max_size=40),
        name=st.text(max_size=40),
        versions=st.lists(st.integers(1, 1000), min_size=1, max_size=5),
        capabilities=st.lists(st.text(max_size=20), max_size=8),
        software=st.text(max_size=20),
        swarm_id=st.text(max_size=16),
        control_port=st.integers(0, 65535),
    ),
    "test.everything": st.builds(
        Everything,
        id=_ids,
        s=st.text(),
        i=st.integers(-(2**63), 2**63 - 1),
        f=st.floats(allow_nan=False, allow_infinity=False),
        b=st.booleans(),
        raw=st.binary(),
        ints=st.lists(st.integers(-(2**31), 2**31)),
        names=st.lists(st.text(max_size=5), max_size=4).map(tuple),
        table=st.dictionaries(
            st.text(max_size=5), st.floats(allow_nan=False, allow_infinity=False), max_size=4
        ),
        maybe=st.one_of(st.none(), st.integers(-5, 5)),
        mode=st.sampled_from(["train", "serve"]),
        record=st.dictionaries(st.text(max_size=8), _plain, max_size=4),
        rows=st.lists(_plain, max_size=4),
        anything=_plain,
    ),
}


@pytest.mark.parametrize("type_name", sorted(STRATEGIES))
def test_round_trip_every_type(type_name):
    @settings(max_examples=150, deadline=None)
    @given(STRATEGIES[type_name])
    def check(msg):
        assert decode(encode(msg)) == msg

    check()


def test_every_registered_type_has_a_round_trip_strategy():
    builtin = {n for n, c in message_types().items() if c.__module__.startswith("swarmp2p.wire")}
    assert builtin <= set(STRATEGIES)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_give_wire_errors(data):
    try:
        decode(data)
    except WireError as e:
        assert e.code in ("malformed", "unknown_type", "version", "bad_field", "too_large")


@settings(max_examples=400, deadline=None)
@given(STRATEGIES["hello"], st.data())
def test_mutated_and_truncated_messages_give_wire_errors(msg, data):
    raw = bytearray(encode(msg))
    cut = data.draw(st.integers(0, len(raw)))
    flips = data.draw(
        st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), max_size=4)
    )
    for pos, val in flips:
        raw[pos] = val
    mutated = bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw)
    try:
        out = decode(mutated)
    except WireError:
        return
    assert isinstance(out, Message)  # a mutation may land on another valid message


@message("test.bounded")
class Bounded(Message):
    port: int = field(default=0, ge=0, le=65535)
    ratio: float | None = field(default=None, ge=0.0, le=1.0)
    tags: list[str] = field(default_factory=list, max_len=2)
    name: str = field(default="", max_len=4)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"port": -1}, "test.bounded.port must be an integer >= 0 and <= 65535, got -1"),
        ({"port": 65536}, "port must be an integer >= 0 and <= 65535, got 65536"),
        ({"ratio": 1.5}, "ratio must be a number >= 0 and <= 1"),
        ({"tags": ["a", "b", "c"]}, "tags has length 3, at most 2"),
        ({"name": "abcde"}, "name has length 5, at most 4"),
    ],
)
def test_ranges_and_lengths_are_enforced_both_ways(fields, fragment):
    with pytest.raises(WireError, match=fragment):
        decode(_packed(t="test.bounded", **fields))
    with pytest.raises(WireError, match=fragment):
        encode(Bounded(**fields))


def test_bounds_accept_the_edges():
    msg = Bounded(port=65535, ratio=None, tags=["a", "b"], name="abcd")
    assert decode(encode(msg)) == msg
    assert decode(encode(Bounded(port=0, ratio=0.0))).ratio == 0.0


@pytest.mark.parametrize("value", [2**63, 2**64 - 1, -(2**63) - 1])
def test_integers_past_64_bits_are_refused_where_they_enter(value):
    """A uint64 (or wider) integer is a clear bad_field, never an OverflowError later (issue 15)."""
    body = dict(t="test.everything", s="", i=value, f=1.0, b=True, raw=b"", ints=[])
    if -(2**63) <= value < 2**64:  # msgpack itself cannot carry wider ones
        with pytest.raises(WireError, match=r"fits? 64 bits") as err:
            decode(_packed(**body))
        assert err.value.code == "bad_field"
    with pytest.raises(WireError, match=r"fits? 64 bits"):
        encode(Everything(s="", i=value, f=1.0, b=True, raw=b"", ints=[]))
    with pytest.raises(WireError, match=r"fits? 64 bits"):
        encode(Everything(s="", i=1, f=1.0, b=True, raw=b"", ints=[], rows=[[value]]))
