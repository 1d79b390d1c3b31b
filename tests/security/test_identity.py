"""Per-node identity against real daemons (issue 15, Build 1-3): a holder of the old shared
keys reaches no handler; a member cannot speak, leave, lead or write the table as another
(nor as itself when it does not lead); `swarm remove` revokes a member within a heartbeat;
after `swarm token --rotate` the old token admits nobody, a removed node included."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq
from security_harness import credentials, join, member
from swarm_harness import HEARTBEAT_S, NodeProc, agreed_on, dump, free_port, swarm, wait_until

from swarmp2p import PROTOCOL_VERSION, __version__
from swarmp2p.net import ClientKeys, NodeKey, RpcError, RpcTimeout, SwarmSecret, request_sync
from swarmp2p.node.messages import (
    Heartbeat,
    LeadRequest,
    LeadVote,
    Leave,
    NodeHello,
    StageReport,
    TableAck,
    TableEvents,
    TablePush,
)
from swarmp2p.node.records import Host, NodeRecord
from swarmp2p.node.table import events as ev
from swarmp2p.node.table.jobtable import JobTable
from swarmp2p.plan import Node

pytestmark = pytest.mark.slow


class Trio:
    """Daemons on 127.0.0.1 that know each other by --peer (no mDNS), one token."""

    def __init__(self, root: Path, token: str) -> None:
        self.root, self.token = root, token
        self.ports: dict[str, int] = {}
        self.nodes: dict[str, NodeProc] = {}

    def start(self, node_id: str, token: str | None = None, fresh_key: bool = False) -> NodeProc:
        port = self.ports.setdefault(node_id, free_port())
        peers = [
            a for n, p in self.ports.items() if n != node_id for a in ("--peer", f"127.0.0.1:{p}")
        ]
        args = [
            "--node-id",
            node_id,
            "--name",
            node_id,
            "--port",
            str(port),
            "--interface",
            "127.0.0.1",
            "--no-mdns",
            *peers,
        ]
        env = {"SWARM_TOKEN": token or self.token, "SWARM_DASHBOARD_PORT": "off"}
        state = self.root / node_id
        if fresh_key:
            (state / "node.key").unlink(missing_ok=True)
        node = NodeProc(state, args, env=env).start()
        self.nodes[node_id] = node
        return node

    def endpoint(self, node_id: str) -> str:
        return f"tcp://127.0.0.1:{self.ports[node_id]}"

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()


def _up(tmp_path, ids="abc") -> Trio:
    trio = Trio(tmp_path, SwarmSecret.generate().token)
    for n in ids:
        trio.ports[n] = free_port()
    nodes = [trio.start(n) for n in ids]
    for node in nodes:
        node.wait_up()
    try:
        wait_until(lambda: agreed_on(nodes, "a", len(ids)), 30, "agreement on leader a")
        wait_until(lambda: nodes[0].status()["leader_ready"], 30, "a ready")
        wait_until(
            lambda: all(len(n.status()["quorum"]["members"]) == len(ids) for n in nodes),
            30,
            "every member listed",
        )
    except AssertionError:
        trio.stop()
        raise AssertionError(dump(nodes)) from None
    return trio


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    trio = _up(tmp_path_factory.mktemp("trio"))
    try:
        yield trio
    finally:
        trio.stop()


def _written(trio: Trio) -> dict[str, tuple[bytes, bytes]]:
    """Each node's table (snapshot and log) and vote files, byte for byte."""
    out = {}
    for n, node in trio.nodes.items():
        vote = node.state.root / "vote.json"
        log = node.state.table_file.with_name("jobs.log")
        table = node.state.table_file.read_bytes() + (log.read_bytes() if log.exists() else b"")
        out[n] = (table, vote.read_bytes() if vote.exists() else b"")
    return out


def _refused(endpoint: str, keys: ClientKeys, msg, **raw) -> str:
    """The refusal code of ``msg`` sent with ``keys``; fails if it was answered."""
    with member(endpoint, "", keys=keys) as m:
        m.send(msg, **raw)
        try:
            reply = m.reply(10.0)
        except RpcError as exc:
            return exc.code
    raise AssertionError(f"{type(msg).TYPE} was answered: {reply!r}")


def test_the_old_shared_keys_reach_no_handler(trio):
    """Before issue 15 every member spoke with the keys the token derives; now the control
    port admits only listed keys, so the token's keys get no handshake, let alone a reply."""
    secret = SwarmSecret.from_token(trio.token)
    a_key = join(trio.endpoint("a"), trio.token).key  # the real server key of a, to be sure
    before = _written(trio)
    public, private = (k.decode() for k in secret.curve_keypair())
    for keys in (secret, ClientKeys(public=public, secret=private, server=a_key)):
        with zmq.Context() as ctx, pytest.raises(RpcTimeout):
            request_sync(
                ctx,
                keys,
                trio.endpoint("a"),
                Heartbeat(node_id="b", term=1, version=1, leader="a"),
                1.5,
            )
    assert _written(trio) == before


def test_a_member_cannot_speak_leave_lead_or_write_as_another(trio):
    endpoint = trio.endpoint("a")
    keys = credentials(endpoint, trio.token, "zmallory")  # a real member, joined with the token
    wait_until(
        lambda: "zmallory" in trio.nodes["b"].status()["quorum"]["members"], 15, "mallory listed"
    )
    s = trio.nodes["a"].status()
    term, version = s["term"], s["table_version"]
    before = _written(trio)
    forged_table = JobTable(epoch="forged", term=term + 5, version=1, leader="zmallory").to_dict()
    drop_b = ev.entry_to_data(
        ev.Entry(version=version + 1, term=term, event=ev.MemberLeft(node_id="b"))
    )
    hello = NodeHello(
        node_id="b",
        name="b",
        versions=[PROTOCOL_VERSION],
        software=__version__,
        swarm_id=s["swarm_id"],
        control_port=9,
        addresses=["127.0.0.1"],
        record=NodeRecord(node=Node(node_id="b", name="b", ram=0, disk_free=0, devices=())),
        host=Host(),
        term=term,
        version=version,
    )
    as_others = [
        hello,
        Heartbeat(node_id="b", term=term, version=version, leader="a"),
        Leave(node_id="b"),
        LeadRequest(candidate="b", term=term + 5),
        TableEvents(
            leader="a", term=term, epoch="", prev_version=version, prev_term=term, entries=[drop_b]
        ),
        TablePush(node_id="a", term=term + 5, table=forged_table),
        StageReport(node_id="b", job_id="j1", attempt=1, stage=0, events=[{"event": "done"}]),
    ]
    for msg in as_others:
        for target in ("a", "b"):
            assert (
                _refused(
                    trio.endpoint(target),
                    credentials(trio.endpoint(target), trio.token, "zmallory"),
                    msg,
                )
                == "forbidden"
            ), msg
    # as itself: not the leader of anyone's view, so no write and no vote
    mine = TableEvents(
        leader="zmallory",
        term=term + 5,
        epoch="",
        prev_version=version,
        prev_term=term,
        entries=[drop_b],
    )
    with member(endpoint, "", keys=keys) as m:
        m.send(mine)
        ack = m.reply(10.0)
        m.send(TablePush(node_id="zmallory", term=term + 5, table=forged_table))
        ack2 = m.reply(10.0)
        m.send(LeadRequest(candidate="zmallory", term=term + 5))
        vote = m.reply(10.0)
    assert isinstance(ack, TableAck) and not ack.ok and "view says a leads" in ack.reason
    assert isinstance(ack2, TableAck) and not ack2.ok
    assert isinstance(vote, LeadVote) and not vote.granted
    assert _written(trio) == before  # no table, no vote changed anywhere
    for node in trio.nodes.values():
        peers = {p["node_id"]: p for p in node.status()["peers"]}
        assert all(peers[n]["alive"] for n in "abc"), peers
        assert node.status()["leader"] == "a"


def test_status_and_peers_show_each_members_key_fingerprint(trio):
    prints = {
        n: NodeKey.load(node.state.node_key_file).fingerprint for n, node in trio.nodes.items()
    }
    for node in trio.nodes.values():
        rows = {p["node_id"]: p for p in node.status()["peers"]}
        assert {n: rows[n]["key"] for n in prints} == prints
        assert all(rows[n]["member"] for n in prints)
    table = swarm(trio.nodes["a"], "peers").stdout
    assert "KEY" in table and all(fp in table for fp in prints.values()), table


def test_a_node_id_cannot_be_taken_by_another_key(trio):
    with pytest.raises(RpcError) as info:
        join(trio.endpoint("b"), trio.token, "a", key=NodeKey.generate())
    assert info.value.code == "refused" and "another key" in info.value.detail


def test_remove_revokes_within_a_heartbeat_and_rotate_shuts_the_old_token_out(tmp_path):
    trio = _up(tmp_path, "abcd")
    try:
        a, b, c = (trio.nodes[n] for n in "abc")
        c_key = NodeKey.load(c.state.node_key_file)
        a_key = join(trio.endpoint("a"), trio.token, "probe").key

        c_keys = ClientKeys(public=c_key.public, secret=c_key.secret, server=a_key)
        beat = Heartbeat(node_id="c", term=1, version=1, leader="a")
        with member(trio.endpoint("a"), "", keys=c_keys) as as_c:  # c's connection, open
            as_c.send(beat)
            assert isinstance(as_c.reply(5.0), Heartbeat)
            out = swarm(b, "remove", "c", "--json")  # from a follower: the leader removes it
            done = time.monotonic()
            assert out.returncode == 0, out.stderr
            as_c.send(beat)  # the connection c had: its next message is refused
            with pytest.raises(RpcError) as info:
                as_c.reply(5.0)
            took = time.monotonic() - done
        assert info.value.code == "not_member" and took < HEARTBEAT_S, (info.value, took)
        print(f"\nremoved node refused {took * 1000:.1f} ms after `swarm remove` returned")
        with zmq.Context() as ctx, pytest.raises(RpcTimeout):  # a new one: no handshake
            request_sync(ctx, c_keys, trio.endpoint("a"), beat, 1.0)
        for node in (a, b):
            wait_until(
                lambda n=node: "c" not in n.status()["quorum"]["members"],
                HEARTBEAT_S * 5,
                "c off the members",
            )
            wait_until(
                lambda n=node: all(
                    p["node_id"] != "c" or not p["alive"] for p in n.status()["peers"]
                ),
                HEARTBEAT_S * 5,
                "c forgotten",
            )
        wait_until(lambda: c.status()["removed"], 10, "c to know it was removed")

        # c comes back with its revoked key and the token it holds: refused
        c.stop()
        trio.start("c")
        time.sleep(HEARTBEAT_S * 10)
        assert all(p["node_id"] != "c" or not p["alive"] for p in a.status()["peers"])

        # a new secret for the swarm while d is away; members keep their keys
        old = trio.token
        trio.nodes["d"].stop()
        out = swarm(a, "token", "--rotate")
        assert out.returncode == 0, out.stderr
        new = out.stdout.strip()
        assert new.startswith("swarm1-") and new != old
        for n in "ab":
            wait_until(
                lambda n=n: trio.nodes[n].state.secret_file.read_text().strip() == new,
                10,
                f"{n} holds the new secret",
            )
        # d comes back with the old secret: it finds its peers by their keys and fetches it
        d = trio.start("d")
        wait_until(
            lambda: d.state.secret_file.read_text().strip() == new, 20, "d to fetch the new secret"
        )
        wait_until(
            lambda: any(p["node_id"] == "d" and p["alive"] for p in a.status()["peers"]),
            10,
            "d back",
        )
        # the removed node under a new identity, and a stranger, both with the old token: out
        trio.nodes["c"].stop()
        trio.start("c", fresh_key=True)
        trio.ports["e"] = free_port()
        e = trio.start("e", token=old)
        time.sleep(HEARTBEAT_S * 15)
        for name in ("c", "e"):
            assert all(p["node_id"] != name or not p["alive"] for p in a.status()["peers"]), name
            assert name not in a.status()["quorum"]["members"]
        with pytest.raises(RpcTimeout), zmq.Context() as ctx:
            request_sync(
                ctx,
                SwarmSecret.from_token(old),
                f"tcp://127.0.0.1:{trio.ports['a'] + 2}",
                _probe_join(),
                1.5,
            )
        # the new token joins
        e.stop()
        (e.state.root / "secret").unlink()
        f = trio.start("e", token=new)
        wait_until(
            lambda: "e" in a.status()["quorum"]["members"], 20, "e to join with the new token"
        )
        assert f.status()["swarm_id"] == a.status()["swarm_id"]
    except AssertionError:
        raise AssertionError(dump(list(trio.nodes.values()))) from None
    finally:
        trio.stop()


def _probe_join():
    from swarmp2p.node.cluster.join import NodeJoin

    return NodeJoin(
        node_id="probe2",
        key=NodeKey.generate().public,
        versions=[PROTOCOL_VERSION],
        control_port=9,
        join_port=11,
        addresses=["127.0.0.1"],
    )
