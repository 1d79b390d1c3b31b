"""A joined member that lies, against real daemons (issue 24, item 5): 500 submissions meet
the cap on unfinished jobs with a clear refusal while leadership stays put and `swarm status`
answers; a 1 GB file offered for a job that does not exist, for a snapshot the table does
not list, or under the name of a real job's listed snapshot, is refused before a byte or a
folder is written; a burst of near-cap messages does
not make the leader look dead."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest
from security_harness import credentials, member
from swarm_harness import NodeProc, agreed_on, free_port, swarm, tiny_llama, wait_until

from swarmp2p.net import AsyncSecureContext, NodeKey, RpcClient, RpcError, RpcServer, ServerKeys
from swarmp2p.net.auth import KeyCheck
from swarmp2p.net.security import SwarmSecret
from swarmp2p.node.config import MAX_WAITING_PER_SUBMITTER, SUBMIT_BURST
from swarmp2p.node.messages import FilePull, ShardChunk, ShardRead, StageReport, Submit
from swarmp2p.plan import parse_job
from swarmp2p.plan.inputs import JobInputs, ModelSource
from swarmp2p.plan.model_shape import from_config
from swarmp2p.timings import TIMINGS
from swarmp2p.wire.messages import MAX_MESSAGE_BYTES, encode

pytestmark = pytest.mark.slow

SNAP = "snapshots/cuts-none/stage-0/step-00000001.pt"
GB = 1 << 30


def _unplaceable() -> Submit:
    """A job no node can hold: a 200-layer model of hidden size 16384 (its shape given, so
    the leader plans it, finds it blocked and lets it wait)."""
    shape = from_config(
        {
            "model_type": "llama",
            "vocab_size": 128000,
            "hidden_size": 16384,
            "intermediate_size": 53248,
            "num_hidden_layers": 200,
            "num_attention_heads": 128,
            "num_key_value_heads": 8,
        }
    )
    job = parse_job(
        {"name": "huge", "model": {"pretrained": "/nowhere/huge"}, "data": {"source": "random"}}
    )
    return Submit(
        job=job,
        submitted_by="zmallory",
        inputs=JobInputs(shape=shape, model=ModelSource(kind="embedded")),
    )


class _Watch(threading.Thread):
    """Polls the leader's `swarm status` (its latency) and the follower's view of the leader
    (leader, term, how long since it heard from it) until stopped."""

    def __init__(self, leader: NodeProc, follower: NodeProc) -> None:
        super().__init__(daemon=True)
        self.leader, self.follower = leader, follower
        self.status_s: list[float] = []
        self.views: set[tuple[str, int]] = set()
        self.silence_s = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            self.leader.status(timeout=5.0)
            self.status_s.append(time.monotonic() - start)
            s = self.follower.status(timeout=5.0)
            self.views.add((s["leader"], s["term"]))
            for row in s["peers"]:
                if row["node_id"] == self.leader.state.root.name:
                    self.silence_s = max(self.silence_s, float(row.get("last_seen_s") or 0))
            self.stop.wait(0.1)


def _cpu_s(node: NodeProc) -> float:
    """CPU seconds the daemon's process has used (user and system)."""
    stat = Path(f"/proc/{node.proc.pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def pair(tmp_path):
    """Daemons a (leading) and b, agreed; their token."""
    token = SwarmSecret.generate().token
    ports = {"a": free_port(), "b": free_port()}
    nodes = []
    for n in "ab":
        args = ["--node-id", n, "--name", n, "--port", str(ports[n]), "--interface", "127.0.0.1"]
        args += ["--no-mdns", "--peer", f"127.0.0.1:{ports['b' if n == 'a' else 'a']}"]
        nodes.append(
            NodeProc(tmp_path / n, args, env={"SWARM_TOKEN": token, "SWARM_DASHBOARD_PORT": "off"})
        )
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_up()
        wait_until(lambda: agreed_on(nodes, "a", 2), 30, "a and b to agree")
        wait_until(lambda: nodes[0].status()["leader_ready"], 30, "a to lead")
        for node, n in zip(nodes, "ab"):
            node.token, node.endpoint = token, f"tcp://127.0.0.1:{ports[n]}"
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.alone  # it times `swarm status` and heartbeats under load
def test_500_submissions_meet_the_cap_and_leadership_stays(pair):
    a, b = pair
    keys = credentials(a.endpoint, a.token)  # returns once the leader lists mallory
    before = a.status()
    cpu = _cpu_s(a)
    watch = _Watch(a, b)
    watch.start()
    started = time.monotonic()
    accepted, refused, other = [], [], []
    try:
        with member(a.endpoint, a.token, keys=keys) as m:
            for _ in range(5):  # 100 at a time: under the server's 256 requests in flight
                for _ in range(100):
                    m.send(_unplaceable())
                for _ in range(100):
                    try:
                        reply = m.reply(30.0)
                    except RpcError as exc:
                        (refused if exc.code == "job_cap" else other).append(exc)
                        continue
                    assert reply is not None, "no reply within 30 s"
                    accepted.append(reply.job_id)
        time.sleep(3 * 0.5)  # a few heartbeat rounds of the leader planning what waits
    finally:
        watch.stop.set()
        watch.join(10)
    busy = (_cpu_s(a) - cpu) / (time.monotonic() - started)
    after = a.status()
    print(
        f"500 submissions: {len(accepted)} accepted, {len(refused)} refused; leader CPU "
        f"{busy:.0%}; status max "
        f"{max(watch.status_s) * 1000:.0f} ms over {len(watch.status_s)}; b heard nothing "
        f"from a for at most {watch.silence_s:.2f} s; views {watch.views}"
    )
    assert other == [], other[:3]
    assert len(accepted) == MAX_WAITING_PER_SUBMITTER and len(refused) == 500 - len(accepted)
    assert "the cap of 16 per node" in refused[0].detail
    assert "--max-waiting-per-node" in refused[0].detail
    mine = {
        j["job_id"]
        for j in after["jobs"]
        if j["record"].get("submitted_by", "").endswith("@zmallory")
    }
    assert mine == set(accepted)  # a refused submission left nothing in the table
    assert all(j["state"] == "pending" for j in after["jobs"] if j["job_id"] in mine)
    assert watch.views == {("a", before["term"])} and after["term"] == before["term"]
    # measured 62-90 ms (before reading a burst one request per loop turn and the faster
    # schema: 0.7-1.3 s; before the caps: 10 s, timed out)
    assert max(watch.status_s) < 0.5, sorted(watch.status_s)[-5:]


def _failing() -> Submit:
    """A job that fails as soon as the leader plans it: a model no node can read, and no
    shape given."""
    job = parse_job(
        {"name": "fails", "model": {"pretrained": "/nowhere/at-all"}, "data": {"source": "random"}}
    )
    return Submit(job=job, submitted_by="zmallory")


def test_jobs_that_fail_at_once_meet_the_submission_rate(pair):
    """Failed jobs are not waiting, so the waiting caps do not bound them: past a burst of
    SUBMIT_BURST the leader takes one job from a node every submit_every_s, with a refusal
    that says when to retry; the table keeps nothing of a refused one."""
    a, _ = pair
    keys = credentials(a.endpoint, a.token)
    taken, refused = [], None
    with member(a.endpoint, a.token, keys=keys) as m:
        start = time.monotonic()
        for i in range(4 * SUBMIT_BURST):
            m.send(_failing(), job_id=f"fails-{i}")
            try:
                reply = m.reply(15.0)
            except RpcError as exc:
                refused = exc
                break
            job_id = reply.job_id
            taken.append(job_id)
            wait_until(lambda j=job_id: _state(a, j) == "failed", 15, f"{job_id} to fail")
        took = time.monotonic() - start
        assert refused is not None, f"{len(taken)} taken in {took:.1f} s, none refused"
        # the burst, and the ones the bucket gained back while this loop ran
        assert SUBMIT_BURST <= len(taken) <= SUBMIT_BURST + took / TIMINGS.submit_every_s + 1, (
            len(taken),
            took,
        )
        assert refused.code == "job_rate", refused
        assert (
            f"past that the leader takes one every {TIMINGS.submit_every_s:g} s" in refused.detail
        )
        assert f"fails-{len(taken)}" not in {j["job_id"] for j in a.status()["jobs"]}
        time.sleep(TIMINGS.submit_every_s)  # the refusal's "retry in": one more is taken then
        m.send(_failing(), job_id="fails-later")
        assert m.reply(15.0).job_id == "fails-later"


def _state(node: NodeProc, job_id: str) -> str:
    return next((j["state"] for j in node.status()["jobs"] if j["job_id"] == job_id), "")


def _evil_server(keys, total: int, asked: list):
    mine = NodeKey(keys.public, keys.secret)
    served = ServerKeys(
        public=mine.public, secret=mine.secret, admits=KeyCheck.anyone(), domain="evil"
    )

    async def evil(msg, peer):
        if isinstance(msg, ShardRead):
            asked.append(msg)
            return ShardChunk(data=b"x" * min(msg.size, 1 << 20), total=total)
        return None

    return served, evil


def _pull(victim, keys, msg: FilePull, asked: list) -> RpcError | None:
    served, evil = _evil_server(keys, GB, asked)

    async def attack() -> RpcError | None:
        ctx = AsyncSecureContext()
        server = RpcServer(ctx, served, "127.0.0.1", 0, evil)
        await server.start()
        client = RpcClient(ctx, keys, victim.endpoint)
        try:
            await client.request(
                FilePull(job_id=msg.job_id, file=msg.file, source=server.endpoint), 15
            )
            return None
        except RpcError as exc:
            return exc
        finally:
            await client.close()
            await server.close()
            ctx.destroy(0)

    return asyncio.run(attack())


def test_a_1gb_file_for_a_job_that_does_not_exist_is_refused_unread(victim):
    keys = credentials(victim.endpoint, victim.token)
    asked: list = []
    err = _pull(victim, keys, FilePull(job_id="ghost", file=SNAP, source=""), asked)
    assert err is not None and err.code == "no_job", err
    assert "no job 'ghost' in the table" in err.detail
    assert asked == [] and not (victim.state.root / "jobs" / "ghost").exists()


def test_a_1gb_file_for_a_real_job_is_refused_unless_the_table_lists_it(pair):
    """The member's own job is in the table (committed by the two real nodes), but it lists
    no snapshot of it: refused before the victim asks for a byte; and a name that is no
    snapshot at all, the same."""
    victim, _ = pair
    keys = credentials(victim.endpoint, victim.token)
    job_id = "mallory-job-1"
    with member(victim.endpoint, victim.token, keys=keys) as m:
        m.send(_unplaceable(), job_id=job_id)
        assert m.reply(15.0) is not None
    wait_until(lambda: any(j["job_id"] == job_id for j in victim.status()["jobs"]), 10, "the job")
    for file, code in ((SNAP, "not_listed"), ("model.safetensors", "bad_field")):
        asked: list = []
        err = _pull(victim, keys, FilePull(job_id=job_id, file=file, source=""), asked)
        assert err is not None and err.code == code, err
        assert asked == [] and not (victim.state.root / "jobs" / job_id).exists()


@pytest.mark.torch
def test_a_1gb_file_offered_for_a_real_jobs_listed_snapshot_is_refused_unwritten(pair, tmp_path):
    """A job trains on the two real nodes and the table lists its snapshots. Then a's host
    turns against b: stage 0's snapshot on a's disk becomes a 1 GB file (sparse), and a
    member asks b to pull it from a. That is far past what a snapshot of this plan can be:
    b reads the first chunk's header, refuses naming the size, and writes nothing (its own
    copy of the snapshot is untouched, no partial file)."""
    a, b = pair
    model = tiny_llama(tmp_path / "tiny", vocab=128)
    job = {
        "name": "snap",
        "model": {"pretrained": str(model), "lora": {"enabled": True, "r": 4}},
        "split": {"stages": 2},
        "data": {"source": "random"},
        "train": {
            "steps": 2,
            "batch_size": 2,
            "seq_len": 8,
            "micro_batches": 1,
            "eval_batches": 1,
            "checkpoint_every": 1,
        },
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    done = swarm(a, "train", str(tmp_path / "job.json"), "--json", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = json.loads(done.stdout)["id"]
    record = next(j for j in b.status()["jobs"] if j["job_id"] == job_id)["record"]
    stages = record["plan"]["stages"]
    assert [s["node_id"] for s in stages] == ["a", "b"], stages
    step = max(int(k) for k in record["snapshots"]["0"])
    cuts = "-".join(str(s["layers"][0]) for s in stages[1:])
    file = f"snapshots/cuts-{cuts}/stage-0/step-{step:08d}.pt"
    real = a.state.root / "jobs" / job_id / file
    with open(real, "r+b") as out:  # the lie: a 1 GB file under the listed name
        out.truncate(GB)
    target = b.state.root / "jobs" / job_id / file  # b keeps a copy of a's (its holder's)
    before = target.read_bytes() if target.exists() else None

    keys = credentials(b.endpoint, b.token)
    with member(b.endpoint, b.token, keys=keys) as m:
        m.send(FilePull(job_id=job_id, file=file, source=a.endpoint))
        with pytest.raises(RpcError) as refused:
            m.reply(30.0)
    err = refused.value
    print(f"refused: {err.detail}")
    assert err.code == "no_file", err
    assert f"the source offers {GB} bytes, over the" in err.detail, err.detail
    after = target.read_bytes() if target.exists() else None
    assert after == before  # b's own copy (if any) untouched
    assert not list(target.parent.glob(f".{target.name}*"))  # and no partial file beside it


@pytest.mark.alone  # it times heartbeats under a burst
def test_a_burst_of_near_cap_messages_does_not_make_the_leader_look_dead(pair):
    a, b = pair
    keys = credentials(a.endpoint, a.token)  # returns once the leader lists mallory
    before = a.status()
    pad = "x" * 1000
    n = (MAX_MESSAGE_BYTES - 8192) // 1024
    report = StageReport(
        node_id="zmallory",
        job_id="ghost",
        attempt=1,
        stage=0,
        events=[{"event": "step", "pad": pad}] * n,
    )
    assert MAX_MESSAGE_BYTES * 0.99 < len(encode(report)) <= MAX_MESSAGE_BYTES
    watch = _Watch(a, b)
    watch.start()
    replies = 0
    try:
        with member(a.endpoint, a.token, keys=keys) as m:
            for _ in range(40):
                m.send(report)
            deadline = time.monotonic() + 60
            while replies < 40 and time.monotonic() < deadline:
                try:
                    if m.reply(1.0) is not None:
                        replies += 1
                except RpcError:
                    replies += 1
        time.sleep(1.0)
    finally:
        watch.stop.set()
        watch.join(10)
    print(
        f"40 x {len(encode(report))} bytes: status max {max(watch.status_s) * 1000:.0f} ms, "
        f"b heard nothing from a for at most {watch.silence_s:.2f} s; views {watch.views}"
    )
    assert replies == 40  # each answered, or refused as busy
    assert watch.views == {("a", before["term"])}
    assert watch.silence_s < 1.5, watch.silence_s  # heartbeats every 0.5 s; dead at 3 s
    assert sum(p["alive"] for p in b.status()["peers"]) >= 2
