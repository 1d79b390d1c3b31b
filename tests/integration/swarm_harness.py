"""Real `swarm up --foreground` daemons as processes, for integration and system tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from swarmp2p.node import api
from swarmp2p.node.state import StateDir

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT_S = 0.2
FAILURE_TIMEOUT_S = 1.5


def free_port() -> int:
    """A free TCP port whose port + 2 is free too: a daemon's join port is its control port
    + 2 (``swarmp2p.node.cluster.join.JOIN_PORT_OFFSET``)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65534:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 2))
            except OSError:
                continue
        return port


def wait_until(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05
) -> Any:
    """Poll ``predicate`` until truthy; its value. AssertionError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
        except (api.ApiError, OSError, ValueError) as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what}; last: {last!r}"
            )
        time.sleep(interval)


def swarm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a daemon or the CLI: no SWARM_ variable of ours, the
    checkout importable, and no speed probe (seconds of busy CPU per daemon on a shared box,
    measuring each other; a test about speeds passes ``SWARM_SPEED_PROBE=on``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["SWARM_SPEED_PROBE"] = "off"
    env.update(extra or {})
    return env


def swarm(node, *args: str, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """The `swarm` CLI against ``node``'s daemon (over its unix socket), output captured; on
    the node's own host when it runs on one (a system test's ``HostNode.cli``)."""
    on_host = getattr(node, "cli", None)
    if on_host is not None:
        return on_host(*args, timeout=timeout, cwd=None if cwd == ROOT else cwd)
    return subprocess.run(
        [sys.executable, "-m", "swarmp2p", *args, "--state-dir", str(node.state.root)],
        capture_output=True,
        text=True,
        env=swarm_env(),
        cwd=cwd,
        timeout=timeout,
    )


def worker_pids(node, module: str = "swarmp2p.runtime.worker") -> set[int]:
    """Pids of the live (not zombie) processes running ``module`` whose parent is ``node``'s
    daemon: its training stage workers, or with ``swarmp2p.runtime.serve_worker`` its serve
    workers."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == node.proc.pid and fields[0] != "Z" and module.encode() in argv:
            pids.add(int(stat.parent.name))
    return pids


def tiny_llama(
    folder: Path,
    *,
    vocab: int = 128,
    layers: int = 4,
    max_positions: int = 64,
    tied: bool = False,
    shard_size: str = "40KB",
    hidden: int = 32,
    **config: Any,
) -> Path:
    """A random tiny Llama (hidden 32 unless told) saved in ``folder`` in several safetensors
    shards."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    llama = tf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        **config,
    )
    model = tf.AutoModelForCausalLM.from_config(llama, attn_implementation="sdpa").float()
    model.save_pretrained(folder, max_shard_size=shard_size)
    return folder


class NodeProc:
    """One daemon: ``swarm up --foreground`` with its own state dir, optionally in a netns."""

    def __init__(
        self,
        state_dir: Path,
        args: Sequence[str],
        *,
        prefix: Sequence[str] = (),
        env: dict[str, str] | None = None,
        heartbeat_s: float = HEARTBEAT_S,
        failure_timeout_s: float = FAILURE_TIMEOUT_S,
    ) -> None:
        self.state = StateDir(root=state_dir)
        self.args = [
            *args,
            "--heartbeat",
            str(heartbeat_s),
            "--failure-timeout",
            str(failure_timeout_s),
        ]
        self.prefix = list(prefix)
        self.env = swarm_env(env)
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.log_path = state_dir.parent / f"{state_dir.name}.out"

    def start(self) -> NodeProc:
        self.state.root.mkdir(parents=True, exist_ok=True)
        cmd = [*self.prefix, sys.executable, "-m", "swarmp2p", "up", "--foreground"]
        cmd += ["--state-dir", str(self.state.root), *self.args]
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT
            )
        self.started_at = time.monotonic()
        return self

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        return api.request(self.state.api_socket, "status", timeout=timeout)

    def submit(self, record: dict, job_id: str = "") -> dict[str, Any]:
        from swarmp2p.client.jobs import submit_job

        return submit_job(self.state.root, record, job_id)

    def wait_up(self, timeout: float = 30.0) -> dict[str, Any]:
        return wait_until(self._up, timeout, f"daemon {self.state.root.name} to answer")

    def _up(self) -> dict[str, Any] | None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
        return self.status()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.running():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM and wait (SIGKILL past ``timeout``); the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def log(self) -> str:
        try:
            return self.log_path.read_text()
        except FileNotFoundError:
            return ""


def leaders(nodes: Sequence[NodeProc]) -> dict[str, str]:
    """node id -> the leader it names, for every node that answers."""
    out = {}
    for node in nodes:
        s = node.status()
        out[s["node_id"]] = s["leader"]
    return out


def agreed_on(nodes: Sequence[NodeProc], leader: str, count: int) -> bool:
    """Every node sees ``count`` live nodes and names ``leader``."""
    for node in nodes:
        s = node.status()
        if s["leader"] != leader or sum(p["alive"] for p in s["peers"]) != count:
            return False
    return True


def dump(nodes: Sequence[NodeProc]) -> str:
    parts = []
    for node in nodes:
        try:
            parts.append(json.dumps(node.status(2.0), indent=1)[:3000])
        except Exception as exc:
            parts.append(f"{node.state.root.name}: {exc}")
        parts.append(node.log()[-3000:])
    return "\n".join(parts)


def direct_plan(
    folder: Path | str,
    job: dict[str, Any] | None = None,
    *,
    cuts: Sequence[int] | None = None,
    stages: int | None = None,
    dtype: str | None = None,
):
    """(Job, Plan) for driving stage workers directly on this machine: ``job`` is job.json
    (``model.pretrained`` defaults to ``folder``, data to random tokens), planned over local
    stages with the given cuts. The same records the daemon builds, so a worker test runs
    what ``swarm train`` runs."""
    from swarmp2p.plan import load_model_shape, parse_job
    from swarmp2p.plan.worker_spec import local_plan

    data = json.loads(json.dumps(job or {}))
    data.setdefault("model", {}).setdefault("pretrained", str(folder))
    data.setdefault("data", {}).setdefault("source", "random")
    parsed = parse_job(data)
    plan = local_plan(parsed, load_model_shape(str(folder)), stages=stages, cuts=cuts, dtype=dtype)
    return parsed, plan


def direct_spec(job, plan, stage: int, *, token: str, next_port: int | None = None, **local):
    """One stage's worker spec (JSON-able) of a ``direct_plan``; ``next_port``: the bound port
    of the next stage on 127.0.0.1."""
    from swarmp2p.plan.worker_spec import worker_spec

    endpoint = f"tcp://127.0.0.1:{next_port}" if next_port is not None else None
    spec = worker_spec(job, plan, stage, token=token, next_endpoint=endpoint, **local)
    return spec.to_dict()
