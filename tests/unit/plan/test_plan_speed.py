"""The speed split and predicted times (plan/speed.py): pure tables."""

from __future__ import annotations

import dataclasses

import pytest
from _plan_factories import A5000, gpu, llama_config, node
from _plan_factories import job as any_job

from swarmp2p.plan import Plan, from_config, load_model_shape, plan_job, usable_memory
from swarmp2p.plan.hardware import Speeds
from swarmp2p.plan.speed import learned_speeds, pipeline_step_s

SMOL = load_model_shape("embedded")
UNIFORM = from_config(llama_config(layers=40, hidden=512, vocab=1024))
"""40 equal layers and a small head: a stage's cost is about its layer count."""


def job(**sections):
    """One pipeline unless told (``split.replicas`` 1): this file prices one split, and
    "auto" may take replicas on measured devices (tests/unit/plan/test_plan_replicas.py)."""
    split = {"replicas": 1, **sections.pop("split", {})}
    return any_job(split=split, **sections)


def fast(flops: float, free_gb: float = 20.0, index: int = 0, dtype: str = "bfloat16"):
    dev = gpu(*A5000, free_gb, index=index)
    return dataclasses.replace(dev, speed=Speeds.from_data({dtype: flops}, "speed"))


def layers_of(plan: Plan) -> list[tuple[int, int]]:
    return [(s.layer_start, s.layer_end) for s in plan.stages]


@pytest.mark.parametrize(
    ("speeds", "want_ratio"),
    [
        ((1e12, 3e12), 3.0),  # the slow device first
        ((3e12, 1e12), 1 / 3),  # the fast device first
        ((2e12, 2e12), 1.0),
    ],
)
def test_measured_speeds_share_out_cost_in_their_ratio(speeds, want_ratio):
    cluster = [node("a", fast(speeds[0])), node("b", fast(speeds[1]))]
    plan = plan_job(job(), cluster, shape=UNIFORM)
    assert plan.split_mode == "speed" and plan.timing.measured
    t = plan.timing.stages
    # stage 1 holds the head, so compare FLOPs, not layers
    assert t[1].flops / t[0].flops == pytest.approx(want_ratio, rel=0.15)
    # the point: both stages take about as long
    assert t[0].step_s == pytest.approx(t[1].step_s, rel=0.15)


def test_speed_split_beats_the_equal_split_in_predicted_time():
    cluster = [node("a", fast(1e12)), node("b", fast(3e12))]
    speed = plan_job(job(), cluster, shape=UNIFORM)
    equal = plan_job(job(split={"mode": "equal"}), cluster, shape=UNIFORM)
    assert layers_of(equal) == [(0, 20), (20, 40)]
    assert layers_of(speed)[0][1] < 15  # the slow device holds about a quarter
    assert equal.timing.step_s / speed.timing.step_s > 1.5
    assert equal.timing.bottleneck == 0  # the slow device is the pace of the equal split


def test_memory_limits_still_win():
    # the fast device could take about 30 of 40 layers, but has room for fewer
    shape = from_config(llama_config(layers=8, hidden=4096, vocab=32000, intermediate_size=11008))
    roomy = [node("a", fast(1e12, free_gb=40)), node("b", fast(8e12, free_gb=40))]
    tight = [node("a", fast(1e12, free_gb=40)), node("b", fast(8e12, free_gb=12))]
    free_plan = plan_job(job(), roomy, shape=shape)
    tight_plan = plan_job(job(), tight, shape=shape)
    assert isinstance(tight_plan, Plan), getattr(tight_plan, "reason", "")
    assert layers_of(free_plan)[1][1] - layers_of(free_plan)[1][0] == 7
    held = layers_of(tight_plan)[1][1] - layers_of(tight_plan)[1][0]
    assert held < 7
    for stage, n in zip(tight_plan.stages, tight):
        assert stage.memory.peak <= usable_memory(n.devices[0])


def test_predicted_times_are_in_the_plan():
    cluster = [node("a", fast(1e12)), node("b", fast(3e12))]
    plan = plan_job(job(), cluster, shape=SMOL)
    timing = plan.timing
    per_stage = [s.step_s for s in timing.stages]
    for s in timing.stages:
        assert s.compute_s == pytest.approx(s.flops / s.speed, rel=1e-5)
        assert s.link_s == 0  # no link speed known
    assert timing.step_s == pytest.approx(pipeline_step_s(per_stage, 4), rel=1e-5)
    assert timing.bottleneck == max(range(2), key=lambda i: per_stage[i])
    assert Plan.from_json(plan.to_json()) == plan  # peers compare these bytes


def test_the_link_costs_time_between_nodes_only():
    slow_link = 10_000_000  # 10 MB/s: the 4 x 128 x 576 float32 activations take ~0.1 s
    devices = [fast(2e12, index=0, dtype="bfloat16"), fast(2e12, index=1, dtype="bfloat16")]
    one_node = [dataclasses.replace(node("a", *devices), link_speed=slow_link)]
    two_nodes = [
        dataclasses.replace(node("a", devices[0]), link_speed=slow_link),
        dataclasses.replace(node("b", devices[0]), link_speed=slow_link),
    ]
    within = plan_job(job(), one_node, shape=SMOL).timing
    across = plan_job(job(), two_nodes, shape=SMOL).timing
    assert [s.link_s for s in within.stages] == [0, 0]
    tokens, hidden = 4 * 128, SMOL.hidden
    act = tokens * (hidden * 2 + 8)  # bfloat16 activations and int64 labels
    assert across.stages[0].sent_bytes == act
    assert across.stages[0].link_s == pytest.approx(act / slow_link, rel=1e-5)
    assert across.stages[1].link_s == pytest.approx(tokens * hidden * 2 / slow_link, rel=1e-5)


def test_without_every_speed_the_split_is_by_free_memory_and_says_why():
    cluster = [node("a", gpu(*A5000, 20)), node("b", fast(3e12, free_gb=5))]
    speed = plan_job(job(), cluster, shape=UNIFORM)
    weighted = plan_job(job(split={"mode": "weighted"}), cluster, shape=UNIFORM)
    assert layers_of(speed) == layers_of(weighted)
    assert not speed.timing.measured and speed.timing.step_s is None
    assert speed.timing.unmeasured == ("a GPU 0 (RTX A5000, compute 8.6)",)
    assert any("no measured speed on a GPU 0" in n for n in speed.notes)
    assert not any("measured speed" in n for n in weighted.notes)


def test_explicit_modes_ignore_speeds():
    cluster = [node("a", fast(1e12)), node("b", fast(3e12))]
    equal = plan_job(job(split={"mode": "equal"}), cluster, shape=UNIFORM)
    cost = plan_job(job(split={"mode": "cost"}), cluster, shape=UNIFORM)
    assert layers_of(equal) == [(0, 20), (20, 40)]
    assert layers_of(cost)[0][1] >= 19  # FLOPs alone: about half each
    assert cost.timing.measured  # times are predicted all the same


def test_the_speed_of_another_dtype_does_not_count():
    cluster = [node("a", fast(1e12, dtype="float32")), node("b", fast(3e12, dtype="float32"))]
    plan = plan_job(job(), cluster, shape=UNIFORM)  # resolves bfloat16 on these GPUs
    assert plan.dtype == "bfloat16" and not plan.timing.measured


def test_learned_speeds_are_flops_over_measured_seconds():
    cluster = [node("a", fast(1e12)), node("b", fast(1e12))]
    timing = plan_job(job(), cluster, shape=UNIFORM).timing
    learned = learned_speeds(timing, [timing.stages[0].compute_s * 2, float("nan")])
    assert learned[0] == pytest.approx(5e11, rel=1e-5)
    assert learned[1] is None


def test_the_head_is_priced_twice_only_where_the_loss_runs_it_again():
    """1F1B's last stage backs one micro-batch right after its forward, so a one-chunk loss keeps
    its logits; GPipe holds them all (recomputed), and so does a micro-batch of several chunks."""
    cluster = [node("a", fast(2e12)), node("b", fast(2e12))]
    split = {"mode": "equal"}

    def last_flops(**train):
        plan = plan_job(job(split=split, train=train), cluster, shape=SMOL)
        return plan.timing.stages[1].flops

    tokens = 4 * 128  # BASE_JOB's batch
    once = last_flops(schedule="1f1b", batch_size=4, seq_len=128, micro_batches=4)
    again = last_flops(schedule="gpipe", batch_size=4, seq_len=128, micro_batches=4)
    assert again - once == pytest.approx(2 * tokens * SMOL.head_compute_params, rel=1e-5)
    long = dict(batch_size=2, seq_len=4096, micro_batches=2)  # 2 chunks a micro-batch
    assert last_flops(schedule="1f1b", **long) == last_flops(schedule="gpipe", **long)
