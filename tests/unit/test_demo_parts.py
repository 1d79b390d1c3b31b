"""`swarm demo`'s pure pieces: its job, the daemons' command lines, the thread share."""

from __future__ import annotations

import pytest

from swarmp2p import demo
from swarmp2p.plan import parse_job


def test_the_demo_job_is_a_valid_three_stage_lora_job_on_the_embedded_model():
    job = parse_job(demo.demo_job(demo.DemoSettings(steps=7)))
    assert job.model.pretrained == "embedded"
    assert job.model.lora.enabled
    assert job.split.stages == 3
    assert job.train.steps == 7
    assert job.train.eval_batches >= 1  # the demo prints an evaluation
    assert job.data.source == "embedded"


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("steps", 0, "steps: 0"),
        ("seq_len", -1, "seq_len: -1"),
        ("eval_batches", 0, "eval_batches: 0"),
        ("nodes", 4, "nodes: 4"),
        ("prompt", "  ", "prompt: empty"),
    ],
)
def test_bad_settings_name_the_field(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        demo.DemoSettings(**{field: value})


@pytest.mark.parametrize(
    ("nodes", "cores", "threads"), [(3, 2, 1), (3, 1, 1), (3, 8, 2), (3, 12, 4), (1, 4, 4)]
)
def test_each_node_gets_its_share_of_the_cores(nodes, cores, threads):
    assert demo.threads_per_node(nodes, cores) == threads


def test_daemon_args_keep_a_node_on_loopback_with_static_peers(tmp_path):
    args = demo.daemon_args(tmp_path / "n", "demo-2", 4001, [4000, 4002])
    assert args[:2] == ["up", "--foreground"]
    pairs = dict(zip(args[2::2], args[3::2]))
    assert pairs["--state-dir"] == str(tmp_path / "n")
    assert pairs["--node-id"] == "demo-2" and pairs["--port"] == "4001"
    assert pairs["--interface"] == "127.0.0.1" and "--token" not in args  # never in argv
    assert "--no-mdns" in args
    peers = [args[i + 1] for i, a in enumerate(args) if a == "--peer"]
    assert peers == ["127.0.0.1:4000", "127.0.0.1:4002"]


def test_free_ports_are_distinct():
    ports = demo.free_ports(3)
    assert len(set(ports)) == 3 and all(0 < p < 65536 for p in ports)


def test_importing_the_demo_imports_no_torch():
    import subprocess
    import sys

    heavy = ["torch", "transformers", "peft", "accelerate", "bitsandbytes"]
    probe = f"import sys, swarmp2p.demo; print(sorted(m for m in sys.modules if m in {heavy!r}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_examples_demo_job_is_the_job_the_demo_trains():
    import json
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "demo-job.json"
    assert json.loads(example.read_text()) == demo.demo_job(demo.DemoSettings())
