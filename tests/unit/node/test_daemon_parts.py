"""Pure parts of the daemon and its CLI library: config checks, messages, rate limit, tables."""

from __future__ import annotations

import dataclasses
import logging
import re

import msgpack
import pytest

from swarmp2p._ratelog import RateLimitedLog
from swarmp2p.client import control
from swarmp2p.node import api
from swarmp2p.node.config import NodeConfig, parse_peer
from swarmp2p.node.messages import (
    Heartbeat,
    LeadRequest,
    LeadVote,
    NodeHello,
    Submit,
    TableAck,
    TablePush,
)
from swarmp2p.node.records import Host, NodeRecord
from swarmp2p.plan import parse_job
from swarmp2p.timings import Timings
from swarmp2p.wire.messages import WireError, decode, encode


def test_parse_peer():
    assert parse_peer("10.0.0.2:7737") == "tcp://10.0.0.2:7737"
    assert parse_peer("box.lan:1") == "tcp://box.lan:1"
    for bad in ("10.0.0.2", ":7737", "h:0", "h:x", "h:70000"):
        with pytest.raises(ValueError, match="is not HOST:PORT"):
            parse_peer(bad)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"port": 70000}, "--port 70000"),
        ({"timings": {"heartbeat_s": 3.0, "failure_timeout_s": 2.0}}, "must be > 0 and below the"),
        ({"timings": {"heartbeat_s": 0.0}}, "must be > 0"),
        ({"timings": {"serve_stage_start_s": 3600.0}}, "must end before `swarm serve` stops"),
        ({"peers": ("nope",)}, "--peer 'nope'"),
    ],
)
def test_config_refuses_bad_values(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        if "timings" in fields:
            fields = {**fields, "timings": Timings(**fields["timings"])}
        NodeConfig(state_dir=tmp_path, **fields)


HELLO = NodeHello(
    node_id="a1",
    name="box",
    versions=[1],
    software="0.1.0",
    swarm_id="0123456789abcdef",
    control_port=7737,
    addresses=["10.0.0.1"],
    record=NodeRecord.from_data(
        {
            "node_id": "a1",
            "name": "box",
            "ram": 1 << 40,
            "disk_free": 0,
            "capabilities": [],
            "devices": [
                {
                    "kind": "cuda",
                    "index": 0,
                    "name": "A5000",
                    "memory_total": 24 << 30,
                    "memory_free": 24 << 30,
                    "fake": True,
                },
                {
                    "kind": "cpu",
                    "index": 0,
                    "name": "cpu",
                    "memory_total": 1 << 40,
                    "memory_free": 1 << 40,
                },
            ],
            "held": {"serve": {"cuda:0": 1 << 30}},
        },
        "",
    ),
    host=Host(cpu_cores=8, machine="m1"),
    term=3,
    version=9,
)


def test_hello_carries_a_typed_record_in_cluster_json_form():
    body = msgpack.unpackb(encode(HELLO))
    gpu, cpu = body["record"]["devices"]
    assert gpu["fake"] is True and "fake" not in cpu  # the wire form is cluster.json's
    assert body["record"]["held"] == {"jobs": {}, "serve": {"cuda:0": 1 << 30}}
    got = decode(encode(HELLO))
    assert got.record.fake == {"cuda:0"} and got.record.held.serve == {"cuda:0": 1 << 30}
    assert got.record.node.devices[0].memory_total == 24 << 30


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda r: r["devices"][0].update(memory_total=-1),
            "node.hello.record.devices[0].memory_total must be an integer >= 0, got -1",
        ),
        (
            lambda r: r["devices"][1].update(fake="yes"),
            'node.hello.record.devices[1].fake must be true or false, got "yes"',
        ),
        (
            lambda r: r.update(held={"serve": {"gpu0": 1}}),
            'node.hello.record.held.serve "gpu0" does not match',
        ),
        (lambda r: r.pop("ram"), "node.hello.record.ram required"),
        (lambda r: r.update(node_id="zz"), "record.node_id 'zz' is not the sender's 'a1'"),
        (lambda r: r.update(vram=3), "node.hello.record.vram unknown key"),
    ],
)
def test_a_bad_record_from_the_network_is_refused_naming_the_field(change, message):
    body = msgpack.unpackb(encode(HELLO))
    change(body["record"])
    with pytest.raises(WireError, match=re.escape(message)):
        decode(msgpack.packb(body))


def test_a_bad_heartbeat_memory_report_is_refused_naming_the_field():
    beat = Heartbeat(node_id="a1", term=1, version=2, leader="a0")
    body = msgpack.unpackb(encode(beat))
    body["memory"] = {"free": {"cuda:0": -5}}
    with pytest.raises(
        WireError, match=r"node.heartbeat.memory.free.cuda:0 must be an integer >= 0"
    ):
        decode(msgpack.packb(body))
    body["memory"] = {"free": {"cuda:0": 5}, "held": {"jobs": {"cuda:0": 1}}, "disk": 7}
    got = decode(msgpack.packb(body))
    record = HELLO.record.with_memory(got.memory)
    assert record.node.devices[0].memory_free == 5 and record.node.disk_free == 7
    assert record.held.jobs == {"cuda:0": 1} and record.held.serve == {}


@pytest.mark.parametrize(
    "msg",
    [
        HELLO,
        Heartbeat(node_id="a1", term=1, version=2, leader="a0"),
        TablePush(node_id="a1", term=2, table={"format": 2, "jobs": {}}, commit=1),
        Submit(job_id="", job=parse_job({"model": {"pretrained": "m"}}), submitted_by="cli"),
        LeadRequest(candidate="a0", term=4),
        LeadVote(node_id="a1", granted=False, reason="no", term=3, version=9, epoch="e", members=3),
        TableAck(node_id="a1", term=3, version=9, ok=False, reason="need the whole table"),
    ],
)
def test_messages_round_trip(msg):
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"node_id": "A B"}, "node id 'A B' is not valid"),
        ({"control_port": 0}, "control_port must be in 1..65535"),
        ({"addresses": []}, "at least one IPv4 address"),
    ],
)
def test_bad_hello_is_a_wire_error(change, message):
    body = msgpack.unpackb(encode(HELLO))
    body.update(change)
    with pytest.raises(WireError, match=message):
        decode(msgpack.packb(body))
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(HELLO, **change)


def test_rate_limited_log_counts_what_it_drops(caplog):
    now = [100.0]
    limited = RateLimitedLog(per_second=3, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="swarmp2p.node"):
        for i in range(50):
            limited.warning("bad %d", i)
        now[0] += 0.5
        limited.flush()  # window not over yet: nothing
        now[0] += 0.6
        limited.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["bad 0", "bad 1", "bad 2", "... 47 more bad requests in the last second"]


def test_api_without_daemon_says_how_to_start_one(tmp_path):
    with pytest.raises(api.ApiError, match=r"no swarm daemon is running .* `swarm up`"):
        api.request(tmp_path / "api.sock", "status", timeout=1)
    with pytest.raises(ValueError, match="unknown local API op 'reboot'"):
        api.request(tmp_path / "api.sock", "reboot")


def test_token_needs_a_swarm(tmp_path):
    with pytest.raises(ValueError, match=r"no swarm in .*: run `swarm up` first"):
        control.token(tmp_path)


def test_status_table():
    status = {
        "node_id": "a",
        "name": "box",
        "port": 7737,
        "swarm_id": "s" * 16,
        "leader": "a",
        "leader_ready": True,
        "term": 2,
        "table_version": 5,
        "jobs": [{"job_id": "j1"}],
        "peers": [
            {
                "node_id": "a",
                "name": "box",
                "address": "10.0.0.1:7737",
                "alive": True,
                "is_leader": True,
                "devices": [
                    {
                        "kind": "cuda",
                        "name": "A5000",
                        "memory_total": 24 << 30,
                        "memory_free": 20 << 30,
                        "compute_capability": "8.6",
                        "fake": True,
                    },
                ],
            },
            {
                "node_id": "b",
                "name": "b",
                "address": "10.0.0.2:7737",
                "alive": False,
                "is_leader": False,
                "devices": [],
            },
        ],
    }
    text = control.format_status(status)
    assert "leader  a" in text and "term 2, version 5, 1 job(s)" in text
    assert "cuda:A5000 20.0G/24.0G cc8.6 (fake)" in text
    row_b = next(line for line in text.splitlines() if line.startswith("b "))
    assert " NO " in row_b
    status["served"] = [
        {
            "model": "tiny",
            "url": "http://127.0.0.1:8080",
            "state": "serving",
            "reason": "",
            "stages": [{"node": "a", "layers": [0, 2]}, {"node": "b", "layers": [2, 4]}],
        },
        {
            "model": "tuned",
            "url": "",
            "state": "restoring",
            "stages": [],
            "reason": "the leader a is not reachable; retry",
        },
    ]
    served = [
        line for line in control.format_status(status).splitlines() if line.startswith("served")
    ]
    assert served == [
        "served  tiny at http://127.0.0.1:8080/v1 (serving): a [0-1], b [2-3]",
        "served  tuned (restoring): -; the leader a is not reachable; retry",
    ]


def test_status_shows_each_served_models_speculation():
    from swarmp2p.client.control import speculation_line

    stats = {"drafted": 410, "accepted": 254, "acceptance": 0.6195, "tokens_per_lap": 2.314}
    base = {"speculate": "auto", "speculate_off": "", "speculation": stats}
    assert speculation_line(base) == (
        "speculate auto: 62% of 410 drafted tokens accepted, 2.31 tokens a lap"
    )
    off = base | {"speculate_off": "stage [0, 2) has linear-attention blocks"}
    assert speculation_line(off) == "speculate auto: off, stage [0, 2) has linear-attention blocks"
    assert speculation_line(base | {"speculation": {"drafted": 0}}) == (
        "speculate auto: nothing drafted yet"
    )
    assert speculation_line(base | {"speculate": "none"}) == "speculate none"
    assert speculation_line(base | {"draft_model": True}) == (
        "speculate auto (draft model at stage 0): 62% of 410 drafted tokens accepted, "
        "2.31 tokens a lap"
    )


def test_status_names_down_members_and_the_writes_this_node_rolled_back():
    from swarmp2p.client.control import _quorum_lines

    q = {
        "members": ["a", "b", "c"],
        "voters": ["a", "b"],
        "down": ["c"],
        "majority": 2,
        "ok": False,
        "reason": "this node sees 1 of 2 voting member(s) (a)",
        "dropped": [
            {
                "versions": [7, 8],
                "events": ["member_removed", "job_submitted"],
                "why": "no majority",
                "term": 3,
                "at": 0.0,
            }
        ],
    }
    assert _quorum_lines(q) == [
        "members 3 (a, b, c), majority 2 of 2 voting (c down)",
        "quorum  NO: this node sees 1 of 2 voting member(s) (a)",
        "dropped versions 7-8 (member_removed, job_submitted): no majority",
    ]


def test_a_stage_start_carries_the_plan_and_the_records_it_was_made_from():
    from _tables import cluster, job, plan

    from swarmp2p.node.messages import StageStart
    from swarmp2p.node.table.events import SnapshotSlice
    from swarmp2p.node.training.jobs import PlanMismatch, check_plan

    planned = plan(("a", "b"))
    msg = StageStart(
        job_id="j1",
        attempt=2,
        stage=1,
        job=job(),
        cluster=tuple(cluster("a", "b")),
        plan=planned,
        next="",
        resume_step=4,
        snapshot_nodes=[],
        leader="a",
        resplit=(SnapshotSlice(stage=0, layers=(0, 3), nodes=("a",)),),
    )
    got = decode(encode(msg))
    assert got == msg and got.plan.to_json() == planned.to_json()
    assert isinstance(got.plan.stages[1].node_id, str) and got.resplit[0].layers == (0, 3)
    from _tables import SHAPE

    assert check_plan(got.job, got.cluster, got.plan, node_id="b", shape=SHAPE) == planned
    other = dataclasses.replace(planned, recompute=not planned.recompute)
    with pytest.raises(PlanMismatch, match="node b computes a different plan"):
        check_plan(got.job, got.cluster, other, node_id="b", shape=SHAPE)
    body = msgpack.unpackb(encode(msg))
    body["plan"] = planned.to_json()  # an older leader's JSON string
    with pytest.raises(WireError, match=r"job\.stage_start\.plan must be an object"):
        decode(msgpack.packb(body))
    body["plan"] = {**planned.to_dict(), "stages": []}
    with pytest.raises(WireError, match=r"job\.stage_start\.plan\.stages"):
        decode(msgpack.packb(body))
    body = msgpack.unpackb(encode(msg))
    body["resplit"] = [{"stage": 0, "layers": [3, 1], "nodes": ["a"]}]
    with pytest.raises(WireError, match=r"job\.stage_start\.resplit\[0\].*not a block range"):
        decode(msgpack.packb(body))


def test_status_lists_unfinished_jobs_and_counts_finished_ones():
    jobs = [
        {
            "job_id": "j1",
            "state": "running",
            "record": {
                "name": "tune",
                "step": 3,
                "job": {"train": {"steps": 10}},
                "metrics": {"step": 4, "loss": 2.5},
            },
        },
        {"job_id": "j2", "state": "pending", "record": {"job": {"train": {"steps": 5}}}},
        {"job_id": "j0", "state": "completed", "record": {}},
        {"job_id": "jx", "state": "failed", "record": {}},
    ]
    assert control._job_lines(jobs) == [
        "job     j1 (tune) RUNNING, step 4/10, training loss 2.5000",
        "job     j2 PENDING, step 0/5",
        "jobs    2 finished (`swarm jobs` lists them)",
    ]
    assert control._job_lines([]) == []


def test_peers_say_what_a_key_not_yet_listed_means():
    row = {"node_id": "c", "name": "c", "address": "-", "alive": True, "is_leader": False}
    text = control.format_peers([{**row, "key": "ab12", "member": False, "devices": []}])
    assert "ab12 (joining)" in text and "?" not in text


def test_jobs_and_models_label_the_training_and_the_held_out_loss():
    from swarmp2p.client.jobs import format_jobs, format_models

    job = {
        "id": "j1",
        "name": "t",
        "state": "COMPLETED",
        "step": 10,
        "steps": 10,
        "plan": {"stages": [{"node": "a"}, {"node": "b"}]},
        "metrics": {"loss": 1.25},
        "evaluation": {"trained": {"loss": 2.5}, "base": {"loss": 3.0}},
    }
    header, row = format_jobs([job, {**job, "id": "j2", "evaluation": {}}]).splitlines()[:2]
    assert "TRAIN LOSS" in header and "HELD-OUT" in header
    assert row.split()[-2:] == ["1.2500", "2.5000"]
    assert format_jobs([{**job, "evaluation": {}}]).splitlines()[1].split()[-2:] == ["1.2500", "-"]
    model = {"id": "m", "job_id": "j1", "base": "tiny", "manifest": {"stages": [1, 2]}}
    model["manifest"]["evaluation"] = job["evaluation"]
    assert format_models([model]) == (
        "m  job j1  base tiny  2 stage(s)  held-out loss 2.5000 (base model 3.0000)"
    )
