"""dashboard_view: the daemon's status as the page's JSON (pure, table-driven)."""

from __future__ import annotations

import math

import pytest

from swarmp2p.dashboard import MAX_POINTS, dashboard_view, metric_points, parse_dashboard_port
from swarmp2p.dashboard.view import device_view, evaluation_rows, stage_views

GIB = 1 << 30


@pytest.mark.parametrize(
    ("raw", "steps", "bad"),
    [
        (None, [], 0),
        ("nonsense", [], 1),
        ([], [], 0),
        ([{"step": 2, "loss": 1.0}, {"step": 1, "loss": 2.0}], [1, 2], 0),
        ([{"step": 1, "loss": 2.0}, {"step": 1, "loss": 1.5}], [1], 0),  # a repeat: last wins
        ([{"step": -1, "loss": 1.0}, {"step": True, "loss": 1.0}, {"step": "3"}], [], 3),
        ([{"step": 0, "loss": math.nan}, {"step": 1, "loss": None, "tokens_per_s": 5}], [1], 1),
        ([{"step": 0, "loss": math.inf, "tokens_per_s": None}, 7, None], [], 3),
    ],
)
def test_metric_points(raw, steps, bad):
    points, n_bad = metric_points(raw)
    assert [p["step"] for p in points] == steps
    assert n_bad == bad
    assert all(set(p) == {"step", "loss", "tokens_per_s"} for p in points)


def test_metric_points_keep_the_newest():
    points, _ = metric_points([{"step": s, "loss": 1.0} for s in range(MAX_POINTS + 10)])
    assert len(points) == MAX_POINTS
    assert points[0]["step"] == 10 and points[-1]["step"] == MAX_POINTS + 9


@pytest.mark.parametrize(
    ("device", "label", "used"),
    [
        (
            {"kind": "cuda", "index": 1, "memory_total": 8 * GIB, "memory_free": 2 * GIB},
            "cuda:1",
            0.75,
        ),
        ({"kind": "cpu", "index": 0, "memory_total": 0, "memory_free": 0}, "cpu:0", None),
        ({"kind": "cuda", "index": 0, "memory_total": GIB, "memory_free": 2 * GIB}, "cuda:0", 0.0),
        ({"kind": "mps", "memory_total": None}, "mps", None),
    ],
)
def test_device_memory_fraction(device, label, used):
    view = device_view(device)
    assert view["label"] == label
    assert view["memory_used_fraction"] == used


def test_stage_views_skip_bad_stages_and_layers():
    plan = {
        "stages": [
            {
                "index": 0,
                "node_id": "a",
                "node": "host-a",
                "devices": ["cuda:0"],
                "layers": [0, 12],
            },
            "junk",
            {"index": 1, "node_id": "b", "layers": [12, "x"]},
        ]
    }
    assert stage_views(plan) == [
        {"index": 0, "node_id": "a", "node": "host-a", "devices": ["cuda:0"], "layers": [0, 12]},
        {"index": 1, "node_id": "b", "node": "b", "devices": [], "layers": None},
    ]
    assert stage_views(None) == [] and stage_views({"stages": "x"}) == []


@pytest.mark.parametrize(
    ("raw", "rows"),
    [
        (None, []),
        ({"loss": 2.5, "perplexity": 12.2}, [{"loss": 2.5, "perplexity": 12.2}]),
        ([{"split": "val", "loss": 2.0, "nested": {"x": 1}}, 3], [{"split": "val", "loss": 2.0}]),
    ],
)
def test_evaluation_rows(raw, rows):
    assert evaluation_rows(raw) == rows


def _status(jobs=(), served=()):
    return {
        "node_id": "a",
        "name": "host-a",
        "swarm_id": "s" * 16,
        "version": "0.1.0",
        "leader": "a",
        "leader_ready": True,
        "term": 2,
        "table_version": 5,
        "peers": [
            {
                "node_id": "a",
                "name": "host-a",
                "address": "127.0.0.1:1",
                "alive": True,
                "is_leader": True,
                "last_seen_s": 0.0,
                "devices": [],
            },
            {
                "node_id": "b",
                "name": "host-b",
                "address": "127.0.0.1:2",
                "alive": False,
                "is_leader": False,
                "last_seen_s": 9.5,
                "clock_skew_s": 0.25,
                "devices": [
                    {
                        "kind": "cuda",
                        "index": 0,
                        "name": "A5000",
                        "memory_total": 24 * GIB,
                        "memory_free": 6 * GIB,
                        "compute_capability": "8.6",
                        "fake": True,
                    }
                ],
            },
        ],
        "jobs": list(jobs),
        "served": list(served),
    }


def test_dashboard_view_nodes_and_leader():
    view = dashboard_view(_status(), now=1000.0)
    assert view["generated_at"] == 1000.0 and view["leader"] == "a"
    assert [n["node_id"] for n in view["nodes"]] == ["a", "b"]
    assert view["alive"] == 1
    b = view["nodes"][1]
    assert b["clock_skew_s"] == 0.25 and b["devices"][0]["memory_used_fraction"] == 0.75
    assert view["nodes"][0]["clock_skew_s"] is None


def test_dashboard_view_jobs_and_served():
    train = {
        "job_id": "j1",
        "state": "running",
        "version": 3,
        "record": {
            "kind": "train",
            "job": {"name": "lora"},
            "plan": {
                "dtype": "bfloat16",
                "stages": [
                    {
                        "index": 0,
                        "node_id": "a",
                        "node": "host-a",
                        "devices": ["cuda:0"],
                        "layers": [0, 4],
                    }
                ],
            },
            "metrics": [
                {"step": 1, "loss": 3.0, "tokens_per_s": 50.0},
                {"step": 0, "loss": 3.5},
                "x",
            ],
            "evaluation": {"loss": 2.9},
        },
    }
    serve = {"job_id": "j2", "state": "running", "record": {"kind": "serve", "name": "embedded"}}
    done = {"job_id": "j3", "state": "completed", "record": {"kind": "serve", "name": "old"}}
    view = dashboard_view(
        _status([train, serve, done], served=[{"model": "m", "url": "http://127.0.0.1:8000/v1"}]),
        now=0.0,
    )
    job = view["jobs"][0]
    assert (job["name"], job["state"], job["dtype"], job["kind"]) == (
        "lora",
        "running",
        "bfloat16",
        "train",
    )
    assert [p["step"] for p in job["metrics"]] == [0, 1] and job["bad_metrics"] == 1
    assert job["stages"][0]["layers"] == [0, 4] and job["evaluation"] == [{"loss": 2.9}]
    assert [m["model"] for m in view["served"]] == ["m", "embedded"]


def test_dashboard_view_of_an_empty_status():
    view = dashboard_view({}, now=0.0)
    assert view["nodes"] == [] and view["jobs"] == [] and view["served"] == []


@pytest.mark.parametrize(
    ("text", "port"),
    [(None, 7738), ("", 7738), (" 0 ", 0), ("8080", 8080), ("off", None), ("OFF", None)],
)
def test_parse_dashboard_port(text, port):
    assert parse_dashboard_port(text) == port


@pytest.mark.parametrize("text", ["-1", "65536", "http", "80.5"])
def test_parse_dashboard_port_refuses(text):
    with pytest.raises(ValueError, match="SWARM_DASHBOARD_PORT"):
        parse_dashboard_port(text)


def test_dispatcher_metrics_map():
    raw = {
        "step": 4,
        "loss": 2.5,
        "tokens_per_s": 90.0,
        "losses": [[1, 0, 3.0], [1, 1, 2.9], [1, 2, 2.8], [2, 2, 2.7], [2, 3, 2.5], ["x"]],
    }
    points, bad = metric_points(raw)
    # a row's step counts from 0 (the workers'); the points carry "step N of M"'s numbers
    assert [(p["step"], p["loss"]) for p in points] == [(1, 3.0), (2, 2.9), (3, 2.7), (4, 2.5)]
    assert points[-1]["tokens_per_s"] == 90.0 and points[0]["tokens_per_s"] is None
    assert bad == 1
    only_newest, _ = metric_points({"step": 1, "loss": 3.1, "tokens_per_s": 12.0})
    assert only_newest == [{"step": 1, "loss": 3.1, "tokens_per_s": 12.0}]
    four, _ = metric_points({"losses": [[1, 5, 2.0, 33.0]]})
    assert four == [{"step": 6, "loss": 2.0, "tokens_per_s": 33.0}]
    assert metric_points({}) == ([], 0)
    assert metric_points({"losses": [[1, -1, 2.0], [1, "3", 2.0], [1, True, 2.0]]}) == ([], 3)


def test_ten_steps_of_the_leaders_metrics_draw_ten_points_of_each_curve():
    """What the leader folds from ten steps (MetricsStore, as the daemon keeps it) gives ten
    loss and ten tokens/s points over steps 1..10, the numbers "step 10 of 10" counts."""
    from swarmp2p.node.training.metrics import MetricsStore
    from swarmp2p.workers.events import StepDone

    store = MetricsStore()
    events = [
        StepDone(
            step=s,
            loss=5.0 - s / 10,
            tokens=64,
            tokens_per_s=100.0 + s,
            act_bytes=0,
            grad_bytes=0,
            step_s=0.5,
            peak_memory_bytes=0,
        )
        for s in range(10)
    ]
    store.fold("j", attempt=1, stage=1, n_stages=2, events=events)
    entry = {
        "job_id": "j",
        "state": "completed",
        "record": {"job": {"train": {"steps": 10}}, "step": 10, "metrics": store.get("j")},
    }
    job = dashboard_view({"jobs": [entry]}, now=0.0)["jobs"][0]
    assert [p["step"] for p in job["metrics"]] == list(range(1, 11))
    assert [p["tokens_per_s"] for p in job["metrics"]] == [100.0 + s for s in range(10)]
    assert job["metrics"][-1]["step"] == job["step"] == job["steps"] == 10


def test_dispatcher_job_record():
    entry = {
        "job_id": "j9",
        "state": "failed",
        "record": {
            "kind": "train",
            "job": {"name": "qlora", "train": {"steps": 50}},
            "step": 12,
            "attempt": 2,
            "reason": None,
            "error": {"stage": 1, "node": "b", "message": "CUDA out of memory"},
            "metrics": {
                "boundaries": {"1": {"act_mb_s": 3.0, "grad_mb_s": 2.0}, "0": {"act_mb_s": 1}}
            },
            "evaluation": {"before": {"loss": 3.2, "perplexity": 24.5}, "after": {"loss": 2.1}},
        },
    }
    job = dashboard_view({"jobs": [entry]}, now=0.0)["jobs"][0]
    assert (job["step"], job["steps"], job["attempt"], job["kind"]) == (12, 50, 2, "train")
    assert job["error"] == "stage 1 on b: CUDA out of memory" and job["reason"] == ""
    assert [b["stage"] for b in job["boundaries"]] == ["0", "1"]
    assert job["boundaries"][0] == {"stage": "0", "act_mb_s": 1.0, "grad_mb_s": None}
    assert job["evaluation"] == [
        {"pass": "before", "loss": 3.2, "perplexity": 24.5},
        {"pass": "after", "loss": 2.1},
    ]


def test_served_models_name_their_nodes_and_count_their_sessions():
    """A served model's stages say the peers' names (as jobs do), the node id only where no
    name is known; its sessions come through as numbers, or None while unknown."""
    ring = {
        "model": "tiny",
        "url": "http://127.0.0.1:8080",
        "state": "serving",
        "reason": "",
        "sessions": {"active": 2, "max": 4, "queued": 3, "stage_batch": [2, 2]},
        "stages": [
            {"index": 0, "node_id": "a", "node": "a", "devices": ["cpu"], "layers": [0, 2]},
            {"index": 1, "node_id": "z", "node": "z", "node_name": "host-z", "layers": [2, 4]},
            {"index": 2, "node_id": "y", "node": "y", "layers": [4, 5]},
        ],
    }
    restoring = {"model": "old", "state": "restoring", "reason": "waiting for b", "stages": []}
    view = dashboard_view(_status(served=[ring, restoring]), now=0.0)
    tiny, old = view["served"]
    assert [s["node"] for s in tiny["stages"]] == ["host-a", "host-z", "y"]
    assert [s["node_id"] for s in tiny["stages"]] == ["a", "z", "y"]
    assert tiny["sessions"] == {
        "active": 2,
        "max": 4,
        "queued": 3,
        "speculation": None,
        "prefix_cache": None,
    }
    assert (tiny["state"], old["state"], old["reason"]) == ("serving", "restoring", "waiting for b")
    assert old["sessions"] is None


def test_served_models_show_speculation_and_the_prefix_cache():
    """What `swarm status` says of a ring's speculative decoding and prefix cache reaches the
    page: acceptance and tokens a lap, why a stage declined, the cache's blocks and hits."""
    sessions = {
        "active": 0,
        "max": 4,
        "queued": 0,
        "speculate": "auto",
        "speculate_off": "",
        "speculation": {
            "laps": 40,
            "tokens": 70,
            "drafted": 60,
            "accepted": 30,
            "acceptance": 0.5,
            "tokens_per_lap": 1.75,
        },
        "prefix_cache": {
            "blocks": 12,
            "capacity": 180,
            "lookups": 5,
            "hits": 2,
            "hit_rate": 0.4,
            "reused_tokens": 128,
            "prompt_tokens": 900,
        },
    }
    off = {**sessions, "speculate_off": "stage 0 keeps a recurrent state", "prefix_cache": None}
    bad = {**sessions, "speculation": {"acceptance": float("nan"), "laps": -3}}
    none = {**sessions, "speculate": "none"}
    view = dashboard_view(
        _status(
            served=[
                {"model": m, "sessions": s}
                for m, s in (("a", sessions), ("b", off), ("c", bad), ("d", none))
            ]
        ),
        now=0.0,
    )
    a, b, c, d = (m["sessions"] for m in view["served"])
    assert a["speculation"] == {
        "mode": "auto",
        "off": "",
        "laps": 40,
        "drafted": 60,
        "acceptance": 0.5,
        "tokens_per_lap": 1.75,
    }
    assert a["prefix_cache"] == {
        "blocks": 12,
        "capacity": 180,
        "lookups": 5,
        "hits": 2,
        "hit_rate": 0.4,
        "reused_tokens": 128,
    }
    assert b["speculation"]["off"] == "stage 0 keeps a recurrent state"
    assert b["prefix_cache"] is None
    assert (c["speculation"]["acceptance"], c["speculation"]["laps"]) == (0.0, 0)
    assert d["speculation"] is None


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "x",
        {"active": 1, "max": 4},
        {"active": -1, "max": 4, "queued": 0},
        {"active": True, "max": 4, "queued": 0},
    ],
)
def test_malformed_sessions_are_unknown(raw):
    view = dashboard_view(_status(served=[{"model": "m", "sessions": raw}]), now=0.0)
    assert view["served"][0]["sessions"] is None


def test_job_stages_take_the_peers_names():
    entry = {
        "job_id": "j",
        "state": "running",
        "record": {"plan": {"stages": [{"index": 0, "node_id": "b", "node": "old-name"}]}},
    }
    job = dashboard_view(_status([entry]), now=0.0)["jobs"][0]
    assert job["stages"][0]["node"] == "host-b"


def test_a_serve_job_already_listed_by_this_node_shows_once():
    serve = {"job_id": "j2", "state": "running", "record": {"kind": "serve", "name": "m"}}
    view = dashboard_view(_status([serve], served=[{"model": "m"}]), now=0.0)
    assert [m["model"] for m in view["served"]] == ["m"]
