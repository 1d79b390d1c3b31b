"""Separate machines for system tests: network-namespace hosts joined by a Linux bridge, each
with its own disk.

Every test gets its own bridge and namespaces with names unique to the run (a random tag),
addresses 10.77.0.x/24 that exist only inside those namespaces, multicast snooping off on
the bridge and a 224.0.0.0/4 route on each host so mDNS works.

Each host also has its own mount namespace, held by a sleeping process, that every command
run on the host enters (``nsenter``): a private /tmp, /var/tmp and /dev/shm, a private HOME
(``/home/swarm``: XDG state, cache and config, the Hugging Face cache, the embedded model, the
daemon's state dir all live there by default), the real home's caches and configs hidden, and
the project (this checkout with its virtualenv) shared read-only. Nothing passes from one host
to another through the filesystem: a model folder or a data file a test puts on one host
exists only there. From outside, the test reads a host's disk under ``host.root``
(``host.outside(path)`` maps a path on the host to it).

``ip netns exec`` gives each host a fresh /sys (its network's), without the machine's cgroup
hierarchies: they are mounted again there, read-only, as a container sees its own, so a daemon
on a host reads the CPU quota it runs under (``tests/integration/cpu_quota.py``).

Teardown stops every daemon and holder, deletes the namespaces (which deletes their veths),
the bridge and the hosts' disks. Tests skip, saying why, when namespaces cannot be made (not
root, no `ip`, `unshare` or `nsenter`): ``conftest.py`` has the fixtures.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from swarm_harness import ROOT, NodeProc, swarm_env

SUBNET = "10.77.0"
CONTROL_PORT = 7737
HOME = "/home/swarm"
"""Each host's HOME (a tmpfs is mounted over /home there, so the real /home is hidden too)."""
STATE = f"{HOME}/.local/state/swarmp2p"
"""The daemon's state dir on each host: the default under its HOME."""
CONFIG_ONLY = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
"""A model's config without weights: enough to plan a job that never runs (its shape)."""
CGROUP_ROOT = Path("/sys/fs/cgroup")
HOST_ENV_DROP = ("SWARM_", "HF_", "XDG_", "TRANSFORMERS_", "TORCH_HOME", "TMPDIR", "HUGGINGFACE")
"""Variables of this process that would point a host at a shared folder (or a test's token)."""
MOUNT_SCRIPT = r"""
set -e
mount -t tmpfs -o mode=0755,size=64m swarm-home /home
mkdir -p /home/swarm
mount --bind "$SWARM_HOST_DISK/home" /home/swarm
for d in $SWARM_HIDE; do
  if [ -d "$d" ]; then mount -t tmpfs -o mode=0700,size=1m swarm-hidden "$d"; fi
done
cgroups() {
  case " $SWARM_CGROUPS " in
    *" .="*) ;;
    *) mount -t tmpfs -o mode=0755,size=1m swarm-cgroup /sys/fs/cgroup ;;
  esac
  for m in $SWARM_CGROUPS; do
    dir=${m%%=*}; rest=${m#*=}; kind=${rest%%:*}; opts=${rest#*:}
    mkdir -p "/sys/fs/cgroup/$dir" && mount -t "$kind" -o "$opts" "$kind" "/sys/fs/cgroup/$dir"
  done
}
if [ -n "$SWARM_CGROUPS" ]; then cgroups || echo "cgroups not all mounted" >&2; fi
mount --bind "$SWARM_PROJECT" "$SWARM_PROJECT"
mount -o remount,bind,ro "$SWARM_PROJECT"
mount -t tmpfs -o mode=1777 swarm-shm /dev/shm
mount -t tmpfs -o mode=1777 swarm-var-tmp /var/tmp
mount --bind "$SWARM_HOST_DISK/tmp" /tmp
echo ready
exec sleep 2147483647
"""
"""Run in the host's new mount namespace; /tmp last, since the host's disk lives under it."""


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")


def cannot_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network-namespace system tests need root (CI runs them as root)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` ({package}) is not installed"
    probe = f"swp{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as exc:
        return f"cannot create a network namespace here: {exc}"
    _ip("netns", "del", probe)
    return None


def _hidden_folders() -> list[str]:
    """The real home's caches, configs and state (and any HF/XDG folder the environment names),
    hidden on every host; never one that holds this interpreter or the project."""
    home = Path.home()
    found = [home / ".cache", home / ".config", home / ".local" / "state", home / ".huggingface"]
    for var in ("HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME"):
        if os.environ.get(var):
            found.append(Path(os.environ[var]))
    keep = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.executable, ROOT)]
    keep.append(Path(os.path.realpath(sys.executable)))
    out = []
    for folder in found:
        real = folder.resolve()
        if any(k == real or real in k.parents for k in keep) or " " in str(real):
            continue
        out.append(str(real))
    return out


def _cgroup_mounts() -> str:
    """The machine's cgroup hierarchies under /sys/fs/cgroup as ``folder=type:options`` words
    for MOUNT_SCRIPT (``.``: cgroup v2 mounted there itself): read-only, a v1 one with just its
    controllers and name, which is what mounting it again (the same hierarchy) needs."""
    try:
        table = Path("/proc/cgroups").read_text().splitlines()[1:]
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    controllers = {line.split()[0] for line in table if line.strip()}
    words = []
    for line in mounts:
        _, where, kind, options = line.split()[:4]
        folder = Path(where)
        if kind not in ("cgroup", "cgroup2") or " " in where or "=" in folder.name:
            continue
        if folder == CGROUP_ROOT and kind == "cgroup2":
            words.append(".=cgroup2:ro")
        elif folder.parent == CGROUP_ROOT:
            keep = [o for o in options.split(",") if o in controllers or o.startswith("name=")]
            words.append(f"{folder.name}={kind}:{','.join(['ro', *keep])}")
    return " ".join(words)


class HostNode(NodeProc):
    """A daemon on a host: its state dir is the host's default one (``STATE``), read from
    outside through the host's disk; ``cli`` runs the `swarm` CLI on the host."""

    def __init__(self, host: Host, node_id: str, args: Sequence[str], env: dict[str, str]) -> None:
        super().__init__(host.outside(STATE), args, prefix=host.enter())
        self.env = host.env(env)
        self.host = host
        self.node_id = node_id
        self.log_path = host.root / f"daemon-{node_id}.out"

    def start(self) -> HostNode:
        import time

        self.state.root.mkdir(parents=True, exist_ok=True)
        cmd = [*self.prefix, sys.executable, "-m", "swarmp2p", "up", "--foreground"]
        cmd += ["--state-dir", STATE, *self.args]
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.started_at = time.monotonic()
        return self

    def cli(
        self, *args: str, timeout: float = 300, cwd: str | Path | None = None
    ) -> subprocess.CompletedProcess:
        """The `swarm` CLI on this host against this daemon (cwd: a folder on the host)."""
        return self.host.run(
            [sys.executable, "-m", "swarmp2p", *args, "--state-dir", STATE],
            cwd=cwd,
            timeout=timeout,
        )


class Host:
    """One machine: a network namespace on the bridge (``ns``, ``address``) and its own disk
    (``root`` from outside). ``swarm_up`` runs a daemon on it, ``run``/``popen`` anything."""

    def __init__(self, lab: Lab, index: int) -> None:
        self.lab = lab
        self.index = index
        self.ns = f"sw{lab.tag}h{index}"
        self.address = f"{SUBNET}.{index + 1}"
        self.root = lab.disks / f"h{index}"
        self.node: HostNode | None = None
        self.holder: subprocess.Popen | None = None

    # --- the host's disk ----------------------------------------------------------------------

    def start(self) -> None:
        """Make the host's mount namespace (held by a sleeping process) over its disk."""
        for sub in ("home", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "tmp").chmod(0o1777)
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "SWARM_HOST_DISK": str(self.root),
            "SWARM_HIDE": " ".join(_hidden_folders()),
            "SWARM_PROJECT": str(ROOT),
            "SWARM_CGROUPS": _cgroup_mounts(),
        }
        cmd = ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--propagation", "private"]
        self.holder = subprocess.Popen(
            [*cmd, "sh", "-c", MOUNT_SCRIPT],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.holder.stdout.readline().strip()
        if line != "ready":
            self.holder.kill()
            _, err = self.holder.communicate(timeout=10)
            raise RuntimeError(f"host {self.ns}: its mount namespace failed: {err.strip()}")

    def outside(self, path: str | Path) -> Path:
        """Where a path on this host is on the test's filesystem (its HOME or /tmp only)."""
        path = Path(path)
        for inside, sub in ((Path(HOME), "home"), (Path("/tmp"), "tmp")):
            if path == inside or inside in path.parents:
                return self.root / sub / path.relative_to(inside)
        raise ValueError(f"{path} is not on host {self.index}'s own disk (its HOME or /tmp)")

    def put(self, source: Path, dest: str) -> str:
        """Copy a file or folder of the test's filesystem to ``dest`` on this host only."""
        target = self.outside(dest)
        target.parent.mkdir(parents=True, exist_ok=True)
        if Path(source).is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
        return dest

    def config_only_model(self, dest: str = f"{HOME}/models/config-only") -> str:
        """A model folder holding only a config.json, on this host: it plans, it never runs."""
        import json

        self.write(f"{dest}/config.json", json.dumps(CONFIG_ONLY))
        return dest

    def write(self, dest: str, text: str) -> str:
        """A text file at ``dest`` on this host only."""
        target = self.outside(dest)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        return dest

    # --- running things on the host -----------------------------------------------------------

    def enter(self, cwd: str | Path | None = None) -> list[str]:
        """The command prefix that runs a program on this host (its network and its disk)."""
        assert self.holder is not None, "host not started"
        pid = self.holder.pid
        # nsenter opens --wd before it enters: name the folder through the holder's root
        wd = f"/proc/{pid}/root{cwd or HOME}"
        return ["nsenter", f"--target={pid}", "--mount", "--net", f"--wd={wd}", "--"]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment less what points at shared folders, HOME on the host."""
        env = {k: v for k, v in swarm_env().items() if not k.startswith(HOST_ENV_DROP)}
        env["HOME"] = HOME
        env["SWARM_SPEED_PROBE"] = "off"  # as swarm_env: a test about speeds turns it on
        env.update(extra or {})
        return env

    def run(
        self,
        argv: Sequence[str],
        *,
        cwd: str | Path | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self.enter(cwd), *argv],
            capture_output=True,
            text=True,
            env=self.env(env),
            timeout=timeout,
        )

    def popen(self, argv: Sequence[str], *, cwd: str | Path | None = None, **kw: Any):
        return subprocess.Popen([*self.enter(cwd), *argv], env=self.env(kw.pop("env", None)), **kw)

    def swarm_up(self, node_id: str, token: str, *extra: str, env=None) -> HostNode:
        """A daemon on this host (not started: ``.start()``)."""
        args = ["--node-id", node_id, "--name", f"host-{node_id}", "--port", str(CONTROL_PORT)]
        args += [*extra]
        env = {**(env or {}), "SWARM_TOKEN": token}  # in the environment, never in argv
        self.node = HostNode(self, node_id, args, env)
        self.lab.nodes.append(self.node)
        return self.node

    def stop(self) -> None:
        if self.holder is not None and self.holder.poll() is None:
            self.holder.send_signal(signal.SIGKILL)
            self.holder.communicate(timeout=10)


class Lab:
    """A bridge plus ``n`` hosts, each with its own network and its own disk."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.tag = secrets.token_hex(3)
        self.bridge = f"sw{self.tag}br"
        # short: a daemon's unix socket path (on a host's disk) must stay under 108 bytes
        self.disks = Path(tempfile.mkdtemp(prefix="swh", dir="/tmp"))
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
            host.start()
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
            host.stop()
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        shutil.rmtree(self.disks, ignore_errors=True)


def start_swarm(hosts: Sequence[Host], env: dict[str, str] | None = None) -> list[HostNode]:
    """A daemon on each host (node ids a, b, c, ...; one new swarm's token), started; once
    they agree that a leads and its table is ready (else AssertionError with their logs)."""
    from swarm_harness import agreed_on, dump, wait_until

    from swarmp2p.net.security import SwarmSecret

    token = SwarmSecret.generate().token
    nodes = [h.swarm_up(chr(ord("a") + i), token, env=env) for i, h in enumerate(hosts)]
    for node in nodes:
        node.start()
    try:
        wait_until(lambda: agreed_on(nodes, "a", len(nodes)), 30, "the hosts to agree")
        wait_until(lambda: nodes[0].status()["leader_ready"], 15, "the leader to be ready")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump(nodes)}") from None
    return nodes
