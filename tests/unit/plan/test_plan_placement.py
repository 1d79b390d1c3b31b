"""plan_job: equal / weighted / cost splits, memory and disk checks, features, determinism."""

from __future__ import annotations

from dataclasses import replace

import pytest
from _plan_factories import A5000, GTX1660S, GiB, gpu, job, llama_config, mixed_pair, node

from swarmp2p.plan import (
    DEVICE_RESERVE,
    Blocked,
    JobError,
    Plan,
    from_config,
    load_model_shape,
    min_max_partition,
    plan_job,
    usable_memory,
)

SMOL = load_model_shape("embedded")


def layers_of(plan: Plan) -> list[tuple[int, int]]:
    return [(s.layer_start, s.layer_end) for s in plan.stages]


def test_equal_vs_weighted():
    cluster = [node("a", gpu(*A5000, 20)), node("b", gpu(*A5000, 5))]
    shape = from_config(llama_config(layers=40, hidden=512, vocab=1024))
    equal = plan_job(job(split={"mode": "equal"}), cluster, shape=shape)
    weighted = plan_job(job(split={"mode": "weighted"}), cluster, shape=shape)
    assert layers_of(equal) == [(0, 20), (20, 40)]
    # usable memory 19.5 : 4.5 GB -> layer parameters in that proportion (32.5 : 7.5)
    assert layers_of(weighted) == [(0, 32), (32, 40)]  # 32.5 layers: ties go first


def test_weighted_moves_layers_off_a_device_that_would_overflow():
    shape = from_config(llama_config(layers=8, hidden=4096, vocab=32000, intermediate_size=11008))
    cluster = [node("a", gpu(*A5000, 20)), node("b", gpu(*A5000, 6))]
    plan = plan_job(job(model={"pretrained": "e", "lora": {"enabled": True}}), cluster, shape=shape)
    assert isinstance(plan, Plan)
    for stage, n in zip(plan.stages, cluster):
        assert stage.memory.peak <= usable_memory(n.devices[0])


def test_cost_split_prices_the_head():
    cluster = [node("a", gpu(*A5000, 20)), node("b", gpu(*A5000, 20))]
    plan = plan_job(job(split={"mode": "cost"}), cluster, shape=SMOL)
    # the head costs about 8 layers: 30 layers + 8 balance at 19 / 11
    assert layers_of(plan) == [(0, 19), (19, 30)]


def test_cost_split_of_dense_layers_before_moe_layers():
    cfg = llama_config(
        layers=16,
        hidden=256,
        vocab=512,
        intermediate_size=512,
        num_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=1024,
        mlp_only_layers=[0, 1, 2, 3, 4, 5, 6, 7],
    )
    shape = from_config(cfg)
    assert shape.moe_layers == (False,) * 8 + (True,) * 8
    cluster = [node(f"n{i}", gpu(*A5000, 20)) for i in range(4)]
    plan = plan_job(job(split={"mode": "cost"}), cluster, shape=shape)
    equal = plan_job(job(split={"mode": "equal"}), cluster, shape=shape)
    sizes = [b - a for a, b in layers_of(plan)]
    assert sizes[0] > sizes[-1]  # cheap dense layers go together

    def spread(p: Plan) -> float:
        costs = []
        for s in p.stages:
            c = sum(shape.layer_active_params[s.layer_start : s.layer_end])
            c += shape.head_compute_params if s.index == len(p.stages) - 1 else 0
            costs.append(c)
        return max(costs) / min(costs)

    assert spread(plan) < spread(equal)
    assert spread(plan) < 1.5


def test_a_stage_that_does_not_fit_is_blocked_naming_the_node():
    shape = from_config(llama_config(layers=32, hidden=4096, vocab=32000, intermediate_size=11008))
    cluster = mixed_pair(free_a=6, free_b=3)
    result = plan_job(job(split={"stages": 2}), cluster, shape=shape)
    assert isinstance(result, Blocked)
    reason = result.placement_blocked_reason
    assert reason.startswith("placed 0 of 2 required workers; 2 stage(s) do not fit")
    assert "fellow-1 GPU 0 (RTX A5000, compute 8.6): stage 0 (layers 0-" in reason
    assert "fellow-2 GPU 0 (GTX 1660 SUPER, compute 7.5): stage 1" in reason
    assert "GB free" in reason and 'quantization {"bits": 4}' in reason


def test_quantization_makes_it_fit():
    shape = from_config(llama_config(layers=32, hidden=4096, vocab=32000, intermediate_size=11008))
    cluster = mixed_pair(free_a=6, free_b=3)
    model = {"pretrained": "e", "quantization": {"bits": 4}, "lora": {"enabled": True}}
    plan = plan_job(job(model=model, split={"stages": 2}), cluster, shape=shape)
    assert isinstance(plan, Plan)
    assert plan.weight_storage == "nf4"


def test_a_disk_too_small_is_blocked_naming_the_node_when_the_stage_count_needs_it():
    cluster = [
        node("a", gpu(*A5000, 20)),
        node("b", gpu(*A5000, 20), disk_gb=0.6, name="tiny-disk"),
    ]
    result = plan_job(job(split={"stages": 2}), cluster, shape=SMOL)
    assert isinstance(result, Blocked)
    reason = result.placement_blocked_reason
    assert reason.startswith("placed 1 of 2 required workers; 1 node(s) lack the disk")
    assert "tiny-disk: stage(s) 1 download" in reason and "the disk has 0.6 GB free" in reason


def test_a_node_short_of_disk_is_left_out_with_the_reason_when_the_others_run_the_job():
    cluster = [
        node("a", gpu(*A5000, 20)),
        node("b", gpu(*A5000, 20), disk_gb=0.6, name="tiny-disk"),
        node("c", gpu(*A5000, 20)),
    ]
    auto = plan_job(job(), cluster, shape=SMOL)  # stages "auto": two of the three
    assert isinstance(auto, Plan) and [s.node_id for s in auto.stages] == ["a", "c"]
    (note,) = [n for n in auto.notes if "disk" in n]
    assert note.startswith("left out for lack of disk: tiny-disk: stage(s) 1 download")
    fixed = plan_job(job(split={"stages": 2}), cluster, shape=SMOL)  # two: c takes b's place
    assert isinstance(fixed, Plan) and [s.node_id for s in fixed.stages] == ["a", "c"]
    assert any("tiny-disk" in n for n in fixed.notes)


def test_download_share_includes_embeddings_first_and_tied_head_last():
    cluster = [node("a", gpu(*A5000, 20)), node("b", gpu(*A5000, 20))]
    plan = plan_job(job(split={"mode": "equal"}), cluster, shape=SMOL)
    half = sum(SMOL.layer_bytes[:15])
    assert plan.stages[0].download == half + SMOL.embed_bytes
    assert plan.stages[1].download == half + SMOL.head_bytes + SMOL.embed_bytes  # tied


def test_several_devices_on_one_node_each_get_a_stage():
    cluster = [node("a", gpu(*A5000, 20, index=0), gpu(*A5000, 20, index=1))]
    plan = plan_job(job(split={"mode": "equal"}), cluster, shape=SMOL)
    assert [(s.node_id, s.devices) for s in plan.stages] == [("a", ("cuda:0",)), ("a", ("cuda:1",))]


def test_cpus_are_used_only_without_gpus():
    from _plan_factories import cpu

    cluster = [node("a", gpu(*A5000, 20), cpu(32)), node("b", cpu(32))]
    plan = plan_job(job(), cluster, shape=SMOL)
    assert [s.devices for s in plan.stages] == [("cuda:0",)]


def test_features_need_every_assigned_node():
    caps = {"wire-v2", "long-context"}
    cluster = [node("a", gpu(*A5000, 20)), node("b", gpu(*A5000, 20), caps=caps)]
    float32 = {"pretrained": "embedded", "dtype": "float32"}
    plan = plan_job(job(split={"compression": "fixed_int8"}, model=float32), cluster, shape=SMOL)
    assert plan.features == ("long-context", "wire-v2")
    assert plan.schedule.micro_batches == 1 and plan.eval_batches == 0
    assert "micro_batches 1: not every node declares microbatch" in plan.notes
    assert plan.boundaries[0].codec == "int8"
    assert plan.boundaries[0].bytes_per_token == 576 + 4
    # a bfloat16 stage's payload crosses as its raw values (boundary.to_frame), priced so
    bf16 = plan_job(job(split={"compression": "fixed_int8"}), cluster, shape=SMOL)
    assert bf16.dtype == "bfloat16"
    assert (bf16.boundaries[0].codec, bf16.boundaries[0].bytes_per_token) == ("raw", 576 * 2)


def test_without_wire_v2_a_fixed_boundary_sends_floats():
    cluster = [node("a", gpu(*A5000, 20), caps=()), node("b", gpu(*A5000, 20))]
    plan = plan_job(job(split={"compression": "fixed_int8"}), cluster, shape=SMOL)
    assert plan.boundaries[0].codec == "raw"
    assert plan.boundaries[0].bytes_per_token == 576 * 2  # bfloat16 floats
    assert plan.features == ()


def test_planning_peer_capabilities_limit_features():
    cluster = [node("a", gpu(*A5000, 20)), node("b", gpu(*A5000, 20))]
    plan = plan_job(job(), cluster, capabilities=frozenset({"microbatch"}), shape=SMOL)
    assert plan.features == ("microbatch",)


def test_a_learned_bottleneck_needs_calibrated_bottleneck_everywhere():
    learned = {"method": "learned_bottleneck", "learned_dim": 256}
    cluster = [node("a", gpu(*A5000, 20)), node("b", gpu(*A5000, 20), caps={"wire-v2"}, name="old")]
    data = {"pretrained": "e", "freeze_backbone": True}
    result = plan_job(job(model=data, split={"compression": learned}), cluster, shape=SMOL)
    assert isinstance(result, Blocked)
    assert "old lacks calibrated-bottleneck" in result.placement_blocked_reason


def test_more_stages_than_devices_is_blocked():
    result = plan_job(job(split={"stages": 3}), mixed_pair(), shape=SMOL)
    assert isinstance(result, Blocked)
    assert result.placement_blocked_reason.startswith("placed 2 of 3 required workers;")


def test_more_stages_than_layers_is_invalid():
    shape = from_config(llama_config(layers=2))
    cluster = [node(f"n{i}", gpu(*A5000, 20)) for i in range(3)]
    with pytest.raises(JobError) as info:
        plan_job(job(split={"stages": 3}), cluster, shape=shape)
    assert info.value.errors[0].path == "split.stages"


def test_auto_uses_at_most_one_stage_per_layer():
    shape = from_config(llama_config(layers=2))
    cluster = [node(f"n{i}", gpu(*A5000, 20 - i)) for i in range(3)]
    plan = plan_job(job(), cluster, shape=shape)
    assert [s.node_id for s in plan.stages] == ["n0", "n1"]


def test_auto_leaves_out_a_device_without_room():
    cluster = [node("a", gpu(*A5000, 20)), node("b", gpu(*GTX1660S, 0.55), name="full-card")]
    plan = plan_job(job(), cluster, shape=SMOL)
    assert isinstance(plan, Plan) and len(plan.stages) == 1
    assert any("full-card" in note for note in plan.notes)


def test_recompute_auto_turns_on_only_when_needed():
    shape = from_config(llama_config(layers=8, hidden=2048, vocab=32000, intermediate_size=5504))
    cluster = [node("a", gpu(*A5000, 8), caps=())]
    train = {"batch_size": 8, "seq_len": 2048, "micro_batches": 1}
    lora = {"pretrained": "e", "lora": {"enabled": True}}
    auto = plan_job(job(model=lora, train=train), cluster, shape=shape)
    assert isinstance(auto, Plan) and auto.recompute
    assert "recompute turned on: the job fits only with it" in auto.notes
    off = plan_job(job(model=lora, train={**train, "recompute": False}), cluster, shape=shape)
    assert isinstance(off, Blocked)
    assert 'set train.recompute to "auto"' in off.placement_blocked_reason
    small = plan_job(job(model=lora, train={**train, "seq_len": 64}), cluster, shape=shape)
    assert isinstance(small, Plan) and not small.recompute


def test_the_plan_is_deterministic_and_order_free():
    cluster = [node("b", gpu(*GTX1660S, 5.5)), node("a", gpu(*A5000, 23))]
    one = plan_job(job(), cluster, shape=SMOL).to_json()
    two = plan_job(job(), list(reversed(cluster)), shape=SMOL).to_json()
    assert one == two
    assert '"status":"planned"' in one


def test_no_devices():
    result = plan_job(job(), [node("a")], shape=SMOL)
    assert isinstance(result, Blocked) and "no node advertises a device" in result.reason


def test_min_max_partition_is_optimal_on_a_small_case():
    costs = [5, 1, 1, 1, 1, 5]
    ranges = min_max_partition(6, 3, lambda i, a, b: float(sum(costs[a:b])))
    assert ranges == ((0, 1), (1, 5), (5, 6))
    assert min_max_partition(4, 2, lambda i, a, b: 1.0, lambda i, a, b: False) is None


def test_stage_records_memory_and_schedule():
    plan = plan_job(job(train={"schedule": "1f1b"}), mixed_pair(), shape=SMOL)
    first, last = plan.stages
    assert first.ops == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert last.memory.loss > 0 and first.memory.loss == 0
    assert plan.schedule.bubble_fraction == pytest.approx(1 / 5)
    assert first.device_free == int(23 * GiB)
    assert plan.schedule.requested == "1f1b"
    assert [p.kind for p in plan.schedule.predicted] == ["1f1b"]


def _fast_pair(free_b: float = 23.0):
    speed = {"float16": 4e13, "bfloat16": 4e13, "float32": 2e13}
    pair = [node("n1", gpu(*A5000, 23.0)), node("n2", gpu(*A5000, free_b))]
    return [replace(n, devices=tuple(replace(d, speed=speed) for d in n.devices)) for n in pair]


def test_auto_prices_every_schedule_and_picks_the_fastest_that_fits():
    def full(schedule="auto"):
        split = {"mode": "equal", "stages": 2}
        return job(split=split, train={"recompute": False, "schedule": schedule})

    plan = plan_job(full(), _fast_pair(), shape=SMOL)
    s = plan.schedule
    assert s.requested == "auto"
    assert [p.kind for p in s.predicted] == ["1f1b", "zb-h1", "zb-h2"]
    steps = {p.kind: p.step_s for p in s.predicted}
    assert all(p.fits and p.step_s > 0 for p in s.predicted)
    assert steps["zb-h1"] < steps["1f1b"]  # a full fine-tune's W fills the bubble
    assert s.kind == min(steps, key=lambda k: (steps[k], ["1f1b", "zb-h1", "zb-h2"].index(k)))
    assert "W0" in plan.stages[0].ops
    # where the last stage's device holds 1F1B's one micro-batch and not zero-bubble's two,
    # only 1F1B fits: auto takes it, and says the others do not fit
    need = {
        k: plan_job(full(k), _fast_pair(), shape=SMOL).stages[1].memory.peak
        for k in ("1f1b", "zb-h1")
    }
    assert need["1f1b"] < need["zb-h1"]
    free_b = (need["1f1b"] + need["zb-h1"]) / 2 + DEVICE_RESERVE["cuda"]
    tight = plan_job(full(), _fast_pair(free_b / GiB), shape=SMOL)
    assert tight.schedule.kind == "1f1b"
    assert {p.kind: p.fits for p in tight.schedule.predicted} == {
        "1f1b": True,
        "zb-h1": False,
        "zb-h2": False,
    }
    forced = plan_job(full("zb-h1"), _fast_pair(free_b / GiB), shape=SMOL)
    assert isinstance(forced, Blocked) and "do not fit" in forced.reason


def test_a_node_without_zero_bubble_runs_1f1b_and_a_forced_zb_names_it():
    pair = _fast_pair()
    old = replace(pair[1], capabilities=pair[1].capabilities - {"zero-bubble"})
    plan = plan_job(job(), [pair[0], old], shape=SMOL)
    assert plan.schedule.kind == "1f1b" and [p.kind for p in plan.schedule.predicted] == ["1f1b"]
    forced = plan_job(job(train={"schedule": "zb-h1"}), [pair[0], old], shape=SMOL)
    assert isinstance(forced, Blocked) and "lacks zero-bubble" in forced.reason


def test_plan_gives_the_stage_specs():
    data = {"pretrained": "e"}
    cluster = [node(f"n{i}", gpu(*A5000, 20)) for i in range(3)]
    plan = plan_job(
        job(model=data, split={"compression": ["fixed_int8", "fp16"]}), cluster, shape=SMOL
    )
    spec = plan.split_spec
    assert spec.n_stages == 3 and spec.n_layers == 30
    assert [spec.layer_range(i) for i in range(3)] == layers_of(plan)
    middle = spec.stage(1)
    assert middle.receive_compression.bits == 8 and middle.send_compression.method == "fp16"


def test_leaving_out_the_turing_card_restores_bfloat16():
    cluster = [node("a", gpu(*A5000, 20)), node("b", gpu(*GTX1660S, 0.55), name="full-card")]
    plan = plan_job(job(), cluster, shape=SMOL)
    assert plan.dtype == "bfloat16"


def test_a_list_of_compressions_fixes_the_stage_count_under_auto():
    cluster = [node(f"n{i}", gpu(*A5000, 20 + i)) for i in range(4)]
    float32 = {"pretrained": "embedded", "dtype": "float32"}
    plan = plan_job(
        job(split={"compression": ["fixed_int8", "fp16"]}, model=float32), cluster, shape=SMOL
    )
    assert isinstance(plan, Plan) and len(plan.stages) == 3
    assert [s.node_id for s in plan.stages] == ["n1", "n2", "n3"]  # the most free memory
    assert [b.codec for b in plan.boundaries] == ["int8", "fp16"]


def test_attention_is_priced_by_the_kernel_each_card_runs():
    # SmolLM2's 9 query heads share 3 key/value heads: below compute 8.0 only swarm_sdpa's
    # expansion keeps SDPA off its math kernel (plan/hardware.py)
    from swarmp2p.plan.hardware import CAPABILITIES

    assert SMOL.n_kv_heads < SMOL.n_heads
    train = {"batch_size": 1, "seq_len": 4096, "micro_batches": 1, "recompute": False}
    old = CAPABILITIES - {"swarm-sdpa"}

    def stage(device, caps=CAPABILITIES, dtype="float16"):
        long = job(train=train, model={"pretrained": "embedded", "dtype": dtype})
        plan = plan_job(long, [node("a", device, caps=caps)], shape=SMOL)
        return plan.stages[0].memory.activations, plan.notes

    turing = gpu(GTX1660S[0], GTX1660S[1], 80)
    efficient, notes = stage(turing)
    assert not any("seq x seq" in n for n in notes)
    math, notes = stage(turing, caps=old)
    scores = 5 * SMOL.n_heads * 4096 * 4096 * SMOL.n_layers  # 5 a s^2 b bytes at 16 bits
    assert math - efficient == scores
    assert any("seq x seq attention scores" in n and "GTX 1660 SUPER" in n for n in notes)
    # Flash runs the grouped call itself at 8.0 and up, with or without swarm_sdpa ...
    assert stage(gpu(A5000[0], A5000[1], 80), caps=old)[0] == efficient
    # ... but not in float32, where only the expansion keeps the scores away
    fp32, _ = stage(gpu(A5000[0], A5000[1], 80), dtype="float32")
    assert stage(gpu(A5000[0], A5000[1], 80), caps=old, dtype="float32")[0] - fp32 == 2 * scores
