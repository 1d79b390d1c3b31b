"""An mDNS removal is not trusted alone: it only triggers a heartbeat (two daemons in-process)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from swarm_harness import free_port

from swarmp2p.net.security import SwarmSecret
from swarmp2p.node.config import NodeConfig
from swarmp2p.node.daemon import Daemon
from swarmp2p.timings import Timings

SECRET = SwarmSecret.generate()


def _daemon(tmp_path, node_id: str, ports: dict[str, int]) -> Daemon:
    peers = tuple(f"127.0.0.1:{p}" for n, p in ports.items() if n != node_id)
    config = NodeConfig(
        state_dir=tmp_path / node_id,
        node_id=node_id,
        port=ports[node_id],
        interface="127.0.0.1",
        peers=peers,
        mdns=False,
        # long: only the confirmed mDNS removal can make b dead soon
        timings=Timings(heartbeat_s=0.1, failure_timeout_s=30.0),
    )
    return Daemon(config, SECRET, env={})


async def _until(predicate, timeout: float) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "timed out"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def test_mdns_removal_is_confirmed_by_a_heartbeat(tmp_path):
    async def scenario() -> None:
        ports = {"a": free_port(), "b": free_port()}
        a, b = _daemon(tmp_path, "a", ports), _daemon(tmp_path, "b", ports)
        runs = [asyncio.ensure_future(d.run()) for d in (a, b)]
        try:
            await _until(lambda: "b" in a.ctx.members.peers and "a" in b.ctx.members.peers, 10)
            # a forged or mistaken goodbye: b still answers its heartbeat, so it stays
            a.heartbeats.on_mdns_remove("b")
            await asyncio.sleep(0.5)
            assert a.ctx.members.peers["b"].alive

            # b crashes (its sockets close, no leave is sent); the goodbye is now confirmed
            b.ctx.members.peers.clear()
            b.stop()
            await runs[1]
            a.heartbeats.on_mdns_remove("b")
            took = await _until(lambda: not a.ctx.members.peers["b"].alive, 5)
            assert took < 2.0  # far below the 30 s failure timeout
            assert a.status()["leader"] == "a"
        finally:
            for d in (a, b):
                d.stop()
            for run in runs:
                with contextlib.suppress(Exception):
                    await run

    asyncio.run(scenario())
