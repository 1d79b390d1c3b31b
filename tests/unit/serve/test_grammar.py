"""Structured outputs' grammars: whatever a sampler picks among the ids a mask allows, the reply
parses and validates. The sampler here is a seeded random choice over the allowed ids (a model
at its worst), on the embedded model's real tokenizer."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer

from swarmp2p.plan.model_shape import embedded_dir
from swarmp2p.serve.decoding import grammar as g

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "kind": {"enum": ["a", "b", "c"]},
    },
    "required": ["name", "age", "address", "kind"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
EOS = 2


@pytest.fixture(scope="module")
def tokenizers():
    folder = embedded_dir()
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("the embedded model is not converted here (./install.sh --dev does it)")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return tok, g.ll_tokenizer(tok, vocab_size=49152, eos_ids=[EOS])


def _sample(
    matcher: g.Matcher, seed: int, closers=(), limit: int = 400, vocab: int = 49152
) -> list[int]:
    """Random allowed ids until the grammar is done or the sampler picks end-of-sequence;
    ``closers`` (ids of ``}`` and the like) are taken a third of the time they are allowed,
    so an open-ended grammar ends well within ``limit``."""
    rng, out = random.Random(seed), []
    while not matcher.done and len(out) < limit:
        bits = np.unpackbits(np.frombuffer(matcher.mask(), dtype=np.uint8), bitorder="little")
        ids = np.flatnonzero(bits[:vocab]).tolist()
        assert ids, "the mask allows nothing"
        if EOS in ids and matcher.accepting and rng.random() < 0.5:
            break
        close = [i for i in closers if i in ids]
        others = [i for i in ids if i != EOS] or ids
        pick = rng.choice(close) if close and rng.random() < 0.34 else rng.choice(others)
        if pick == EOS:
            break
        matcher.advance(pick)
        out.append(pick)
    return out


def test_twenty_seeded_replies_to_a_nested_schema_all_parse_and_validate(tokenizers):
    tok, llt = tokenizers
    grammar = g.grammar_for({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    for seed in range(20):
        m = g.Matcher(llt, grammar)
        text = tok.decode(_sample(m, seed))
        assert m.accepting, text
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_gives_an_object_and_text_gives_no_grammar(tokenizers):
    tok, llt = tokenizers
    closers = [i for t in ("}", '"', "]", '"}', "0") for i in llt.tokenize_str(t)]
    for seed in range(3):
        m = g.Matcher(llt, g.grammar_for({"type": "json_object"}))
        assert isinstance(json.loads(tok.decode(_sample(m, seed, closers))), dict)
    assert g.grammar_for({"type": "text"}) is None and g.grammar_for(None) is None


def test_the_end_of_sequence_id_is_allowed_only_once_the_reply_is_whole(tokenizers):
    _, llt = tokenizers
    m = g.Matcher(llt, g.grammar_for({"type": "json_object"}))
    assert not g.allowed(m.mask(), EOS) and not m.accepting
    for token in llt.tokenize_str("{}"):
        m.advance(token)
    assert m.accepting and g.allowed(m.mask(), EOS)
    with pytest.raises(g.GrammarError, match="does not follow the grammar"):
        g.Matcher(llt, g.grammar_for({"type": "json_object"})).advance(llt.tokenize_str("x")[0])


@pytest.mark.parametrize("name", ["add", None])
def test_a_forced_tool_call_parses_into_tool_calls(tokenizers, name):
    tok, llt = tokenizers
    m = g.Matcher(llt, g.tool_call_grammar(TOOLS, name))
    text = tok.decode(_sample(m, 1))
    content, calls = g.parse_tool_calls("Sure. " + text)
    assert content == "Sure." and len(calls) == 1
    call = calls[0]["function"]
    assert call["name"] == (name or call["name"]) and call["name"] in ("add", "get_weather")
    schema = next(t for t in TOOLS if t["function"]["name"] == call["name"])["function"]
    jsonschema.validate(json.loads(call["arguments"]), schema["parameters"])


def test_what_cannot_become_a_grammar_is_refused_by_name():
    with pytest.raises(g.GrammarError, match=r"not one of the tools .*'get_weather', 'add'"):
        g.tool_call_grammar(TOOLS, "nope")
    with pytest.raises(g.GrammarError, match="type 'yaml' is not one of"):
        g.grammar_for({"type": "yaml"})
    with pytest.raises(g.GrammarError, match="json_schema must be an object"):
        g.grammar_for({"type": "json_schema", "json_schema": "nope"})
    big = {"type": "object", "description": "x" * g.MAX_SCHEMA_BYTES}
    with pytest.raises(g.GrammarError, match="bytes, above"):
        g.json_grammar(big, "response_format json_schema")


def test_tool_call_blocks_that_are_not_calls_stay_text():
    text = 'a <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> b <tool_call>oops</tool_call>'
    content, calls = g.parse_tool_calls(text)
    assert content == "a  b <tool_call>oops</tool_call>"
    assert [c["function"] for c in calls] == [{"name": "add", "arguments": '{"a": 1}'}]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert g.parse_tool_calls("no calls here") == ("no calls here", [])


def test_tool_call_tags_that_are_added_tokens_are_matched_as_those_tokens(tokenizers):
    """Qwen's and Hermes' tokenizers have ``<tool_call>`` as an added token, which llguidance
    reads as special: a grammar that spelled the tag as text would mask in the token and then
    refuse it ("token ... does not follow the grammar"), so the tag is named as the token."""
    from tokenizers import AddedToken

    tok, _ = tokenizers
    assert g.tag_tokens(tok) == frozenset()
    qwen_like = Tokenizer.from_str(tok.to_str())
    qwen_like.add_tokens([AddedToken("<tool_call>"), AddedToken("</tool_call>")])
    tags = g.tag_tokens(qwen_like)
    assert tags == {"<tool_call>", "</tool_call>"}
    vocab = 49152 + 2
    llt = g.ll_tokenizer(qwen_like, vocab_size=vocab, eos_ids=[EOS])
    opener = qwen_like.token_to_id("<tool_call>")
    unit = {
        "type": "object",
        "properties": {"unit": {"enum": ["c", "f"]}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "units", "parameters": unit}}]
    m = g.Matcher(llt, g.tool_call_grammar(tools, "units", tags))
    bits = np.unpackbits(np.frombuffer(m.mask(), dtype=np.uint8), bitorder="little")
    assert np.flatnonzero(bits[:vocab]).tolist() == [opener]
    m.advance(opener)
    out = [opener, *_sample(m, 1, vocab=vocab)]
    assert m.accepting and out[-1] == qwen_like.token_to_id("</tool_call>")
    _, calls = g.parse_tool_calls(qwen_like.decode(out))
    assert calls[0]["function"]["name"] == "units"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), unit)


def test_the_ids_a_grammar_forces_spell_its_fixed_text_and_each_is_allowed_in_turn(tokenizers):
    """A schema's keys and punctuation are forced: ``forced`` spells them (the session's next
    draft), each id allowed by the mask where it stands; none once the grammar is done."""
    tok, llt = tokenizers
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }
    m = g.Matcher(llt, g.grammar_for({"type": "json_schema", "json_schema": {"schema": schema}}))
    forced = m.forced()
    assert forced and tok.decode(forced).replace(" ", "").startswith('{"city":')
    for token in forced:
        assert g.allowed(m.mask(), token), (token, tok.decode([token]))
        m.advance(token)
    text = tok.decode([*forced, *_sample(m, 0)])  # the rest: random allowed ids
    assert isinstance(json.loads(text)["city"], str), text
    if not m.done:
        m.advance(EOS)
    assert m.done and m.forced() == []
