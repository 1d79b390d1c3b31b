"""The small holes of issue 15 (items 7, 9, 10): the dashboard's state needs the user's key, a
node id with a newline is refused, a deeply nested job.json exits 2 with the reason, and an
atomic write syncs its folder."""

from __future__ import annotations

import http.client
import json
import os
import stat
import subprocess
import sys
import time
import urllib.parse

import pytest
from security_harness import member_request
from swarm_harness import ROOT, swarm_env

from swarmp2p import PROTOCOL_VERSION, __version__
from swarmp2p._atomic import write_atomic
from swarmp2p.net import RpcError
from swarmp2p.node.cluster.election import check_node_id
from swarmp2p.node.messages import NodeHello
from swarmp2p.node.records import Host, NodeRecord
from swarmp2p.plan import Node


def _http(port: int, path: str, cookie: str | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path, headers={"Cookie": cookie} if cookie else {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


@pytest.mark.slow
def test_the_dashboard_shows_the_swarm_only_to_its_user(victim):
    """Another local user reaches 127.0.0.1 too: without the key /api/state says 401 and reads
    nothing; the URL `swarm dashboard` prints (to its user, over the 0600 socket) sets it."""
    out = subprocess.run(
        [sys.executable, "-m", "swarmp2p", "dashboard", "--state-dir", str(victim.state.root)],
        capture_output=True,
        text=True,
        env=swarm_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    url = urllib.parse.urlsplit(out.stdout.strip())
    port, key = url.port, urllib.parse.parse_qs(url.query)["key"][0]
    key_file = victim.state.root / "dashboard.key"
    assert key_file.read_text().strip() == key
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key not in victim.state.log_file.read_text()  # the log names the address only

    status, _, body = _http(port, "/api/state")
    assert status == 401 and b"swarm_id" not in body
    status, _, body = _http(port, "/api/state", cookie=f"swarmp2p_dashboard_{port}={'x' * 43}")
    assert status == 401 and b"swarm_id" not in body
    assert _http(port, "/?key=guess")[0] == 403
    forged = f"/?open={int(time.time())}.{'0' * 64}"  # a one-time link not made with the key
    assert _http(port, forged)[0] == 403 and "Set-Cookie" not in _http(port, forged)[1]

    status, headers, _ = _http(port, f"/?key={key}")
    assert status == 303 and "HttpOnly" in headers["Set-Cookie"]
    cookie = headers["Set-Cookie"].split(";")[0]
    status, _, body = _http(port, "/api/state", cookie=cookie)
    assert status == 200 and json.loads(body)["node_id"] == "v"


def _hello(node_id: str) -> NodeHello:
    return NodeHello(
        node_id=node_id,
        name="zmallory",
        versions=[PROTOCOL_VERSION],
        software=__version__,
        swarm_id="0" * 16,
        control_port=9,
        addresses=["127.0.0.1"],
        record=NodeRecord(node=Node(node_id=node_id, name="m", ram=0, disk_free=0, devices=())),
        host=Host(),
        term=0,
        version=0,
    )


@pytest.mark.parametrize("node_id", ["zz\n", "zz\nnode a0 joined", "a\x00", "A1", ".x", ""])
def test_check_node_id_matches_whole(node_id):
    with pytest.raises(ValueError, match="is not valid"):
        check_node_id(node_id)


@pytest.mark.slow
def test_a_member_cannot_join_with_a_newline_in_its_node_id(victim):
    """'zz\\n' passed ``^...$``: the log said ``node zz⏎ joined``. Now the daemon refuses it."""
    before = victim.state.log_file.read_text()
    swarm_id = victim.status()["swarm_id"]
    for bad in ("zz\n", "zz\nnode a0 joined"):
        with pytest.raises(RpcError) as info:
            member_request(
                victim.endpoint, victim.token, _hello("zz"), node_id=bad, swarm_id=swarm_id
            )
        assert info.value.code == "bad_field" and "node id" in info.value.detail
    assert [p["node_id"] for p in victim.status()["peers"] if p["node_id"] != "zmallory"] == ["v"]
    assert "zz" not in victim.state.log_file.read_text()[len(before) :]


@pytest.mark.parametrize(
    ("command", "body"),
    [
        ("train", "[" * 200_000 + "]" * 200_000),
        ("train", '{"model": ' + '{"a": ' * 900 + "1" + "}" * 900 + "}"),
        ("plan", "[" * 200_000 + "]" * 200_000),
    ],
    ids=["train-200k-brackets", "train-900-maps", "plan-200k-brackets"],
)
def test_a_deeply_nested_job_json_exits_2_with_the_reason(tmp_path, command, body):
    job = tmp_path / "job.json"
    job.write_text(body)
    cluster = tmp_path / "cluster.json"
    cluster.write_text("[]")
    if command == "plan":
        args = [str(job), "--cluster", str(cluster)]
    else:
        args = [str(job), "--state-dir", str(tmp_path / "s")]
    out = subprocess.run(
        [sys.executable, "-m", "swarmp2p", command, *args],
        capture_output=True,
        text=True,
        env=swarm_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "nested" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "s").exists()  # nothing was written


def test_write_atomic_syncs_the_folder_after_the_rename(tmp_path, monkeypatch):
    """The rename is durable only once its folder is synced (fsync(2)); watch the real fsync
    calls and what each descriptor names."""
    synced = []
    real_fsync = os.fsync

    def watch(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", watch)
    target = tmp_path / "sub" / "state.json"
    write_atomic(target, "x")
    assert target.read_text() == "x"
    assert len(synced) == 2
    assert synced[0].startswith(str(target.parent / ".state.json."))  # the temp file's data
    assert synced[1] == str(target.parent)  # then the folder holding the new name
