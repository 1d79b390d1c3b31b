"""The wire benchmark and fuzz script run from a checkout and end with their JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _last_json(args: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=180, cwd=BENCH.parent
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fuzz_script_finds_no_crash_in_a_short_run():
    result = _last_json([str(BENCH / "fuzz_wire.py"), "--inputs", "3000", "--seed", "7"])
    assert result["inputs"] == 3000 and result["crashes"] == 0
    assert result["accepted_frames"] > 0  # the corpus seeds themselves decode


@pytest.mark.slow
def test_wire_bench_quick_mode_reports_its_keys():
    result = _last_json([str(BENCH / "wire.py"), "--quick"])
    for key in ("zmq_over_tcp", "curve_over_plain", "rtt_4k_ms"):
        assert result[key] > 0
    assert set(result["codec_mb_s"]) >= {"none", "fp16", "int8", "tokint4"}
    assert abs(result["bytes_per_token_vs_f32"]["int8"] - (576 + 4) / (4 * 576)) < 1e-4
