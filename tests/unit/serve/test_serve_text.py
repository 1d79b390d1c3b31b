"""Text: a real byte-level BPE tokenizer trained in the test, the chat template, stop strings."""

from __future__ import annotations

import pytest
from conftest import CORPUS

from swarmp2p.serve.text import TextCodec, TextStream


@pytest.fixture
def folder(tokenizer_folder):
    return tokenizer_folder


def test_codec_reads_the_folder(folder):
    codec = TextCodec.from_folder(folder)
    assert codec.eos_ids == {2, 7}
    ids = codec.encode("hello world")
    assert codec.decode(ids) == "hello world"
    prompt = codec.render_chat([{"role": "user", "content": "hi"}])
    assert prompt == "<s>user\nhi</s>\n<s>assistant\n"
    ids = codec.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(2) == 1  # the special tokens are single ids


def test_codec_without_template_says_what_to_do(folder, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    codec = TextCodec.from_folder(tmp_path)
    with pytest.raises(ValueError, match=r"no chat template.*use /v1/completions"):
        codec.render_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer\.json"):
        TextCodec.from_folder(tmp_path / "nowhere")


def _feed(codec, text, stop):
    ids = codec.encode(text)
    pieces: list[str] = []
    stream = TextStream(codec, stop, on_text=pieces.append)
    seen = []
    stopped = False
    for token in ids:
        seen.append(token)
        if stream.push(seen):
            stopped = True
            break
    return stream.finish(), pieces, stopped


@pytest.mark.parametrize(
    ("stop", "want", "stopped"),
    [
        ((), "the capital of France is Paris", False),
        (("France",), "the capital of ", True),
        (("is P", "capital"), "the ", True),
        (("Parisian",), "the capital of France is Paris", False),  # a prefix never matched
    ],
)
def test_stream_cuts_at_stop_strings_and_loses_nothing(folder, stop, want, stopped):
    codec = TextCodec.from_folder(folder)
    text, pieces, was_stopped = _feed(codec, "the capital of France is Paris", stop)
    assert text == want
    assert "".join(pieces) == want
    assert was_stopped == stopped


def test_stream_holds_back_split_characters(folder):
    codec = TextCodec.from_folder(folder)
    text, pieces, _ = _feed(codec, "déjà vu ✓", ())
    assert text == "déjà vu ✓"
    assert all("\ufffd" not in p for p in pieces)


def test_streamed_text_equals_decoding_the_whole(folder):
    codec = TextCodec.from_folder(folder)
    text = " ".join(CORPUS)
    got, pieces, _ = _feed(codec, text, ())
    assert got == codec.decode(codec.encode(text)) == "".join(pieces)


def test_stop_string_check_costs_the_same_per_token_late_as_early(folder):
    """2,000 tokens through a stream with stop strings that never match (two of them keep a
    tail held back now and then): the per-token cost of the last 300 tokens is within 2x of
    that of 300 early ones (decoding everything again per token made it grow ~10x)."""
    import statistics
    import time

    codec = TextCodec.from_folder(folder)
    ids: list[int] = []
    while len(ids) < 2000:
        ids += codec.encode(" ".join(CORPUS) + " ")
    ids = ids[:2000]
    stream = TextStream(codec, ["zzz never", "Paris!", "one two three four six", "\n\n"])
    costs, seen = [], []
    for token in ids:
        seen.append(token)
        start = time.perf_counter_ns()
        assert not stream.push(seen)
        costs.append(time.perf_counter_ns() - start)
    early = statistics.median(costs[100:400])
    late = statistics.median(costs[1700:2000])
    assert late / early < 2.0, (early, late)
    assert stream.finish() == codec.decode(ids)


TRICKY_TEMPLATE = (
    "{%- set ns = namespace(seen=0) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'stop' %}{% break %}{% endif -%}"
    "{%- if m['role'] == 'skip' %}{% continue %}{% endif -%}"
    "{%- set ns.seen = ns.seen + 1 -%}"
    "<s>{{ m['role'] }}\n{{ m['content'] }}\n"
    "{{ m | tojson }}|{{ m | tojson(ensure_ascii=True) }}|"
    "{{ dict(a=m['role'], b=ns.seen) | tojson(indent=2, sort_keys=True) }}|"
    "{{ m | tojson(separators=(',', ':')) }}</s>\n"
    "{% endfor -%}"
    "{%- generation %}seen {{ ns.seen }}{% endgeneration %}\n"
    "Today: {{ strftime_now('%Y-%m') }} {{ eos_token }}{{ bos_token is defined }}\n"
    "{%- if add_generation_prompt %}<s>assistant\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": 'Réponds en français. «Guillemets» & <tags> "quoted"'},
    {"role": "skip", "content": "never shown"},
    {"role": "user", "content": "日本語で？ ☕ naïve café – déjà vu ✓"},
    {"role": "stop", "content": "the loop breaks here"},
    {"role": "user", "content": "unreachable"},
]


@pytest.mark.torch
@pytest.mark.parametrize("template", ["tricky", "embedded"])
def test_chat_templates_render_byte_identical_to_apply_chat_template(folder, template, tmp_path):
    """tojson(ensure_ascii=False and True, indent, sort_keys, separators), {% break %},
    {% continue %}, namespace, dict, strftime_now, {% generation %}, non-ASCII; and the
    embedded model's own template."""
    import shutil

    from transformers import AutoTokenizer

    if template == "embedded":
        from swarmp2p.runtime.models import resolve_model_ref

        source = resolve_model_ref("embedded")
        messages = [m for m in MESSAGES if m["role"] in ("system", "user")][:2]
    else:
        source = tmp_path / "tricky"
        shutil.copytree(folder, source)
        (source / "chat_template.jinja").write_text(TRICKY_TEMPLATE, encoding="utf-8")
        messages = MESSAGES
    reference = AutoTokenizer.from_pretrained(str(source))
    want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    codec = TextCodec.from_folder(source)
    got = codec.render_chat(messages)
    assert got.encode("utf-8") == want.encode("utf-8")
    if template == "tricky":
        assert "日本語で？" in got and "\\u65e5" in got and "never shown" not in got
    assert codec.encode_chat(messages) == reference.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )


def test_a_template_that_raises_names_the_reason(folder, tmp_path):
    import shutil

    shutil.copytree(folder, tmp_path / "m")
    (tmp_path / "m" / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('users first') }}{% endif %}"
    )
    codec = TextCodec.from_folder(tmp_path / "m")
    with pytest.raises(ValueError, match="the chat template refused the messages: users first"):
        codec.render_chat([{"role": "system", "content": "x"}])
