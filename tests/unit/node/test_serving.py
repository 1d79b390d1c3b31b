"""Serving placement (a pure function of a model's shape and the live nodes' records) and the
serve control messages on the wire."""

from __future__ import annotations

import pytest

from swarmp2p.node.messages import (
    SERVE_MESSAGES,
    ServeFileRead,
    ServePlace,
    ServePlaced,
    ServeStage,
    ServeStageConnect,
    ServeStageExit,
    ServeStageStart,
    ServeStageStop,
    ShardCopy,
)
from swarmp2p.node.serve_placement import ServeError, place_stages
from swarmp2p.plan import Pricing, StagePricer, Workload, from_config
from swarmp2p.plan.model_shape import shape_from_wire, shape_to_wire
from swarmp2p.wire.messages import decode, encode

MIB = 2**20
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


def cpu_node(node_id: str, free: int) -> dict:
    # DEVICE_RESERVE keeps 1 GiB of a CPU's free memory back
    device = {"kind": "cpu", "index": 0, "name": "cpu", "memory_total": free + GIB,
              "memory_free": free + GIB, "compute_capability": ""}  # fmt: skip
    return {"node_id": node_id, "devices": [device]}


def gpu_node(node_id: str, free: int) -> dict:
    node = cpu_node(node_id, 64 * GIB)
    gpu = {"kind": "cuda", "index": 1, "name": "g", "memory_total": free + 512 * MIB,
           "memory_free": free + 512 * MIB, "compute_capability": "8.6"}  # fmt: skip
    node["devices"].insert(0, gpu)
    return node


def price(start, end, first, last, sessions=4, tokens=256):
    pricer = StagePricer(
        SHAPE,
        Pricing(dtype="float32", finetune_mode="none"),
        Workload(training=False, serving_sessions=sessions, serving_tokens=tokens),
    )
    return pricer.price(start, end, first=first, last=last).peak


def place(records, stages=0, sessions=4, tokens=256):
    return place_stages(SHAPE, records, stages=stages, max_sessions=sessions,
                        max_context=tokens, dtype="float32")  # fmt: skip


@pytest.mark.parametrize(
    ("free", "stages", "nodes", "layers"),
    [
        ({"b": GIB, "a": GIB, "c": GIB}, 0, ["a", "b", "c"], [(0, 2), (2, 4), (4, 6)]),
        ({"a": GIB, "b": GIB}, 3, ["a", "b", "a"], [(0, 2), (2, 4), (4, 6)]),
        ({"a": GIB, "b": 2 * GIB, "c": 3 * GIB}, 2, ["b", "c"], [(0, 3), (3, 6)]),
        ({"a": GIB}, 0, ["a"], [(0, 6)]),
        ({f"n{i}": GIB for i in range(9)}, 0, [f"n{i}" for i in range(6)],
         [(i, i + 1) for i in range(6)]),
    ],
)  # fmt: skip
def test_stages_go_to_the_roomiest_nodes_in_node_id_order(free, stages, nodes, layers):
    placed = place([cpu_node(n, f) for n, f in free.items()], stages)
    assert [s["node_id"] for s in placed] == nodes
    assert [(s["layer_start"], s["layer_end"]) for s in placed] == layers
    assert [s["device"] for s in placed] == ["cpu"] * len(nodes)
    n = len(layers)
    assert [s["memory"] for s in placed] == [
        price(a, b, i == 0, i == n - 1) for i, (a, b) in enumerate(layers)
    ]


def test_the_kv_cache_is_priced_for_every_session_and_token():
    one = place([cpu_node("a", GIB)], sessions=1, tokens=100)[0]["memory"]
    many = place([cpu_node("a", GIB)], sessions=8, tokens=100)[0]["memory"]
    kv_per_token = 2 * 2 * 16 * 4 * 6  # k and v, 2 kv heads of 16, float32, 6 blocks
    assert many - one == 7 * 100 * kv_per_token


def test_a_gpu_is_preferred_and_named():
    placed = place([gpu_node("a", GIB), cpu_node("b", 4 * GIB)], stages=1)
    assert (placed[0]["node_id"], placed[0]["device"]) == ("b", "cpu")
    placed = place([gpu_node("a", 8 * GIB), cpu_node("b", 4 * GIB)], stages=2)
    assert [(s["node_id"], s["device"]) for s in placed] == [("a", "cuda:1"), ("b", "cpu")]


def test_a_stage_that_does_not_fit_is_refused_naming_stage_node_and_bytes():
    need = price(0, 3, True, False, sessions=64, tokens=512)
    records = [cpu_node("a", need - 1), cpu_node("b", 8 * GIB)]
    with pytest.raises(ServeError) as info:
        place(records, stages=2, sessions=64, tokens=512)
    text = str(info.value)
    assert "cannot place 2 serving stage(s) for 64 session(s) of 512 tokens" in text
    assert f"stage 0 (blocks 0-2) needs {need / MIB:.1f} MiB, node a (cpu)" in text
    assert "stage 1" not in text and "lower --max-sessions/--max-context" in text


def test_two_stages_on_one_node_must_fit_together():
    first, second = price(0, 3, True, False), price(3, 6, False, True)
    fits = place([cpu_node("a", first + second)], stages=2)
    assert [s["node_id"] for s in fits] == ["a", "a"]
    with pytest.raises(ServeError, match=r"stage 1 .* node a"):
        place([cpu_node("a", first + second - 1)], stages=2)


@pytest.mark.parametrize(
    ("records", "stages", "message"),
    [
        ([], 0, "no live node"),
        ([cpu_node("a", GIB)], 7, r"stages: 7 is not in \[1, 6\]"),
    ],
)
def test_bad_placements_say_why(records, stages, message):
    with pytest.raises(ServeError, match=message):
        place(records, stages)


@pytest.mark.parametrize(
    "msg",
    [
        ServePlace(serve_id="s1", model="/m", stages=0, max_sessions=4, max_context=256,
                   dtype="float32", quantization={"bits": 4}),
        ServePlaced(serve_id="s1", leader="a", stages=[{"node_id": "a", "layer_start": 0}]),
        ServeStageStart(serve_id="s1", attempt=2, spec={"model": "/m"}, env={"device": "cpu"},
                        issuer="b"),
        ServeStageExit(serve_id="s1", attempt=2, stage=1, node_id="c", message="killed by SIGKILL"),
        ServeStageConnect(serve_id="s1", attempt=2, stage=1, next="tcp://10.0.0.2:4000"),
        ServeStageStop(serve_id="s1", attempt=2, stage=-1),
        ServeStage(serve_id="s1", attempt=2, stage=0, endpoint="tcp://x:1", state="ready"),
        ServePlace(serve_id="s1", model="/m", stages=0, max_sessions=4, max_context=256,
                   dtype="float32", shape=shape_to_wire(SHAPE), bounds=[[0, 4], [4, 6]],
                   holders=[["a"], ["b", "c"]]),
        ServeStageStart(serve_id="s1", attempt=1, spec={"model": "/m"}, env={}, issuer="b",
                        files={"config.json": [10, "0" * 64]},
                        shard={"job_id": "j1", "folder": "export/stage-1", "files": {},
                               "sources": ["a"], "tied": None}),
        ServeFileRead(serve_id="s1", file="model.safetensors", offset=0, size=1 << 20),
        ShardCopy(job_id="j1", stage=1, node_id="c"),
    ],
)  # fmt: skip
def test_serve_messages_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_the_daemon_routes_exactly_the_serve_requests():
    assert set(SERVE_MESSAGES) == {
        ServePlace, ServeStageStart, ServeStageConnect, ServeStageStop, ServeStageExit,
        ServeFileRead,
    }  # fmt: skip


def test_a_shape_crosses_the_wire_unchanged_and_a_bad_one_is_named():
    wire = decode(encode(ServePlace(serve_id="s", model="/m", stages=0, max_sessions=1,
                                    max_context=8, dtype="float32", shape=shape_to_wire(SHAPE))))  # fmt: skip
    assert shape_from_wire(wire.shape) == SHAPE
    with pytest.raises(ValueError, match="unknown field"):
        shape_from_wire({**shape_to_wire(SHAPE), "colour": 1})
    with pytest.raises(ValueError, match="layer_params"):
        shape_from_wire({**shape_to_wire(SHAPE), "layer_params": [1]})


def trained(records, holders, bounds=([0, 2], [2, 6]), sessions=4):
    return place_stages(SHAPE, records, stages=0, max_sessions=sessions, max_context=256,
                        dtype="float32", bounds=[list(b) for b in bounds], holders=holders)  # fmt: skip


def test_a_trained_model_keeps_its_split_and_goes_where_its_shards_are():
    records = [cpu_node(n, 8 * GIB) for n in "abc"]
    out = trained(records, [["c"], ["a"]])
    assert [(s["node_id"], s["layer_start"], s["layer_end"]) for s in out] == [
        ("c", 0, 2), ("a", 2, 6)
    ]  # fmt: skip
    # a holder that is not live is passed over for the roomiest live node (it fetches a copy)
    out = trained(records[:2], [["c", "b"], ["x"]])
    assert [s["node_id"] for s in out] == ["b", "a"]


def test_a_trained_stage_leaves_a_holder_without_room_and_says_why_when_none_fits():
    stage_bytes = price(0, 2, first=True, last=False)
    small = cpu_node("a", stage_bytes // 2)  # usable: half a stage
    big = cpu_node("b", 8 * GIB)
    out = trained([small, big], [["a"], ["a"]])
    assert [s["node_id"] for s in out] == ["b", "b"]
    with pytest.raises(ServeError, match=r"stage 0 \(blocks 0-1\) needs .* node a"):
        trained([small], [["a"], ["a"]])
