"""bench/plan_scale.py --quick runs and ends with its JSON line (a smoke check, not a benchmark)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_plan_scale_quick():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "plan_scale.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("plan_job over 64 nodes, 80 layers")
    assert any(line.startswith("| dense | cost | 64 |") for line in lines)
    result = json.loads(lines[-1])
    assert set(result) == {"dense_ms", "moe_ms"}
    assert all(v > 0 for v in result.values())
