"""`swarm serve` on real hosts in network namespaces, each with its own disk: a tiny Llama that
only the issuing host has served across 3 hosts, which fetch only their stages' files from it;
one stage host SIGKILLed mid-stream, the streamed request completes with the identical greedy
text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from hosts import HOME, STATE, start_swarm
from swarm_harness import dump, swarm
from test_swarm_serve_loopback import PROMPT, greedy_text, tiny_llama_with_tokenizer

from swarmp2p.plan import model_shape

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.torch]

ENV = {"OMP_NUM_THREADS": "1"}
MAX_NEW = 400


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama, made here; the test puts it on the issuing host b only."""
    return tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny-llama"))


def test_serve_across_three_hosts_sigkill_a_stage_host_mid_stream(netns_lab, tiny):
    hosts = netns_lab(3)
    nodes = start_swarm(hosts, ENV)
    a, b, c = nodes
    model = hosts[1].put(tiny, f"{HOME}/models/tiny")

    serve = swarm(
        b,
        "serve",
        model,
        "--name",
        "tiny",
        "--stages",
        "3",
        "--port",
        "8080",
        "--max-context",
        "512",
        "--json",
        timeout=300,
    )
    assert serve.returncode == 0, serve.stderr + dump(nodes)
    view = json.loads(serve.stdout)
    assert [s["node"] for s in view["stages"]] == ["a", "b", "c"]
    expected = greedy_text(tiny, PROMPT, MAX_NEW)
    # a and c fetched from b only the files their stages read (a: the embedding and the
    # blocks; c: the blocks and the head), each a strict part of the model
    shape = model_shape.from_folder(tiny)
    for node, (first, last) in ((a, (True, False)), (c, (False, True))):
        stage = next(s for s in view["stages"] if s["node"] == node.node_id)
        start, end = stage["layers"]
        want = set(model_shape.stage_files(shape, start, end, first, last))
        got = {p.name for p in node.host.outside(f"{STATE}/models").glob("*/*.safetensors")}
        assert got == want and got < {p.name for p in tiny.glob("*.safetensors")}, got

    # the client runs on b's host, where the API listens on 127.0.0.1
    client = hosts[1].popen(
        [
            sys.executable,
            "-m",
            "swarmp2p",
            "generate",
            "tiny",
            PROMPT,
            "--max-tokens",
            str(MAX_NEW),
            "--temperature",
            "0",
            "--stream",
            "--url",
            view["url"],
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        # unbuffered: communicate() below reads the pipe's descriptor, not a buffer's bytes
        head = os.read(client.stdout.fileno(), 64)  # the first streamed piece(s)
        assert head, client.stderr.read().decode()
        c.kill()  # SIGKILL the host of the last stage: its worker dies with it
        killed = time.monotonic()
        rest, err = client.communicate(timeout=180)
    finally:
        if client.poll() is None:
            client.kill()
            client.communicate()
    assert client.returncode == 0, err.decode() + dump([a, b])
    assert (head + rest).decode().rstrip("\n") == expected
    served = b.status()["served"][0]
    assert (
        served["failovers"] == 1
        and served["replayed"] == 1
        and {s["node"] for s in served["stages"]} == {"a", "b"}
    )
    assert time.monotonic() - killed < 120
    assert not b.host.outside(f"{STATE}/models").exists()  # b served its own folder
