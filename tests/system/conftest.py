"""Network-namespace hosts joined by a Linux bridge, each able to run a real `swarm up`.

Every test gets its own bridge and namespaces with names unique to the run (a random tag),
addresses 10.77.0.x/24 that exist only inside those namespaces, multicast snooping off on
the bridge and a 224.0.0.0/4 route on each host so mDNS works. Teardown stops every daemon,
deletes the namespaces (which deletes their veths) and the bridge. Tests skip, saying why,
when namespaces cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from swarm_harness import NodeProc

SUBNET = "10.77.0"
CONTROL_PORT = 7737


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")


def _cannot_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network-namespace system tests need root (CI runs them as root)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"swp{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as exc:
        return f"cannot create a network namespace here: {exc}"
    _ip("netns", "del", probe)
    return None


class Host:
    """One namespace on the bridge: ``ns``, ``address``; ``swarm_up`` runs a daemon in it."""

    def __init__(self, lab: Lab, index: int) -> None:
        self.lab = lab
        self.ns = f"sw{lab.tag}h{index}"
        self.address = f"{SUBNET}.{index + 1}"
        self.node: NodeProc | None = None

    def swarm_up(
        self, node_id: str, token: str, *extra: str, env=None, hide: Path | None = None
    ) -> NodeProc:
        """A daemon on this host; ``hide``: a folder this host does not have (an empty tmpfs is
        mounted over it in the daemon's own mount namespace), as on a separate machine."""
        args = ["--node-id", node_id, "--name", f"host-{node_id}", "--port", str(CONTROL_PORT)]
        args += [*extra]
        env = {**(env or {}), "SWARM_TOKEN": token}  # in the environment, never in argv
        prefix = ["ip", "netns", "exec", self.ns]
        if hide is not None:
            mount = 'mount -t tmpfs -o size=1m swarm-hidden "$0" && exec "$@"'
            prefix += ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount]
            prefix += [str(hide)]
        self.node = NodeProc(self.lab.tmp_path / node_id, args, prefix=prefix, env=env)
        self.lab.nodes.append(self.node)
        return self.node


class Lab:
    """A bridge plus ``n`` namespace hosts."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.tag = secrets.token_hex(3)
        self.bridge = f"sw{self.tag}br"
        self.hosts: list[Host] = []
        self.nodes: list[NodeProc] = []

    def build(self, n: int) -> list[Host]:
        _ip("link", "add", self.bridge, "type", "bridge", "mcast_snooping", "0")
        _ip("link", "set", self.bridge, "up")
        for i in range(n):
            host = Host(self, i)
            self.hosts.append(host)
            outside, inside = f"sw{self.tag}v{i}", f"sw{self.tag}p{i}"
            _ip("netns", "add", host.ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", host.ns)
            _ip("link", "set", outside, "master", self.bridge, "up")
            _ip("-n", host.ns, "link", "set", inside, "name", "eth0")
            _ip("-n", host.ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.ns, "link", "set", "eth0", "up")
            _ip("-n", host.ns, "link", "set", "lo", "up")
            _ip("-n", host.ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
        return self.hosts

    def cut(self, *indices: int) -> None:
        """Take hosts off the bridge: they reach each other (if several) but no other host."""
        for i in indices:
            _ip("link", "set", f"sw{self.tag}v{i}", "nomaster")

    def heal(self, *indices: int) -> None:
        for i in indices:
            _ip("link", "set", f"sw{self.tag}v{i}", "master", self.bridge, "up")

    def teardown(self) -> None:
        for node in self.nodes:
            node.stop()
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


@pytest.fixture
def netns_lab(tmp_path):
    """A factory: ``netns_lab(n)`` builds ``n`` hosts on a fresh bridge; all torn down after."""
    reason = _cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    lab = Lab(tmp_path)
    try:
        yield lab.build
    finally:
        lab.teardown()


@pytest.fixture
def netns_lab_of(tmp_path):
    """Like ``netns_lab``, but yields the Lab itself (``build``, ``cut``, ``heal``)."""
    reason = _cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    lab = Lab(tmp_path)
    try:
        yield lab
    finally:
        lab.teardown()
