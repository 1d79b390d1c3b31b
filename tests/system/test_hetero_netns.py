"""Mismatched machines (issue 17): two network-namespace hosts whose daemons run under cgroup
CPU quotas, host a on a full core and host b on 25% of one (the speed probe and the stage
workers follow each daemon into its group). Each measures its speed under its own quota, so
the default (speed) split gives b fewer layers, and the same full fine-tune runs at least 1.5x
the tokens/s of an equal split: the leader's steady tokens/s (steps from 2 on) of each.

It runs ``alone``: a quota caps a host, it does not give it a core. Beside other work a gets
less than its core, the speed split's bottleneck (a's 6 layers) slows while the equal split's
(b's 4 layers, held to its quota) does not, and the ratio shrinks. At 0.35 CPU for b (the
issue's example) the ideal ratio is 1.9x (a 6 layers / b 2 against b's 4 at 0.35) and the runs
measured 1.14-1.91x, too near the bar to pass by more than chance; at 0.25 the ideal is 2.3x
(a 7 / b 1: a's 7 against b's 4 layers at a quarter of a core)."""

from __future__ import annotations

import json
import time

import pytest
import swarm_harness
from cpu_quota import CpuQuota, prefix, why_not
from hosts import HOME
from swarm_harness import agreed_on, dump, swarm, wait_until

from swarmp2p.net.security import SwarmSecret
from swarmp2p.node import api

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.torch, pytest.mark.alone]

QUOTAS = {"a": 1.0, "b": 0.25}
"""CPUs each host's daemon (with its speed probe and stage workers) may use."""
ENV = {"OMP_NUM_THREADS": "1", "SWARM_SPEED_PROBE": "on"}
MODEL = f"{HOME}/models/tiny"
LAYERS = 8
MIN_SPEEDUP = 1.5


@pytest.fixture
def quotas():
    reason = why_not()
    if reason:
        pytest.skip(reason)
    tag = SwarmSecret.generate().swarm_id[:6]
    made = {h: CpuQuota(f"swarmp2p-hetero-{h}-{tag}", cpus) for h, cpus in QUOTAS.items()}
    yield made
    for q in made.values():
        q.remove()


def _job(split: str | None) -> dict:
    """A full fine-tune whose step is compute-bound (~0.3 s on a full core, in 4 micro-batches:
    the pipeline's fill and drain cost less than with 2); ``split``: its mode (None: the
    default)."""
    return {
        "name": f"hetero-{split or 'default'}",
        "model": {"pretrained": MODEL},
        "split": {"stages": 2, **({"mode": split} if split else {})},
        "data": {"source": "random"},
        "train": {
            "steps": 10,
            "batch_size": 8,
            "seq_len": 64,
            "micro_batches": 4,
            "lr": 1e-4,
            "eval_batches": 0,
            "checkpoint_every": 0,
            "recompute": False,
        },
    }


def _measured(node) -> bool:
    """Both hosts' CPUs advertise a measured speed."""
    peers = node.status()["peers"]
    return len(peers) == 2 and all(d.get("speed") for p in peers for d in p["devices"])


def _run(node, split: str | None) -> dict:
    """Run the job split ``split`` to its end; its view from the daemon's ``job`` API."""
    job = _job(split)
    path = node.host.write(f"{HOME}/{job['name']}.json", json.dumps(job))
    out = swarm(node, "train", path, "--detach", "--json")
    assert out.returncode == 0, out.stderr
    job_id = json.loads(out.stdout)["job_id"]

    def ended() -> dict | None:
        view = api.request(node.state.api_socket, "job", timeout=5.0, job_id=job_id)
        return view if view["state"] in ("COMPLETED", "FAILED") else None

    return wait_until(ended, 120, f"job {job['name']} to end", interval=0.2)


def _held(view: dict, node_id: str) -> int:
    (stage,) = [s for s in view["plan"]["stages"] if s["node"] == node_id]
    return stage["layers"][1] - stage["layers"][0]


def test_the_speed_split_outruns_an_equal_split_on_mismatched_hosts(quotas, netns_lab, tmp_path):
    model = swarm_harness.tiny_llama(
        tmp_path / "model", vocab=128, layers=LAYERS, hidden=256, max_positions=64, shard_size="2MB"
    )
    hosts = netns_lab(2)
    token = SwarmSecret.generate().token
    nodes = []
    for host, node_id in zip(hosts, QUOTAS):
        host.put(model, MODEL)
        node = host.swarm_up(node_id, token, env=ENV)
        node.prefix = [*prefix(quotas[node_id]), *node.prefix]  # from its first instruction
        nodes.append(node.start())
    a = nodes[0]
    try:
        wait_until(lambda: agreed_on(nodes, "a", 2), 30, "the hosts to agree")
        wait_until(lambda: a.status()["leader_ready"], 15, "the leader to be ready")
        wait_until(lambda: _measured(a), 120, "both hosts to measure their speed")
        t0 = time.monotonic()
        equal = _run(a, "equal")
        t1 = time.monotonic()
        speed = _run(a, None)
        t2 = time.monotonic()
        print(
            f"\nup and measured {t0 - a.started_at:.1f} s, equal job {t1 - t0:.1f} s, "
            f"default job {t2 - t1:.1f} s"
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump(nodes)}") from None
    for view in (equal, speed):
        assert view["state"] == "COMPLETED", json.dumps(view, indent=1)[:3000]
    rates = {v["job"]["split"]["mode"]: v["metrics"]["steady_tokens_per_s"] for v in (equal, speed)}
    layers = {v["job"]["split"]["mode"]: {n: _held(v, n) for n in QUOTAS} for v in (equal, speed)}
    throttled = {n: q.throttled_us() for n, q in quotas.items()}
    peers = a.status()["peers"]
    assert {p["node_id"]: p["host"]["cpu_quota"] for p in peers} == QUOTAS  # each sees its own
    speeds = {p["node_id"]: p["devices"][-1]["speed"]["float32"] / 1e9 for p in peers}
    print(f"\ntokens/s {rates}, speedup {rates['speed'] / rates['equal']:.2f}x")
    print(f"layers {layers}; throttled_us {throttled}; probe GFLOP/s {speeds}")
    print(
        "predicted_s",
        [s["predicted_s"] for s in speed["plan"]["stages"]],
        "measured_s",
        [s["measured_s"] for s in speed["plan"]["stages"]],
    )
    assert layers["equal"] == {"a": LAYERS // 2, "b": LAYERS // 2}
    assert layers["speed"]["b"] < layers["equal"]["b"]
    assert throttled["b"] > 0  # the slow host's quota did slow it
    assert rates["speed"] >= MIN_SPEEDUP * rates["equal"], (rates, layers)
