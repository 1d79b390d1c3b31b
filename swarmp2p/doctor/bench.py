"""``swarm doctor --bench``: measure this node's training speed again (``node.speed_probe``),
through the running daemon when there is one. Never imports torch."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from swarmp2p import __version__
from swarmp2p.node import api, hardware, views
from swarmp2p.node.requests import BenchRequest
from swarmp2p.node.speed_probe import measure
from swarmp2p.node.state import StateDir
from swarmp2p.timings import TIMINGS


def bench(state_dir: Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``swarm doctor --bench``: measure again. The running daemon measures and advertises
    (its record, its thread share); with none, this machine is measured and the cache written
    for the next ``swarm up``."""
    env = os.environ if env is None else env
    try:
        return api.send(
            StateDir(root=state_dir).api_socket, BenchRequest(), timeout=TIMINGS.speed_probe_s
        )
    except api.NoDaemon:
        pass
    record, host = hardware.probe(node_id="bench", name="bench", version=__version__, env=env)
    omp = str(env.get("OMP_NUM_THREADS", "")).strip()
    threads = int(omp) if omp.isdigit() and int(omp) > 0 else host.cpu_cores
    speeds = measure(record, threads=threads, env=env, fresh=True)
    record = record.with_speeds(speeds)
    return {"node_id": None, "speeds": speeds, "devices": views.devices(record)}


def format_bench(result: Mapping[str, Any]) -> str:
    """One line per device: its measured training speed per dtype."""
    lines = []
    for d in result.get("devices", []):
        speeds = d.get("speed") or {}
        text = ", ".join(f"{dt} {v / 1e9:.1f} GFLOP/s" for dt, v in sorted(speeds.items()))
        label = f"{d.get('kind')}:{d.get('index')} {d.get('name')}"
        lines.append(f"{label}: {text or 'not measured'}")
    where = (
        f"node {result['node_id']}" if result.get("node_id") else "this machine (no daemon runs)"
    )
    return f"training speed of {where}:\n" + "\n".join(lines)


__all__ = ["bench", "format_bench"]
