"""The OpenAI-compatible API over a 2-stage ring of the embedded model, with the official
``openai`` client."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest

from swarmp2p.serve.api import ApiServer, build_app
from swarmp2p.serve.local import LocalRing
from swarmp2p.serve.request import ServedModel
from swarmp2p.serve.text import TextCodec

pytestmark = [pytest.mark.torch, pytest.mark.slow]

CONTEXT = 256
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served():
    from swarmp2p.models import resolve_model_ref

    folder = resolve_model_ref("embedded")
    with LocalRing("embedded", bounds=[(0, 15), (15, 30)], threads=1, max_context=CONTEXT) as ring:
        model = ServedModel(
            name="embedded",
            client=ring.client,
            codec=TextCodec.from_folder(folder),
            max_context=CONTEXT,
        )
        with ApiServer(build_app([model])) as server:
            yield server, model, folder


@pytest.fixture
def client(served):
    server, _, _ = served
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["embedded"]


def test_chat_says_paris_and_equals_generate_in_one_process(client, served):
    import torch
    from transformers import AutoModelForCausalLM

    _, model, folder = served
    reply = client.chat.completions.create(
        model="embedded", messages=FRANCE, temperature=0, max_tokens=24
    )
    text = reply.choices[0].message.content
    assert "Paris" in text
    assert reply.usage.prompt_tokens == len(model.codec.encode_chat(FRANCE))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = model.codec.encode_chat(FRANCE)
    with torch.no_grad():
        out = whole.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
    new = out[0, len(prompt) :].tolist()
    assert reply.usage.completion_tokens == len(new)
    assert text == model.codec.decode(new)


def test_speculation_through_the_api_gives_generates_tokens(client, served):
    """The ring speculates by default (auto): a prompt that asks for a passage again is
    answered with plain greedy decoding's tokens exactly, and drafts were accepted."""
    import torch
    from transformers import AutoModelForCausalLM

    _, model, folder = served
    passage = "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun."
    messages = [{"role": "user", "content": f"Repeat exactly: {passage}"}]
    before = model.client.spec_stats()
    reply = client.chat.completions.create(
        model="embedded", messages=messages, temperature=0, max_tokens=32
    )
    after = model.client.spec_stats()
    assert model.client.speculate == "auto"
    assert after["accepted"] > before["accepted"], (before, after)
    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = model.codec.encode_chat(messages)
    with torch.no_grad():
        out = whole.generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
    assert reply.choices[0].message.content == model.codec.decode(out[0, len(prompt) :].tolist())


def test_completion_usage_length_and_streaming_agree(client, served):
    _, model, _ = served
    prompt = "The three primary colors are"
    full = client.completions.create(model="embedded", prompt=prompt, temperature=0, max_tokens=9)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(model.codec.encode(prompt))
    assert full.usage.completion_tokens == 9
    chunks = list(
        client.completions.create(
            model="embedded",
            prompt=prompt,
            temperature=0,
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 2  # really streamed
    assert chunks[-1].usage.completion_tokens == 9
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    pieces = list(
        client.chat.completions.create(
            model="embedded", messages=FRANCE, temperature=0, max_tokens=12, stream=True
        )
    )
    assert pieces[0].choices[0].delta.role == "assistant"
    streamed = "".join(p.choices[0].delta.content or "" for p in pieces)
    whole = client.chat.completions.create(
        model="embedded", messages=FRANCE, temperature=0, max_tokens=12
    )
    assert streamed == whole.choices[0].message.content


def test_stop_strings_cut_the_text(client):
    base = client.completions.create(
        model="embedded", prompt="Count: one, two, three,", temperature=0, max_tokens=12
    ).choices[0]
    word = base.text.strip().split()[1]  # a word in the middle of the greedy continuation
    cut = client.completions.create(
        model="embedded",
        prompt="Count: one, two, three,",
        temperature=0,
        max_tokens=12,
        stop=["zzz-never", word],
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == base.text[: base.text.index(word)]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="embedded",
            prompt="Count: one, two, three,",
            temperature=0,
            max_tokens=12,
            stop=[word],
            stream=True,
        )
    )
    assert streamed == cut.text


def test_sampling_seed_repeats_and_temperature_varies(client):
    def ask(**kw):
        return (
            client.completions.create(
                model="embedded", prompt="Once upon a time", max_tokens=12, **kw
            )
            .choices[0]
            .text
        )

    assert ask(temperature=1.0, seed=11) == ask(temperature=1.0, seed=11)
    assert len({ask(temperature=1.0, seed=s) for s in (1, 2, 3)}) > 1
    assert ask(temperature=1.0, extra_body={"top_k": 1}, seed=4) == ask(temperature=0)


def test_four_concurrent_requests_each_get_their_solo_answer(client):
    prompts = ["The sun is", "Python is a", "My favourite food is", "The ocean"]
    kwargs = [dict(temperature=0), dict(temperature=0), dict(temperature=0.8, seed=3), {}]
    kwargs[3] = dict(temperature=0)
    solo = [
        client.completions.create(model="embedded", prompt=p, max_tokens=10, **k).choices[0].text
        for p, k in zip(prompts, kwargs)
    ]
    together: list = [None] * 4
    barrier = threading.Barrier(4)

    def one(i):
        barrier.wait()
        together[i] = (
            client.completions.create(
                model="embedded", prompt=prompts[i], max_tokens=10, **kwargs[i]
            )
            .choices[0]
            .text
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == solo


def _post(url, data: bytes, headers=None):
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_errors_come_in_openai_shape(client, served):
    server, _, _ = served
    status, body = _post(server.url + "/v1/completions", b'{"model": "embedded", "prompt": ')
    assert status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "could not parse the JSON body" in body["error"]["message"]

    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-9", prompt="hi")
    assert missing.value.body["code"] == "model_not_found"
    assert "gpt-9" in missing.value.body["message"]

    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="embedded", prompt="word " * (CONTEXT + 10))
    assert long.value.body["code"] == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in long.value.body["message"]

    with pytest.raises(openai.BadRequestError) as hot:
        client.completions.create(model="embedded", prompt="hi", temperature=7)
    assert hot.value.body["param"] == "temperature"

    status, body = _post(server.url + "/v1/nothing", b"{}")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"


def test_an_api_key_is_required_when_set(served):
    _, model, _ = served
    with ApiServer(build_app([model], api_key="s3cret")) as server:
        with (
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad,
            pytest.raises(openai.AuthenticationError),
        ):
            bad.models.list()
        with openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0) as good:
            assert [m.id for m in good.models.list().data] == ["embedded"]


def test_swarm_generate_and_chat_are_clients_of_the_api(client, served):
    from click.testing import CliRunner

    from swarmp2p.cli import main

    server, _, _ = served
    want = (
        client.completions.create(
            model="embedded", prompt="The capital of France is", temperature=0, max_tokens=6
        )
        .choices[0]
        .text
    )
    runner = CliRunner()
    args = ["--url", server.url, "embedded", "The capital of France is"]
    args += ["--max-tokens", "6", "--temperature", "0"]
    for stream in ("--no-stream", "--stream"):
        result = runner.invoke(main, ["generate", *args, stream])
        assert result.exit_code == 0, result.output
        assert result.output == want + "\n"

    result = runner.invoke(
        main,
        ["chat", "embedded", "--url", server.url, "--temperature", "0", "--max-tokens", "24"],
        input="What is the capital of France?\n\n",
    )
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output

    result = runner.invoke(main, ["generate", "--url", server.url, "gpt-9", "hi"])
    assert result.exit_code == 1
    assert "404: The model `gpt-9` does not exist" in result.output


def test_a_client_leaving_mid_stream_ends_its_session(client, served):
    import time

    _, model, _ = served
    stream = client.completions.create(
        model="embedded", prompt="Once upon a time", temperature=0, max_tokens=240, stream=True
    )  # 240 tokens take several seconds here
    pieces = 0
    for chunk in stream:
        pieces += bool(chunk.choices and chunk.choices[0].text)
        if pieces == 2:
            break
    assert model.client.active == 1
    stream.close()
    started = time.monotonic()
    while model.client.active and time.monotonic() < started + 10:
        time.sleep(0.02)
    assert model.client.active == 0
    assert time.monotonic() - started < 2.0  # cancelled, not run to its 240 tokens


def test_models_retrieve_names_the_context(client):
    card = client.models.retrieve("embedded")
    assert card.id == "embedded"
    assert card.model_extra["max_model_len"] == CONTEXT
    assert client.models.list().data[0].model_extra["max_model_len"] == CONTEXT
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-9")
    assert missing.value.body["code"] == "model_not_found"


def test_n_choices_and_logprobs(client):
    reply = client.chat.completions.create(
        model="embedded",
        messages=FRANCE,
        n=2,
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content == reply.choices[1].message.content  # greedy twice
    assert reply.usage.completion_tokens == 12
    entries = reply.choices[0].logprobs.content
    assert (
        len(entries) == 6 and "".join(e.token for e in entries) == reply.choices[0].message.content
    )
    for entry in entries:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token

    sampled = client.completions.create(
        model="embedded",
        prompt="Once upon a time",
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=8,
        logprobs=2,
    )
    texts = [c.text for c in sampled.choices]
    assert len(set(texts)) > 1  # each choice its own draw
    for choice in sampled.choices:
        assert "".join(choice.logprobs.tokens) == choice.text
        assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
        assert choice.logprobs.text_offset[0] == 0
    again = client.completions.create(
        model="embedded", prompt="Once upon a time", n=3, temperature=1.0, seed=7, max_tokens=8
    )
    assert [c.text for c in again.choices] == texts  # the seed makes every choice repeat

    streamed = list(
        client.chat.completions.create(
            model="embedded", messages=FRANCE, n=2, temperature=0, max_tokens=6, stream=True
        )
    )
    for index in (0, 1):
        text = "".join(
            c.choices[0].delta.content or "" for c in streamed if c.choices[0].index == index
        )
        assert text == reply.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in streamed if c.choices[0].finish_reason]
    assert finishes == ["length", "length"]


def test_penalties_bias_and_min_p_change_the_output(client, served):
    def ask(prompt="one one one one one one", **kw):
        return client.completions.create(
            model="embedded", prompt=prompt, temperature=0, max_tokens=8, **kw
        )

    plain = ask().choices[0].text
    assert ask(frequency_penalty=2.0).choices[0].text != plain
    cat = "The cat sat on the"  # greedy: " cat's back, and the cat sat"
    assert ask(cat, presence_penalty=-2.0).choices[0].text != ask(cat).choices[0].text
    assert ask(extra_body={"repetition_penalty": 3.0}).choices[0].text != plain
    assert ask(extra_body={"min_p": 0.5}).choices[0].text == plain  # greedy ignores warpers
    equals = served[1].codec.tokenizer.token_to_id("=")
    forced = ask(logit_bias={str(equals): 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == ["="] * 8
    assert forced.usage.completion_tokens == 8


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}


def test_response_format_json_is_enforced_on_every_seeded_reply(client):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in range(20):
        reply = client.chat.completions.create(
            model="embedded",
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            max_tokens=80,
            temperature=1.0,
            seed=seed,
            response_format=fmt,
        )
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    whole = client.chat.completions.create(
        model="embedded",
        messages=FRANCE,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(whole.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="embedded",
            messages=FRANCE,
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "x"}},
            },
        )
    assert bad.value.body["param"] == "response_format"


def test_a_constrained_session_drafts_and_keeps_plain_decoding_s_tokens(served):
    """A json_schema session speculates like any other: every verified row is masked with the
    grammar's state after the drafts before it, so greedy and seeded replies equal those of the
    same session with drafting off, token for token, and some drafts are kept."""
    import jsonschema

    from swarmp2p.serve.decoding.grammar import grammar_for
    from swarmp2p.serve.protocol import SamplingParams

    _, model, _ = served
    client, codec = model.client, model.codec
    grammar = grammar_for({"type": "json_schema", "json_schema": {"schema": PERSON}}).text
    ada = '{"name": "Ada", "age": 36, "address": {"city": "London"}}'
    ask = [{"role": "user", "content": f"Repeat this JSON exactly: {ada}"}]
    prompt = codec.encode_chat(ask)
    kw = dict(max_tokens=60, stop_ids=codec.eos_ids, grammar=grammar, timeout=120)
    for sampling in (None, SamplingParams(temperature=1.0, seed=7)):
        before = client.spec_stats()
        drafted = client.generate(prompt, sampling=sampling, **kw)
        after = client.spec_stats()
        plain = client.generate(prompt, sampling=sampling, speculate=False, **kw)
        assert drafted == plain, (codec.decode(drafted), codec.decode(plain))
        assert after["accepted"] > before["accepted"], (before, after)
        text = codec.decode([t for t in drafted if t not in codec.eos_ids])
        jsonschema.validate(json.loads(text), PERSON)


def _get(url, headers=None):
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_health_and_prometheus_metrics(client, served):
    server, _, _ = served
    client.completions.create(model="embedded", prompt="Hi", temperature=0, max_tokens=3)
    status, body = _get(server.url + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, text = _get(server.url + "/metrics")
    assert status == 200
    assert 'swarm_requests_total{model="embedded",endpoint="/v1/completions",status="200"}' in text
    assert 'swarm_time_to_first_token_seconds_bucket{model="embedded",le="+Inf"}' in text
    assert 'swarm_inter_token_latency_seconds_count{model="embedded"}' in text
    assert 'swarm_queue_depth{model="embedded"} 0' in text
    assert 'swarm_stage_batch_size{model="embedded",stage="1"}' in text
    assert 'swarm_speculative_acceptance_ratio{model="embedded"}' in text
    assert 'swarm_speculative_tokens_per_lap{model="embedded"}' in text
    generated = [line for line in text.splitlines() if line.startswith("swarm_generation_tokens")]
    assert int(generated[0].split()[-1]) >= 3


def test_foreign_hosts_and_origins_are_refused(served):
    server, _, _ = served
    port = server.url.rsplit(":", 1)[1]
    status, body = _get(server.url + "/v1/models", {"Host": f"evil.example:{port}"})
    assert status == 403 and "DNS-rebinding" in body
    body = json.dumps({"model": "embedded", "prompt": "hi", "max_tokens": 1}).encode()
    status, reply = _post(
        server.url + "/v1/completions",
        body,
        {"Origin": "http://evil.example", "Content-Type": "text/plain"},
    )
    assert status == 403 and "cross-site" in reply["error"]["message"]
    assert _get(server.url + "/v1/models", {"Host": f"localhost:{port}"})[0] == 200
    status, _ = _post(server.url + "/v1/completions", body, {"Origin": f"http://127.0.0.1:{port}"})
    assert status == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [18446744073709551616]}, "prompt"),
        ({"prompt": [49152]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "hi", "top_k": 1e23}, "top_k"),
        ({"prompt": "hi", "top_k": 10**23}, "top_k"),
        ({"prompt": "hi", "seed": 2**70}, "seed"),
        ({"prompt": "hi", "max_tokens": 2**70}, "max_tokens"),
        ({"prompt": "hi", "n": 10**20}, "n"),
        ({"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"prompt": "hi", "logprobs": 10**30}, "logprobs"),
    ],
)
def test_out_of_range_numbers_are_400_and_leave_no_session(served, body, param):
    server, model, _ = served
    status, reply = _post(
        server.url + "/v1/completions", json.dumps({"model": "embedded", **body}).encode()
    )
    assert status == 400, reply
    assert reply["error"]["param"] == param
    assert model.client.active == 0 and model.client.queue_depth == 0


def test_a_client_that_leaves_a_plain_request_cancels_it(served):
    """Not streamed: the server notices the closed connection and frees the session."""
    import socket
    import time

    server, model, _ = served
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps(
        {"model": "embedded", "prompt": "Once upon a time", "temperature": 0, "max_tokens": 240}
    ).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        started = time.monotonic()
        while model.client.active == 0 and time.monotonic() < started + 10:
            time.sleep(0.01)
        assert model.client.active == 1
    left = time.monotonic()
    while model.client.active and time.monotonic() < left + 10:
        time.sleep(0.02)
    assert model.client.active == 0
    assert time.monotonic() - left < 2.0  # cancelled, not run to its 240 tokens
