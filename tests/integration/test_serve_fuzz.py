"""A fuzz of the OpenAI API over real HTTP against a real served tiny model (a 2-stage ring of
worker processes): random and mutated requests must never crash it (no 5xx but 503 for a
full ring), leak a session slot, or leave it unable to serve."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
from pathlib import Path

import pytest

from swarmp2p.serve.api import ApiServer, build_app
from swarmp2p.serve.local import LocalRing
from swarmp2p.serve.request import ServedModel
from swarmp2p.serve.text import TextCodec

pytestmark = [pytest.mark.torch, pytest.mark.slow]

REQUESTS = 10_000
CONTEXT = 40
SESSIONS = 4


@pytest.fixture(scope="module")
def tiny_served(tmp_path_factory):
    """A tiny random Llama with the embedded model's tokenizer and chat template, served by
    two worker processes behind the API."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from swarmp2p.models import resolve_model_ref

    folder = tmp_path_factory.mktemp("tiny-served")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    source = resolve_model_ref("embedded")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{source}/{name}", folder / name)
    with LocalRing(
        str(folder),
        bounds=[(0, 1), (1, 2)],
        threads=1,
        max_context=CONTEXT,
        max_sessions=SESSIONS,
        step_timeout=20,
    ) as ring:
        ring.client.queue_timeout = 10.0
        model = ServedModel(
            name="tiny",
            client=ring.client,
            codec=TextCodec.from_folder(folder),
            max_context=CONTEXT,
            vocab_size=49152,
        )
        with ApiServer(build_app([model])) as server:
            yield server, model


WEIRD = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    7,
    2**31,
    2**63,
    2**64,
    -(2**64),
    10**30,
    1e23,
    -1e23,
    0.5,
    1e-300,
    1e-6,
    1e308,
    float("nan"),
    float("inf"),
    -0.0,
    "",
    "x",
    "tiny",
    "a" * 5000,
    "日本語 ☕",
    "\x00\x01",
    [],
    [1],
    [[1]],
    [2**64],
    [-5],
    [49152],
    [0] * 30,
    {},
    {"a": 1},
    {"1": 100},
    {"type": "json_object"},
    {"type": "text"},
    {"include_usage": True},
    [{"role": "user"}],
    [{"role": "user", "content": [{"type": "image_url"}]}],
    [[[[[]]]]],
]
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "response_format",
    "echo",
    "best_of",
    "suffix",
    "tools",
    "tool_choice",
    "user",
]


def _valid(rng: random.Random) -> tuple[str, dict]:
    chat = rng.random() < 0.5
    body: dict = {"model": "tiny", "max_tokens": rng.randint(1, 3)}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "Bonjour ☕", "2+2?"])}]
    else:
        body["prompt"] = rng.choice(["Hello", [5, 6, 7], ["The sky"], "naïve"])
    for name, values in (
        ("stream", [True, False]),
        ("temperature", [0, 0.7, 1.5]),
        ("n", [1, 2]),
        ("seed", [1, 2**40]),
        ("stop", ["\n", ["a", "b"]]),
        ("logprobs", [True] if chat else [0, 2]),
        ("frequency_penalty", [0.5, -1]),
        ("logit_bias", [{"5": 3.0}]),
        ("top_k", [1, 40]),
    ):
        if rng.random() < 0.25:
            body[name] = rng.choice(values)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def _request(rng: random.Random) -> tuple[str, str, bytes, dict]:
    """(method, path, body, headers) of one fuzz request."""
    roll = rng.random()
    headers = {"Content-Type": "application/json"}
    if roll < 0.05:  # bytes that are not JSON
        return "POST", "/v1/completions", rng.randbytes(rng.randint(0, 64)), headers
    if roll < 0.08:  # a wrong method or path
        method = rng.choice(["GET", "PUT", "DELETE", "POST"])
        path = rng.choice(
            [
                "/v1/models/tiny",
                "/v1/completions",
                "/v1/x",
                "/health",
                "/metrics",
                "/v1/models/../../etc",
                "/v1/chat/completions",
            ]
        )
        return method, path, b"{}", headers
    path, body = _valid(rng)
    if roll < 0.5:  # mutated: a few fields get odd values
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(FIELDS)] = rng.choice(WEIRD)
    elif roll < 0.6:  # a random JSON value as the body
        body = rng.choice(WEIRD)
    text = json.dumps(body)
    if roll > 0.97 and len(text) > 4:  # a cut-off body
        text = text[: rng.randint(1, len(text) - 1)]
    return "POST", path, text.encode(), headers


async def _fuzz(url: str, count: int, seed: int) -> dict[int, int]:
    import aiohttp

    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    failures: list[str] = []
    queue: asyncio.Queue = asyncio.Queue()
    for _ in range(count):
        queue.put_nowait(_request(rng))
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def worker() -> None:
            while not queue.empty():
                method, path, body, headers = queue.get_nowait()
                async with http.request(method, url + path, data=body, headers=headers) as r:
                    text = await r.text(errors="replace")
                statuses[r.status] = statuses.get(r.status, 0) + 1
                crashed = r.status >= 500 and r.status != 503
                if crashed or "generation failed" in text:
                    failures.append(f"{method} {path} {body[:300]!r} -> {r.status} {text[:300]}")

        await asyncio.gather(*(worker() for _ in range(12)))
    assert not failures, "\n".join(failures[:10])
    return statuses


def test_ten_thousand_odd_requests_crash_nothing_and_leak_no_slot(tiny_served):
    server, model = tiny_served
    started = time.monotonic()
    statuses = asyncio.run(_fuzz(server.url, REQUESTS, seed=16))
    took = time.monotonic() - started
    assert sum(statuses.values()) == REQUESTS
    assert statuses.get(200, 0) > REQUESTS // 10  # many valid requests were served
    assert statuses.get(400, 0) > REQUESTS // 10  # and many refused
    deadline = time.monotonic() + 10
    while (model.client.active or model.client.queue_depth) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (model.client.active, model.client.queue_depth) == (0, 0)
    # every stage still has room for a full batch: no stage kept a session it was not told of
    sessions = [model.client.submit([5, 6, 7], max_tokens=3) for _ in range(SESSIONS)]
    assert all(len(s.result(30)) == 3 for s in sessions)
    print(f"fuzz: {REQUESTS} requests in {took:.1f} s; statuses {dict(sorted(statuses.items()))}")


MALFORMED = [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: zz\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET / HTTP/1.1\r\nHo st: x\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # a TLS hello
    b"GET /\x00 HTTP/1.1\r\n\r\n",
]


def _raw(port: int, data: bytes) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(data)
        return conn.recv(64)


def test_a_served_process_keeps_its_key_out_of_argv_and_logs_junk_in_one_line(tmp_path):
    """`python -m swarmp2p.serve --api-key -` (issue 24): the key is read from stdin, so no
    process's /proc/PID/cmdline holds it; requests without it are refused; 1,000 malformed
    HTTP requests leave one short line each at most (rate-limited), no traceback, and the
    server still answers a good request."""
    import os
    import socket
    import subprocess
    import sys

    from swarmp2p.serve.client import ApiClientError, complete_text

    key = "k3y-" + os.urandom(8).hex()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "SWARM_API_KEY"}
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "swarmp2p.serve",
                "embedded",
                "--port",
                str(port),
                "--max-context",
                "64",
                "--threads",
                "1",
                "--api-key",
                "-",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            text=True,
        )
    try:
        proc.stdin.write(key + "\n")
        proc.stdin.close()
        line = proc.stdout.readline()  # "serving ... on URL/v1" once it answers
        assert line.startswith("serving"), (line, log.read_text())
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = (Path("/proc") / pid / "cmdline").read_bytes()
            except OSError:
                continue
            assert key.encode() not in argv, f"the API key is in the command line of {pid}"
        url = f"http://127.0.0.1:{port}"
        body = {"model": "embedded", "prompt": "Hi", "max_tokens": 2, "temperature": 0}
        for wrong in (None, "wrong"):
            with pytest.raises(ApiClientError, match="401"):
                complete_text(url, "/v1/completions", body, api_key=wrong)
        before = log.stat().st_size
        for i in range(1000):
            assert _raw(port, MALFORMED[i % len(MALFORMED)]).startswith(b"HTTP/1.")
        text, usage = complete_text(url, "/v1/completions", body, api_key=key)
        assert isinstance(text, str)
        assert usage["completion_tokens"] >= 1
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)
    written = log.read_text(errors="replace")[before:]
    assert "Traceback" not in written, written[:2000]
    assert "malformed HTTP request from 127.0.0.1" in written, written[:2000]
    assert len(written.encode()) < 20_000, (len(written), written[:2000])
