"""The dashboard and doctor are light plane: importing them loads no torch or its friends."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ["torch", "transformers", "peft", "accelerate", "bitsandbytes", "safetensors.torch"]
PROBE = (
    "import json, sys, swarmp2p.dashboard, swarmp2p.doctor, swarmp2p.node.daemon, swarmp2p.cli; "
    f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
)


def test_dashboard_and_doctor_import_no_torch():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
