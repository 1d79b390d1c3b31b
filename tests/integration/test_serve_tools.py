"""Tool calls end to end: the official ``openai`` client against the API over a real 2-stage
ring of a tiny random llama whose tokenizer and tool-aware chat template (Qwen's and Hermes'
``<tool_call>{json}</tool_call>`` format) are built here. A random model calls a tool only when
the grammar makes it: ``tool_choice`` naming a function, or ``required``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import openai
import pytest

from swarmp2p.serve.api import ApiServer, build_app
from swarmp2p.serve.local import LocalRing
from swarmp2p.serve.request import ServedModel
from swarmp2p.serve.text import TextCodec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "runtime"))  # tiny_models

pytestmark = [pytest.mark.torch, pytest.mark.slow]

CONTEXT = 2048
TEMPLATE = """\
{%- if tools %}<s>system
You can call these functions:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.</s>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<s>assistant
{%- for call in m.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}</s>
{% elif m.role == 'tool' %}<s>tool
<tool_response>{{ m.content }}</tool_response></s>
{% else %}<s>{{ m.role }}
{{ m.content }}</s>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<s>assistant
{% endif %}"""
PLAIN_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
CORPUS = [
    "What is the weather in Paris? Let me check the weather for you.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    "</tool_call>",
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "The sum of 1 and 2 is 3. It is sunny in Paris, 21 degrees.",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 999},
                    "b": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _model_folder(root, template: str):
    """A tiny random llama saved with a byte-level BPE tokenizer trained on CORPUS, whose
    ``<tool_call>`` and ``</tool_call>`` are added (not special) tokens as in Qwen's."""
    import torch
    from tiny_models import byte_bpe
    from tokenizers import AddedToken
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_bpe(CORPUS, vocab_size=480)
    tok.add_tokens([AddedToken("<tool_call>"), AddedToken("</tool_call>")])
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=CONTEXT,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root)
    tok.save(str(root / "tokenizer.json"))
    (root / "chat_template.jinja").write_text(template)
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return root


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = _model_folder(tmp_path_factory.mktemp("tools-model"), TEMPLATE)
    plain = _model_folder(tmp_path_factory.mktemp("plain-model"), PLAIN_TEMPLATE)
    with LocalRing(str(folder), bounds=[(0, 1), (1, 2)], threads=1, max_context=CONTEXT) as ring:
        models = [
            ServedModel(
                name=name,
                client=ring.client,
                codec=TextCodec.from_folder(source),
                max_context=CONTEXT,
            )
            for name, source in (("tiny-tools", folder), ("tiny-plain", plain))
        ]
        with ApiServer(build_app(models)) as server:
            yield server, models[0]


@pytest.fixture
def client(served):
    server, _ = served
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _ask(client, tool_choice, **kw):
    """A chat completion of ASK offering TOOLS, sampled at temperature 1 unless ``kw`` says."""
    args = dict(model="tiny-tools", messages=ASK, tools=TOOLS, max_tokens=96, temperature=1.0)
    return client.chat.completions.create(**{**args, "tool_choice": tool_choice, **kw})


def _checked(call, names=("get_weather", "add")) -> dict:
    """The call's arguments, once they parse and validate against its tool's parameters."""
    assert call.type == "function" and call.id and call.function.name in names
    schema = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("seed", range(3))
def test_a_named_tool_choice_gives_a_valid_call_of_that_function(client, seed):
    reply = _ask(client, {"type": "function", "function": {"name": "get_weather"}}, seed=seed)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert len(choice.message.tool_calls) == 1 and choice.message.content is None
    assert _checked(choice.message.tool_calls[0], names=("get_weather",))["unit"] in ("c", "f")


def test_required_calls_one_of_the_tools_on_every_seed(client):
    for seed in range(6):
        choice = _ask(client, "required", seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        _checked(call)


def test_auto_answers_text_or_a_valid_call_and_the_template_saw_the_tools(client):
    without = client.chat.completions.create(
        model="tiny-tools", messages=ASK, max_tokens=4, temperature=0
    )
    for seed in range(3):
        reply = _ask(client, "auto", max_tokens=24, seed=seed)
        choice = reply.choices[0]
        # the prompt held the tools' descriptions, as the template rendered them
        assert reply.usage.prompt_tokens > without.usage.prompt_tokens + 40
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                _checked(call)
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content


def test_a_streamed_call_arrives_as_delta_chunks_the_client_accumulates(client):
    args = dict(
        model="tiny-tools",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=96,
        temperature=1.0,
        seed=7,
    )
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert calls and all(t.index == 0 for t in calls)
    assert not any(d.content for d in deltas)  # no piece of the block leaked as text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    with client.chat.completions.stream(**args) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls
    (want,) = whole.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert streamed.function.name == want.function.name == "add"
    assert streamed.id.startswith("call_") and streamed.id != want.id  # every reply's ids are new
    assert streamed.function.arguments == want.function.arguments  # the same seed, the same call
    _checked(streamed, names=("add",))


def test_a_conversation_goes_on_after_the_tool_answers(client):
    first = _ask(client, "required", seed=1)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    reply = _ask(client, "none", messages=messages, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert not reply.choices[0].message.tool_calls


def test_a_template_that_does_not_take_tools_is_refused_with_a_400(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny-plain", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=4
        )
    body = refused.value.body
    assert body["param"] == "tools" and body["code"] == "unsupported_tools"
    assert "does not take tools" in body["message"]
