"""`swarm train --plan` and `swarm plan` show a replicated plan's replicas."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))

from _plan_factories import A5000, gpu, job, llama_config, node

from swarmp2p.cli._jobs import _print_live_plan
from swarmp2p.cli._plan import replica_lines
from swarmp2p.plan import CAPABILITIES, from_config, plan_job

CAPS = CAPABILITIES | {"replicas"}


def test_the_live_plan_lists_every_replica_with_its_nodes(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    cluster = [node(f"n{i}", gpu(*A5000, 20.0), caps=CAPS) for i in range(4)]
    shape = from_config(llama_config(layers=8))
    plan = plan_job(job(split={"replicas": 2}), cluster, CAPS, shape=shape).to_dict()
    for s in plan["stages"]:
        s["disk_free"] = 10**12  # what the daemon's live plan adds beside each stage
    _print_live_plan(plan)
    out = capsys.readouterr().out
    assert "replicas: 2 (stage i of each holds the same layers)" in out
    for r in (0, 1):
        line = next(ln for ln in out.splitlines() if f"replica {r}:" in ln)
        for s in plan["stages"] if r == 0 else plan["replicas"][0]["stages"]:
            assert s["node"] in line
    one = plan_job(job(split={"replicas": 1}), cluster, CAPS, shape=shape).to_dict()
    assert replica_lines(one) == []
