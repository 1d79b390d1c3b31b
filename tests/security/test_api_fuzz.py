"""A fuzz of the local API (issue 15): 10,000 random and mutated requests over the unix socket
of a real daemon end with no "internal" reply, every request answered, and `swarm status`
still answered. Seeded: a failure names the seed and the request that caused it."""

from __future__ import annotations

import json
import random
import socket
import string
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from swarm_harness import NodeProc, free_port

from swarmp2p.net import SwarmSecret
from swarmp2p.node.api import API_OPS

pytestmark = pytest.mark.slow

REQUESTS = 10_000
SEED = 1515
SKIPPED_OPS = ("down", "rotate")
"""Ops fuzzed only with their names mangled: one stops the daemon, one re-keys the swarm
(both answer, but they are not a crash to look for)."""

TEMPLATES = [
    {"op": "status"},
    {"op": "peers"},
    {"op": "jobs"},
    {"op": "job", "job_id": "j1"},
    {"op": "cancel", "job_id": "j1"},
    {"op": "logs", "job_id": "j1", "stage": 0},
    {"op": "models"},
    {"op": "export", "model": "m", "dest": "/nonexistent/out"},
    {"op": "served"},
    {"op": "serve_stop", "model": "m"},
    {"op": "serve", "request": {"model": "/nonexistent-model", "stages": 2, "max_sessions": 1}},
    {"op": "invite", "minutes": 5},
    {"op": "remove", "node_id": "zz"},
    {
        "op": "submit",
        "job_id": "f1",
        "job": {
            "model": {"pretrained": "/nonexistent-model", "lora": {"enabled": True, "r": 4}},
            "data": {"source": "random"},
            "train": {"steps": 2, "batch_size": 1, "seq_len": 8},
        },
    },
    {
        "op": "live_plan",
        "job": {"model": {"pretrained": "/nonexistent-model"}, "data": {"source": "random"}},
    },
]


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(12 if depth < 4 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**63, -(2**64), 10**30, rng.randrange(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.5, -0.0, 1e308, float("inf"), float("nan"), 1e-320])
    if kind in (4, 5, 6):
        alphabet = string.printable + "\x00\u2603\ud7ff/.."
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
    if kind == 7:
        return rng.choice(["..", "../../etc/passwd", "j1", "embedded-not", "a" * 5000, ""])
    if kind in (8, 9):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {
        rng.choice(["op", "job", "model", "x", "job_id", "stage", ""]): _value(rng, depth + 1)
        for _ in range(rng.randrange(0, 5))
    }


def _mutate(rng: random.Random, data):
    """One random change somewhere in ``data`` (a copy)."""
    data = json.loads(json.dumps(data))
    if not isinstance(data, dict) or not data or rng.random() < 0.1:
        return _value(rng)
    node = data
    while True:
        key = rng.choice(list(node))
        if isinstance(node[key], dict) and node[key] and rng.random() < 0.6:
            node = node[key]
            continue
        roll = rng.random()
        if roll < 0.5:
            node[key] = _value(rng)
        elif roll < 0.7:
            del node[key]
        elif roll < 0.85:
            node[str(_value(rng)) if rng.random() < 0.2 else "extra"] = _value(rng)
        else:
            node[key] = [node[key]] * rng.randrange(0, 3)
        return data


def _line(rng: random.Random) -> bytes:
    roll = rng.random()
    if roll < 0.08:  # not JSON at all
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200))).replace(b"\n", b"")
    if roll < 0.12:
        depth = rng.choice([10, 100, 5000, 200_000])
        return b"[" * depth + b"]" * depth
    if roll < 0.2:
        return json.dumps(_value(rng), allow_nan=True).encode()
    ops = [o for o in API_OPS if o not in SKIPPED_OPS]
    if roll < 0.4:
        op = rng.choice(ops) if rng.random() < 0.8 else rng.choice(SKIPPED_OPS) + "x"
        body = {
            "op": op,
            **{
                rng.choice(
                    ["job", "model", "job_id", "dest", "stage", "minutes", "node_id", "x"]
                ): _value(rng)
                for _ in range(rng.randrange(0, 4))
            },
        }
        return json.dumps(body, allow_nan=True).encode()
    body = _mutate(rng, rng.choice(TEMPLATES))
    if isinstance(body, dict) and body.get("op") in SKIPPED_OPS:
        body["op"] = "status"
    return json.dumps(body, allow_nan=True).encode()


def _ask(path: str, line: bytes) -> dict | None:
    """The daemon's reply to one raw line (None: it closed without one)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(line + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    return json.loads(data) if data else None


def test_ten_thousand_random_and_mutated_requests_crash_nothing(tmp_path):
    port = free_port()
    args = ["--node-id", "f", "--port", str(port), "--interface", "127.0.0.1", "--no-mdns"]
    env = {
        "SWARM_TOKEN": SwarmSecret.generate().token,
        "SWARM_DASHBOARD_PORT": "off",
        "HF_HUB_OFFLINE": "1",
    }
    node = NodeProc(tmp_path / "f", args, env=env).start()
    try:
        node.wait_up()
        rng = random.Random(SEED)
        lines = [_line(rng) for _ in range(REQUESTS)]
        path = str(node.state.api_socket)
        started = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda line: _ask(path, line), lines))
        took = time.monotonic() - started
        unanswered = [lines[i][:200] for i, r in enumerate(replies) if r is None]
        internal = [
            (lines[i][:200], r.get("error"))
            for i, r in enumerate(replies)
            if r is not None and (r.get("kind") == "internal" or r.get("code") == "internal")
        ]
        kinds: dict[str, int] = {}
        for r in replies:
            key = "ok" if r and r.get("ok") else (r or {}).get("kind", "none")
            kinds[key] = kinds.get(key, 0) + 1
        assert not internal, f"seed {SEED}: {len(internal)} internal replies, e.g. {internal[:3]}"
        assert not unanswered, f"seed {SEED}: {len(unanswered)} unanswered, e.g. {unanswered[:3]}"
        assert node.status()["node_id"] == "f" and node.running()
        assert sum(kinds.values()) == REQUESTS and kinds.get("user", 0) > REQUESTS // 2, kinds
        assert took < 60, f"{REQUESTS} requests took {took:.1f} s"
        print(f"\n{REQUESTS} local API requests in {took:.1f} s: {dict(sorted(kinds.items()))}")
    finally:
        node.stop()
