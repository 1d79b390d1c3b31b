"""Joining with a pairing code over mDNS on 127.0.0.1 (issue 14 Build 3): `swarm up` on a
machine with no swarm lists the LAN's swarms; `swarm invite` + `swarm up --code` joins with no
token typed; a bystander's junk tries (from another address) use up only its own tries and the
real joiner still pairs; junk from four addresses burns the invite; `--open` joins an open
swarm with no code."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
from swarm_harness import ROOT, NodeProc, dump, free_port, swarm, swarm_env, wait_until

from swarmp2p.errors import SwarmError
from swarmp2p.net.discovery import browse
from swarmp2p.node.cluster import pairing

pytestmark = pytest.mark.slow


def _up(state, node_id: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "swarmp2p",
        "up",
        "--state-dir",
        str(state),
        "--node-id",
        node_id,
        "--port",
        str(port),
        "--interface",
        "127.0.0.1",
        "--heartbeat",
        "0.2",
        "--failure-timeout",
        "1.5",
        *args,
    ]
    env = swarm_env({"SWARM_DASHBOARD_PORT": "off"})
    return subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=ROOT, input=stdin, timeout=120
    )


def _down(state) -> None:
    subprocess.run(
        [sys.executable, "-m", "swarmp2p", "down", "--state-dir", str(state)],
        capture_output=True,
        env=swarm_env(),
        timeout=60,
    )


def _listed(node, other: str) -> bool:
    return any(p["node_id"] == other and p["alive"] for p in node.status()["peers"])


def _junk(code: str, plate: str, source: str, tries: int) -> list[str]:
    """A bystander at ``source`` (another loopback address) runs the real exchange against the
    advertised invite ``plate`` with a wrong code, ``tries`` times; the errors it got."""

    async def run() -> list[str]:
        seen = await browse(5.0, until=lambda s: bool(pairing._offers(s, plate)))
        offers = pairing._offers(seen, plate)
        assert offers, f"invite {plate} is not advertised"
        endpoint, key, _ = offers[0]
        bound = endpoint.replace("tcp://", f"tcp://{source}:0;", 1)  # source address, any port
        words = "lion-lion-lion" if not code.endswith("lion-lion-lion") else "otter-otter-otter"
        errors = []
        for _ in range(tries):
            with pytest.raises(SwarmError) as got:
                await pairing.exchange(bound, key, f"{plate}-{words}", plate)
            errors.append(str(got.value))
        return errors

    return asyncio.run(run())


def test_a_code_joins_a_new_machine_and_junk_tries_do_not_block_it(tmp_path):
    a = NodeProc(
        tmp_path / "a",
        ["--node-id", "a", "--port", str(free_port()), "--interface", "127.0.0.1", "--new"],
        env={"SWARM_DASHBOARD_PORT": "off"},
    )
    a.start()
    joined = []
    try:
        a.wait_up()
        swarm_id = a.status()["swarm_id"]
        # a machine with no swarm sees this one and says how to join, creating nothing
        seen = _up(tmp_path / "x", "x")
        assert seen.returncode == 2 and swarm_id in seen.stderr and "swarm invite" in seen.stderr
        assert not (tmp_path / "x" / "secret").exists()

        got = json.loads(swarm(a, "invite", "--json").stdout)
        code = got["code"]
        started = time.monotonic()
        out = _up(tmp_path / "b", "b", "--code", "-", stdin=code + "\n")  # not in argv either
        joined.append(tmp_path / "b")
        assert out.returncode == 0, out.stderr + dump([a])
        assert "paired with node a" in out.stdout and "swarm1-" not in out.stdout + out.stderr
        b = NodeProc(tmp_path / "b", [])
        wait_until(lambda: _listed(a, "b") and _listed(b, "a"), 20, "a and b to list each other")
        took = time.monotonic() - started
        assert b.status()["swarm_id"] == swarm_id
        wait_until(lambda: "b" in a.status()["quorum"]["members"], 10, "b to be a member")
        assert took < 15, took

        # a used code is gone
        again = _up(tmp_path / "c", "c", "--code", code)
        assert again.returncode != 0 and "no member on this LAN offers invite" in again.stderr

        # a bystander reads the nameplate from the advert and throws junk at it: it runs out
        # of its own tries, and the real joiner (another address) still pairs with the code
        code = json.loads(swarm(a, "invite", "--json").stdout)["code"]
        plate, words = code.split("-", 1)
        errors = _junk(code, plate, "127.0.0.2", pairing.MAX_TRIES + 1)
        for error, left in zip(errors, ("2 tries left", "1 tries left", "no tries left")):
            assert "does not match" in error and left in error, errors
        assert "127.0.0.2) used its 3 tries" in errors[-1], errors
        wrong = f"{plate}-" + (
            "lion-lion-lion" if words != "lion-lion-lion" else "otter-otter-otter"
        )
        typo = _up(tmp_path / "c", "c", "--code", wrong)  # the joiner's own typo: its own tries
        assert typo.returncode == 2 and "2 tries left" in typo.stderr, typo.stderr
        assert not (tmp_path / "c" / "secret").exists()
        out = _up(tmp_path / "c", "c", "--code", code)
        joined.append(tmp_path / "c")
        assert out.returncode == 0 and "paired with node a" in out.stdout, out.stderr + dump([a])
        wait_until(lambda: "c" in a.status()["quorum"]["members"], 20, "c to be a member")

        # junk from MAX_GUESSES / MAX_TRIES addresses burns an invite: the right code fails
        code = json.loads(swarm(a, "invite", "--json").stdout)["code"]
        plate = code.split("-", 1)[0]
        for i in range(pairing.MAX_GUESSES // pairing.MAX_TRIES):
            _junk(code, plate, f"127.0.0.{3 + i}", pairing.MAX_TRIES)
        late = _up(tmp_path / "d", "d", "--code", code)
        assert late.returncode != 0 and not (tmp_path / "d" / "secret").exists(), late.stderr
        assert "d" not in a.status()["quorum"]["members"]
    finally:
        for state in joined:
            _down(state)
        a.stop()


def test_open_swarm_joins_without_a_code(tmp_path):
    first = _up(tmp_path / "o1", "o1", "--open")
    states = [tmp_path / "o1"]
    try:
        assert first.returncode == 0 and "created a new swarm" in first.stdout, first.stderr
        second = _up(tmp_path / "o2", "o2", "--open")
        states.append(tmp_path / "o2")
        assert second.returncode == 0 and "paired with node o1" in second.stdout, second.stderr
        o1 = NodeProc(tmp_path / "o1", [])
        wait_until(lambda: _listed(o1, "o2"), 20, "o1 to list o2")
    finally:
        for state in states:
            _down(state)
