"""HTTP bodies through ``schema``: every bad parameter answered 400 naming it (OpenAI's
``param``), with a message that says what it must be; good bodies become the same request."""

from __future__ import annotations

import pytest

from swarmp2p.serve.request import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ApiError,
    ServedModel,
    parse_request,
)
from swarmp2p.serve.text import TextCodec

CONTEXT = 32
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def models(tokenizer_folder):
    codec = TextCodec.from_folder(tokenizer_folder)
    return {"m": ServedModel(name="m", client=None, codec=codec, max_context=CONTEXT)}


def _refused(models, body, chat=False) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request({"model": "m", **body}, models, chat=chat)
    return info.value


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"prompt": 3}, "prompt", "prompt: must be a string, a list of token ids"),
        ({"prompt": ["a", "b"]}, "prompt", "batches of several prompts are not supported"),
        ({"prompt": [999]}, "prompt", "token id 999 is outside the vocabulary"),
        ({"prompt": [2**64]}, "prompt", "token id 18446744073709551616 is outside"),
        ({"prompt": ""}, "prompt", "the prompt is empty after tokenizing"),
        (
            {"prompt": "hi", "max_tokens": 0},
            "max_tokens",
            "max_tokens: must be an integer >= 1, got 0",
        ),
        ({"prompt": "hi", "max_tokens": 2**70}, "max_tokens", "that fits 64 bits"),
        ({"prompt": "hi", "n": 17}, "n", "n: must be an integer >= 1 and <= 16, got 17"),
        (
            {"prompt": "hi", "temperature": 7},
            "temperature",
            "must be a number >= 0 and <= 2, got 7",
        ),
        ({"prompt": "hi", "temperature": True}, "temperature", "got true"),
        ({"prompt": "hi", "top_k": 1e23}, "top_k", "must be an integer >= -1"),
        (
            {"prompt": "hi", "seed": 2**70},
            "seed",
            "seed: must be an integer in [-9223372036854775808",
        ),
        ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", ">= 0.01 and <= 10"),
        ({"prompt": "hi", "stream": "yes"}, "stream", 'stream: must be true or false, got "yes"'),
        ({"prompt": "hi", "stream_options": 3}, "stream_options", "must be an object, got 3"),
        ({"prompt": "hi", "stop": ["a"] * 5}, "stop", "a list of up to 4 strings"),
        ({"prompt": "hi", "echo": True}, "echo", "echo is not supported by this server"),
        ({"prompt": "hi", "best_of": 2}, "best_of", "best_of is not supported"),
        ({"prompt": "hi", "tools": [{}]}, "tools[0]", "tools[0].type: required"),
        ({"prompt": "hi", "tool_choice": "auto"}, "tool_choice", "tool_choice auto: needs tools"),
        ({"prompt": "hi", "tool_choice": "any"}, "tool_choice", "is not none, auto, required"),
        ({"prompt": "hi", "tools": [TOOL]}, "tools", "tool calls go with /v1/chat/completions"),
        (
            {"prompt": "hi", "response_format": {"type": "json_schema"}},
            "response_format",
            "json_schema: required with type json_schema",
        ),
        (
            {
                "prompt": "hi",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": "integer", "minimum": "x"}},
                },
            },
            "response_format",
            "response_format json_schema 's'",
        ),
        ({"prompt": "hi", "response_format": {"type": "xml"}}, "response_format", '"json_object"'),
        ({"prompt": "hi", "logit_bias": {"a": 1}}, "logit_bias", "key 'a' is not a token id"),
        ({"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
        (
            {"prompt": "hi", "logit_bias": {"5": 200}},
            "logit_bias",
            "logit_bias.5: must be a number >= -100",
        ),
        (
            {"prompt": "hi", "logprobs": 21},
            "logprobs",
            "logprobs: must be an integer >= 0 and <= 20",
        ),
        ({"prompt": "hi", "logprobs": True}, "logprobs", "got true"),
    ],
)
def test_a_bad_completions_parameter_is_named(models, body, param, says):
    error = _refused(models, body)
    assert (error.status, error.param) == (400, param)
    assert says in error.message


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({}, "messages", "messages: required"),
        ({"messages": []}, "messages", "messages: must be a non-empty list"),
        ({"messages": [3]}, "messages[0]", "messages[0]: must be an object, got 3"),
        ({"messages": [{"content": "x"}]}, "messages[0]", "messages[0].role: required"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0]",
            "messages[0].content: part 0: only text parts are supported",
        ),
        ({"messages": HI, "max_tokens": 0}, "max_tokens", "max_tokens: must be an integer >= 1"),
        ({"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens", ">= 1, got 0"),
        ({"messages": HI, "logprobs": 3}, "logprobs", "logprobs: must be true or false, got 3"),
        ({"messages": HI, "top_logprobs": 2}, "top_logprobs", "top_logprobs: needs logprobs: true"),
    ],
)
def test_a_bad_chat_parameter_is_named(models, body, param, says):
    error = _refused(models, body, chat=True)
    assert (error.status, error.param) == (400, param)
    assert says in error.message


def test_every_problem_is_listed_and_the_model_comes_first(models):
    error = _refused(models, {"model": None, "temperature": 9})
    assert error.param == "model"
    assert "model: required, the id of a served model" in error.message
    assert "prompt: required" in error.message and "temperature: must be" in error.message
    with pytest.raises(ApiError) as missing:  # an unknown model is a 404, whatever else is wrong
        parse_request({"model": "gpt-9", "temperature": 9}, models, chat=False)
    assert (missing.value.status, missing.value.code) == (404, "model_not_found")
    with pytest.raises(ApiError, match="the request body must be a JSON object"):
        parse_request([], models, chat=False)


def test_the_context_length_message_names_what_is_too_long(models):
    long = _refused(models, {"prompt": "word " * 40})
    assert long.code == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens, but the prompt has " in long.message
    chat = _refused(models, {"messages": [{"role": "user", "content": "word " * 40}]}, chat=True)
    assert "but the messages have " in chat.message and chat.param == "messages"


def test_structured_outputs_become_a_grammar_and_tools_need_a_template_that_takes_them(models):
    plain = parse_request({"model": "m", "prompt": "hi"}, models, chat=False)
    assert plain.grammar is None and not plain.tool_calls
    json_ = parse_request(
        {"model": "m", "prompt": "hi", "response_format": {"type": "json_object"}},
        models,
        chat=False,
    )
    assert json_.grammar and not json_.tool_calls
    # the test template never reads tools: offering them is refused, not silently dropped
    refused = _refused(models, {"messages": HI, "tools": [TOOL]}, chat=True)
    assert (refused.param, refused.code) == ("tools", "unsupported_tools")
    assert "does not take tools" in refused.message
    none = parse_request(
        {"model": "m", "messages": HI, "tools": [TOOL], "tool_choice": "none"}, models, chat=True
    )
    assert none.grammar is None and not none.tool_calls


def test_good_bodies_read_as_before(models):
    """Nulls are absent parameters and unknown ones are ignored, as OpenAI-compatible servers
    do; OpenAI's defaults apply."""
    plain = parse_request(
        {"model": "m", "prompt": "hi", "user": "u", "temperature": None}, models, chat=False
    )
    assert plain.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS and plain.n == 1
    assert plain.sampling.temperature == 1.0 and plain.sampling.top_k == 0
    assert (plain.stop, plain.stream, plain.include_usage, plain.logprobs) == (
        (),
        False,
        False,
        None,
    )
    full = parse_request(
        {
            "model": "m",
            "prompt": [[5, 6]],
            "max_tokens": 3,
            "stop": "x",
            "seed": 2**64 - 1,
            "top_p": 0,
            "logit_bias": {"5": 2},
            "logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "best_of": 1,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
        },
        models,
        chat=False,
    )
    assert full.prompt == (5, 6) and full.max_tokens == 3 and full.stop == ("x",)
    assert full.sampling.seed == (2**64 - 1) % 2**63 and full.sampling.top_p == 1e-9
    assert full.sampling.logit_bias == ((5, 2.0),) and full.logprobs == 2
    assert full.stream and full.include_usage
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    chat = parse_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": parts, "name": "bob"}],
            "logprobs": True,
            "top_logprobs": 3,
            "max_tokens": 9,
            "max_completion_tokens": 4,
        },
        models,
        chat=True,
    )
    same = parse_request({"model": "m", "messages": HI}, models, chat=True)
    assert chat.logprobs == 3 and chat.max_tokens == 4 and chat.chat
    assert same.max_tokens == CONTEXT - len(same.prompt)  # chat: the rest of the context
