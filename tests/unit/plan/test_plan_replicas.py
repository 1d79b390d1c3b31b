"""Replicas in the plan (``split.replicas``, plan/placer.py's ``plan_replicas``): pure tables."""

from __future__ import annotations

import dataclasses

import pytest
from _plan_factories import A5000, gpu, job, llama_config, node

from swarmp2p.plan import CAPABILITIES, Blocked, Plan, from_config, plan_job
from swarmp2p.plan.hardware import Speeds
from swarmp2p.plan.placer import REPLICAS_CAPABILITY, replica_groups
from swarmp2p.plan.result import PlannedReplica

UNIFORM = from_config(llama_config(layers=40, hidden=512, vocab=1024))
CAPS = CAPABILITIES | {REPLICAS_CAPABILITY}
NO_REPLICAS = CAPABILITIES - {REPLICAS_CAPABILITY}
"""An older node's: it syncs no replicas."""


def dev(flops: float | None = None, free_gb: float = 20.0):
    d = gpu(*A5000, free_gb)
    if flops is None:
        return d
    return dataclasses.replace(d, speed=Speeds.from_data({"bfloat16": flops}, "speed"))


def swarm(*flops: float | None, caps=CAPS, link: int = 0):
    return [
        dataclasses.replace(node(f"n{i}", dev(f), caps=caps), link_speed=link)
        for i, f in enumerate(flops)
    ]


def layers(stages) -> list[tuple[int, int]]:
    return [tuple(s.layers) for s in stages]


def test_a_one_replica_plan_is_the_plan_without_replicas():
    cluster = swarm(2e12, 2e12, 2e12, 2e12, caps=NO_REPLICAS)  # no node runs replicas
    today = plan_job(job(), cluster, NO_REPLICAS, shape=UNIFORM)
    for replicas in (1, "auto"):
        got = plan_job(job(split={"replicas": replicas}), cluster, NO_REPLICAS, shape=UNIFORM)
        assert got.to_json() == today.to_json()
    with_caps = swarm(2e12, 2e12, 2e12, 2e12)
    one = plan_job(job(split={"replicas": 1}), with_caps, CAPS, shape=UNIFORM)
    assert isinstance(one, Plan) and one.replicas == () and len(one.stages) == 4
    assert "replicas" not in one.to_dict()
    assert Plan.from_json(one.to_json()) == one


def test_two_replicas_hold_the_same_layers_on_their_own_devices():
    cluster = swarm(None, None, None, None)
    plan = plan_job(job(split={"replicas": 2}), cluster, CAPS, shape=UNIFORM)
    assert isinstance(plan, Plan), plan
    assert plan.n_replicas == 2 and len(plan.stages) == 2
    assert layers(plan.replica_stages(1)) == layers(plan.stages)
    nodes = [s.node_id for r in range(2) for s in plan.replica_stages(r)]
    assert sorted(nodes) == ["n0", "n1", "n2", "n3"]
    assert any("2 replicas x 2 stages, synced every step" in n for n in plan.notes)
    assert Plan.from_json(plan.to_json()) == plan
    assert plan_job(job(split={"replicas": 2}), cluster, CAPS, shape=UNIFORM) == plan


def test_replicas_share_the_split_whose_slowest_replica_is_fastest():
    # replica groups {4, 1} and {3, 2} (snake order); each alone would split differently
    cluster = swarm(4e12, 3e12, 2e12, 1e12)
    plan = plan_job(job(split={"replicas": 2, "stages": 2}), cluster, CAPS, shape=UNIFORM)
    assert isinstance(plan, Plan), plan
    groups = [{s.node_id for s in plan.replica_stages(r)} for r in range(2)]
    assert sorted(map(sorted, groups)) == [["n0", "n3"], ["n1", "n2"]]
    worst = max(plan.timing.step_s, plan.replicas[0].timing.step_s)
    by_id = {n.node_id: n for n in cluster}
    own_cuts = []
    for g in groups:  # each replica split on its own
        alone = plan_job(job(split={"stages": 2}), [by_id[k] for k in sorted(g)], shape=UNIFORM)
        own_cuts.append(alone.stages[1].layer_start)
    assert plan.stages[1].layer_start in own_cuts
    assert len(set(own_cuts)) == 2  # they differ, so the choice is a real one
    for cut in own_cuts:
        other = plan_job(
            job(split={"replicas": 2, "stages": 2}), cluster, CAPS, shape=UNIFORM, cuts=[cut]
        )
        assert max(other.timing.step_s, other.replicas[0].timing.step_s) >= worst


@pytest.mark.parametrize(
    ("split", "caps", "want"),
    [
        ({"replicas": 2}, NO_REPLICAS, "lacks replicas (split.replicas 2)"),
        ({"replicas": 3, "stages": 2}, CAPS, "split.replicas 3 x 2 stages needs 6 devices"),
        ({"replicas": 5}, CAPS, "split.replicas 5 x 1 stages needs 5 devices"),
    ],
)
def test_replicas_that_cannot_be_placed_block_with_the_reason(split, caps, want):
    cluster = swarm(None, None, None, None, caps=caps)
    got = plan_job(job(split=split), cluster, caps, shape=UNIFORM)
    assert isinstance(got, Blocked) and want in got.reason, got


def test_auto_replicas_need_measured_speeds_and_must_pay():
    unmeasured = plan_job(job(), swarm(None, None, None, None), CAPS, shape=UNIFORM)
    assert unmeasured.replicas == () and len(unmeasured.stages) == 4
    measured = plan_job(job(), swarm(2e12, 2e12, 2e12, 2e12), CAPS, shape=UNIFORM)
    assert measured.n_replicas > 1
    assert any("replicas x" in n and "tokens/s against" in n for n in measured.notes)
    # over a slow link a step's float32 gradients cost more than the replicas win
    slow = plan_job(job(), swarm(2e12, 2e12, 2e12, 2e12, link=10**6), CAPS, shape=UNIFORM)
    assert slow.replicas == ()
    diloco = {"sync": {"mode": "diloco", "every": 500}}
    low = plan_job(
        job(train=diloco), swarm(2e12, 2e12, 2e12, 2e12, link=10**6), CAPS, shape=UNIFORM
    )
    assert low.n_replicas > 1
    assert any("DiLoCo every 500 steps" in n for n in low.notes)


def test_replica_groups_deal_fast_and_slow_devices_out_snake_wise():
    cluster = swarm(1e12, 4e12, 2e12, 3e12, 5e12, 6e12)
    placed = [(n, n.devices[0]) for n in cluster]
    groups = replica_groups(placed, 3, 2, "bfloat16")
    ids = [[n.node_id for n, _ in g] for g in groups]
    assert ids == [["n0", "n5"], ["n2", "n4"], ["n1", "n3"]]  # 6+1, 5+2, 4+3


def test_a_plan_refuses_a_replica_with_other_layers():
    plan = plan_job(job(split={"replicas": 2}), swarm(None, None, None, None), CAPS, shape=UNIFORM)
    other = plan.replicas[0]
    moved = dataclasses.replace(other.stages[0], layers=(0, other.stages[0].layers[1] + 1))
    bad = PlannedReplica(index=1, stages=(moved, *other.stages[1:]))
    with pytest.raises(ValueError, match="same layers"):
        dataclasses.replace(plan, replicas=(bad,))
