"""The runtime registry: names without imports, lazy resolution, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from swarmp2p.runtime import available_runtimes, get_runtime, register_runtime


def test_listing_and_importing_the_registry_loads_no_framework():
    probe = (
        "import json, sys; from swarmp2p.runtime import available_runtimes; "
        "names = available_runtimes(); "
        "print(json.dumps([names, [m for m in ('torch', 'transformers') if m in sys.modules]]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    names, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    assert "torch" in names
    assert heavy == []


def test_registered_factory_is_built_once_and_shared():
    calls = []

    def factory():
        calls.append(1)
        return object()

    register_runtime("test-registry-shared", factory)
    first = get_runtime("test-registry-shared")
    assert get_runtime("test-registry-shared") is first
    assert calls == [1]
    assert "test-registry-shared" in available_runtimes()


@pytest.mark.parametrize(
    ("name", "factory", "error", "match"),
    [
        ("torch", object, ValueError, "already registered"),
        ("", object, ValueError, "non-empty"),
        ("test-registry-bad", 3, TypeError, "callable"),
    ],
)
def test_bad_registrations_are_refused(name, factory, error, match):
    with pytest.raises(error, match=match):
        register_runtime(name, factory)


def test_unknown_runtime_names_the_available_ones():
    with pytest.raises(ValueError, match=r"unknown runtime 'tensorflow'; available: .*torch"):
        get_runtime("tensorflow")


@pytest.mark.torch
def test_torch_runtime_resolves_lazily():
    runtime = get_runtime("torch")
    assert runtime.name == "torch"
    assert callable(runtime.load_stage_shard) and callable(runtime.build_stage)
