"""cluster.json records: parsing, defaults, round trips, errors with paths; plan/ is stdlib only."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from swarmp2p import __version__
from swarmp2p.plan import (
    CAPABILITIES,
    ClusterError,
    Device,
    Node,
    cluster_to_json,
    load_cluster,
    parse_cluster,
)

ROOT = Path(__file__).resolve().parents[3]

NODE = {
    "node_id": "a1",
    "name": "ampere",
    "ram": 64 * 2**30,
    "disk_free": 100 * 2**30,
    "devices": [
        {
            "kind": "cuda",
            "index": 0,
            "name": "RTX A5000",
            "memory_total": 24 * 2**30,
            "memory_free": 23 * 2**30,
            "compute_capability": "8.6",
        },
    ],
}


def test_omitted_capabilities_and_version_mean_this_version():
    (node,) = parse_cluster([NODE])
    assert node.capabilities == CAPABILITIES
    assert node.version == __version__
    assert node.devices[0].label == "GPU 0 (RTX A5000, compute 8.6)"


def test_round_trip_is_exact():
    data = {**NODE, "capabilities": ["wire-v2"], "version": "0.0.9", "link_speed": 125_000_000}
    data["devices"] = [{**NODE["devices"][0], "speed": {"bfloat16": 9.5e13, "float32": 2.1e13}}]
    (node,) = parse_cluster([data])
    assert node.to_dict() == data
    assert Node.from_dict(node.to_dict()) == node
    assert parse_cluster(json.loads(cluster_to_json([node]))) == (node,)


def test_an_old_record_has_no_speeds_and_an_unknown_link():
    (node,) = parse_cluster([NODE])
    assert node.link_speed == 0 and node.devices[0].speed.get("float32") is None


@pytest.mark.parametrize(
    ("speed", "message"),
    [
        ({"float64": 1.0}, "devices[0].speed.float64: is not a dtype"),
        ({"float32": 0}, "devices[0].speed.float32: must be FLOP/s"),
        ({"float32": True}, "devices[0].speed.float32: must be FLOP/s"),
        ([1.0], "devices[0].speed: must be an object"),
    ],
)
def test_bad_speeds_are_refused_with_their_path(speed, message):
    data = {**NODE, "devices": [{**NODE["devices"][0], "speed": speed}]}
    with pytest.raises(ClusterError) as err:
        parse_cluster([data])
    assert message in str(err.value)


def test_device_labels():
    cpu = Device(kind="cpu", index=0, name="Ryzen", memory_total=1, memory_free=1)
    unknown = Device(kind="cuda", index=1, name="Card", memory_total=1, memory_free=1)
    assert cpu.label == "CPU 0 (Ryzen)" and not cpu.is_gpu
    assert unknown.label == "GPU 1 (Card)"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda n: n.pop("ram"), "cluster[0].ram: required"),
        (lambda n: n.update(disk_free=-1), "cluster[0].disk_free: must be an integer >= 0"),
        (lambda n: n.update(gpus=[]), "cluster[0].gpus: unknown key"),
        (lambda n: n.update(capabilities="wire-v2"), "cluster[0].capabilities: must be a list"),
        (
            lambda n: n["devices"][0].update(kind="tpu"),
            "cluster[0].devices[0].kind: must be one of",
        ),
        (
            lambda n: n["devices"][0].update(compute_capability=7.5),
            "cluster[0].devices[0].compute_capability",
        ),
        (
            lambda n: n["devices"][0].update(compute_capability="sm75"),
            "cluster[0].devices[0].compute_capability",
        ),
        (
            lambda n: n["devices"][0].update(memory_free="lots"),
            "cluster[0].devices[0].memory_free: must be an integer >= 0",
        ),
        (lambda n: n["devices"][0].update(vram=1), "cluster[0].devices[0].vram: unknown key"),
        (
            lambda n: n["devices"].append(dict(n["devices"][0])),
            "cluster[0].devices[1]: duplicate cuda index 0",
        ),
    ],
)
def test_errors_name_the_field(mutate, message):
    data = json.loads(json.dumps(NODE))
    mutate(data)
    with pytest.raises(ClusterError) as info:
        parse_cluster([data])
    assert any(str(e).startswith(message) for e in info.value.errors), info.value.errors


def test_cluster_level_errors():
    with pytest.raises(ClusterError, match="must be a JSON list"):
        parse_cluster({"nodes": []})
    with pytest.raises(ClusterError, match="has no nodes"):
        parse_cluster([])
    with pytest.raises(ClusterError, match="node_id 'a1' appears more than once"):
        parse_cluster([NODE, NODE])


def test_load_cluster_reports_bad_json(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("[")
    with pytest.raises(ClusterError, match="not valid JSON"):
        load_cluster(path)


@pytest.mark.parametrize("name", ["cluster-mixed", "cluster-pascal-turing", "cluster-cpu-trio"])
def test_example_clusters_parse(name):
    assert len(load_cluster(ROOT / "examples" / f"{name}.json")) >= 2


def test_plan_imports_only_the_standard_library():
    """plan/ (and the schema validator it parses records with, the codec layout it prices
    boundaries with, and the timings a worker spec carries) import only the stdlib."""
    allowed = set(sys.stdlib_module_names) | {"swarmp2p"}
    light = [
        ROOT / "swarmp2p" / f
        for f in ("schema.py", "_install.py", "codec_layout.py", "timings/__init__.py")
    ]
    paths = [*sorted((ROOT / "swarmp2p" / "plan").glob("*.py")), *light]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
                if name.startswith("swarmp2p."):
                    ok = name.startswith("swarmp2p.plan") or name in (
                        "swarmp2p.schema",
                        "swarmp2p._install",
                        "swarmp2p.codec_layout",
                        "swarmp2p.timings",
                    )
                    assert ok, f"{path.name} imports {name}"
