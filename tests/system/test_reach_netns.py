"""Any member reaches any served model, on hosts in network namespaces with their own disks:
a tiny Llama only host b has is served from b on the LAN (`--host 0.0.0.0`, its API key from
a file); `swarm generate` and `swarm chat` on a host whose daemon does not serve it go to b
through the daemons' CURVE links and give b's greedy tokens, streamed or not; an HTTP client
on another host reaches b's API with the key, and is refused without it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from hosts import HOME, STATE, start_swarm
from swarm_harness import dump, swarm, wait_until
from test_swarm_serve_loopback import PROMPT, greedy_text, tiny_llama_with_tokenizer

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.torch]

ENV = {"OMP_NUM_THREADS": "1"}
MAX_NEW = 32
PORT = 8080


def _generate(node, *extra: str):
    args = ["generate", "tiny", PROMPT, "--max-tokens", str(MAX_NEW), "--temperature", "0"]
    return swarm(node, *args, *extra)


def _chat(node, line: str) -> subprocess.CompletedProcess:
    """`swarm chat` on ``node``'s host with one line on stdin."""
    argv = [sys.executable, "-m", "swarmp2p", "chat", "tiny", "--temperature", "0"]
    argv += ["--max-tokens", "12", "--state-dir", STATE]
    proc = node.host.popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = proc.communicate(line + "\n", timeout=300)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama with the embedded model's tokenizer and chat template."""
    from swarmp2p.models import resolve_model_ref

    folder = tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny-llama"))
    shutil.copy(f"{resolve_model_ref('embedded')}/chat_template.jinja", folder)
    return folder


def test_a_member_that_does_not_serve_the_model_reaches_it_over_the_swarm(netns_lab, tiny):
    hosts = netns_lab(3)
    nodes = start_swarm(hosts, ENV)
    a, b, c = nodes
    model = hosts[1].put(tiny, f"{HOME}/models/tiny")
    key = hosts[1].write(f"{HOME}/api.key", "lan-k3y")
    hosts[1].outside(key).chmod(0o600)

    serve = swarm(
        b,
        "serve",
        model,
        "--name",
        "tiny",
        "--stages",
        "2",
        "--port",
        str(PORT),
        "--host",
        "0.0.0.0",
        "--api-key-file",
        key,
        "--max-context",
        "256",
        "--json",
        timeout=300,
    )
    assert serve.returncode == 0, serve.stderr + dump(nodes)
    view = json.loads(serve.stdout)
    expected = greedy_text(tiny, PROMPT, MAX_NEW)
    wait_until(
        lambda: all([m["model"] for m in n.status()["served_in_swarm"]] == ["tiny"] for n in nodes),
        20,
        "every table listing b's model",
    )
    # on b (the issuing node), as before: its own API with its key
    here = _generate(b, "--no-stream")
    assert here.returncode == 0 and here.stdout.rstrip("\n") == expected, here.stderr
    # on a and c, whose daemons do not serve tiny (one of them runs no stage of it at all):
    # the relay through their daemon to b's, without the key, streamed and not
    assert {s["node"] for s in view["stages"]} != {"a", "b", "c"}
    for node in (a, c):
        assert node.status()["served"] == []
        for mode in ("--stream", "--no-stream"):
            out = _generate(node, mode)
            assert out.returncode == 0, out.stderr + dump(nodes)
            assert out.stdout.rstrip("\n") == expected, (node.node_id, mode)
    chat_here, chat_there = _chat(b, "Hello"), _chat(a, "Hello")
    assert chat_here.returncode == 0 and chat_there.returncode == 0, chat_there.stderr
    assert chat_there.stdout == chat_here.stdout and chat_there.stdout.strip()

    # b's API on the LAN: an HTTP client on a reaches it at b's address with the key only
    url = f"http://{hosts[1].address}:{PORT}"
    client = [sys.executable, "-m", "swarmp2p", "generate", "tiny", PROMPT, "--url", url]
    client += ["--max-tokens", str(MAX_NEW), "--temperature", "0"]
    keyed = hosts[0].run(client, env={"SWARM_API_KEY": "lan-k3y"})
    assert keyed.returncode == 0 and keyed.stdout.rstrip("\n") == expected, keyed.stderr
    bare = hosts[0].run(client)
    assert bare.returncode != 0 and "401" in bare.stderr, bare.stderr
