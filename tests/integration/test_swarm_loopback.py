"""Real daemons on 127.0.0.1 (static --peer, no mDNS): forming a swarm, status, replication."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from swarm_harness import FAILURE_TIMEOUT_S, ROOT, agreed_on, dump, swarm_env, wait_until

from swarmp2p.net.security import SwarmSecret

pytestmark = pytest.mark.slow

TOKEN = SwarmSecret.generate().token
CONFIG_ONLY = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}


def _waiting_job(folder) -> dict:
    """A job on a model folder holding only its config (it plans, it never runs): float16 fits
    no CPU, so the table keeps it waiting."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG_ONLY))
    model = {"pretrained": str(folder), "dtype": "float16"}
    return {"name": "t", "model": model, "data": {"source": "random"}}


def test_three_nodes_form_a_swarm_and_status_has_the_issue_shape(loopback_swarm):
    loopback_swarm.reserve("a", "b", "c")
    nodes = [
        loopback_swarm.node("c", token=TOKEN),
        loopback_swarm.node("b", token=TOKEN, env={"SWARM_FAKE_DEVICES": "A5000:24:8.6"}),
        loopback_swarm.node("a", token=TOKEN),
    ]
    for node in nodes:
        node.start()
    try:
        wait_until(lambda: agreed_on(nodes, "a", 3), 20, "three nodes to agree on leader a")
    except AssertionError:
        raise AssertionError(dump(nodes)) from None
    s = nodes[0].status()
    assert s["node_id"] == "c" and s["name"] == "host-c"
    assert s["swarm_id"] == SwarmSecret.from_token(TOKEN).swarm_id
    assert s["leader"] == "a"
    assert [p["node_id"] for p in s["peers"]] == ["c", "a", "b"]  # itself first
    by_id = {p["node_id"]: p for p in s["peers"]}
    assert by_id["a"]["is_leader"] and not by_id["b"]["is_leader"] and not by_id["c"]["is_leader"]
    assert all(p["alive"] for p in s["peers"])
    assert by_id["b"]["address"] == f"127.0.0.1:{loopback_swarm.ports['b']}"
    gpu = by_id["b"]["devices"][0]
    assert {k: gpu[k] for k in ("kind", "name", "compute_capability", "fake")} == {
        "kind": "cuda",
        "name": "A5000",
        "compute_capability": "8.6",
        "fake": True,
    }
    assert gpu["memory_total"] == 24 << 30
    for p in s["peers"]:
        for d in p["devices"]:
            assert {
                "kind",
                "name",
                "memory_total",
                "memory_free",
                "compute_capability",
                "fake",
            } <= set(d)
    assert by_id["c"]["devices"][-1]["kind"] == "cpu" and by_id["c"]["devices"][-1]["fake"] is False
    assert isinstance(s["jobs"], list)


def test_cli_status_peers_token(loopback_swarm):
    node = loopback_swarm.node("a", token=TOKEN).start()
    node.wait_up()

    def cli(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "swarmp2p", *args, "--state-dir", str(node.state.root)],
            capture_output=True,
            text=True,
            env=swarm_env(),
            cwd=ROOT,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    s = json.loads(cli("status", "--json"))
    assert s["node_id"] == "a" and s["peers"][0]["node_id"] == "a"
    peers = json.loads(cli("peers", "--json"))
    assert [p["node_id"] for p in peers] == ["a"]
    assert cli("token").strip() == TOKEN  # the token alone, for `| swarm up --token -`
    as_json = json.loads(cli("token", "--json"))
    assert as_json["command"] == "swarm up --token -" and as_json["token"] == TOKEN
    assert as_json["swarm_id"] == s["swarm_id"]
    text = cli("status")
    assert "leader  a" in text and "127.0.0.1" in text


def test_wrong_token_is_refused_and_never_listed(loopback_swarm):
    loopback_swarm.reserve("a", "b", "x")
    a = loopback_swarm.node(
        "a", token=TOKEN, peers=[f"127.0.0.1:{loopback_swarm.ports['b']}"]
    ).start()
    b = loopback_swarm.node(
        "b", token=TOKEN, peers=[f"127.0.0.1:{loopback_swarm.ports['a']}"]
    ).start()
    intruder = loopback_swarm.node("x", token=SwarmSecret.generate().token).start()  # dials a and b
    wait_until(lambda: agreed_on([a, b], "a", 2), 20, "a and b to agree")
    intruder.wait_up()
    time.sleep(FAILURE_TIMEOUT_S)  # several heartbeat rounds of the intruder's hellos
    for node in (a, b):
        assert [p["node_id"] for p in node.status()["peers"]] == [
            node.status()["node_id"],
            *(["b"] if node is a else ["a"]),
        ]
    s = intruder.status()
    assert [p["node_id"] for p in s["peers"]] == ["x"] and s["leader"] == "x"


def test_submission_replicates_survives_leader_loss_and_old_leader_leads_again(
    loopback_swarm, tmp_path
):
    job = _waiting_job(tmp_path / "model")
    loopback_swarm.reserve("a", "b", "c")
    nodes = {n: loopback_swarm.node(n, token=TOKEN) for n in ("a", "b", "c")}
    for node in nodes.values():
        node.start()
    all3 = list(nodes.values())
    wait_until(
        lambda: agreed_on(all3, "a", 3) and all(n.status()["term"] >= 1 for n in all3),
        20,
        "agreement",
    )
    done = nodes["c"].submit(job, job_id="j1")  # forwarded to a
    assert done["job_id"] == "j1" and done["replicas"] >= 2
    wait_until(
        lambda: all([j["job_id"] for j in n.status()["jobs"]] == ["j1"] for n in all3),
        5,
        "j1 on every node",
    )

    nodes["a"].kill()
    killed = time.monotonic()
    survivors = [nodes["b"], nodes["c"]]
    wait_until(lambda: agreed_on(survivors, "b", 2), FAILURE_TIMEOUT_S + 5, "b to lead")
    took = time.monotonic() - killed
    assert took <= FAILURE_TIMEOUT_S + 1.0 + 1.0, took  # timeout + 1 s, plus polling slack
    wait_until(lambda: nodes["b"].status()["leader_ready"], 10, "b to take over")
    done = nodes["c"].submit(job, job_id="j2")
    assert done["replicas"] == 2
    newest = nodes["b"].status()
    assert [j["job_id"] for j in newest["jobs"]] == ["j1", "j2"]

    nodes["a"].start()  # restarted with its stale table
    wait_until(lambda: agreed_on(all3, "a", 3), 20, "a to lead again")
    wait_until(lambda: nodes["a"].status()["leader_ready"], 10, "a to take over")
    s = nodes["a"].status()
    assert [j["job_id"] for j in s["jobs"]] == ["j1", "j2"]
    assert s["term"] > newest["term"]
    wait_until(
        lambda: all(n.status()["table_version"] == s["table_version"] for n in all3),
        5,
        "every node to hold a's table",
    )


def test_mdns_on_loopback_finds_peers_without_static_addresses(loopback_swarm):
    nodes = [loopback_swarm.node(n, token=TOKEN, peers=[], mdns=True) for n in ("b", "a")]
    other_swarm = loopback_swarm.node("0", token=SwarmSecret.generate().token, peers=[], mdns=True)
    for node in (*nodes, other_swarm):
        node.start()
    wait_until(lambda: agreed_on(nodes, "a", 2), 20, "mDNS discovery on loopback")
    time.sleep(1.0)
    assert [p["node_id"] for p in nodes[0].status()["peers"]] == ["b", "a"]  # not "0"
    assert [p["node_id"] for p in other_swarm.status()["peers"]] == ["0"]
    assert any("mDNS: found node" in n.log() for n in nodes)  # no static peers were given
