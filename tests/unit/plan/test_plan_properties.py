"""Property tests: coverage, memory fit, byte-identical plans."""

from __future__ import annotations

import random

from _plan_factories import gpu, llama_config, node
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmp2p.plan import Plan, from_config, parse_job, plan_job, usable_memory


@st.composite
def scenarios(draw):
    layers = draw(st.integers(1, 48))
    hidden = draw(st.sampled_from([64, 256, 1024, 4096]))
    moe = draw(st.booleans())
    extra = {"num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [0]} if moe else {}
    shape = from_config(llama_config(layers=layers, hidden=hidden, vocab=32000, **extra))
    n_nodes = draw(st.integers(1, 6))
    nodes = []
    for i in range(n_nodes):
        n_dev = draw(st.integers(1, 2))
        devs = [
            gpu("GPU", draw(st.sampled_from(["8.6", "7.5", ""])), draw(st.floats(0.5, 24)), index=j)
            for j in range(n_dev)
        ]
        nodes.append(node(f"node-{i:02d}", *devs, disk_gb=draw(st.floats(1, 200))))
    mode = draw(st.sampled_from(["equal", "weighted", "cost"]))
    lora = draw(st.booleans())
    job = parse_job(
        {
            "model": {"pretrained": "x", "lora": {"enabled": lora}},
            "split": {"mode": mode},
            "train": {
                "batch_size": 4,
                "seq_len": draw(st.sampled_from([64, 512])),
                "micro_batches": draw(st.sampled_from([1, 2, 4])),
                "schedule": draw(st.sampled_from(["gpipe", "1f1b"])),
            },
        }
    )
    return job, nodes, shape


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios(), seed=st.integers(0, 2**16))
def test_plans_cover_every_layer_fit_memory_and_are_byte_identical(scenario, seed):
    job, nodes, shape = scenario
    result = plan_job(job, nodes, shape=shape)
    shuffled = list(nodes)
    random.Random(seed).shuffle(shuffled)
    again = plan_job(job, shuffled, shape=shape)
    assert result.to_json() == again.to_json()
    if not isinstance(result, Plan):
        assert result.placement_blocked_reason.startswith("placed ")
        return
    covered = [layer for s in result.stages for layer in range(s.layer_start, s.layer_end)]
    assert covered == list(range(shape.n_layers))
    assert all(s.layer_end > s.layer_start for s in result.stages)
    devices = {(n.node_id, f"cuda:{d.index}"): d for n in nodes for d in n.devices}
    for s in result.stages:
        device = devices[(s.node_id, s.devices[0])]
        assert s.memory.peak <= usable_memory(device)
    assert len(result.boundaries) == len(result.stages) - 1
