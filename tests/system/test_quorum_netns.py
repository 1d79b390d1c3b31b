"""Issue 24's two data-loss attacks on real hosts (network namespaces, each with its own disk):

- three hosts train and register a model and all go down; a newcomer whose id sorts lowest
  joins the one member that came back: it never leads an empty history, the job and the model
  survive on every host, and once the old members are back (in either order) there is one
  leader and one table;
- a leader cut off from the others tries to remove them one by one and to write alone: every
  removal and the write are refused, nothing is revoked, and the healed swarm holds one table,
  the majority's.
"""

from __future__ import annotations

import json
import time

import _tiny
import pytest
from hosts import CONTROL_PORT, HOME
from swarm_harness import agreed_on, dump, swarm, wait_until

from swarmp2p.net.security import SwarmSecret

pytestmark = [pytest.mark.system, pytest.mark.slow]

ENV = {"OMP_NUM_THREADS": "1"}
"""Every host shares this machine's cores: one torch thread per stage worker."""


def _job_on(node, name: str) -> str:
    """A job on ``node``'s host that waits (its float16 fits no CPU): a table entry, no worker."""
    model = node.host.config_only_model()
    job = {
        "name": name,
        "model": {"pretrained": model, "dtype": "float16"},
        "data": {"source": "random"},
    }
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


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny Llama with a word-level tokenizer, made here; the test puts it on one host."""
    return _tiny.tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab=128, layers=3)


def _trained(node, tiny_llama) -> str:
    """Train a 3-stage LoRA job on the tiny Llama (its folder only on ``node``'s host), to the
    end: the table holds a completed job and the model it registered. The job's id."""
    node.host.put(tiny_llama, f"{HOME}/models/tiny")
    job = {
        "name": "tiny",
        "model": {
            "pretrained": f"{HOME}/models/tiny",
            "lora": {"enabled": True, "r": 4, "alpha": 8},
        },
        "split": {"stages": 3, "mode": "equal"},
        "data": {"source": "random"},
        "train": {
            "steps": 2,
            "batch_size": 2,
            "seq_len": 8,
            "micro_batches": 2,
            "eval_batches": 1,
            "checkpoint_every": 0,
        },
    }
    out = swarm(
        node, "train", node.host.write(f"{HOME}/tiny.json", json.dumps(job)), "--json", timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    view = json.loads(out.stdout)
    assert view["state"] == "COMPLETED", view
    return view["id"]


def _models(node) -> list[tuple[str, str]]:
    out = swarm(node, "models", "--json", timeout=30)
    assert out.returncode == 0, out.stderr
    return [(m["id"], m["job_id"]) for m in json.loads(out.stdout)]


@pytest.mark.torch
@pytest.mark.parametrize(
    "back", [("nd", "nc"), ("nc", "nd")], ids=["last-down-first", "first-down-first"]
)
def test_a_newcomer_that_sorts_lowest_never_wipes_the_swarm(netns_lab_of, tiny_llama, back):
    lab = netns_lab_of
    hosts = lab.build(4)
    token = SwarmSecret.generate().token
    a, b, c = (h.swarm_up(n, token, env=ENV) for h, n in zip(hosts, ("nb", "nc", "nd")))
    old = [a, b, c]
    try:
        for node in old:
            node.start()
        wait_until(lambda: agreed_on(old, "nb", 3), 30, "agreement on nb")
        wait_until(
            lambda: all(len(n.status()["quorum"]["voters"]) == 3 for n in old), 20, "3 voters"
        )
        job = _trained(c, tiny_llama)  # three hosts train and register a model
        model = [("tiny", job)]
        wait_until(lambda: all(_models(n) == model for n in old), 30, "the model everywhere")

        for node in old:  # the whole swarm goes down, cleanly
            assert node.stop() == 0
        a.start()  # one member comes back alone
        wait_until(lambda: a.status()["leader"] == "nb", 30, "a up again")
        # a fresh machine joins it with the token; its new id sorts below every member's
        d = hosts[3].swarm_up("na", token, "--peer", f"{hosts[0].address}:{CONTROL_PORT}", env=ENV)
        d.start()
        # both ways: until d's hello reaches a (tens of ms after its join) d sees only itself
        # and names itself in its view, though its start-up grace keeps it from leading
        wait_until(
            lambda: all(sum(p["alive"] for p in n.status()["peers"]) == 2 for n in (a, d)),
            30,
            "a and d meet",
        )
        deadline = time.monotonic() + 6  # several heartbeats and a takeover grace
        while time.monotonic() < deadline:
            sa, sd = a.status(), d.status()
            assert sd["leader"] == "nb" and sa["leader"] == "nb", (sa["leader"], sd["leader"])
            assert not sd["quorum"]["ok"] or sd["table_version"] == 0
            assert _jobs(a) == [job] and _side_files(a) == []
            time.sleep(0.3)
        assert "na" not in a.status()["quorum"]["members"]  # a minority lists nobody
        assert "leading swarm" not in d.log(), d.log()[-3000:]  # not even in its first instants
        assert _models(a) == model

        by_id = {"nc": b, "nd": c}
        for node_id in back:  # the old members come back, in the order given
            by_id[node_id].start()
        nodes = [a, b, c, d]
        back_at = time.monotonic()
        wait_until(lambda: agreed_on(nodes, "na", 4), 60, "agreement on na, now a member")
        # 1.5 s here idle, 4.3 s on one core, 7.8 s on one core beside four busy loops
        print(f"agreed on na {time.monotonic() - back_at:.2f} s after the old members started")
        wait_until(lambda: all(_jobs(n) == [job] for n in nodes), 30, "the job on every host")
        wait_until(lambda: _one_table(nodes), 30, "one table, one leader")
        assert all(n.status()["quorum"]["ok"] for n in nodes)
        assert all(_side_files(n) == [] for n in nodes)
        assert all(_models(n) == model for n in nodes)  # the trained model survives everywhere
        assert all(j["state"] == "completed" for j in d.status()["jobs"]), d.status()["jobs"]
        # the members that were down count again, listed one change at a time
        everyone = ["na", "nb", "nc", "nd"]
        wait_until(
            lambda: all(sorted(n.status()["quorum"]["voters"]) == everyone for n in nodes),
            30,
            "4 voters",
        )
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
        wait_until(
            lambda: all(len(n.status()["quorum"]["voters"]) == 3 for n in nodes), 20, "3 voters"
        )
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
        # others, refused before any write): either way nothing of it is left. What the
        # scheduler noted meanwhile (the waiting job's reason: its first one may land just
        # before the cut, unacknowledged, so before the removal; then one worker short) went
        # with it; the refused submission was never written
        for d in sa["quorum"]["dropped"]:
            assert d["events"].count("member_removed") == 1, d
            assert set(d["events"]) <= {"member_removed", "job_pending"}, d

        wait_until(lambda: agreed_on([b, c], "nb", 2), 30, "b and c to agree without a")
        second = _submit(b, "majority")
        assert second.returncode == 0, second.stderr
        j2 = json.loads(second.stdout)["job_id"]

        lab.heal(0)
        healed = time.monotonic()
        wait_until(
            lambda: (
                agreed_on(nodes, "na", 3)
                and _one_table(nodes)
                and all(_jobs(n) == sorted([j1, j2]) for n in nodes)
            ),
            60,
            "one table after healing",
        )
        took = time.monotonic() - healed
        print(f"converged {took:.2f} s after healing")
        for node in nodes:
            s = node.status()
            assert sorted(s["quorum"]["voters"]) == ["na", "nb", "nc"] and s["quorum"]["ok"]
            assert _side_files(node) == []
        assert not any(p.get("revoked") for p in a.status()["peers"])
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump(nodes)}") from None
