"""Issue 24's two data-loss attacks on real hosts (network namespaces, each with its own disk):

- a newcomer whose id sorts lowest joins the one member that came back after the whole swarm
  went down: it never leads an empty history, the table survives on every host, and once the
  old members are back there is one leader and one table;
- a leader cut off from the others tries to remove them one by one and to write alone: every
  removal and the write are refused, nothing is revoked, and the healed swarm holds one table,
  the majority's.
"""

from __future__ import annotations

import json
import time

import pytest
from hosts import CONTROL_PORT, HOME
from swarm_harness import agreed_on, dump, swarm, wait_until

from swarmp2p.net.security import SwarmSecret

pytestmark = [pytest.mark.system, pytest.mark.slow]


def _job_on(node, name: str) -> str:
    """A job on ``node``'s host that waits (its float16 fits no CPU): a table entry, no worker."""
    model = node.host.config_only_model()
    job = {"name": name, "model": {"pretrained": model, "dtype": "float16"},
           "data": {"source": "random"}}  # fmt: skip
    return node.host.write(f"{HOME}/{name}.json", json.dumps(job))


def _submit(node, name: str):
    return swarm(node, "train", _job_on(node, name), "--detach", "--json", timeout=60)


def _jobs(node) -> list[str]:
    return sorted(j["job_id"] for j in node.status()["jobs"])


def _one_table(nodes) -> bool:
    keys = {(s["term"], s["table_version"], s["leader"]) for s in (n.status() for n in nodes)}
    return len(keys) == 1


def _side_files(node) -> list[str]:
    """Tables a node set aside as another history's (there must be none)."""
    table = node.state.table_file
    return sorted(p.name for p in table.parent.glob(f"{table.name}.*"))


def test_a_newcomer_that_sorts_lowest_never_wipes_the_swarm(netns_lab_of):
    lab = netns_lab_of
    hosts = lab.build(4)
    token = SwarmSecret.generate().token
    a, b, c = (h.swarm_up(n, token) for h, n in zip(hosts, ("nb", "nc", "nd")))
    old = [a, b, c]
    try:
        for node in old:
            node.start()
        wait_until(lambda: agreed_on(old, "nb", 3), 30, "agreement on nb")
        wait_until(lambda: all(len(n.status()["quorum"]["voters"]) == 3 for n in old), 20, "3 voters")  # fmt: skip
        done = _submit(c, "kept")
        assert done.returncode == 0, done.stderr
        job = json.loads(done.stdout)["job_id"]
        wait_until(lambda: all(_jobs(n) == [job] for n in old), 20, "the job everywhere")

        for node in old:  # the whole swarm goes down, cleanly
            assert node.stop() == 0
        a.start()  # one member comes back alone
        wait_until(lambda: a.status()["leader"] == "nb", 30, "a up again")
        # a fresh machine joins it with the token; its new id sorts below every member's
        d = hosts[3].swarm_up("na", token, "--peer", f"{hosts[0].address}:{CONTROL_PORT}")
        d.start()
        wait_until(lambda: sum(p["alive"] for p in a.status()["peers"]) == 2, 30, "a meets d")
        deadline = time.monotonic() + 6  # several heartbeats and a takeover grace
        while time.monotonic() < deadline:
            sa, sd = a.status(), d.status()
            assert sd["leader"] == "nb" and sa["leader"] == "nb", (sa["leader"], sd["leader"])
            assert not sd["quorum"]["ok"] or sd["table_version"] == 0
            assert _jobs(a) == [job] and _side_files(a) == []
            time.sleep(0.3)
        assert "na" not in a.status()["quorum"]["members"]  # a minority lists nobody

        c.start()  # the old members come back, the last one down first
        b.start()
        nodes = [a, b, c, d]
        wait_until(lambda: agreed_on(nodes, "na", 4), 60, "agreement on na, now a member")
        wait_until(lambda: all(_jobs(n) == [job] for n in nodes), 30, "the job on every host")
        wait_until(lambda: _one_table(nodes), 30, "one table, one leader")
        assert all(n.status()["quorum"]["ok"] for n in nodes)
        assert all(_side_files(n) == [] for n in nodes)
        # the members that were down count again, listed one change at a time
        everyone = ["na", "nb", "nc", "nd"]
        wait_until(lambda: all(sorted(n.status()["quorum"]["voters"]) == everyone for n in nodes), 30, "4 voters")  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump([n for n in lab.nodes if n.running()])}") from None


def test_a_cut_off_leader_cannot_remove_the_others_or_write_alone(netns_lab_of):
    lab = netns_lab_of
    hosts = lab.build(3)
    token = SwarmSecret.generate().token
    nodes = [h.swarm_up(n, token) for h, n in zip(hosts, ("na", "nb", "nc"))]
    a, b, c = nodes
    try:
        for node in nodes:
            node.start()
        wait_until(lambda: agreed_on(nodes, "na", 3), 30, "agreement on na")
        wait_until(lambda: all(len(n.status()["quorum"]["voters"]) == 3 for n in nodes), 20, "3 voters")  # fmt: skip
        first = _submit(a, "before")
        assert first.returncode == 0, first.stderr
        j1 = json.loads(first.stdout)["job_id"]

        lab.cut(0)  # the leader alone, at once: its view still sees the others
        for other in ("nb", "nc"):
            removed = swarm(a, "remove", other, timeout=60)
            assert removed.returncode != 0, removed.stdout
            err = removed.stderr
            assert "majority" in err or "1 of 3 voting member" in err, err
        alone = _submit(a, "alone")
        assert alone.returncode == 4, (alone.returncode, alone.stderr)
        sa = a.status()
        assert sorted(sa["quorum"]["voters"]) == ["na", "nb", "nc"] and not sa["quorum"]["ok"]
        # the first removal was written and rolled back (or, had the view already lost the
        # others, refused before any write): either way nothing of it is left
        assert all(d["events"] == ["member_removed"] for d in sa["quorum"]["dropped"])

        wait_until(lambda: agreed_on([b, c], "nb", 2), 30, "b and c to agree without a")
        second = _submit(b, "majority")
        assert second.returncode == 0, second.stderr
        j2 = json.loads(second.stdout)["job_id"]

        lab.heal(0)
        healed = time.monotonic()
        wait_until(
            lambda: agreed_on(nodes, "na", 3) and _one_table(nodes)
            and all(_jobs(n) == sorted([j1, j2]) for n in nodes),
            60, "one table after healing",
        )  # fmt: skip
        took = time.monotonic() - healed
        print(f"converged {took:.2f} s after healing")
        for node in nodes:
            s = node.status()
            assert sorted(s["quorum"]["voters"]) == ["na", "nb", "nc"] and s["quorum"]["ok"]
            assert _side_files(node) == []
        assert not any(p.get("revoked") for p in a.status()["peers"])
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump(nodes)}") from None
