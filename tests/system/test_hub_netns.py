"""Hub models across hosts with their own disks, through a local stand-in for the Hub's file
endpoints (``hub_server.py``, on a fourth host) so the real huggingface_hub client runs: a
3-stage job on a Hub id, and `swarm serve` of another Hub id on 3 hosts. The submitting
(issuing) node reads only the config and the safetensors headers; every host downloads only
its stage's files; no host downloads the whole model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import _tiny
import pytest
from hosts import HOME
from swarm_harness import agreed_on, dump, swarm, wait_until

from swarmp2p.net.security import SwarmSecret
from swarmp2p.plan import model_shape

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.torch]

PORT = 8088
RATE = 400_000
"""Bytes a second the stand-in sends: a stage's download lasts long enough to be seen."""
HEADER_READ = 100_001
"""What the client reads of a safetensors file for its header (``bytes=0-100000``)."""


def _stats(hub_host) -> dict:
    path = hub_host.outside(f"{HOME}/stats.json")
    return json.loads(path.read_text()) if path.is_file() else {}


def _got(stats, address, repo) -> dict[str, int]:
    """Files of ``repo`` the host at ``address`` downloaded whole: name -> bytes."""
    files = stats.get(address, {}).get("files", {})
    return {k.rsplit("/", 1)[1]: v for k, v in files.items() if k.startswith(repo + "/")}


def _ranges(stats, address, repo) -> dict[str, int]:
    ranges = stats.get(address, {}).get("ranges", {})
    return {k.rsplit("/", 1)[1]: v for k, v in ranges.items() if k.startswith(repo + "/")}


def _table(title, rows, total):
    print(f"\n{title}\n| host | downloaded (B) | header reads (B) | model (B) | share |")
    print("|---|---|---|---|---|")
    for host, got, heads in rows:
        print(f"| {host} | {got} | {heads} | {total} | {got / total:.2f} |")


def test_a_hub_job_and_a_hub_serve_fetch_only_each_stages_files(netns_lab, tmp_path):
    hosts = netns_lab(4)
    hub_host = hosts[3]
    repos = {
        "tiny/llama": _tiny.hub_llama(tmp_path / "llama"),
        "tiny/chat": _tiny.hub_llama(tmp_path / "chat", layers=3, seed=1),
    }
    for repo, folder in repos.items():
        hub_host.put(folder, f"{HOME}/hub/{repo}")
    here = Path(__file__).resolve().parent
    server = hub_host.popen(
        [
            sys.executable,
            str(here / "hub_server.py"),
            f"{HOME}/hub",
            hub_host.address,
            str(PORT),
            f"{HOME}/stats.json",
            str(RATE),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().strip() == "ready"
        _run(hosts[:3], hub_host, repos)
    finally:
        server.kill()
        server.wait(10)


def _run(hosts, hub_host, repos):
    env = {
        "HF_ENDPOINT": f"http://{hub_host.address}:{PORT}",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "OMP_NUM_THREADS": "1",
    }
    token = SwarmSecret.generate().token
    nodes = [h.swarm_up(i, token, env=env) for h, i in zip(hosts, "abc")]
    for n in nodes:
        n.start()
    a, b, _ = nodes
    address = {n.node_id: h.address for n, h in zip(nodes, hosts)}
    try:
        wait_until(lambda: agreed_on(nodes, "a", 3) and a.status()["leader_ready"], 30, "agreement")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump(nodes)}") from None

    # --- a 3-stage job on a Hub id, submitted on b ---------------------------------------------
    job = {
        "name": "hubjob",
        "model": {"pretrained": "tiny/llama", "lora": {"enabled": True, "r": 4, "dropout": 0.0}},
        "split": {"stages": 3, "mode": "equal"},
        "data": {"source": "random"},
        "train": {"steps": 3, "batch_size": 2, "seq_len": 8, "eval_batches": 0},
    }
    out = swarm(b, "train", b.host.write(f"{HOME}/job.json", json.dumps(job)), "--detach", "--json")
    assert out.returncode == 0, out.stderr + dump(nodes)
    job_id = json.loads(out.stdout)["job_id"]
    seen = []

    def done():
        seen.extend(f for f in a.status()["fetching"] if f["from"] == "the Hub")
        entry = next(j for j in a.status()["jobs"] if j["job_id"] == job_id)
        return entry["state"] in ("completed", "failed") and entry

    try:
        entry = wait_until(done, 240, "the Hub job to end", interval=0.1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump(nodes)}") from None
    assert entry["state"] == "completed", json.dumps(entry, indent=1)[:4000]
    assert seen and all(f["bytes"][1] > 0 for f in seen)  # a progress line while it fetched
    text = swarm(a, "status").stdout  # the line `swarm status` prints (empty by now)
    assert "fetch " not in text or "from the Hub" in text

    stats = _stats(hub_host)
    weights = {p.name: p.stat().st_size for p in repos["tiny/llama"].glob("*.safetensors")}
    planned = {s["node_id"]: set(s["files"]) for s in entry["record"]["plan"]["stages"]}
    rows = []
    for node_id, files in planned.items():
        got = _got(stats, address[node_id], "tiny/llama")
        assert {n for n in got if n.endswith(".safetensors")} == files, (node_id, sorted(got))
        assert {"config.json", "tokenizer.json"} <= set(got)
        assert sum(got[n] for n in files) < sum(weights.values())  # never the whole model
        heads = _ranges(stats, address[node_id], "tiny/llama")
        if node_id == "b":  # the submitter read the headers: a few KB a file, no weights
            assert set(heads) == set(weights) and all(v <= HEADER_READ for v in heads.values())
        else:
            assert heads == {}
        rows.append((node_id, sum(got.values()), sum(heads.values())))
    _table("bytes fetched per host, 3-stage Hub job", rows, sum(weights.values()))

    # --- another Hub id served across the 3 hosts, issued on a -----------------------------------
    served = swarm(
        a,
        "serve",
        "tiny/chat",
        "--name",
        "chat",
        "--stages",
        "3",
        "--port",
        "8080",
        "--max-context",
        "64",
        "--json",
        timeout=300,
    )
    assert served.returncode == 0, served.stderr + dump(nodes)
    view = json.loads(served.stdout)
    said = a.host.run(
        [
            sys.executable,
            "-m",
            "swarmp2p",
            "generate",
            "chat",
            "w1 w2 w3",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--url",
            view["url"],
        ]
    )
    assert said.returncode == 0 and said.stdout.strip(), said.stderr
    stats = _stats(hub_host)
    shape = model_shape.from_folder(repos["tiny/chat"])
    n = len(view["stages"])
    rows = []
    for i, stage in enumerate(view["stages"]):
        start, end = stage["layers"]
        want = set(model_shape.stage_files(shape, start, end, i == 0, i == n - 1))
        got = _got(stats, address[stage["node"]], "tiny/chat")
        assert {f for f in got if f.endswith(".safetensors")} == want, (stage, sorted(got))
        rows.append(
            (
                stage["node"],
                sum(got.values()),
                sum(_ranges(stats, address[stage["node"]], "tiny/chat").values()),
            )
        )
    chat_weights = sum(p.stat().st_size for p in repos["tiny/chat"].glob("*.safetensors"))
    _table("bytes fetched per host, 3-stage Hub serve", rows, chat_weights)
