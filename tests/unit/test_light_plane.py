"""The light plane (plan, wire, net, node, the CLI) never imports torch or its friends."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LIGHT_PACKAGES = [
    "swarmp2p.plan",
    "swarmp2p.wire",
    "swarmp2p.net",
    "swarmp2p.node",
    "swarmp2p.client",
    "swarmp2p.data",
    "swarmp2p.dashboard",
    "swarmp2p.serve",
]
LIGHT_MODULES = [
    "swarmp2p",
    "swarmp2p.cli",
    "swarmp2p.demo",
    "swarmp2p.doctor",
    "swarmp2p.runtime",
    "swarmp2p.models",
    "swarmp2p.runtime._process",
    "swarmp2p.runtime.stage_links",
    "swarmp2p.runtime.worker",
    "swarmp2p.workers.events",
    "swarmp2p.workers",
]
HEAVY = ["torch", "transformers", "peft", "accelerate", "bitsandbytes", "safetensors.torch"]

_PROBE = r"""
import importlib, json, pkgutil, sys
packages, modules, heavy = json.loads(sys.argv[1])
imported = []
for name in modules:
    importlib.import_module(name)
    imported.append(name)
for root in packages:
    pkg = importlib.import_module(root)
    imported.append(root)
    for info in pkgutil.walk_packages(pkg.__path__, root + "."):
        importlib.import_module(info.name)
        imported.append(info.name)
print(json.dumps({"imported": imported, "heavy": [h for h in heavy if h in sys.modules]}))
"""


def _probe(packages: list[str], modules: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps([packages, modules, HEAVY])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_light_plane_imports_no_torch():
    result = _probe(LIGHT_PACKAGES, LIGHT_MODULES)
    assert result["heavy"] == [], f"the light plane imported {result['heavy']}"
    assert len(result["imported"]) >= len(LIGHT_PACKAGES) + len(LIGHT_MODULES)


@pytest.mark.torch
def test_probe_detects_a_heavy_import():
    """The probe itself can fail: importing the torch runtime does load torch."""
    pytest.importorskip("torch")
    result = _probe([], ["swarmp2p.runtime.torch"])
    assert "torch" in result["heavy"]
