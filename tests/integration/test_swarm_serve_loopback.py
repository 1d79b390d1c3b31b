"""`swarm serve` on real daemons on 127.0.0.1: three nodes each run a stage of a tiny Llama, the
API on the issuing node answers `swarm generate` with `model.generate`'s greedy text, a stage
host SIGKILLed mid-stream is re-placed and the stream completes with the same text, and
`swarm serve --stop` frees every worker."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from swarm_harness import (
    ROOT,
    dump,
    free_port,
    swarm,
    swarm_env,
    tiny_llama,
    wait_until,
    worker_pids,
)

from swarmp2p.net.security import SwarmSecret

pytestmark = [pytest.mark.slow, pytest.mark.torch]

TOKEN = SwarmSecret.generate().token
ENV = {"OMP_NUM_THREADS": "1"}  # the daemons and their workers share this machine's cores
PROMPT = "The capital of France is"


def tiny_llama_with_tokenizer(folder, *, tied: bool = False):
    """A 4-block random Llama with the embedded model's tokenizer (its vocabulary size)."""
    from swarmp2p.models import resolve_model_ref

    embedded = resolve_model_ref("embedded")
    tiny_llama(
        folder,
        vocab=49152,
        max_positions=512,
        tied=tied,
        shard_size="2MB",
        eos_token_id=2,
        bos_token_id=1,
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{embedded}/{name}", folder / name)
    return folder


def greedy_text(folder, prompt: str, max_new: int, model=None) -> str:
    """What `model.generate` says greedily after ``prompt``, decoded as the API decodes
    (``model``: these weights instead of the folder's)."""
    import torch
    from transformers import AutoModelForCausalLM

    from swarmp2p.serve.text import TextCodec

    codec = TextCodec.from_folder(folder)
    ids = codec.encode(prompt)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = model.eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=sorted(codec.eos_ids),
            pad_token_id=2,
        )
    return codec.decode(out[0, len(ids) :].tolist())


def generate(url: str, prompt: str, max_tokens: int, *, stream: bool = False, timeout=300):
    args = ["generate", "tiny", prompt, "--max-tokens", str(max_tokens), "--temperature", "0"]
    args += ["--url", url, "--stream" if stream else "--no-stream"]
    return subprocess.run(
        [sys.executable, "-m", "swarmp2p", *args],
        capture_output=True,
        text=True,
        env=swarm_env(),
        cwd=ROOT,
        timeout=timeout,
    )


def _worker_pids(node) -> set[int]:
    """Pids of the serve workers ``node``'s daemon runs now."""
    return worker_pids(node, "swarmp2p.runtime.serve_worker")


def _workers(node) -> int:
    return len(_worker_pids(node))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny-llama"))


def _swarm(loopback_swarm, ids="abc", env=ENV):
    return loopback_swarm.start(ids, token=TOKEN, env=env)


def test_serve_across_three_daemons_generate_equals_model_generate_and_stop(loopback_swarm, tiny):
    a, b, c = _swarm(loopback_swarm)
    port = free_port()
    # issued on b (a follower): the leader a places the stages, the API runs on b
    done = swarm(
        b,
        "serve",
        str(tiny),
        "--name",
        "tiny",
        "--stages",
        "3",
        "--port",
        str(port),
        "--max-context",
        "256",
        "--json",
    )
    assert done.returncode == 0, done.stderr + dump([a, b, c])
    view = json.loads(done.stdout)
    assert view["url"] == f"http://127.0.0.1:{port}"
    assert [s["node"] for s in view["stages"]] == ["a", "b", "c"]
    # the shared planner's cost split: the 49152-token head costs more than two blocks
    assert [s["layers"] for s in view["stages"]] == [[0, 2], [2, 3], [3, 4]]
    assert view["dtype"] == "float32"  # CPUs
    served = b.status()["served"]
    assert [(s["model"], s["state"], len(s["stages"])) for s in served] == [("tiny", "serving", 3)]
    assert a.status()["served"] == []  # the API lives on the issuing node only
    assert [_workers(n) for n in (a, b, c)] == [1, 1, 1]

    again = swarm(b, "serve", str(tiny), "--name", "tiny", "--port", str(free_port()))
    assert again.returncode != 0 and "already served" in again.stderr

    expected = greedy_text(tiny, PROMPT, 24)
    out = generate(view["url"], PROMPT, 24)
    assert out.returncode == 0, out.stderr + dump([a, b, c])
    assert out.stdout.rstrip("\n") == expected
    # without --url: b's daemon says where it serves tiny; a serves nothing
    streamed = swarm(
        b, "generate", "tiny", PROMPT, "--max-tokens", "24", "--temperature", "0", "--stream"
    )
    assert streamed.stdout.rstrip("\n") == expected, streamed.stderr
    sessions = b.status()["served"][0]["sessions"]  # the last step went through all 3 stages
    base = {k: sessions[k] for k in ("active", "queued", "max", "stage_batch")}
    assert base == {"active": 0, "queued": 0, "max": sessions["max"], "stage_batch": [1, 1, 1]}
    assert sessions["speculate"] == "auto" and sessions["prefix_cache"]["lookups"] >= 1
    # a serves nothing: its daemon relays to b over the swarm's CURVE links, streamed or not
    for mode in ("--stream", "--no-stream"):
        relayed = swarm(
            a, "generate", "tiny", PROMPT, "--max-tokens", "24", "--temperature", "0", mode
        )
        assert relayed.returncode == 0, relayed.stderr + dump([a, b, c])
        assert relayed.stdout.rstrip("\n") == expected, mode
    nowhere = swarm(c, "generate", "no-such-model", PROMPT)
    assert nowhere.returncode == 1
    assert "'no-such-model' is not served in the swarm (served: tiny (node b))" in nowhere.stderr
    assert "`swarm serve no-such-model`" in nowhere.stderr

    stopped = swarm(b, "serve", "--stop", "tiny")
    assert stopped.returncode == 0, stopped.stderr
    assert b.status()["served"] == []
    wait_until(lambda: [_workers(n) for n in (a, b, c)] == [0, 0, 0], 20, "workers gone")
    unknown = swarm(b, "serve", "--stop", "tiny")
    assert unknown.returncode != 0 and "not served from this node" in unknown.stderr


def test_a_stage_host_sigkilled_mid_stream_is_replaced_and_the_text_is_unchanged(
    loopback_swarm, tiny
):
    # two nodes keep it short: b's stage is re-placed on a, next to a's own stage
    a, b = _swarm(loopback_swarm, "ab")
    port = free_port()
    done = swarm(
        a,
        "serve",
        str(tiny),
        "--name",
        "tiny",
        "--stages",
        "2",
        "--port",
        str(port),
        "--max-context",
        "512",
        "--json",
    )
    assert done.returncode == 0, done.stderr + dump([a, b])
    url = json.loads(done.stdout)["url"]
    max_new = 400
    expected = greedy_text(tiny, PROMPT, max_new)

    from swarmp2p.serve.client import stream_text

    pieces: list[str] = []
    first = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_new, "temperature": 0}
        try:
            for piece in stream_text(url, "/v1/completions", body):
                pieces.append(piece)
                first.set()
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)
        first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(120), "no first token"
    b.kill()  # SIGKILL: its serve worker dies with it
    at_kill = len(pieces)
    reader.join(180)
    assert not reader.is_alive()
    assert not errors, f"{errors!r}\n" + dump([a])
    served = a.status()["served"][0]
    assert served["failovers"] == 1 and served["replayed"] == 1 and served["state"] == "serving"
    assert [s["node"] for s in served["stages"]] == ["a", "a"]
    assert len(pieces) > at_kill, "the stream ended before the stage host was killed"
    assert "".join(pieces) == expected
    # the rebuilt ring keeps serving
    again = generate(url, PROMPT, 8)
    assert again.returncode == 0 and again.stdout.rstrip("\n") == greedy_text(tiny, PROMPT, 8)


def test_one_node_refuses_bad_requests_with_the_reason_and_serves_one_stage(
    loopback_swarm, tiny, tmp_path
):
    a = loopback_swarm.node("a", token=TOKEN, env=ENV).start()
    a.wait_up()
    wait_until(lambda: a.status()["leader_ready"], 30, "leader ready")
    cases = [
        (["serve", str(tmp_path / "missing")], "does not exist"),
        (["serve", str(tiny), "--host", "0.0.0.0"], "without an API key"),
        (
            ["serve", str(tiny), "--max-sessions", "1000000", "--max-context", "512"],
            "placed 0 of 1 serving stage(s)",
        ),  # a KV cache of 262 GB
        (["serve", str(tiny), "--stages", "9"], "stages: 9 is not in [1, 4]"),
        (["serve", str(tiny), "--max-sessions", "2000000"], "max_sessions: must be an integer"),
        (["serve"], "name a MODEL"),
        (["serve", "no-such-model"], "no model 'no-such-model': not a trained model"),
    ]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        # refused before any stage loads (it took the ring's load, 6-9 s, before)
        taken_port = f"cannot listen on 127.0.0.1:{port}: in use"
        cases.append((["serve", str(tiny), "--port", port], taken_port))
        for args, message in cases:
            began = time.monotonic()
            out = swarm(a, *args)
            assert out.returncode != 0 and message in out.stderr, (args, out.stderr)
            if message == taken_port:
                assert "pass --port N" in out.stderr and time.monotonic() - began < 4, out.stderr
        # said once, pointing to the list of trained models
        unknown = swarm(a, "serve", "no-such-model")
        assert unknown.stderr.count("no-such-model") == 1 and "`swarm models`" in unknown.stderr
        assert unknown.returncode == 2, unknown.stderr
    assert a.status()["served"] == []
    assert _workers(a) == 0

    # one stage on one node: the whole model in one worker
    done = swarm(
        a,
        "serve",
        str(tiny),
        "--name",
        "tiny",
        "--stages",
        "1",
        "--port",
        str(free_port()),
        "--max-context",
        "256",
        "--json",
    )
    assert done.returncode == 0, done.stderr + dump([a])
    view = json.loads(done.stdout)
    assert [(s["node"], s["layers"]) for s in view["stages"]] == [("a", [0, 4])]
    out = generate(view["url"], PROMPT, 12)
    assert out.returncode == 0, out.stderr + dump([a])
    assert out.stdout.rstrip("\n") == greedy_text(tiny, PROMPT, 12)
    assert _workers(a) == 1


def test_serve_with_a_draft_model_refuses_a_mismatch_and_keeps_greedy_text(
    loopback_swarm, tiny, tmp_path
):
    """``swarm serve MODEL --draft DRAFT``: a draft of another tokenizer and ``--speculate
    draft`` without a draft are refused by name before any stage loads; the model drafting for
    itself on two stages (stage 0 holds it) gives plain greedy text, and status says so."""
    a = loopback_swarm.node("a", token=TOKEN, env=ENV).start()
    a.wait_up()
    wait_until(lambda: a.status()["leader_ready"], 30, "leader ready")
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[1000:1002]  # not special (added) tokens
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    for args, message in [
        (["--draft", str(other)], "does not share the tokenizer of"),
        (["--speculate", "draft"], "'draft' needs a draft model (--draft MODEL)"),
    ]:
        out = swarm(a, "serve", str(tiny), "--stages", "1", *args)
        assert out.returncode != 0 and message in out.stderr, (args, out.stderr)
    assert _workers(a) == 0
    done = swarm(
        a,
        "serve",
        str(tiny),
        "--name",
        "tiny",
        "--stages",
        "2",
        "--draft",
        str(tiny),
        "--speculate",
        "draft",
        "--port",
        str(free_port()),
        "--max-context",
        "256",
        "--json",
    )
    assert done.returncode == 0, done.stderr + dump([a])
    view = json.loads(done.stdout)
    out = generate(view["url"], PROMPT, 12)
    assert out.returncode == 0, out.stderr + dump([a])
    assert out.stdout.rstrip("\n") == greedy_text(tiny, PROMPT, 12)
    status = swarm(a, "status")
    assert "speculate draft (draft model at stage 0): 100% of" in status.stdout, status.stdout


def test_a_lost_stage_that_fits_nowhere_fails_the_request_with_the_reason_in_bounded_time(
    loopback_swarm, tiny
):
    # each node: one fake Ampere GPU with ~51 MiB usable, so the plan serves bfloat16 (on the
    # CPU); 600 sessions of 512 tokens fit one stage per node, but not two stages on one node
    # once a node is gone (no prefix cache: its 64 MiB would not fit beside them)
    env = {**ENV, "SWARM_FAKE_DEVICES": "fake:0.55:8.6"}
    a, b = _swarm(loopback_swarm, "ab", env=env)
    done = swarm(
        a,
        "serve",
        str(tiny),
        "--name",
        "tiny",
        "--stages",
        "2",
        "--port",
        str(free_port()),
        "--max-context",
        "512",
        "--max-sessions",
        "600",
        "--prefix-cache-mb",
        "0",
        "--json",
    )
    assert done.returncode == 0, done.stderr + dump([a, b])
    view = json.loads(done.stdout)
    assert (
        view["dtype"] == "bfloat16" and [s["devices"] for s in view["stages"]] == [["cuda:0"]] * 2
    )
    url = view["url"]

    from swarmp2p.serve.client import ApiClientError, stream_text

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "temperature": 0}
    stream = stream_text(url, "/v1/completions", body)
    next(stream)
    b.kill()
    started = time.monotonic()
    with pytest.raises(ApiClientError, match="cannot be re-placed on the live nodes") as info:
        for _ in stream:
            pass
    assert time.monotonic() - started < 20
    assert "stages 0 (layers 0-" in str(info.value) and "MiB usable" in str(info.value)
    served = a.status()["served"][0]
    assert served["state"] == "degraded" and "cannot be re-placed" in served["reason"]


def test_a_stage_worker_killed_on_a_live_node_is_restarted_and_the_text_is_unchanged(
    loopback_swarm, tiny
):
    (a,) = _swarm(loopback_swarm, "a")
    done = swarm(
        a,
        "serve",
        str(tiny),
        "--name",
        "tiny",
        "--stages",
        "2",
        "--port",
        str(free_port()),
        "--max-context",
        "512",
        "--json",
    )
    assert done.returncode == 0, done.stderr + dump([a])
    url = json.loads(done.stdout)["url"]
    workers = sorted(_worker_pids(a))
    assert len(workers) == 2
    expected = greedy_text(tiny, PROMPT, 400)

    from swarmp2p.serve.client import stream_text

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "temperature": 0}
    stream = stream_text(url, "/v1/completions", body)
    pieces = [next(stream)]
    os.kill(workers[-1], signal.SIGKILL)  # the node lives on; its daemon reports the exit
    pieces.extend(stream)
    assert "".join(pieces) == expected
    served = a.status()["served"][0]
    assert (served["failovers"], served["replayed"], served["state"]) == (1, 1, "serving")
    assert _workers(a) == 2


def test_a_quantized_serve_equals_the_same_quantization_in_one_process(loopback_swarm, tiny):
    import torch
    from transformers import AutoModelForCausalLM

    from swarmp2p.runtime.torch.model.quantization import bnb_config, normalize_spec

    a, b = _swarm(loopback_swarm, "ab")
    quant = {"bits": 8}  # NF4's CPU kernel needs wider layers than this tiny model's 32
    done = swarm(
        a,
        "serve",
        str(tiny),
        "--name",
        "tiny",
        "--stages",
        "2",
        "--port",
        str(free_port()),
        "--max-context",
        "256",
        "--quantization",
        json.dumps(quant),
        "--json",
    )
    assert done.returncode == 0, done.stderr + dump([a, b])
    reference = AutoModelForCausalLM.from_pretrained(
        tiny,
        dtype=torch.float32,
        quantization_config=bnb_config(normalize_spec(quant), ["lm_head"]),
        device_map="cpu",
    )
    ids = torch.tensor([[5, 17, 300, 42]])
    plain = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():  # the quantization is real: it moves the logits
        assert not torch.allclose(reference(ids).logits, plain(ids).logits)
    expected = greedy_text(tiny, PROMPT, 24, reference)
    out = generate(json.loads(done.stdout)["url"], PROMPT, 24)
    assert out.returncode == 0, out.stderr + dump([a, b])
    assert out.stdout.rstrip("\n") == expected


def test_an_issuer_restart_reaps_its_old_workers_and_serves_again(loopback_swarm, tiny):
    a, b = _swarm(loopback_swarm, "ab")
    port = free_port()
    key_file = b.state.root / "api.key"  # never in argv
    key_file.write_text("k3y\n")
    key_file.chmod(0o600)
    # issued on b from a relative path: the daemon reads it from the CLI's folder
    done = swarm(
        b,
        "serve",
        tiny.name,
        "--name",
        "tiny",
        "--stages",
        "2",
        "--port",
        str(port),
        "--max-context",
        "256",
        "--api-key-file",
        str(key_file),
        "--json",
        cwd=tiny.parent,
    )
    assert done.returncode == 0, done.stderr + dump([a, b])
    url = json.loads(done.stdout)["url"]
    # the key stays on b, 0600; the table every member holds lists the model, not the key
    (key_copy,) = (b.state.root / "serve" / "keys").iterdir()
    assert oct(key_copy.stat().st_mode & 0o777) == "0o600" and key_copy.read_text() == "k3y"
    wait_until(
        lambda: [m["model"] for m in a.status()["served_in_swarm"]] == ["tiny"],
        20,
        "a's table listing b's model",
    )
    assert "k3y" not in a.state.table_file.read_text()
    expected = greedy_text(tiny, PROMPT, 12)
    before = _worker_pids(a)
    assert len(before) == 1

    # SIGKILL the issuer and bring it straight back, faster than a failure timeout: a reaps
    # its stage worker when b's heartbeats stop claiming the old serve id; b serves again
    b.kill()
    b.start()
    b.wait_up()
    wait_until(
        lambda: [s["state"] for s in b.status()["served"]] == ["serving"],
        90,
        "b serving tiny again",
    )
    wait_until(
        lambda: len(_worker_pids(a)) == 1 and not before & _worker_pids(a),
        30,
        "a's old worker reaped and one new worker",
    )
    from swarmp2p.serve.client import complete_text

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    assert complete_text(url, "/v1/completions", body, api_key="k3y")[0] == expected
    # `swarm generate` finds the URL and the API key from b's daemon, as it restored them
    said = swarm(b, "generate", "tiny", PROMPT, "--max-tokens", "12", "--temperature", "0")
    assert said.stdout.rstrip("\n") == expected, said.stderr
    # a member reaches it without the key: membership admits over CURVE, b adds its own key
    relayed = swarm(a, "generate", "tiny", PROMPT, "--max-tokens", "12", "--temperature", "0")
    assert relayed.stdout.rstrip("\n") == expected, relayed.stderr

    # stopped for good: forgotten, and a's worker stops
    stopped = swarm(b, "serve", "--stop", "tiny")
    assert stopped.returncode == 0, stopped.stderr
    assert not key_copy.exists()
    wait_until(lambda: a.status()["served_in_swarm"] == [], 20, "the table forgetting it")
    wait_until(lambda: _workers(a) == 0, 20, "a's worker stopped")
    # an issuer that goes away for good takes its remote workers with it
    again = swarm(b, "serve", str(tiny), "--name", "tiny", "--stages", "2", "--port", str(port))
    assert again.returncode == 0, again.stderr
    assert _workers(a) == 1
    b.kill()
    wait_until(lambda: _workers(a) == 0, 30, "a reaping the workers of the dead issuer")


def test_a_peer_refuses_a_serve_plan_it_does_not_compute_itself(loopback_swarm):
    """Version skew: a stage's node plans again from the inputs it is sent and refuses another
    plan, before it starts anything."""
    import asyncio

    from swarmp2p.net.auth import AsyncSecureContext
    from swarmp2p.net.rpc import RpcClient, RpcError
    from swarmp2p.node.messages import ServeStageStart
    from swarmp2p.plan import Node, from_config
    from swarmp2p.plan.serve import ServeInputs

    b = loopback_swarm.node("b", token=TOKEN, env=ENV).start()
    b.wait_up()
    wait_until(lambda: b.status()["leader_ready"], 30, "b to found the swarm")  # a member
    shape = from_config(
        {
            "model_type": "llama",
            "vocab_size": 128,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    cluster = (
        {
            "node_id": "b",
            "name": "host-b",
            "ram": 2**34,
            "disk_free": 2**34,
            "devices": [
                {
                    "kind": "cpu",
                    "index": 0,
                    "name": "cpu",
                    "memory_total": 2**34,
                    "memory_free": 2**34,
                    "compute_capability": "",
                }
            ],
        },
    )
    inputs = ServeInputs(
        shape=shape, cluster=tuple(Node.from_dict(c) for c in cluster), stages=1, max_context=64
    )
    plan = inputs.plan()
    skewed = plan.to_json().replace('"dtype":"float32"', '"dtype":"bfloat16"')

    from swarmp2p.net import ClientKeys, NodeKey

    # as the issuer b itself (its own key: a serve.stage_start must come from its issuer)
    b_key = NodeKey.load(b.state.node_key_file)
    as_b = ClientKeys(public=b_key.public, secret=b_key.secret, server=b_key.public)

    async def ask(plan_json):
        ctx = AsyncSecureContext()
        client = RpcClient(ctx, as_b, f"tcp://127.0.0.1:{loopback_swarm.ports['b']}")
        try:
            msg = ServeStageStart(
                serve_id="sx",
                attempt=1,
                stage=0,
                inputs=inputs,
                plan=plan_json,
                model="/nonexistent",
                issuer="b",
            )
            return await client.request(msg, 30.0)
        finally:
            await client.close()
            ctx.destroy(linger=0)

    with pytest.raises(RpcError) as refused:
        asyncio.run(ask(skewed))
    assert refused.value.code == "plan_mismatch", refused.value
    assert "node b computes a different serve plan" in refused.value.detail
    assert "same swarmp2p version" in refused.value.detail
    assert _workers(b) == 0  # nothing started
