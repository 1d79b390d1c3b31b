"""Dtype rules by compute capability, and one dtype per job (the reference's cases)."""

from __future__ import annotations

import pytest
from _plan_factories import A5000, GTX1080, GTX1660S, cpu, gpu, job, mixed_pair, node

from swarmp2p.plan import Blocked, Plan, plan_job, resolve_dtype, supported_dtypes


@pytest.mark.parametrize(
    ("device", "explicit", "expected"),
    [
        (gpu("RTX A5000", "8.6", 24), None, ("bfloat16", "float16", "float32")),
        (gpu("A100", "8.0", 40), None, ("bfloat16", "float16", "float32")),
        (gpu("V100", "7.0", 16), None, ("float16", "float32")),
        (gpu("GTX 1660 SUPER", "7.5", 6), None, ("float16", "float32")),
        (gpu("GTX 1080", "6.1", 8), None, ("float32",)),
        (gpu("old fellow", "", 8), None, ("bfloat16", "float16", "float32")),
        (cpu(16), None, ("float32",)),
        (cpu(16), "bfloat16", ("bfloat16", "float32")),
        (cpu(16), "float16", ("float32",)),
    ],
)
def test_supported_dtypes(device, explicit, expected):
    assert supported_dtypes(device, explicit=explicit) == expected


@pytest.mark.parametrize(
    ("cards", "requested", "dtype", "excluded"),
    [
        ([A5000, A5000], None, "bfloat16", 0),
        ([A5000, GTX1660S], None, "float16", 0),
        ([GTX1080, GTX1660S], None, "float32", 0),
        ([A5000, ("fellow without nvml", "")], None, "bfloat16", 0),
        ([A5000, GTX1660S], "bfloat16", "bfloat16", 1),
        ([A5000, GTX1660S], "float32", "float32", 0),
        ([GTX1080, GTX1660S], "float16", "float16", 1),
    ],
)
def test_resolve_dtype(cards, requested, dtype, excluded):
    devices = [(node(f"n{i}", gpu(n, cc, 8)), gpu(n, cc, 8)) for i, (n, cc) in enumerate(cards)]
    choice = resolve_dtype(devices, requested)
    assert choice.dtype == dtype
    assert len(choice.excluded) == excluded


def test_mixed_pair_plans_float16():
    result = plan_job(job(), mixed_pair())
    assert isinstance(result, Plan)
    assert result.dtype == "float16"
    assert [s.node_name for s in result.stages] == ["fellow-1", "fellow-2"]


def test_explicit_bfloat16_on_two_forced_stages_is_blocked_with_the_reference_message():
    data = {"pretrained": "embedded", "dtype": "bfloat16"}
    result = plan_job(job(model=data, split={"stages": 2}), mixed_pair())
    assert isinstance(result, Blocked)
    assert result.placement_blocked_reason == (
        "placed 1 of 2 required workers; 1 GPU(s) excluded by dtype bfloat16:\n"
        "fellow-2 GPU 0 (GTX 1660 SUPER, compute 7.5) cannot run bfloat16"
    )
    assert (result.placed, result.required) == (1, 2)


def test_explicit_bfloat16_with_auto_stages_uses_the_cards_that_run_it_and_names_the_rest():
    cluster = [node(f"a{i}", gpu(*A5000, 23)) for i in range(3)] + [
        node("t", gpu(*GTX1660S, 5.5), name="turing")
    ]
    result = plan_job(job(model={"pretrained": "embedded", "dtype": "bfloat16"}), cluster)
    assert isinstance(result, Plan) and result.dtype == "bfloat16"
    assert [s.node_id for s in result.stages] == ["a0", "a1", "a2"]
    assert (
        "left out (dtype bfloat16): turing GPU 0 (GTX 1660 SUPER, compute 7.5) cannot run bfloat16"
        in result.notes
    )
    only = plan_job(job(model={"pretrained": "embedded", "dtype": "bfloat16"}), mixed_pair())
    assert isinstance(only, Plan) and [s.node_name for s in only.stages] == ["fellow-1"]


def test_pascal_and_turing_run_float32():
    cluster = [node("p", gpu(*GTX1080, 7.5)), node("t", gpu(*GTX1660S, 5.5))]
    result = plan_job(job(), cluster)
    assert isinstance(result, Plan)
    assert result.dtype == "float32"


def test_empty_compute_capability_is_not_excluded():
    cluster = [node("a", gpu(*A5000, 23)), node("b", gpu("unknown card", "", 10))]
    result = plan_job(job(model={"pretrained": "embedded", "dtype": "bfloat16"}), cluster)
    assert isinstance(result, Plan)
    assert result.dtype == "bfloat16"
    assert len(result.stages) == 2


def test_forced_stage_count_skips_an_excluded_card_when_enough_remain():
    cluster = [
        node("a", gpu(*A5000, 23)),
        node("b", gpu(*GTX1660S, 5.5)),
        node("c", gpu(*A5000, 23)),
    ]
    data = {"pretrained": "embedded", "dtype": "bfloat16"}
    result = plan_job(job(model=data, split={"stages": 2}), cluster)
    assert isinstance(result, Plan)
    assert [s.node_id for s in result.stages] == ["a", "c"]


def test_cpu_trio_runs_float32_and_bfloat16_only_when_asked():
    cluster = [node(f"c{i}", cpu(8)) for i in range(3)]
    assert plan_job(job(), cluster).dtype == "float32"
    explicit = plan_job(job(model={"pretrained": "embedded", "dtype": "bfloat16"}), cluster)
    assert isinstance(explicit, Plan) and explicit.dtype == "bfloat16"
