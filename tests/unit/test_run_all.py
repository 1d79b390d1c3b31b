"""bench/run_all.py: runs benchmarks as processes, checks each last line, writes the markdown."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import swarmp2p

ROOT = Path(__file__).resolve().parents[2]
RUN_ALL = ROOT / "bench" / "run_all.py"

GOOD = """import argparse, json
p = argparse.ArgumentParser(); p.add_argument("--quick", action="store_true"); a = p.parse_args()
print("## good")
print("| n | quick |"); print("|---|---|"); print(f"| 1 | {a.quick} |")
print(json.dumps({"quick": a.quick}))
"""
CRASH = 'import sys\nq = "--quick"\nprint("| half |")\nsys.exit("boom: ran out of tensors")\n'
NOJSON = 'p = "--quick"\nprint("| a |")\nprint("done")\n'
NOQUICK = 'print("{}")\n'


def _load():
    spec = importlib.util.spec_from_file_location("run_all", RUN_ALL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = module
    spec.loader.exec_module(module)
    return module


run_all = _load()


@pytest.mark.parametrize(
    ("stdout", "markdown", "result", "error"),
    [
        ('| a |\n{"x": 1}\n', "| a |", {"x": 1}, ""),
        ('| a |\n\n{"x": 1}\n\n', "| a |", {"x": 1}, ""),
        ("", "", None, "printed nothing"),
        ("| a |\ndone\n", "| a |\ndone", None, "last line is not JSON: 'done'"),
        ("[1, 2]\n", "[1, 2]", None, "not an object"),
    ],
)
def test_parse_output(stdout, markdown, result, error):
    got = run_all.parse_output(stdout)
    assert got[0] == markdown and got[1] == result
    assert error in got[2] and bool(got[2]) == bool(error)


def _bench_dir(tmp_path, **scripts) -> Path:
    folder = tmp_path / "bench"
    folder.mkdir()
    for name, text in scripts.items():
        (folder / f"{name}.py").write_text(text)
    (folder / "_helper.py").write_text("raise SystemExit('never run')\n")
    return folder


def _run(*args):
    return subprocess.run(
        [sys.executable, str(RUN_ALL), *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_run_all_reports_failures_and_writes_markdown(tmp_path):
    folder = _bench_dir(tmp_path, good=GOOD, crash=CRASH, nojson=NOJSON)
    out_md = tmp_path / "docs" / "benchmarks.md"
    out = _run("--quick", "--bench-dir", str(folder), "--output", str(out_md))
    assert out.returncode == 1, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["benchmarks"] == 3 and sorted(summary["failed"]) == ["crash.py", "nojson.py"]
    text = out_md.read_text()
    assert (
        "QUICK MODE" in text
        and "| python |" in text
        and f"| swarmp2p | {swarmp2p.__version__} |" in text
    )
    assert "| `bench/good.py` | `--quick` |" in text and "| 1 | True |" in text
    assert "### good" in text  # the benchmark's heading sits below ours
    assert '{"quick": true}' in text
    assert "boom: ran out of tensors" in text and "last line is not JSON: 'done'" in text
    assert "_helper" not in text
    assert not list(out_md.parent.glob(".*.tmp"))


def test_run_all_full_mode_passes_no_flag_and_quick_writes_nothing_by_default(tmp_path):
    folder = _bench_dir(tmp_path, good=GOOD)
    out_md = tmp_path / "full.md"
    assert _run("--bench-dir", str(folder), "--output", str(out_md)).returncode == 0
    assert (
        "| `bench/good.py` | `-` |" in out_md.read_text() and "| 1 | False |" in out_md.read_text()
    )
    quick = _run("--quick", "--bench-dir", str(folder))
    assert quick.returncode == 0 and json.loads(quick.stdout.splitlines()[-1])["output"] is None


def test_run_all_refuses_a_benchmark_without_quick_mode_and_unknown_names(tmp_path):
    folder = _bench_dir(tmp_path, good=GOOD, bare=NOQUICK)
    out = _run("--quick", "--bench-dir", str(folder))
    assert out.returncode == 2 and "bare.py has no --quick flag" in out.stderr
    out = _run("--only", "nope", "--bench-dir", str(folder))
    assert out.returncode == 2 and "--only ['nope']" in out.stderr and "'good'" in out.stderr


def test_run_all_on_the_real_cheap_benchmarks(tmp_path):
    out_md = tmp_path / "b.md"
    out = _run("--quick", "--only", "plan_scale", "--only", "fuzz_wire", "--output", str(out_md))
    assert out.returncode == 0, out.stdout + out.stderr
    text = out_md.read_text()
    assert "dense_ms" in text and '"crashes": 0' in text and "`--inputs 2000`" in text


MEET = """import argparse, json, pathlib, sys, time
p = argparse.ArgumentParser(); p.add_argument("--quick", action="store_true"); p.parse_args()
here = pathlib.Path(sys.argv[0]); me, other = here.stem, {"a": "b", "b": "a"}[here.stem]
(here.parent / f"{me}.up").touch()
deadline = time.monotonic() + 30
while not (here.parent / f"{other}.up").exists():  # ends only if both run at once
    if time.monotonic() > deadline:
        sys.exit(f"{other} never ran beside {me}")
    time.sleep(0.02)
print(json.dumps({"name": me}))
"""


def test_run_all_runs_quick_benchmarks_side_by_side_only_when_asked(tmp_path):
    folder = _bench_dir(tmp_path, a=MEET, b=MEET)
    out = _run(
        "--quick", "--jobs", "2", "--bench-dir", str(folder), "--output", str(tmp_path / "q.md")
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = (tmp_path / "q.md").read_text()
    assert text.index("## bench/a.py") < text.index("## bench/b.py")  # the plan's order
    full = _run("--jobs", "2", "--bench-dir", str(folder))
    assert full.returncode == 2 and "--jobs 2" in full.stderr and "only with --quick" in full.stderr


def test_the_longest_quick_runs_start_first_and_are_reported_in_order(tmp_path):
    folder = _bench_dir(tmp_path, a=GOOD, serve=GOOD, train_pipeline=GOOD, z=GOOD)
    out = _run("--quick", "--jobs", "2", "--bench-dir", str(folder))
    assert out.returncode == 0, out.stdout + out.stderr
    started = [line.split()[1] for line in out.stderr.splitlines() if line.startswith("running")]
    assert sorted(started[:2]) == ["bench/serve.py", "bench/train_pipeline.py"], started  # at once
    rows = [line.split("|")[1].strip() for line in out.stdout.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["a.py", "serve.py", "train_pipeline.py", "z.py"], rows
    alone = _run("--quick", "--bench-dir", str(folder))  # one at a time: the plan's order
    started = [line.split()[1] for line in alone.stderr.splitlines() if line.startswith("running")]
    assert started == ["bench/a.py", "bench/serve.py", "bench/train_pipeline.py", "bench/z.py"]


def test_gpu_benchmarks_are_left_out_and_their_docs_section_is_kept(tmp_path):
    folder = _bench_dir(tmp_path, good=GOOD, gpu="import sys\nsys.exit('ran without a GPU')\n")
    out_md = tmp_path / "b.md"
    section = "<!-- gpu:begin -->\n## GPU: H200\n| 1 | 2 |\n<!-- gpu:end -->"
    out_md.write_text(f"# Benchmarks\n\nold tables\n\n{section}\n")
    out = _run("--quick", "--bench-dir", str(folder), "--output", str(out_md))
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["benchmarks"] == 1 and summary["failed"] == []
    text = out_md.read_text()
    assert "old tables" not in text and text.count(section) == 1 and "bench/gpu.py" not in text
    assert run_all.gpu_section("no markers") == "" and run_all.gpu_section(text) == section
