"""The relay's pure parts: a response's pieces handed back in order, none past a reply's cap,
and the address an issuing node reaches its own API at."""

from __future__ import annotations

import pytest

from swarmp2p.node.messages import RELAY_TEXT_CHARS, ServeRelayOpen
from swarmp2p.node.serving.relay import _Relay, local_url
from swarmp2p.wire.messages import WireError, decode, encode


def test_pieces_come_back_in_order_and_none_past_the_cap():
    relay = _Relay(sender="b", asked_at=0.0)
    big = "x" * (RELAY_TEXT_CHARS + 10)
    for piece in ("data: 1\n\n", big, "data: [DONE]\n\n"):
        relay.push(piece)
    first = relay.take()
    assert first == "data: 1\n\n"  # the next piece would pass the cap: it waits
    second = relay.take()
    assert second == "x" * RELAY_TEXT_CHARS  # a piece over the cap alone is split
    assert relay.take() == "x" * 10 + "data: [DONE]\n\n"
    assert relay.take() == "" and relay.size == 0
    assert (
        first + second + "x" * 10 + "data: [DONE]\n\n" == "data: 1\n\n" + big + "data: [DONE]\n\n"
    )


@pytest.mark.parametrize(
    ("bound", "reached"),
    [
        ("http://0.0.0.0:8080", "http://127.0.0.1:8080"),
        ("http://[::]:8080", "http://[::1]:8080"),
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("http://192.168.1.20:8080", "http://192.168.1.20:8080"),
    ],
)
def test_an_api_on_every_interface_is_reached_on_loopback(bound, reached):
    assert local_url(bound) == reached


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("path", "/metrics", "path"),
        ("path", "/v1/completions/../../health", "path"),
        ("model", "", "model"),
        ("body", "x" * (RELAY_TEXT_CHARS + 1), "body"),
    ],
)
def test_a_relay_open_for_another_route_or_an_oversized_body_is_refused_naming_it(
    field, value, named
):
    good = ServeRelayOpen(model="tiny", path="/v1/chat/completions", body="{}")
    assert decode(encode(good)) == good
    with pytest.raises((WireError, ValueError), match=named):
        decode(_with(good, field, value))


def _with(msg, field, value) -> bytes:
    import msgpack

    raw = msgpack.unpackb(encode(msg), raw=False)
    raw[field] = value
    return msgpack.packb(raw, use_bin_type=True)
