"""Joining with pairing codes across network-namespace hosts (issue 14 Build 3, issue 15):
three hosts join with codes and no token typed; three wrong codes lock a host out of an
invite; an eavesdropper on the inviter's bridge port sees neither the token nor the code, and
replaying every byte stream it saw joins nothing."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
from swarm_harness import ROOT, NodeProc, dump, swarm, swarm_env, wait_until

pytestmark = [pytest.mark.system, pytest.mark.slow]

PORT = 7737
CODE_JOIN_TARGET_S = 3.0
"""Issue 14: `swarm up --code` to listed in every peer's status, on the bridge."""


class Sniffer:
    """Every TCP payload crossing one interface (an AF_PACKET socket in the root namespace,
    on the inviter's port of the bridge): the eavesdropper."""

    def __init__(self, interface: str) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
        self.sock.bind((interface, 0))
        self.sock.settimeout(0.2)
        self.segments: list[tuple[tuple[str, int, str, int], int, bytes]] = []
        self.clients: set[tuple[str, int, str, int]] = set()
        """Flows whose first SYN (no ACK) came from their source: client to server."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame = self.sock.recv(65536)
            except TimeoutError:
                continue
            if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[23] != 6:  # IPv4, TCP
                continue
            ihl = (frame[14] & 0x0F) * 4
            total = struct.unpack("!H", frame[16:18])[0]
            src, dst = socket.inet_ntoa(frame[26:30]), socket.inet_ntoa(frame[30:34])
            tcp = 14 + ihl
            sport, dport, seq = struct.unpack("!HHI", frame[tcp : tcp + 8])
            offset = (frame[tcp + 12] >> 4) * 4
            if frame[tcp + 13] & 0x12 == 0x02:  # SYN without ACK: a client connects
                self.clients.add((src, sport, dst, dport))
            payload = frame[tcp + offset : 14 + total]
            if payload:
                self.segments.append(((src, sport, dst, dport), seq, bytes(payload)))

    def stop(self) -> dict[tuple[str, int, str, int], bytes]:
        """Each flow's bytes in sequence order (retransmissions dropped)."""
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        flows: dict[tuple[str, int, str, int], dict[int, bytes]] = {}
        for flow, seq, payload in self.segments:
            flows.setdefault(flow, {})[seq] = payload
        return {f: b"".join(p for _, p in sorted(s.items())) for f, s in flows.items()}


def _daemon(lab, host, node_id: str, *args: str) -> NodeProc:
    """A daemon in ``host``'s namespace (no token: ``args`` say how it joins)."""
    argv = [
        "--node-id",
        node_id,
        "--name",
        f"host-{node_id}",
        "--port",
        str(PORT),
        "--interface",
        host.address,
        *args,
    ]
    node = NodeProc(
        lab.tmp_path / node_id,
        argv,
        prefix=["ip", "netns", "exec", host.ns],
        env={"SWARM_DASHBOARD_PORT": "off"},
    )
    lab.nodes.append(node)
    return node


def _up_once(host, state, code: str) -> subprocess.CompletedProcess:
    """`swarm up --code` on ``host`` that is expected to fail (and write nothing)."""
    cmd = [
        "ip",
        "netns",
        "exec",
        host.ns,
        sys.executable,
        "-m",
        "swarmp2p",
        "up",
        "--code",
        code,
        "--state-dir",
        str(state),
        "--port",
        "7747",
        "--interface",
        host.address,
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, env=swarm_env(), cwd=ROOT, timeout=60
    )


def _listed_everywhere(nodes, ids) -> bool:
    for node in nodes:
        live = {p["node_id"] for p in node.status()["peers"] if p["alive"]}
        if not set(ids) <= live:
            return False
    return True


def _replay(host, flows, clients) -> None:
    """Send each captured client-to-server byte stream again, from ``host``'s namespace."""
    script = (
        "import socket, sys, json, time\n"
        "for dst, port, data in json.loads(sys.stdin.read()):\n"
        "    try:\n"
        "        s = socket.create_connection((dst, port), timeout=3)\n"
        "    except OSError:\n"
        "        continue\n"
        "    s.sendall(bytes.fromhex(data))\n"
        "    end = time.monotonic() + 1.0\n"
        "    s.settimeout(0.2)\n"
        "    while time.monotonic() < end:\n"
        "        try:\n"
        "            if not s.recv(65536): break\n"
        "        except OSError: pass\n"
        "    s.close()\n"
    )
    todo = [[f[2], f[3], data.hex()] for f, data in flows.items() if f in clients]
    assert todo, "the eavesdropper saw no connection to replay"
    subprocess.run(
        ["ip", "netns", "exec", host.ns, sys.executable, "-c", script],
        input=json.dumps(todo),
        text=True,
        timeout=120,
        check=True,
    )


@pytest.mark.alone  # it times the joins (2x a quiet box's 3 s); beside two busy xdist workers a
# joiner's hello could time out after its join and the third host waited past 20 s for the table
def test_three_hosts_join_with_codes_and_an_eavesdropper_learns_nothing_that_joins(netns_lab_of):
    lab = netns_lab_of
    hosts = lab.build(4)
    h1 = _daemon(lab, hosts[0], "h1", "--new").start()
    try:
        h1.wait_up()
        wait_until(lambda: h1.status()["leader_ready"], 20, "h1 to found its swarm")
        sniffer = Sniffer(f"sw{lab.tag}v0")
        joined, codes, took = [h1], [], []
        for i, node_id in ((1, "h2"), (2, "h3")):
            code = json.loads(swarm(h1, "invite", "--json").stdout)["code"]
            codes.append(code)
            node = _daemon(lab, hosts[i], node_id, "--code", code).start()
            joined.append(node)
            wait_until(
                lambda: _listed_everywhere(joined, [n.state.root.name for n in joined]),
                20,
                f"{node_id} listed everywhere",
                interval=0.02,
            )
            took.append(time.monotonic() - node.started_at)
        ids = ["h1", "h2", "h3"]
        wait_until(
            lambda: all(sorted(n.status()["quorum"]["members"]) == ids for n in joined),
            20,
            "three members",
        )
        token = h1.state.secret_file.read_text().strip()
        assert all(n.state.secret_file.read_text().strip() == token for n in joined)
        print(f"\ncode joins on the bridge: {', '.join(f'{t:.2f} s' for t in took)}")

        # three wrong codes lock that host out of the invite: the right one fails after them
        code = json.loads(swarm(h1, "invite", "--json").stdout)["code"]
        plate = code.split("-")[0]
        wrong = (
            f"{plate}-lion-lion-lion"
            if not code.endswith("lion-lion-lion")
            else f"{plate}-otter-otter-otter"
        )
        spare = lab.tmp_path / "spare"
        for _ in range(3):
            out = _up_once(hosts[3], spare, wrong)
            assert out.returncode == 2 and "does not match" in out.stderr, out.stderr
            time.sleep(1.0)
        out = _up_once(hosts[3], spare, code)
        assert out.returncode != 0 and not (spare / "secret").exists(), out.stderr

        flows = sniffer.stop()
        clients = sniffer.clients
        seen = b"".join(flows.values())
        assert seen, "the eavesdropper saw nothing"
        for secret in (token, *codes, code):
            for form in (
                secret.encode(),
                secret.upper().encode(),
                secret.replace("-", " ").encode(),
            ):
                assert form not in seen, f"{secret[:12]}... crossed the bridge in the clear"
        before = {n.state.root.name: sorted(n.status()["quorum"]["members"]) for n in joined}
        log_before = len(h1.log())
        _replay(hosts[3], flows, clients)
        time.sleep(2.0)
        for n in joined:
            assert sorted(n.status()["quorum"]["members"]) == before[n.state.root.name] == ids
            assert {p["node_id"] for p in n.status()["peers"]} == set(ids)
        assert "paired with invite" not in h1.log()[log_before:]
        assert max(took) <= 2 * CODE_JOIN_TARGET_S, (
            took
        )  # slack for a loaded box; see bench/join.py
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump(lab.nodes)}") from None
