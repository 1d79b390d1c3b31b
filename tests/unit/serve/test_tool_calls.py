"""Tool calls read from generated text (``<tool_call>{json}</tool_call>``, the format of Qwen's
and Hermes' chat templates), whole and as a stream of token pieces: what a client gets for a
call split across pieces, two calls, text around them, a malformed block and a block that
never closes."""

from __future__ import annotations

import json
import random
import re

import pytest

from swarmp2p.serve.decoding.grammar import ToolCallStream, parse_tool_calls
from swarmp2p.serve.generation import Choice

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def _function(name: str, **arguments) -> dict:
    return {"name": name, "arguments": json.dumps(arguments)}


def _pieces(text: str, seed: int) -> list[str]:
    """``text`` cut at random places into pieces of 1-4 characters, as tokens come."""
    rng, out, at = random.Random(seed), [], 0
    while at < len(text):
        step = rng.randint(1, 4)
        out.append(text[at : at + step])
        at += step
    return out


def _stream(pieces: list[str]) -> tuple[list[str], list[dict], ToolCallStream]:
    stream, content, calls = ToolCallStream(), [], []
    for piece in pieces:
        text, done = stream.push(piece)
        content.append(text)
        calls.extend(done)
    content.append(stream.finish())
    return content, calls, stream


@pytest.mark.parametrize("seed", range(8))
def test_a_call_split_across_many_pieces_comes_whole_and_only_once_it_closes(seed):
    text = "Let me look. " + WEATHER
    pieces = _pieces(text, seed)
    stream, seen = ToolCallStream(), []
    for i, piece in enumerate(pieces):
        content, calls = stream.push(piece)
        seen.append(content)
        assert "<" not in content, f"piece {i} leaked part of the block as text: {content!r}"
        # the call comes with the piece that closes its block, not before
        closes = "".join(pieces[: i + 1]).endswith("</tool_call>")
        assert bool(calls) == closes, (i, piece)
    assert "".join(seen) == "Let me look. " and stream.finish() == ""
    assert [c["function"] for c in stream.calls] == [_function("get_weather", city="Paris")]
    assert re.fullmatch(r"call_[0-9a-f]{24}", stream.calls[0]["id"])
    assert stream.calls[0]["type"] == "function"
    assert _no_ids(parse_tool_calls(text)[1]) == _no_ids(stream.calls)


def test_text_before_a_call_is_streamed_at_once_and_a_lone_angle_bracket_is_not_held():
    stream = ToolCallStream()
    assert stream.push("Checking the weather") == ("Checking the weather", [])
    assert stream.push(" now <") == (" now ", [])  # "<" may begin a block: held
    assert stream.push("= 3 ") == ("<= 3 ", [])  # it did not: text
    assert stream.push("<tool") == ("", [])
    content, calls = stream.push('_call>{"name": "add", "arguments": {"a": 1}}</tool_call> ok')
    assert content == " ok" and [c["function"] for c in calls] == [_function("add", a=1)]


@pytest.mark.parametrize("seed", range(4))
def test_two_calls_come_in_order_with_the_text_between_them(seed):
    text = f"First {WEATHER} then {ADD} done."
    content, calls, _ = _stream(_pieces(text, seed))
    assert "".join(content) == "First  then  done."
    assert [c["function"] for c in calls] == [
        _function("get_weather", city="Paris"),
        _function("add", a=1, b=2),
    ]
    whole_content, whole_calls = parse_tool_calls(text)
    assert _no_ids(whole_calls) == _no_ids(calls) and whole_content == "First  then  done."


def test_every_call_id_is_new_across_replies():
    """A conversation carries the calls of many replies and a client answers each by its id:
    ids numbered from call_0 in every reply made two turns' calls share one."""
    ids = [c["id"] for _ in range(3) for c in parse_tool_calls(f"{WEATHER} {ADD}")[1]]
    stream = ToolCallStream()
    stream.push(f"{ADD}{ADD}")
    ids += [c["id"] for c in stream.calls]
    assert len(ids) == 8 and len(set(ids)) == 8, ids
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids), ids


def _no_ids(calls):
    return [{k: v for k, v in c.items() if k != "id"} for c in calls]


@pytest.mark.parametrize(
    "body",
    [
        "not json at all",
        '{"name": "add", "arguments": {"a": 1}',  # cut short
        '{"arguments": {"a": 1}}',  # no name
        '{"name": 7, "arguments": {}}',  # a name that is no string
        '{"name": "add", "arguments": [1, 2]}',  # arguments that are no object
        '{"name": "add", "arguments": "{not json"}',  # arguments as text that is no JSON
        '["add", {"a": 1}]',
    ],
)
def test_a_malformed_block_stays_text_whole_and_calls_nothing(body):
    block = f"<tool_call>{body}</tool_call>"
    text = f"a {block} b"
    content, calls, stream = _stream(_pieces(text, 0))
    assert "".join(content) == text and calls == [] and stream.calls == []
    assert parse_tool_calls(text) == (text, [])
    choice = Choice(index=0, session=None, text=None, tools=ToolCallStream(), finish_reason="stop")
    assert choice.split(text, final=True) == (text, []) and choice.reply_reason == "stop"


def test_a_malformed_block_does_not_swallow_a_good_call_after_it():
    text = "<tool_call>{oops</tool_call> and " + ADD
    content, calls = parse_tool_calls(text)
    assert content == "<tool_call>{oops</tool_call> and"
    assert [c["function"] for c in calls] == [_function("add", a=1, b=2)]
    streamed, streamed_calls, _ = _stream(_pieces(text, 3))
    assert "".join(streamed) == "<tool_call>{oops</tool_call> and " and _no_ids(
        streamed_calls
    ) == _no_ids(calls)


def test_arguments_written_as_a_json_string_or_as_parameters_are_read_as_an_object():
    as_text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    as_parameters = '<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>'
    none = '<tool_call>{"name": "now"}</tool_call>'
    for text, want in [(as_text, {"a": 1}), (as_parameters, {"a": 1}), (none, {})]:
        _, calls = parse_tool_calls(text)
        assert json.loads(calls[0]["function"]["arguments"]) == want


def test_a_block_never_closed_before_max_tokens_is_returned_as_text_with_length():
    cut = WEATHER[: WEATHER.index("Paris")]
    choice = Choice(
        index=0, session=None, text=None, tools=ToolCallStream(), finish_reason="length"
    )
    content, calls = choice.split("Sure. ", final=False)
    assert (content, calls) == ("Sure. ", [])
    content, calls = choice.split(cut, final=True)
    assert content == cut and calls == []
    assert choice.reply_reason == "length"  # not "tool_calls": nothing was called


def test_a_reply_that_called_a_tool_finishes_with_tool_calls():
    choice = Choice(index=0, session=None, text=None, tools=ToolCallStream(), finish_reason="stop")
    content, calls = choice.split("Sure. " + WEATHER, final=True)
    assert content == "Sure. " and len(calls) == 1
    assert choice.reply_reason == "tool_calls"
    plain = Choice(index=0, session=None, text=None, tools=None, finish_reason="stop")
    assert plain.split(WEATHER, final=True) == (WEATHER, []) and plain.reply_reason == "stop"
