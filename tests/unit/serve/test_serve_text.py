"""Text: a real byte-level BPE tokenizer trained in the test, the chat template, stop strings;
SentencePiece-style tokenizers built here, streamed against the whole text."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from contextlib import contextmanager

import pytest

from swarmp2p.serve.text import TextCodec, TextStream


def _corpus() -> list[str]:
    """The serve tests' corpus, from this folder's conftest by path (a bare ``import conftest``
    finds whichever conftest another folder put first on sys.path)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "_serve_conftest", Path(__file__).with_name("conftest.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CORPUS


CORPUS = _corpus()


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
        from swarmp2p.models import resolve_model_ref

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


# --- streamed text against the prompt's: SentencePiece-style and byte-level tokenizers ------


def _spm_codec(style: str) -> TextCodec:
    """A SentencePiece-style tokenizer built here ("▁" marks a space; what the vocabulary
    lacks falls back to byte tokens): "metaspace" with a Metaspace pre-tokenizer and decoder
    (as Mistral's and newer conversions have), "llama" as Llama 2's tokenizer.json (the
    normalizer prepends and replaces "▁"; the decoder replaces it, fuses the bytes and strips
    the first space)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += ["▁", "▁Hello", "▁world", "ly", ",", "▁wor", "ld", "▁café"]
    model = models.Unigram([(p, -1.0) for p in pieces], unk_id=0, byte_fallback=True)
    tok = Tokenizer(model)
    if style == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    else:
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return TextCodec(tok, chat_template=None, eos_ids=frozenset({2}), special={})


SPM_GENERATED = ["▁world", "ly", ",", "▁wor", "ld", "▁", "<0xE2>", "<0x9C>", "<0x93>", "▁café"]
"""A word, one continuing it without "▁", a comma, a word in two pieces, a "✓" in three bytes."""


def _streamed(codec, prompt, generated):
    pieces: list[str] = []
    stream = TextStream(codec, on_text=pieces.append, prompt=prompt)
    for i in range(len(generated)):
        assert not stream.push(generated[: i + 1])
    return pieces, stream.finish()


def _added_text(codec, prompt, generated):
    """What the generated ids add to the prompt's text, decoding both whole."""
    before = codec.decode(prompt)
    whole = codec.decode([*prompt, *generated])
    assert whole.startswith(before)
    return whole[len(before) :]


@pytest.mark.parametrize("style", ["metaspace", "llama"])
@pytest.mark.parametrize("prompt", ["Hello", "Hello world,", "Hello world, " * 10 + "Hello"])
def test_sentencepiece_stream_keeps_the_first_space(style, prompt):
    """After "Hello", "▁world" streams as " world": the decoder starts from the prompt's ids.
    Decoded alone (``decode(generated)``) the first "▁" is the start of a text and dropped,
    which made the stream (and the whole answer) "Helloworld"."""
    codec = _spm_codec(style)
    ids = [1, *codec.encode(prompt)]  # <s> first, as a chat template or a Llama prompt has it
    assert codec.tokenizer.encode(prompt).tokens[0] == "▁Hello"
    generated = [codec.tokenizer.token_to_id(p) for p in SPM_GENERATED]
    pieces, text = _streamed(codec, ids, generated)
    assert "".join(pieces) == text == _added_text(codec, ids, generated)
    assert text == " worldly, world ✓ café"
    assert text == " " + codec.decode(generated)  # the space decoding alone drops
    assert pieces[0] == " world"
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("prompt", ["the capital of", "the capital of 日本", "one two " * 20])
def test_byte_level_stream_equals_decoding_the_generated_ids(folder, prompt):
    """Byte-level (GPT-2, SmolLM): the space is a byte of its token, so the stream, the
    generated ids decoded alone and their text after the prompt's are the same; characters
    split across tokens come whole (in the prompt's tail too)."""
    codec = TextCodec.from_folder(folder)
    prompt = codec.encode(prompt)
    generated = codec.encode(" France is déjà vu ✓ 日本 ☕")
    assert any("\ufffd" in codec.token_text(t) for t in generated)  # some character is split
    pieces, text = _streamed(codec, prompt, generated)
    want = " France is déjà vu ✓ 日本 ☕"
    assert "".join(pieces) == text == _added_text(codec, prompt, generated) == want
    assert codec.decode(generated) == want
    assert all("\ufffd" not in p for p in pieces)


@contextmanager
def _scripted_ring(generated, max_context=64):
    """A RingClient whose "ring" is a thread answering every prefill and decode step with the
    next of ``generated`` (each session from the start): no model, the tokens chosen."""
    from swarmp2p.net import InProcLink, LinkTimeout
    from swarmp2p.serve import Decode, Prefill, RingClient, Tokens, decode_message

    to_stage0, stage0_in = InProcLink.pair()
    from_last, manager_in = InProcLink.pair()
    done = threading.Event()

    def answer():
        sent: dict[int, int] = {}
        while not done.is_set():
            try:
                msg = decode_message(stage0_in.recv(0.05)[0])
            except LinkTimeout:
                continue
            if isinstance(msg, Prefill):
                group, step, rows = -1, 0, [(msg.sid, msg.pos + len(msg.tokens))]
            elif isinstance(msg, Decode):
                group, step = msg.group, msg.step
                rows = [(sid, pos + 1) for sid, pos in zip(msg.sids, msg.positions, strict=True)]
            else:
                continue
            tokens = []
            for sid, _ in rows:
                sent[sid] = sent.get(sid, 0) + 1
                tokens.append(generated[sent[sid] - 1])
            tokens = tuple(tokens)
            sids, positions = zip(*rows, strict=True)
            reply = Tokens(group=group, step=step, sids=sids, positions=positions, tokens=tokens)
            # a lap of a real ring takes time; with none, every token may arrive before the
            # stream is read, and one chunk rightly carries them all
            time.sleep(0.02)
            from_last.send([reply.encode()])

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with RingClient(to_stage0, manager_in, max_context=max_context) as client:
            yield client
    finally:
        done.set()
        thread.join(5)


def _post(url: str, body: dict) -> bytes:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


def _sse_texts(raw: bytes) -> list[str]:
    """The text of each completion chunk of a streamed answer."""
    out = []
    for line in raw.decode("utf-8").splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[len("data: ") :])["choices"]:
            out.append(choice["text"])
    return [t for t in out if t]


@pytest.mark.parametrize("style", ["metaspace", "llama", "byte-level"])
def test_the_api_streams_the_text_it_answers_whole(style, folder):
    """/v1/completions over a scripted ring, streamed and not: the chunks joined are the
    whole answer's text, what the generated ids add to the prompt's ("Hello" + " world...")."""
    from swarmp2p.serve import ApiServer, ServedModel, build_app

    if style == "byte-level":
        codec = TextCodec.from_folder(folder)
        generated = codec.encode(" France is déjà vu ✓ 日本 ☕")
        prompt, want = "the capital of", " France is déjà vu ✓ 日本 ☕"
    else:
        codec = _spm_codec(style)
        generated = [codec.tokenizer.token_to_id(p) for p in SPM_GENERATED]
        prompt, want = "Hello", " worldly, world ✓ café"
    body = {"model": "m", "prompt": prompt, "max_tokens": len(generated), "temperature": 0}
    with _scripted_ring(generated) as client:
        model = ServedModel(name="m", client=client, codec=codec, max_context=64)
        with ApiServer(build_app([model])) as server:
            url = server.url + "/v1/completions"
            whole = json.loads(_post(url, body))
            chunks = _sse_texts(_post(url, {**body, "stream": True}))
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["choices"][0]["text"] == "".join(chunks) == want
    assert len(chunks) > 1 and all("\ufffd" not in c for c in chunks)
