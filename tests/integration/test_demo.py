"""`swarm demo` end to end: three real daemons train, evaluate, serve and generate; Ctrl-C
stops everything it started."""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"
STATE_LINE = re.compile(r"state under (\S+)\)")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "160"
    return env


def _demo_processes(root: str) -> list[str]:
    """Command lines of live processes of the demo under ``root``."""
    from swarmp2p.demo import marked_processes

    return [cmd for _, cmd in marked_processes(root)]


def _wait_gone(root: str, timeout: float = 15.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := _demo_processes(root)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _kill_demo(root: str) -> None:
    """SIGKILL whatever the demo left running (only after a failed assertion)."""
    from swarmp2p.demo import MARK_ENV

    mark = f"{MARK_ENV}={root}".encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if mark in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc.name), signal.SIGKILL)
            except OSError:
                continue


def _eval_rows(text: str) -> dict[str, list[float]]:
    """pass -> [loss, perplexity, top-1] from the printed evaluation table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if len(cells) == 5 and cells[0] in ("base", "trained"):
            rows[cells[0]] = [float(c) for c in cells[1:4]]
    return rows


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(600)
def test_demo_trains_evaluates_serves_and_generates_and_keep_leaves_it_serving():
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "swarmp2p", "demo", "--steps", "2", "--keep"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=600,
    )
    text = out.stdout + out.stderr
    root = STATE_LINE.search(text).group(1)
    try:
        assert out.returncode == 0, text
        assert re.search(r"swarm up: demo-1 :\d+, demo-2 :\d+, demo-3 :\d+; leader demo-1", text)
        assert "COMPLETED" in out.stdout, text
        split = r"demo-1 layers 0-(\d+), demo-2 layers (\d+)-(\d+), demo-3 layers (\d+)-29"
        trained = re.search(r"stages: (.*)", out.stdout).group(1)
        assert re.fullmatch(split, trained), trained
        served = re.search(r"serving at (http://127\.0\.0\.1:\d+)/v1: (.*)", out.stdout)
        assert served and re.fullmatch(split, served.group(2)), out.stdout
        rows = _eval_rows(out.stdout)
        assert set(rows) == {"base", "trained"}, out.stdout
        for loss, ppl, top1 in rows.values():
            assert 0 < loss < 10 and math.isclose(ppl, math.exp(loss), rel_tol=1e-3)
            assert 0 <= top1 <= 1
        # the embedded model on its own corpus: far below a random model's ln(49152) = 10.8
        assert rows["base"][0] < 6, rows
        assert "generation:\n" in out.stdout, out.stdout
        generation = out.stdout.split("generation:\n", 1)[1].rstrip("\n")
        assert generation.startswith(PROMPT) and len(generation) > len(PROMPT), generation
        # greedy, and two LoRA steps barely move a 135M model
        assert "Paris" in generation.splitlines()[0], generation

        # --keep: the demo has exited, its three daemons still serve the model
        assert Path(root).is_dir()
        argv = ["generate", "demo", PROMPT, "--url", served.group(1), "--temperature", "0"]
        again = subprocess.run(
            [sys.executable, "-m", "swarmp2p", *argv, "--max-tokens", "12"],
            capture_output=True,
            text=True,
            env=_env(),
            cwd=ROOT,
            timeout=120,
        )
        assert again.returncode == 0, again.stderr
        assert PROMPT + again.stdout.rstrip("\n") == generation, (again.stdout, generation)
        stops = re.findall(r"^\s+(swarm down --state-dir \S+)$", out.stderr, re.M)
        assert len(stops) == 3, out.stderr
        for cmd in stops:
            down = subprocess.run(
                [sys.executable, "-m", "swarmp2p", *cmd.split()[1:]],
                capture_output=True,
                text=True,
                env=_env(),
                timeout=60,
            )
            assert down.returncode == 0, down.stderr
        assert _wait_gone(root) == [], "`swarm down` left processes of the demo behind"
    finally:
        _kill_demo(root)
        shutil.rmtree(root, ignore_errors=True)
    print(f"demo --steps 2 took {time.monotonic() - started:.0f} s")


@pytest.mark.slow
@pytest.mark.torch
def test_ctrl_c_while_training_stops_every_daemon_and_worker_and_removes_the_state():
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmp2p", "demo", "--steps", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    lines, root = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if root is None and (m := STATE_LINE.search(line)):
                root = m.group(1)
            if "fine-tuning" in line:
                break
        assert root, "".join(lines)
        # the stage workers are up (3 daemons + 3 workers), then Ctrl-C
        deadline = time.monotonic() + 120
        while len(_demo_processes(root)) < 6:
            assert time.monotonic() < deadline, f"no workers: {_demo_processes(root)}"
            assert proc.poll() is None, "".join(lines) + proc.stdout.read()
            time.sleep(0.2)
        assert any("swarmp2p.runtime.worker" in c for c in _demo_processes(root))
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = "".join(lines) + rest
    try:
        assert proc.returncode == 130, text
        assert "interrupted while training; stopping the swarm" in text, text
        assert _wait_gone(root) == [], "daemons or workers outlived Ctrl-C"
        assert not Path(root).exists()
    finally:
        _kill_demo(root)


@pytest.mark.slow
def test_a_daemon_that_dies_interrupts_the_demo_naming_it_and_close_leaves_nothing(tmp_path):
    from swarmp2p import demo

    swarm = demo.LocalSwarm(nodes=3, root=tmp_path / "swarm", env=_env())
    try:
        swarm.start()
        assert swarm.status(swarm.leader)["leader"] == "demo-1"
        swarm.watch(interval=0.1)
        victim = swarm.procs[1]
        victim.send_signal(signal.SIGKILL)
        with pytest.raises(KeyboardInterrupt):  # the watcher interrupts a wait of the demo
            time.sleep(30)
        assert isinstance(swarm.failure, demo.DemoError)
        assert "daemon demo-2 exited with code -9" in str(swarm.failure)
        with pytest.raises(demo.DemoError, match=r"daemon demo-2 exited with code -9") as err:
            swarm.check("training")
        assert "demo-2.out" in str(err.value)  # where to look
    finally:
        swarm.close()
    assert swarm.procs == []
    assert not (tmp_path / "swarm").exists()
    assert _wait_gone(str(tmp_path / "swarm")) == []
