"""Text: a real byte-level BPE tokenizer trained in the test, the chat template, stop strings."""

from __future__ import annotations

import json

import pytest

from swarmp2p.serve.text import TextCodec, TextStream

CORPUS = [
    "the capital of France is Paris",
    "hello world, hello there",
    "one two three four five six",
    "naïve café – déjà vu ✓",
]
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    out = tmp_path_factory.mktemp("tok")
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    return out


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
