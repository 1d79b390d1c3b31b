"""The serve control messages on the wire, and a stage node's re-check of the serve plan (the
placement tables themselves are ``tests/unit/plan/test_plan_serve.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from swarmp2p.node.messages import (
    SERVE_MESSAGES,
    ServeFileRead,
    ServeNote,
    ServePlace,
    ServePlaced,
    ServeRelayNext,
    ServeRelayOpen,
    ServeShardHold,
    ServeStage,
    ServeStageConnect,
    ServeStageExit,
    ServeStageStart,
    ServeStageStop,
    ShardCopy,
)
from swarmp2p.node.records import NodeRecord
from swarmp2p.node.serving.ring import Served, inputs_of
from swarmp2p.node.serving.stages import check_serve_plan
from swarmp2p.node.training.jobs import PlanMismatch, cluster_records
from swarmp2p.plan import from_config
from swarmp2p.plan.serve import ServeInputs, ServePlan, ServeRequest
from swarmp2p.plan.split import Compression
from swarmp2p.wire.messages import WireError, decode, encode

GIB = 2**30
SHAPE = from_config(
    {
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
)


def record(
    node_id: str,
    free: int = 8 * GIB,
    *,
    fake_gpu: str | None = None,
    caps=("serve-codec", "wire-v2"),
) -> NodeRecord:
    """A node record as a daemon advertises it (a fake GPU carries the ``fake`` mark)."""
    devices = [
        {
            "kind": "cpu",
            "index": 0,
            "name": "cpu",
            "memory_total": free + GIB,
            "memory_free": free + GIB,
            "compute_capability": "",
        }
    ]
    if fake_gpu is not None:
        devices.insert(
            0,
            {
                "kind": "cuda",
                "index": 0,
                "name": "fake",
                "memory_total": free,
                "memory_free": free,
                "compute_capability": fake_gpu,
                "fake": True,
            },
        )
    data = {
        "node_id": node_id,
        "name": f"host-{node_id}",
        "ram": 64 * GIB,
        "disk_free": 100 * GIB,
        "capabilities": list(caps),
        "devices": devices,
    }
    return NodeRecord.from_data(data, "")


def inputs(*records: NodeRecord, **kw) -> ServeInputs:
    return ServeInputs(shape=SHAPE, cluster=tuple(cluster_records(list(records))), **kw)


@pytest.mark.parametrize(
    "msg",
    [
        ServePlace(
            serve_id="s1",
            inputs=ServeInputs(
                shape=SHAPE, max_sessions=4, max_context=256, quantization=None, dtype="float16"
            ),
        ),
        ServePlace(
            serve_id="s1",
            inputs=ServeInputs(
                shape=SHAPE,
                bounds=((0, 4), (4, 6)),
                holders=(("a",), ("b", "c")),
                trained_compression=(
                    Compression(method="learned_bottleneck", learned_dim=32, code_bits=8),
                ),
            ),
        ),
        ServePlaced(serve_id="s1", leader="a", inputs=inputs(record("a")), plan="{}"),
        ServeStageStart(
            serve_id="s1",
            attempt=2,
            stage=1,
            inputs=inputs(record("a")),
            plan="{}",
            model="/m",
            issuer="b",
            embedded=True,
            revision="0" * 40,
            files={"config.json": [10, "0" * 64]},
            shard={
                "job_id": "j1",
                "folder": "export/stage-1",
                "files": {},
                "sources": ["a"],
                "tied": None,
            },
        ),
        ServeStageExit(serve_id="s1", attempt=2, stage=1, node_id="c", message="killed by SIGKILL"),
        ServeStageConnect(serve_id="s1", attempt=2, stage=1, next="tcp://10.0.0.2:4000"),
        ServeStageStop(serve_id="s1", attempt=2, stage=-1),
        ServeStage(serve_id="s1", attempt=2, stage=0, endpoint="tcp://x:1", state="ready"),
        ServeFileRead(serve_id="s1", file="model.safetensors", offset=0, size=1 << 20),
        ShardCopy(job_id="j1", stage=1, node_id="c"),
        ServeShardHold(
            stage=1,
            shard={
                "job_id": "j1",
                "folder": "export/stage-1",
                "files": {"weights.safetensors": "0" * 64},
                "sources": ["a"],
                "tied": None,
            },
        ),
    ],
)
def test_serve_messages_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_a_serve_id_that_is_not_one_path_component_is_refused_on_the_wire():
    msg = ServeStageStop(serve_id="s1", attempt=1, stage=0)
    data = encode(dataclasses.replace(msg, serve_id="s1"))
    with pytest.raises(WireError, match="serve_id"):
        decode(data.replace(b"\xa2s1", b"\xa4../x"))


def test_the_daemon_routes_exactly_the_serve_requests():
    assert set(SERVE_MESSAGES) == {
        ServePlace,
        ServeStageStart,
        ServeStageConnect,
        ServeStageStop,
        ServeStageExit,
        ServeFileRead,
        ServeShardHold,
        ServeNote,
        ServeRelayOpen,
        ServeRelayNext,
    }


def test_a_stage_node_accepts_the_plan_it_computes_itself_and_refuses_any_other():
    given = inputs(record("a"), record("b"), stages=2)
    plan = given.plan()
    assert isinstance(plan, ServePlan) and [s.node_id for s in plan.stages] == ["a", "b"]
    assert check_serve_plan(given, plan.to_json(), node_id="b") == plan
    skewed = plan.to_json().replace('"max_sessions":4', '"max_sessions":5')
    assert skewed != plan.to_json()
    with pytest.raises(PlanMismatch, match="node b computes a different serve plan") as info:
        check_serve_plan(given, skewed, node_id="b")
    assert info.value.code == "plan_mismatch" and "same swarmp2p version" in str(info.value)
    # inputs it cannot place at all (another version's rules): refused as a mismatch too
    tight = inputs(record("a", free=1024), stages=1, max_sessions=64)
    with pytest.raises(PlanMismatch, match="node a cannot place this serving ring"):
        check_serve_plan(tight, plan.to_json(), node_id="a")


@pytest.mark.parametrize(("capability", "dtype"), [("8.6", "bfloat16"), ("7.5", "float16")])
def test_fake_gpus_plan_like_real_ones(capability, dtype):
    """The leader plans from live records: a fake device's mark is dropped, so a fake Ampere
    serves bfloat16 and a fake Turing float16 (their workers compute on the CPU)."""
    plan = inputs(record("a", fake_gpu=capability)).plan()
    assert (plan.dtype, plan.stages[0].device) == (dtype, "cuda:0")


def test_a_trained_models_inputs_carry_its_boundaries_and_its_ring_skips_old_nodes():
    learned = {"method": "learned_bottleneck", "learned_dim": 32, "code_bits": 8}
    stages = [{"node": "a", "layers": [0, 2]}, {"node": "b", "layers": [2, 6]}]
    trained = {
        "id": "m-1",
        "manifest": {"split": [[0, 2], [2, 6]], "compression": [learned], "stages": stages},
    }
    served = Served(
        request=ServeRequest(model="m-1"),
        serve_id="s1",
        folder="/m",
        shape=SHAPE,
        dtype="float32",
        quantization=None,
        trained=trained,
        holders=[["a"], ["b"]],
    )
    ask = inputs_of(served, frozenset("abc"))
    assert ask.trained_compression == (Compression.from_data(learned, "c"),)
    old = record("b")  # its record declares no calibrated-bottleneck
    new = [record(n, caps=["calibrated-bottleneck"]) for n in "ac"]
    plan = dataclasses.replace(ask, cluster=tuple(cluster_records([new[0], old, new[1]]))).plan()
    assert isinstance(plan, ServePlan)
    assert [s.node_id for s in plan.stages] == ["a", "c"]
