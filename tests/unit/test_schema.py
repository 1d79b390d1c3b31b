"""The one validator: records checked by their type hints, every error with its field path."""

from __future__ import annotations

import json
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, Literal

import pytest

from swarmp2p.plan import load_cluster, load_job, plan_job
from swarmp2p.plan.result import Plan
from swarmp2p.schema import INT_MAX, FieldError, SchemaError, field, parse, to_data

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True, slots=True)
class Inner:
    n: int = field(default=1, ge=1, le=10)
    tag: str = field(default="x", min_len=1, max_len=4)


@dataclass(frozen=True, kw_only=True, slots=True)
class Outer:
    name: str
    inner: Inner = dataclass_field(default_factory=Inner)
    items: tuple[Inner, ...] = ()
    mode: Literal["a", "b"] = "a"
    auto: Literal["auto"] | int = field(default="auto", ge=1)
    maybe: float | None = None
    table: dict[str, int] = dataclass_field(default_factory=dict)
    pair: tuple[int, str] = (0, "")
    blob: Any = None
    total: int = dataclass_field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.inner.n + sum(i.n for i in self.items))
        if self.mode == "b" and self.maybe is None:
            raise SchemaError([FieldError(path="maybe", message="required when mode is b")])


def errors(data: Any) -> dict[str, str]:
    with pytest.raises(SchemaError) as info:
        parse(Outer, data)
    return {e.path: e.message for e in info.value.errors}


def test_every_problem_is_reported_with_its_path():
    got = errors(
        {
            "nmae": "x",
            "inner": {"n": 0, "tag": ""},
            "items": [{"n": 2}, {"n": "3"}],
            "mode": "c",
            "auto": 0,
            "maybe": "1",
            "table": {"a": 1.5},
            "pair": [1],
        }
    )
    assert set(got) == {
        "nmae",
        "name",
        "inner.n",
        "inner.tag",
        "items[1].n",
        "mode",
        "auto",
        "maybe",
        "table.a",
        "pair",
    }
    assert got["inner.n"] == "must be an integer >= 1 and <= 10, got 0"
    assert got["mode"] == 'must be one of "a", "b", got "c"'
    assert got["auto"] == 'must be one of "auto" or an integer >= 1, got 0'
    assert got["name"] == "required"
    assert got["nmae"].startswith("unknown key; known: name, inner")


def test_cross_field_rules_report_at_their_path_after_the_fields_pass():
    assert errors({"name": "x", "mode": "b"}) == {"maybe": "required when mode is b"}
    assert errors({"name": "x", "inner": {"n": 11}}) == {
        "inner.n": "must be an integer >= 1 and <= 10, got 11"
    }


@pytest.mark.parametrize("value", [2**63, 2**64, -(2**63) - 1, 10**40])
def test_integers_are_bounded_to_64_bits_everywhere(value):
    assert ("fits 64 bits" if value > 0 else ">= 1") in errors({"name": "x", "auto": value})["auto"]
    assert "does not fit 64 bits" in errors({"name": "x", "blob": {"a": [value]}})["blob.a[0]"]
    assert "must be a number" in errors({"name": "x", "maybe": value})["maybe"]


def test_non_finite_numbers_and_bools_are_not_numbers():
    assert "must be a number" in errors({"name": "x", "maybe": float("nan")})["maybe"]
    assert "an integer >= 1, got true" in errors({"name": "x", "auto": True})["auto"]


def test_round_trip_with_derived_fields():
    rec = parse(Outer, {"name": "x", "items": [{"n": 3}], "maybe": 2, "pair": [4, "y"]})
    assert rec.total == 4 and rec.maybe == 2.0 and rec.pair == (4, "y")
    data = to_data(rec)
    assert data["total"] == 4 and data["items"] == [{"n": 3, "tag": "x"}]
    assert parse(Outer, json.loads(json.dumps(data))) == rec
    data["total"] = 99  # a derived value is recomputed, not trusted
    assert parse(Outer, data).total == 4


def test_plain_data_is_bounded_in_depth():
    deep: Any = 1
    for _ in range(40):
        deep = [deep]
    assert "nests deeper" in errors({"name": "x", "blob": deep})["blob" + "[0]" * 17]


@pytest.mark.parametrize("cluster", ["cluster-mixed", "cluster-pascal-turing", "cluster-cpu-trio"])
@pytest.mark.parametrize("job", ["lora", "full", "compressor_only"])
def test_a_plan_reads_back_from_its_json(job, cluster):
    result = plan_job(
        load_job(ROOT / "examples" / f"{job}.json"),
        load_cluster(ROOT / "examples" / f"{cluster}.json"),
    )
    if not isinstance(result, Plan):
        pytest.skip(f"{job} on {cluster} is blocked: {result.reason}")
    again = Plan.from_json(result.to_json())
    assert again == result and again.to_json() == result.to_json()


def test_a_tampered_plan_is_refused_naming_the_field():
    plan = plan_job(
        load_job(ROOT / "examples" / "lora.json"),
        load_cluster(ROOT / "examples" / "cluster-cpu-trio.json"),
    )
    data = json.loads(plan.to_json())
    data["stages"][1]["layers"] = [0, INT_MAX + 1]
    data["dtype"] = "float8"
    with pytest.raises(SchemaError) as info:
        Plan.from_dict(data)
    paths = {e.path for e in info.value.errors}
    assert {"stages[1].layers[1]", "dtype"} <= paths
