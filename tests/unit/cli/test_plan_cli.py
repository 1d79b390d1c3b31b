"""`swarm plan` as a real subprocess: planned (0), blocked (3), invalid (2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"


def swarm(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), COLUMNS="160")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "swarmp2p", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )


def write(tmp_path: Path, name: str, data) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_the_readme_command_prints_a_plan(tmp_path):
    out = swarm(
        "plan", "examples/lora.json", "--cluster", "examples/cluster-mixed.json", tmp_path=tmp_path
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "planned smollm2-lora" in text
    assert "dtype float16" in text and "finetune lora" in text
    assert "ampere" in text and "turing" in text and "RTX A5000" in text
    assert "schedule 1f1b, 4 micro-batch(es), bubble fraction 0.200" in text
    assert "0 -> 1" in text  # the boundary table


def test_json_of_a_plan(tmp_path):
    out = swarm(
        "plan",
        "examples/lora.json",
        "--cluster",
        "examples/cluster-mixed.json",
        "--json",
        tmp_path=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["status"] == "planned" and data["dtype"] == "float16"
    assert data["reason"] is None and data["errors"] == []
    stages = data["stages"]
    assert [s["node"] for s in stages] == ["ampere", "turing"]
    assert stages[0]["devices"] == ["cuda:0"]
    assert stages[0]["layers"][0] == 0 and stages[-1]["layers"][1] == 30
    assert stages[0]["layers"][1] == stages[1]["layers"][0]  # end-exclusive, contiguous


@pytest.mark.parametrize(
    ("job", "cluster"),
    [
        ("full.json", "cluster-pascal-turing.json"),
        ("qlora.json", "cluster-mixed.json"),
        ("compressor_only.json", "cluster-cpu-trio.json"),
        ("none.json", "cluster-cpu-trio.json"),
    ],
)
def test_every_example_plans(tmp_path, job, cluster):
    out = swarm(
        "plan", f"examples/{job}", "--cluster", f"examples/{cluster}", "--json", tmp_path=tmp_path
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["status"] == "planned"


def test_blocked_prints_the_reason_and_exits_3(tmp_path):
    data = json.loads((EXAMPLES / "lora.json").read_text())
    data["model"]["dtype"] = "bfloat16"
    data["split"]["stages"] = 2  # auto stages would leave the Turing card out
    job = write(tmp_path, "bf16.json", data)
    out = swarm("plan", job, "--cluster", "examples/cluster-mixed.json", tmp_path=tmp_path)
    assert out.returncode == 3
    assert "placed 1 of 2 required workers; 1 GPU(s) excluded by dtype bfloat16:" in out.stderr
    assert "turing GPU 0 (GTX 1660 SUPER, compute 7.5) cannot run bfloat16" in out.stderr
    as_json = swarm(
        "plan", job, "--cluster", "examples/cluster-mixed.json", "--json", tmp_path=tmp_path
    )
    assert as_json.returncode == 3
    result = json.loads(as_json.stdout)
    assert result["status"] == "blocked" and result["stages"] == [] and result["errors"] == []
    assert result["reason"].endswith("cannot run bfloat16")


def test_invalid_job_lists_every_error_and_exits_2(tmp_path):
    job = write(
        tmp_path,
        "bad.json",
        {
            "model": {"pretrained": "embedded", "lora": {"enabeld": True}},
            "train": {"steps": -3, "schedule": "zb"},
        },
    )
    out = swarm("plan", job, "--cluster", "examples/cluster-mixed.json", tmp_path=tmp_path)
    assert out.returncode == 2
    assert "invalid: 3 error(s)" in out.stderr
    assert "train.steps: must be an integer >= 1, got -3" in out.stderr
    assert "model.lora.enabeld: unknown key" in out.stderr
    assert 'train.schedule: must be one of "auto", "gpipe", "1f1b", "zb-h1"' in out.stderr
    as_json = json.loads(
        swarm(
            "plan", job, "--cluster", "examples/cluster-mixed.json", "--json", tmp_path=tmp_path
        ).stdout
    )
    assert as_json["status"] == "invalid" and as_json["stages"] == []
    paths = [e["path"] for e in as_json["errors"]]
    assert paths == ["model.lora.enabeld", "train.steps", "train.schedule"]


def test_invalid_cluster_exits_2_naming_the_field(tmp_path):
    cluster = write(
        tmp_path,
        "c.json",
        [
            {
                "node_id": "a",
                "name": "a",
                "ram": 1,
                "disk_free": 1,
                "devices": [
                    {"kind": "tpu", "index": 0, "name": "x", "memory_total": 1, "memory_free": 1}
                ],
            }
        ],
    )
    out = swarm("plan", "examples/lora.json", "--cluster", cluster, "--json", tmp_path=tmp_path)
    assert out.returncode == 2
    errors = json.loads(out.stdout)["errors"]
    assert errors == [
        {
            "path": "cluster[0].devices[0].kind",
            "message": 'must be one of "cuda", "cpu", "mps", got "tpu"',
        }
    ]


def test_missing_model_is_invalid(tmp_path):
    data = json.loads((EXAMPLES / "lora.json").read_text())
    data["model"]["pretrained"] = "nobody/nothing"
    job = write(tmp_path, "m.json", data)
    out = swarm(
        "plan", job, "--cluster", "examples/cluster-mixed.json", "--json", tmp_path=tmp_path
    )
    assert out.returncode == 2
    (error,) = json.loads(out.stdout)["errors"]
    assert error["path"] == "model.pretrained" and "local Hugging Face cache" in error["message"]


def test_unreadable_job_file(tmp_path):
    out = swarm(
        "plan",
        str(tmp_path / "nope.json"),
        "--cluster",
        "examples/cluster-mixed.json",
        tmp_path=tmp_path,
    )
    assert out.returncode == 2
    assert "cannot read" in out.stderr


def test_version(tmp_path):
    out = swarm("--version", tmp_path=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("swarm 0.") and "(commit " in out.stdout


def test_plans_are_byte_identical_across_processes(tmp_path, monkeypatch):
    outputs = set()
    for seed in ("1", "2"):
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        out = swarm(
            "plan",
            "examples/qlora.json",
            "--cluster",
            "examples/cluster-cpu-trio.json",
            "--json",
            tmp_path=tmp_path,
        )
        assert out.returncode == 0, out.stderr
        outputs.add(out.stdout)
    assert len(outputs) == 1
