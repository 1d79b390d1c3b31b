"""`swarm serve` on real hosts in network namespaces: a tiny Llama that only the issuing host
has (the others see an empty folder at its path) served across 3 hosts, which fetch their copy
from it; one stage host SIGKILLed mid-stream, the streamed request completes with the identical
greedy text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from swarm_harness import ROOT, agreed_on, dump, swarm_env, wait_until
from test_swarm_serve_loopback import PROMPT, greedy_text, tiny_llama_with_tokenizer

from swarmp2p.net.security import SwarmSecret

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.torch]

ENV = {"OMP_NUM_THREADS": "1"}
MAX_NEW = 400


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama; only the issuing host b sees it (a and c have an empty folder there)."""
    return tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny-llama"))


def _in(host, *args, **kw):
    return subprocess.Popen(
        ["ip", "netns", "exec", host.ns, sys.executable, "-m", "swarmp2p", *args],
        env=swarm_env(),
        cwd=ROOT,
        **kw,
    )


def test_serve_across_three_hosts_sigkill_a_stage_host_mid_stream(netns_lab, tiny):
    hosts = netns_lab(3)
    token = SwarmSecret.generate().token
    nodes = [
        h.swarm_up(i, token, env=ENV, hide=None if i == "b" else tiny) for h, i in zip(hosts, "abc")
    ]
    for node in nodes:
        node.start()
    a, b, c = nodes
    try:
        wait_until(lambda: agreed_on(nodes, "a", 3), 30, "the hosts to agree")
        wait_until(lambda: a.status()["leader_ready"], 15, "the leader to be ready")
    except AssertionError:
        raise AssertionError(dump(nodes)) from None

    serve = subprocess.run(
        [sys.executable, "-m", "swarmp2p", "serve", str(tiny), "--name", "tiny", "--stages", "3",
         "--port", "8080", "--max-context", "512", "--json", "--state-dir", str(b.state.root)],
        capture_output=True, text=True, env=swarm_env(), cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert serve.returncode == 0, serve.stderr + dump(nodes)
    view = json.loads(serve.stdout)
    assert [s["node"] for s in view["stages"]] == ["a", "b", "c"]
    expected = greedy_text(tiny, PROMPT, MAX_NEW)

    # the client runs on b's host, where the API listens on 127.0.0.1
    client = _in(
        hosts[1], "generate", "tiny", PROMPT, "--max-tokens", str(MAX_NEW), "--temperature", "0",
        "--stream", "--url", view["url"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
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
    # a fetched its copy from b (it cannot see the folder); b served its own folder
    fetched = list((a.state.root / "serve" / "models").glob("*/model*.safetensors"))
    assert fetched and not (b.state.root / "serve" / "models").exists()
