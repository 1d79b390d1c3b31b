"""A serve worker's spec: the serve plan and the stage, made by ``serve_spec`` alone, read back
through the one validator with every bad field named, and what the worker reads from it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from swarmp2p.plan import from_config
from swarmp2p.plan.serve import plan_serve
from swarmp2p.plan.worker_spec import local_cluster
from swarmp2p.schema import SchemaError
from swarmp2p.serve.spec import parse_serve_spec, serve_spec

SHAPE = from_config(
    {
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
)


def plan(kind: str = "cpu", **kw):
    kw.setdefault("bounds", [[0, 1], [1, 4]])
    return plan_serve(
        SHAPE, local_cluster(len(kw["bounds"]), kind=kind), max_sessions=3, max_context=100, **kw
    )


def test_the_spec_reads_the_stage_from_the_plan_and_round_trips():
    p = plan(kind="cuda", compression=["fixed_int8"], codes=[True])  # a fake GPU: bfloat16
    spec = serve_spec(p, 1, model="/m", token="t", host="10.0.0.2", device="cuda:0", threads=2)
    assert parse_serve_spec(json.loads(json.dumps(spec.to_dict()))) == spec
    assert (spec.stage_index, spec.layers) == (1, (1, 4))
    assert (spec.is_first, spec.is_last, spec.n_stages) == (False, True, 2)
    assert (spec.dtype, spec.plan.max_sessions, spec.plan.max_context) == ("bfloat16", 3, 100)
    assert (spec.planned.send_compression, spec.planned.send_codes) == ("none", False)
    first = serve_spec(p, 0, model="/m", token="t")
    assert (first.planned.send_compression, first.planned.send_codes, first.is_first) == (
        "fixed_int8",
        True,
        True,
    )
    assert first.quantization is None
    q = serve_spec(plan(quantization={"bits": 8}), 0, model="/m", token="t")
    assert q.quantization["bits"] == 8


@pytest.mark.parametrize(
    ("change", "path", "match"),
    [
        ({"stage": 2}, "stage", "must be < the plan's 2 stage"),
        ({"host": "example.org"}, "host", "is not an IP address"),
        ({"port": 70000}, "port", "<= 65535"),
        ({"device": "gpu0"}, "device", "does not match"),
        ({"token": ""}, "token", "non-empty"),
        ({"tied_head": "/h"}, "tied_head", "only a stage served from a shard"),
        ({"shard": ""}, "shard", "non-empty"),
        ({"colour": "red"}, "colour", "unknown key"),
        ({"plan": {"stages": []}}, "plan.model", "required"),
        ({"link_keys": {"public": "p", "secret": "s", "prev": "a"}}, "link_keys", "prev and next"),
        (
            {"link_keys": {"public": "p", "secret": "", "prev": "a", "next": "b"}},
            "link_keys",
            "secret",
        ),
    ],
)
def test_a_bad_field_is_refused_with_its_path(change, path, match):
    data = {**serve_spec(plan(), 1, model="/m", token="t").to_dict(), **change}
    with pytest.raises(SchemaError) as info:
        parse_serve_spec(data)
    assert any(e.path == path and match in e.message for e in info.value.errors), info.value


def test_only_the_last_stage_takes_a_tied_head():
    p = plan()
    assert serve_spec(p, 1, model="/m", token="t", shard="/s", tied_head="/h").tied_head == "/h"
    with pytest.raises(SchemaError, match="only the last stage has an output head"):
        serve_spec(p, 0, model="/m", token="t", shard="/s", tied_head="/h")


def test_the_worker_refuses_a_bad_spec_before_it_imports_torch():
    data = serve_spec(plan(), 0, model="/m", token="t").to_dict()
    data["plan"]["dtype"] = "int8"
    probe = "from swarmp2p.runtime import serve_worker; serve_worker.main()"
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", probe],
        input=json.dumps(data) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    event = json.loads(out.stdout.splitlines()[-1])
    assert event["event"] == "error" and "plan.dtype" in event["message"]
    assert "| torch" not in out.stderr  # -X importtime lists every module imported


def test_the_link_keys_travel_to_the_worker_as_its_link_credentials():
    """Per-node link keys (issue 15): the worker binds admitting only ``prev`` and dials
    ``next`` with its node's own key pair."""
    from swarmp2p.net import NodeKey
    from swarmp2p.net.links import link_credentials

    me, before, after = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()
    keys = {"public": me.public, "secret": me.secret, "prev": before.public, "next": after.public}
    spec = serve_spec(plan(), 0, model="/m", token="t", link_keys=keys)
    back = parse_serve_spec(json.loads(json.dumps(spec.to_dict())))
    assert back.link_keys == keys
    server, client = link_credentials(back.link_keys)
    check = server.admits.callback
    assert check("", before.public.encode()) and not check("", after.public.encode())
    assert client is not None and client.server == after.public
    assert serve_spec(plan(), 0, model="/m", token="t").link_keys is None  # the token's keys
