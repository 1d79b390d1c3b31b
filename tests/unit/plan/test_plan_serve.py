"""Serving planned by the shared planner: ``plan_serve`` (dtype rules, the KV cache, the split
training uses, a trained model's bounds and holders, reasons that name stage, node and bytes),
the ServeRequest every entry point parses, and the records every peer re-checks."""

from __future__ import annotations

import random

import pytest
from _plan_factories import A5000, GTX1080, GTX1660S, cpu, gpu, node

from swarmp2p.plan import Blocked, from_config
from swarmp2p.plan.hardware import CAPABILITIES
from swarmp2p.plan.memory import Pricing, StagePricer, Workload
from swarmp2p.plan.placer import DEVICE_RESERVE
from swarmp2p.plan.serve import (
    ServeInputs,
    ServePlan,
    ServeRequest,
    parse_serve_request,
    plan_serve,
)
from swarmp2p.plan.split import Compression
from swarmp2p.schema import SchemaError, parse, to_data

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
BIG_HEAD = from_config(
    {
        "model_type": "llama",
        "vocab_size": 50000,  # the head's matmul costs about 85 of these blocks
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
)
KV_PER_TOKEN_LAYER = 2 * 2 * 16  # k and v, 2 kv heads of 16 values


def cpu_gb(node_id: str, usable: float, **kw):
    """A node with one CPU whose usable memory (free less the reserve) is ``usable`` GiB."""
    return node(node_id, cpu(usable + DEVICE_RESERVE["cpu"] / GIB), **kw)


def price(start, end, first, last, *, sessions=4, tokens=256, dtype="float32"):
    pricer = StagePricer(
        SHAPE,
        Pricing(dtype=dtype, finetune_mode="none"),
        Workload(training=False, serving_sessions=sessions, serving_tokens=tokens),
    )
    return pricer.price(start, end, first=first, last=last)


def serve(cluster, **kw):
    kw.setdefault("max_sessions", 4)
    kw.setdefault("max_context", 256)
    return plan_serve(kw.pop("shape", SHAPE), cluster, **kw)


@pytest.mark.parametrize(
    ("devices", "dtype"),
    [
        ([gpu(*A5000, 8)], "bfloat16"),
        ([gpu(*GTX1660S, 6)], "float16"),
        ([gpu("V100", "7.0", 16)], "float16"),
        ([gpu(*GTX1080, 8)], "float32"),
        ([cpu(8)], "float32"),
        ([gpu(*A5000, 8), gpu(*GTX1660S, 6, index=1)], "float16"),  # every stage runs it
        ([gpu("unknown", "", 8)], "bfloat16"),  # a capability not read excludes nothing
    ],
    ids=["ampere", "turing", "volta", "pascal", "cpu", "ampere+turing", "unknown"],
)
def test_the_dtype_is_the_best_every_stage_device_runs(devices, dtype):
    plan = serve([node("a", *devices)])
    assert isinstance(plan, ServePlan), plan
    assert plan.dtype == dtype
    assert len(plan.stages) == len(devices)


def test_an_explicit_dtype_names_the_device_that_cannot_run_it():
    pair = [node("a", gpu(*A5000, 8)), node("b", gpu(*GTX1660S, 6), name="turing-box")]
    blocked = serve(pair, dtype="bfloat16")  # auto: every device was going to serve
    assert isinstance(blocked, Blocked) and blocked.dtype == "bfloat16"
    assert "turing-box GPU 0 (GTX 1660 SUPER, compute 7.5) cannot run bfloat16" in blocked.reason
    assert blocked.reason.startswith("placed 1 of 2 serving stage(s)")
    # one stage: the Turing card is left out, and the plan says so
    plan = serve(pair, dtype="bfloat16", stages=1)
    assert [(s.node_id, plan.dtype) for s in plan.stages] == [("a", "bfloat16")]
    assert plan.notes == (
        "left out, cannot run bfloat16: turing-box GPU 0 (GTX 1660 SUPER, compute 7.5)",
    )
    # a CPU runs bfloat16 only when asked by name, never float16
    assert serve([cpu_gb("c", 8)], dtype="bfloat16").dtype == "bfloat16"
    assert "cannot run float16" in serve([cpu_gb("c", 8)], dtype="float16").reason


def test_the_kv_cache_of_every_session_and_token_is_priced_in_the_dtype():
    one = serve([cpu_gb("a", 1)], max_sessions=1, max_context=100).stages[0].memory
    many = serve([cpu_gb("a", 1)], max_sessions=8, max_context=100).stages[0].memory
    assert (
        many.peak - one.peak == many.kv_cache - one.kv_cache == 7 * 100 * 6 * KV_PER_TOKEN_LAYER * 4
    )
    half = serve([node("g", gpu(*A5000, 1))], max_sessions=8, max_context=100).stages[0].memory
    assert half.kv_cache * 2 == many.kv_cache and half.weights * 2 == many.weights
    assert many == price(0, 6, True, True, sessions=8, tokens=100)


@pytest.mark.parametrize(("asked", "held"), [(0, 512), (100, 100), (4096, 512)])
def test_the_context_is_the_models_at_most(asked, held):
    plan = serve([cpu_gb("a", 1)], max_context=asked)
    assert plan.max_context == held
    assert plan.stages[0].memory.kv_cache == 4 * held * 6 * KV_PER_TOKEN_LAYER * 4


def test_a_stage_that_does_not_fit_is_blocked_naming_stage_node_device_and_bytes():
    need = price(0, 3, True, False, sessions=64, tokens=512)
    usable_mib = need.peak / MIB - 0.5
    cluster = [cpu_gb("a", usable_mib / 1024, name="small"), cpu_gb("b", 8, name="big")]
    blocked = serve(cluster, stages=2, split="equal", max_sessions=64, max_context=512)
    assert isinstance(blocked, Blocked) and (blocked.required, blocked.placed) == (2, 1)
    lines = blocked.reason.splitlines()
    assert lines[0] == (
        "placed 1 of 2 serving stage(s); 1 device(s) lack the memory (equal "
        "split, float32, KV cache for 64 session(s) of 512 tokens):"
    )
    assert lines[1] == (
        f"small CPU 0 (x86-64 CPU): stage 0 (layers 0-2) needs "
        f"{need.peak / MIB:.1f} MiB (KV cache {need.kv_cache / MIB:.1f} MiB), "
        f"{usable_mib:.1f} MiB usable"
    )
    assert "lower --max-sessions or --max-context" in lines[2] and "add a node" in lines[2]
    # the weighted split moves blocks off the small device instead
    plan = serve(cluster, stages=2, split="weighted", max_sessions=64, max_context=512)
    assert plan.stages[0].layers[1] < 3


def test_stages_sharing_a_device_must_fit_it_together():
    first, second = price(0, 3, True, False), price(3, 6, False, True)
    both = (first.peak + second.peak) / GIB
    plan = serve([cpu_gb("a", both)], stages=2, split="equal")
    assert [(s.node_id, s.layers) for s in plan.stages] == [("a", (0, 3)), ("a", (3, 6))]
    blocked = serve([cpu_gb("a", both - 1 / GIB)], stages=2, split="equal")
    assert "stages 0 (layers 0-2), 1 (layers 3-5) need" in blocked.reason


@pytest.mark.parametrize(
    ("usable", "stages", "nodes"),
    [
        ({"b": 1, "a": 1, "c": 1}, 0, ["a", "b", "c"]),  # auto: one stage per device
        ({"a": 1, "b": 2, "c": 3}, 2, ["b", "c"]),  # the roomiest, kept in node-id order
        ({"a": 1, "b": 2}, 3, ["a", "b", "b"]),  # more stages than devices: consecutive
        ({"a": 1}, 0, ["a"]),
        ({f"n{i}": 1 for i in range(9)}, 0, [f"n{i}" for i in range(6)]),  # one per block
    ],
)
def test_stages_go_to_the_roomiest_devices_in_node_id_order(usable, stages, nodes):
    plan = serve([cpu_gb(n, u) for n, u in usable.items()], stages=stages)
    assert [s.node_id for s in plan.stages] == nodes
    assert [s.device for s in plan.stages] == ["cpu"] * len(nodes)
    assert plan.stages[-1].layers[1] == 6


def test_gpus_are_used_when_any_node_has_one():
    plan = serve([node("a", gpu(*A5000, 1, index=1), cpu(64)), cpu_gb("b", 64)])
    assert [(s.node_id, s.device) for s in plan.stages] == [("a", "cuda:1")]


def test_auto_leaves_out_the_device_without_room_and_says_so():
    need = price(0, 6, True, True, sessions=64, tokens=512).peak
    cluster = [cpu_gb("a", 0.001), cpu_gb("b", 2 * need / GIB)]
    plan = serve(cluster, max_sessions=64, max_context=512)
    assert [s.node_id for s in plan.stages] == ["b"]
    assert plan.notes == ("left out for lack of free memory: a CPU 0 (x86-64 CPU)",)


def test_the_split_is_trainings_cost_balanced_split_with_the_head_priced():
    plan = serve([cpu_gb(n, 8) for n in "abc"], shape=BIG_HEAD)
    assert plan.split_mode == "cost"
    assert [s.layers for s in plan.stages] == [(0, 4), (4, 5), (5, 6)]  # the head: one block
    plan = serve([cpu_gb(n, 8) for n in "abc"], shape=BIG_HEAD, split="equal")
    assert [s.layers for s in plan.stages] == [(0, 2), (2, 4), (4, 6)]


def test_a_trained_model_keeps_its_split_and_goes_where_its_shards_are():
    cluster = [cpu_gb(n, 8) for n in "abc"]
    trained = dict(bounds=[[0, 2], [2, 6]], dtype="float32")
    plan = serve(cluster, holders=[["c"], ["a", "b"]], **trained)
    assert [(s.node_id, s.layers) for s in plan.stages] == [("c", (0, 2)), ("a", (2, 6))]
    assert plan.split_mode == "fixed"
    # a holder that is not live is passed over for the roomiest live device (it fetches a copy)
    plan = serve(cluster[:2], holders=[["c", "b"], ["x"]], **trained)
    assert [s.node_id for s in plan.stages] == ["b", "a"]


def test_a_trained_stage_leaves_a_holder_without_room_and_says_why_when_none_fits():
    stage = price(0, 2, first=True, last=False).peak
    small, big = cpu_gb("a", stage / 2 / GIB), cpu_gb("b", 8)
    plan = serve([small, big], bounds=[[0, 2], [2, 6]], holders=[["a"], ["a"]])
    assert [s.node_id for s in plan.stages] == ["b", "b"]
    blocked = serve([small], bounds=[[0, 2], [2, 6]], holders=[["a"], ["a"]])
    assert isinstance(blocked, Blocked)
    assert "a CPU 0 (x86-64 CPU): stages 0 (layers 0-1), 1 (layers 2-5) need" in blocked.reason
    assert blocked.reason.startswith("placed 0 of 2 serving stage(s)")


LEARNED = Compression(method="learned_bottleneck", learned_dim=32, code_bits=8)
OLD_CAPS = frozenset(CAPABILITIES - {"calibrated-bottleneck"})


def test_a_learned_bottleneck_model_goes_only_onto_nodes_declaring_calibrated_bottleneck():
    # training's rule (placer.bottleneck_needs): every node of a ring with a learned boundary
    trained = dict(bounds=[[0, 2], [2, 6]], holders=[["a"], ["b"]], dtype="float32")
    cluster = [cpu_gb("a", 8), cpu_gb("b", 8, caps=OLD_CAPS, name="old"), cpu_gb("c", 8)]
    plan = serve(cluster, trained_compression=(LEARNED,), **trained)
    assert isinstance(plan, ServePlan)
    assert [s.node_id for s in plan.stages] == ["a", "c"]  # old's shard is fetched by c
    assert any("old lacks calibrated-bottleneck" in note for note in plan.notes)
    blocked = serve(cluster[1:2], trained_compression=(LEARNED,), **trained)
    assert isinstance(blocked, Blocked)
    assert blocked.reason == (
        "placed 0 of 2 serving stage(s); 1 capability(ies) missing:\n"
        "old lacks calibrated-bottleneck (the learned bottleneck is calibrated on both sides); "
        "update swarmp2p there"
    )
    # a fixed boundary needs nothing: the old node serves its own shard
    fixed = Compression(method="fixed", bits=8)
    plan = serve(cluster, trained_compression=(fixed,), **trained)
    assert [s.node_id for s in plan.stages] == ["a", "b"]
    # the planning peer without it cannot place such a ring at all
    blocked = serve(cluster, trained_compression=(LEARNED,), capabilities=OLD_CAPS, **trained)
    assert isinstance(blocked, Blocked) and "3 capability(ies) missing" in blocked.reason


def test_a_learned_bottleneck_model_prices_its_halves_on_both_sides():
    trained = dict(bounds=[[0, 2], [2, 6]], holders=[["a"], ["b"]], dtype="float32")
    cluster = [cpu_gb("a", 8), cpu_gb("b", 8)]
    plain = serve(cluster, **trained)
    plan = serve(cluster, trained_compression=(LEARNED,), **trained)
    sent = (64 * 32 + 32) * 4  # down: 64 x 32 and its bias, float32
    got = (32 * 64 + 64) * 4  # up
    assert plan.stages[0].memory.weights - plain.stages[0].memory.weights == sent
    assert plan.stages[1].memory.weights - plain.stages[1].memory.weights == got


def test_trained_compression_needs_bounds_of_as_many_boundaries():
    with pytest.raises(SchemaError, match="trained_compression: 2 boundary spec"):
        serve([cpu_gb("a", 8)], bounds=[[0, 2], [2, 6]], trained_compression=(LEARNED, LEARNED))


def test_the_plan_is_the_same_bytes_whatever_the_order_of_its_inputs():
    cluster = [
        node("n2", gpu(*A5000, 8, index=1), gpu(*A5000, 8, index=0), name="two"),
        node("n1", gpu(*GTX1660S, 6), name="one"),
        node("n3", gpu(*A5000, 12), name="three"),
    ]
    want = serve(cluster, max_sessions=3).to_json()
    rng = random.Random(7)
    for _ in range(5):
        shuffled = [
            node(n.node_id, *rng.sample(n.devices, len(n.devices)), name=n.name)
            for n in rng.sample(cluster, len(cluster))
        ]
        assert serve(shuffled, max_sessions=3).to_json() == want
    assert ServePlan.from_json(want).to_json() == want


def test_boundaries_cross_as_codes_where_both_nodes_declare_the_serve_codec():
    old = cpu_gb("b", 8, caps={"wire-v2"})
    plan = serve([cpu_gb("a", 8), old, cpu_gb("c", 8)], compression=["fixed_int8", "fp16"])
    assert [(s.send_compression, s.send_codes) for s in plan.stages] == [
        ("fixed_int8", False),
        ("fp16", False),
        ("none", False),
    ]
    plan = serve([cpu_gb("a", 8), cpu_gb("c", 8)], compression=["fixed_int4"])
    assert [(s.send_compression, s.send_codes) for s in plan.stages] == [
        ("fixed_int4", True),
        ("none", False),
    ]
    plan = serve([cpu_gb("a", 8), cpu_gb("c", 8)], compression=["fixed_int4"], codes=[False])
    assert not plan.stages[0].send_codes


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"stages": 7}, r"stages: 7 is not in \[1, 6\] \(the model's blocks\)"),
        ({"bounds": [[0, 2], [3, 6]]}, "bounds: .* are not contiguous block ranges from 0 to 6"),
        ({"bounds": [[0, 2], [2, 6]], "stages": 3}, "stages: 3, but the model is split in 2"),
        ({"bounds": [[0, 6]], "holders": [["a"], ["b"]]}, "holders: one list of nodes per stage"),
        ({"stages": 3, "compression": ["fp16"]}, "compression: 1 spec.*3 stage"),
        ({"stages": 2, "compression": ["zip"]}, "compression: 'zip' is not one of"),
    ],
)
def test_a_request_no_cluster_could_meet_is_refused_naming_the_field(kw, message):
    with pytest.raises(SchemaError, match=message) as info:
        serve([cpu_gb("a", 8)], **kw)
    assert len(info.value.errors) == 1 and message.startswith(info.value.errors[0].path)


def test_no_device_is_blocked():
    blocked = serve([])
    assert isinstance(blocked, Blocked) and "no live node advertises a device" in blocked.reason


def test_the_serve_request_is_parsed_once_with_every_error_named():
    req = parse_serve_request(
        {
            "model": "m",
            "name": None,
            "dtype": None,
            "api_key": "",
            "quantization": {"bits": 4},
            "stages": 2,
        }
    )
    assert (req.served_name, req.stages, req.port, req.api_key) == ("m", 2, 8080, None)
    assert req.quantization.bits == 4 and req.quantization.quant_type == "nf4"
    assert parse_serve_request(req.to_dict()) == req
    assert "api_key" not in req.to_dict()
    with pytest.raises(SchemaError) as info:
        parse_serve_request(
            {
                "model": "",
                "name": "a b",
                "stages": -1,
                "port": 70000,
                "dtype": "int8",
                "max_sessions": 0,
                "colour": 1,
                "quantization": {"bits": 3},
            }
        )
    paths = {e.path for e in info.value.errors}
    assert paths == {
        "model",
        "name",
        "stages",
        "port",
        "dtype",
        "max_sessions",
        "colour",
        "quantization.bits",
    }
    assert ServeRequest(model="m", max_context=2**24).max_context == 2**24


def test_the_inputs_cross_the_wire_and_plan_the_same_bytes():
    cluster = (cpu_gb("a", 8), node("b", gpu(*A5000, 8)))
    inputs = ServeInputs(
        shape=SHAPE,
        cluster=cluster,
        stages=0,
        max_sessions=2,
        bounds=((0, 2), (2, 6)),
        holders=(("b",), ("a",)),
        codes=True,
        trained_compression=(LEARNED,),
    )
    back = parse(ServeInputs, to_data(inputs))
    assert back == inputs
    assert back.plan().to_json() == inputs.plan().to_json()
    with pytest.raises(SchemaError, match="invalid serve plan"):
        ServePlan.from_json(inputs.plan().to_json().replace('"dtype":"bfloat16"', '"dtype":"x"'))


def test_the_prefix_cache_is_priced_per_stage_and_sized_in_blocks():
    cluster = [cpu_gb("a", 4), cpu_gb("b", 4)]
    off = serve(cluster, stages=2)
    on = serve(cluster, stages=2, prefix_cache_mb=1)
    assert off.prefix_blocks == 0 and all(s.memory.prefix_cache == 0 for s in off.stages)
    assert all(s.memory.prefix_cache == MIB for s in on.stages)
    assert [s.memory.peak - MIB for s in on.stages] == [s.memory.peak for s in off.stages]
    # float32, as many blocks as the budget holds on the stage with the most layers
    most = max(s.layers[1] - s.layers[0] for s in on.stages)
    assert on.prefix_blocks == MIB // (KV_PER_TOKEN_LAYER * 4 * most * 16)
    assert ServePlan.from_json(on.to_json()) == on


def test_a_prefix_cache_over_the_memory_is_named_in_the_blocked_reason():
    blocked = serve([cpu_gb("a", 0.01)], stages=1, prefix_cache_mb=64)
    assert isinstance(blocked, Blocked) and "--prefix-cache-mb, 64 MiB a stage" in blocked.reason
    assert not isinstance(serve([cpu_gb("a", 0.01)], stages=1), Blocked)


def test_a_recurrent_model_plans_no_prefix_cache_and_says_why():
    hybrid = from_config(
        {
            "model_type": "qwen3_5_text",
            "vocab_size": 1000,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "layer_types": [
                "linear_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
        }
    )
    assert hybrid.recurrent
    plan = serve([cpu_gb("a", 4)], shape=hybrid, prefix_cache_mb=8)
    assert plan.prefix_blocks == 0 and any("prefix cache off" in n for n in plan.notes)


def test_the_default_prefix_cache_takes_what_room_is_left_and_never_blocks_the_ring():
    bare = serve([cpu_gb("a", 4)], stages=1, prefix_cache_mb=0).stages[0].memory.peak
    # room for the ring and 40 MiB: the default budget halves from 64 to 32 MiB, and says so
    tight = serve([cpu_gb("a", (bare + 40 * MIB) / GIB)], stages=1, prefix_cache_mb=None)
    assert tight.stages[0].memory.prefix_cache == 32 * MIB and tight.prefix_blocks > 0
    assert any("prefix cache 32 MiB a stage" in n for n in tight.notes), tight.notes
    # no room for one MiB: the ring places without a cache, with a note
    full = serve([cpu_gb("a", (bare + MIB // 2) / GIB)], stages=1, prefix_cache_mb=None)
    assert full.prefix_blocks == 0 and full.stages[0].memory.prefix_cache == 0
    assert any("prefix cache off" in n for n in full.notes), full.notes
    # room to spare: the whole default, no note; an explicit budget is priced as asked
    roomy = serve([cpu_gb("a", 4)], stages=1, prefix_cache_mb=None)
    assert roomy.stages[0].memory.prefix_cache == 64 * MIB
    assert not any("prefix cache" in n for n in roomy.notes)
    asked = serve([cpu_gb("a", (bare + 40 * MIB) / GIB)], stages=1, prefix_cache_mb=64)
    assert isinstance(asked, Blocked) and "--prefix-cache-mb, 64 MiB a stage" in asked.reason
    # a cache never costs a stage: the budget that keeps both devices is chosen over 64 MiB on one
    two = [cpu_gb("a", (bare + 40 * MIB) / GIB), cpu_gb("b", (bare + 40 * MIB) / GIB)]
    both = serve(two, prefix_cache_mb=None)
    assert len(both.stages) == len(serve(two, prefix_cache_mb=0).stages) == 2
    assert all(0 < s.memory.prefix_cache <= 64 * MIB for s in both.stages)
    # every stage node plans the same from the request's inputs
    inputs = ServeInputs(shape=SHAPE, cluster=tuple(two), max_context=256, prefix_cache_mb=None)
    assert parse(ServeInputs, to_data(inputs)).plan().to_json() == both.to_json()


def test_the_serve_request_carries_the_prefix_cache_size():
    assert parse_serve_request({"model": "m"}).prefix_cache_mb is None  # as much as fits
    assert parse_serve_request({"model": "m", "prefix_cache_mb": 0}).prefix_cache_mb == 0
    with pytest.raises(SchemaError, match="prefix_cache_mb"):
        parse_serve_request({"model": "m", "prefix_cache_mb": -1})


DRAFT_CONFIG = {
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
DRAFT = from_config(DRAFT_CONFIG)


def test_a_draft_model_is_priced_on_stage_0_only_with_the_sessions_kv_cache():
    """Its weights (all blocks, embedding and head) and the KV cache of max_sessions x the
    context, in the plan's dtype, on the first stage; the plan names it."""
    cluster = [cpu_gb("a", 4), cpu_gb("b", 4)]
    off = serve(cluster, stages=2, max_sessions=4, max_context=256)
    on = serve(cluster, stages=2, max_sessions=4, max_context=256, draft=DRAFT)
    alone = StagePricer(
        DRAFT,
        Pricing(dtype="float32", finetune_mode="none"),
        Workload(training=False, serving_sessions=4, serving_tokens=256),
    ).price(0, 2, first=True, last=True)
    assert alone.kv_cache > 0
    assert [s.memory.draft for s in on.stages] == [alone.peak, 0]
    first, second = off.stages
    assert [s.memory.peak for s in on.stages] == [
        first.memory.peak + alone.peak,
        second.memory.peak,
    ]
    assert on.draft == DRAFT.name and off.draft is None
    # its share of the multiply-adds a token: blocks and head, against the served model's
    share = (sum(DRAFT.layer_active_params) + DRAFT.head_compute_params) / (
        sum(SHAPE.layer_active_params) + SHAPE.head_compute_params
    )
    assert on.draft_compute == pytest.approx(share, abs=1e-6) and 0 < share < 1
    assert off.draft_compute == 0
    assert ServePlan.from_json(on.to_json()) == on


def test_a_draft_model_that_does_not_fit_beside_stage_0_blocks_the_plan_naming_it():
    bare = serve([cpu_gb("a", 4)], stages=1)
    with_draft = serve([cpu_gb("a", 4)], stages=1, draft=DRAFT)
    room = (bare.stages[0].memory.peak + with_draft.stages[0].memory.draft // 2) / GIB
    assert isinstance(serve([cpu_gb("a", room)], stages=1), ServePlan)
    blocked = serve([cpu_gb("a", room)], stages=1, draft=DRAFT)
    assert isinstance(blocked, Blocked) and "draft model" in blocked.reason, blocked


def test_a_draft_model_with_a_shorter_context_is_refused_by_name():
    short = from_config({**DRAFT_CONFIG, "max_position_embeddings": 128})
    with pytest.raises(SchemaError, match="holds 128 positions, fewer than the 256"):
        serve([cpu_gb("a", 4)], stages=1, max_context=256, draft=short)
