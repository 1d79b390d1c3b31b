"""Timings in one place per plane: every one named with its unit, a reason beside it, one name
for one value, and no timing constant left in a module of its own."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from swarmp2p.timings import TIMINGS, Timings
from swarmp2p.timings.workers import WORKER_TIMINGS, WorkerTimings

PACKAGE = Path(__file__).resolve().parents[2] / "swarmp2p"
NOT_TIMINGS = {"LINES_PER_S", "LARGE_BYTES_PER_S", "TTFT_BUCKETS_S", "ITL_BUCKETS_S"}
"""Rates and histogram buckets: seconds in their names, not waits anyone tunes."""


def _documented(cls) -> dict[str, bool]:
    """Each field of ``cls`` -> whether a docstring follows it in the source."""
    source = Path(__import__(cls.__module__, fromlist=["x"]).__file__).read_text()
    body = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.ClassDef) and n.name == cls.__name__
    ).body
    out = {}
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign):
            after = body[i + 1] if i + 1 < len(body) else None
            out[node.target.id] = isinstance(after, ast.Expr) and isinstance(
                getattr(after, "value", None), ast.Constant
            )
    return out


@pytest.mark.parametrize("cls", [Timings, WorkerTimings])
def test_every_timing_has_its_unit_and_its_reason(cls):
    documented = _documented(cls)
    for f in dataclasses.fields(cls):
        assert f.name.endswith(("_s", "_ms")), f"{cls.__name__}.{f.name} names no unit"
        assert documented.get(f.name), f"{cls.__name__}.{f.name} has no reason beside it"


def test_one_name_one_place():
    light = {f.name for f in dataclasses.fields(Timings)}
    workers = {f.name for f in dataclasses.fields(WorkerTimings)}
    assert not light & workers, light & workers
    assert Timings() == TIMINGS and WorkerTimings() == WORKER_TIMINGS


def test_no_module_keeps_a_timing_constant_of_its_own():
    pattern = re.compile(r"^([A-Z][A-Z0-9_]*_(?:S|MS))\s*[:=]", re.M)
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "timings":
            continue
        found += [
            f"{path.relative_to(PACKAGE)}: {name}"
            for name in pattern.findall(path.read_text())
            if name not in NOT_TIMINGS
        ]
    assert found == [], found
