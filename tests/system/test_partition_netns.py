"""Quorum on real hosts: cut the bridge between {a, b} and {c}. The minority host accepts no
submission and says why; the majority side keeps working; healed, one table, nothing lost.
Then a second partition, the leader alone: the same, and one table again once healed."""

from __future__ import annotations

import json

import pytest
from hosts import HOME
from swarm_harness import agreed_on, dump, swarm, wait_until

from swarmp2p.net.security import SwarmSecret

pytestmark = [pytest.mark.system, pytest.mark.slow]


def _job_on(node) -> str:
    """A job file on ``node``'s host for a model only that host has, which never runs (its
    float16 fits no CPU): it waits, so the tables hold it and no worker starts."""
    model = node.host.config_only_model()
    job = {
        "name": "p",
        "model": {"pretrained": model, "dtype": "float16"},
        "data": {"source": "random"},
    }
    return node.host.write(f"{HOME}/job.json", json.dumps(job))


def _submit(node, job_file) -> object:
    return swarm(node, "train", str(job_file), "--detach", "--json", timeout=60)


def _jobs(node) -> list[str]:
    return sorted(j["job_id"] for j in node.status()["jobs"])


def test_a_cut_minority_refuses_submissions_and_the_healed_swarm_holds_one_table(netns_lab_of):
    lab = netns_lab_of
    hosts = lab.build(3)
    token = SwarmSecret.generate().token
    nodes = [h.swarm_up(n, token) for h, n in zip(hosts, "abc")]
    for node in nodes:
        node.start()
    a, b, c = nodes
    try:
        wait_until(lambda: agreed_on(nodes, "a", 3), 20, "agreement on a")
        wait_until(
            lambda: all(len(n.status()["quorum"]["members"]) == 3 for n in nodes), 20, "3 members"
        )
        first = _submit(c, _job_on(c))
        assert first.returncode == 0, first.stderr
        j1 = json.loads(first.stdout)["job_id"]

        lab.cut(2)  # c alone
        wait_until(lambda: not c.status()["quorum"]["ok"], 15, "c to see it is a minority")
        status = c.status()
        assert "sees 1 of 3 voting member(s)" in status["quorum"]["reason"]
        text = swarm(c, "status").stdout
        assert "quorum  NO: this node sees 1 of 3 voting member(s)" in text
        refused = _submit(c, _job_on(c))
        assert refused.returncode == 4, (refused.returncode, refused.stderr)  # unavailable
        assert "accepts new jobs only on a side that sees 2" in refused.stderr

        wait_until(lambda: agreed_on([a, b], "a", 2), 15, "a and b to agree without c")
        second = _submit(b, _job_on(b))
        assert second.returncode == 0, second.stderr
        j2 = json.loads(second.stdout)["job_id"]
        assert j2 not in _jobs(c)

        lab.heal(2)
        wait_until(lambda: agreed_on(nodes, "a", 3), 20, "agreement after healing")
        wait_until(lambda: all(_jobs(n) == sorted([j1, j2]) for n in nodes), 20, "one table")
        wait_until(
            lambda: len({(n.status()["term"], n.status()["table_version"]) for n in nodes}) == 1,
            20,
            "the same table version everywhere",
        )
        assert all(n.status()["quorum"]["ok"] for n in nodes)

        # a second partition, the other way: the leader alone this time
        lab.cut(0)
        wait_until(lambda: agreed_on([b, c], "b", 2), 20, "b and c to agree without a")
        wait_until(lambda: not a.status()["quorum"]["ok"], 15, "a to see it is a minority")
        alone = _submit(a, _job_on(a))
        assert alone.returncode == 4, (alone.returncode, alone.stderr)
        third = _submit(c, _job_on(c))
        assert third.returncode == 0, third.stderr
        j3 = json.loads(third.stdout)["job_id"]
        lab.heal(0)
        every = sorted([j1, j2, j3])
        wait_until(
            lambda: (
                agreed_on(nodes, "a", 3)
                and all(_jobs(n) == every for n in nodes)
                and len({(n.status()["term"], n.status()["table_version"]) for n in nodes}) == 1
            ),
            30,
            "one table after the second healing",
        )
        assert all(n.status()["quorum"]["ok"] for n in nodes)
        assert not any(p.get("revoked") for p in a.status()["peers"])
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump(nodes)}") from None
