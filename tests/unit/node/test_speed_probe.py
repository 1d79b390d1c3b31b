"""The node's speed probe plumbing: CPU share from cgroups, link speed, what the probe measures,
its cache, and the records it fills (node/speed_probe.py); the probe itself runs once."""

from __future__ import annotations

import json
import time

import pytest

from swarmp2p.node import hardware, speed_probe
from swarmp2p.node.training import jobs
from swarmp2p.plan import Node, Plan, parse_job
from swarmp2p.plan.worker_spec import local_plan
from swarmp2p.schema import to_data
from swarmp2p.timings import TIMINGS

V1 = "12:cpu,cpuacct:/lab/hostb\n0::/lab/hostb\n"


def _cgroup_v1(root, quota, period=100_000, parent_quota=-1):
    base = root / "cpu,cpuacct"
    for folder, q in ((base / "lab", parent_quota), (base / "lab" / "hostb", quota)):
        folder.mkdir(parents=True)
        (folder / "cpu.cfs_quota_us").write_text(f"{q}\n")
        (folder / "cpu.cfs_period_us").write_text(f"{period}\n")
    (base / "cpu.cfs_quota_us").write_text("-1\n")
    (base / "cpu.cfs_period_us").write_text("100000\n")
    return root


@pytest.mark.parametrize(
    ("quota", "parent", "want"),
    [(35_000, -1, 0.35), (-1, -1, None), (250_000, 150_000, 1.5), (-1, 50_000, 0.5)],
)
def test_cpu_quota_is_the_tightest_cgroup_v1_limit_up_the_tree(tmp_path, quota, parent, want):
    root = _cgroup_v1(tmp_path, quota, parent_quota=parent)
    assert speed_probe.cpu_quota(root, V1) == want


def test_cpu_quota_reads_cgroup_v2(tmp_path):
    folder = tmp_path / "lab" / "hostb"
    folder.mkdir(parents=True)
    (folder / "cpu.max").write_text("70000 100000\n")
    (tmp_path / "lab" / "cpu.max").write_text("max 100000\n")
    assert speed_probe.cpu_quota(tmp_path, "0::/lab/hostb\n") == 0.7


@pytest.mark.parametrize(
    ("affinity", "quota", "want"), [(8, None, 8), (8, 0.35, 1), (8, 2.5, 3), (2, 4.0, 2)]
)
def test_cpu_share_caps_affinity_by_the_quota(affinity, quota, want):
    assert speed_probe.cpu_share(affinity, quota) == want


@pytest.mark.parametrize(
    ("threads", "affinity", "quota", "want"),
    [(1, 8, None, 1.0), (4, 2, None, 2.0), (1, 8, 0.35, 0.35), (4, 8, 2.5, 2.5), (2, 8, 4.0, 2.0)],
)
def test_the_probe_may_keep_its_threads_busy_capped_by_affinity_and_quota(
    threads, affinity, quota, want
):
    assert speed_probe.probe_cpus(threads, affinity, quota) == want


def test_link_speed_is_the_fastest_rated_interface(tmp_path):
    for name, speed in (("eth0", "1000"), ("eth1", "10000"), ("wg0", "-1")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "speed").write_text(speed + "\n")
    assert speed_probe.link_speed(["eth0", "wg0"], tmp_path) == 125_000_000
    assert speed_probe.link_speed(["eth0", "eth1"], tmp_path) == 1_250_000_000
    assert speed_probe.link_speed(["lo", "../etc"], tmp_path) == 0


def test_machine_id_is_stable_and_shared_by_this_machine():
    assert speed_probe.machine_id() == speed_probe.machine_id() != ""


def _record(fake: str | None = None):
    env = {"SWARM_FAKE_DEVICES": fake} if fake else {}
    record, host = hardware.probe(node_id="n1", name="n1", version="1", env=env)
    return record, host


def test_the_probe_measures_what_each_device_trains_a_fake_gpu_on_the_cpu():
    fake = json.dumps(
        [
            {"name": "A5000", "memory_total": 2**34, "compute_capability": "8.6"},
            {
                "name": "1660S",
                "memory_total": 2**32,
                "compute_capability": "7.5",
                "speed": {"float16": 5e12, "float32": 4e12},
            },
        ]
    )
    record, host = _record(fake)
    assert host.cpu_cores >= 1 and host.machine == speed_probe.machine_id()
    request = speed_probe.probe_request(record, threads=1)
    got = {d["key"]: (d["torch_device"], d["dtypes"]) for d in request["devices"]}
    assert got == {
        "cuda:0": ("cpu", ["bfloat16", "float16", "float32"]),
        "cpu:0": ("cpu", ["bfloat16", "float32"]),
    }  # the 1660S came with its speed: not measured
    assert record.node.devices[1].speed.to_data() == {"float16": 5e12, "float32": 4e12}
    assert request["cpus"] == 1.0  # one thread
    assert speed_probe.probe_request(record, threads=1, quota=0.35)["cpus"] == 0.35
    assert Node.from_dict(to_data(record.node)).devices[1].speed.get("float16") == 5e12


def test_a_bad_fake_speed_names_the_field():
    with pytest.raises(ValueError, match=r"SWARM_FAKE_DEVICES\[0\]\.speed"):
        hardware.parse_fake_devices('[{"name": "x", "memory_total": 1, "speed": {"f": 1}}]')


def test_measured_speeds_fill_a_new_record():
    record, _ = _record()
    measured = record.with_speeds({"cpu:0": {"float32": 3e10}})
    assert measured.node.devices[-1].speed.to_data() == {"float32": 3e10}
    assert measured.with_speeds({"cpu:0": {"float32": 3e10}}) == measured  # no change
    assert not record.node.devices[-1].speed  # records are frozen
    with pytest.raises(ValueError, match=r"cpu:0\.float8: is not a dtype"):
        record.with_speeds({"cpu:0": {"float8": 1.0}})  # a bad cached speed is refused


def test_stages_on_one_machine_share_its_cores():
    job = parse_job({"model": {"pretrained": "embedded"}, "data": {"source": "random"}})
    from swarmp2p.plan import load_model_shape

    plan: Plan = local_plan(job, load_model_shape("embedded"), stages=3)
    plan = Plan.from_dict(
        {
            **plan.to_dict(),
            "stages": [{**s.to_dict(), "node_id": n} for s, n in zip(plan.stages, ("a", "b", "c"))],
        }
    )
    same = {"a": "m1", "b": "m1", "c": "m2"}
    assert jobs.stages_on_machine(plan, "a", same) == 2
    assert jobs.stages_on_machine(plan, "c", same) == 1
    assert jobs.stages_on_machine(plan, "a", {"a": "", "b": ""}) == 1  # unknown: its own only
    assert jobs.cpu_threads(2, jobs.stages_on_machine(plan, "a", same)) == 1


@pytest.mark.torch
@pytest.mark.slow
def test_the_probe_runs_in_a_subprocess_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(speed_probe, "PROBE_SECONDS", 0.05)
    record, _ = _record()
    env = {"XDG_CACHE_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    speeds = speed_probe.measure(record, threads=1, env=env)
    assert set(speeds) == {"cpu:0"} and speeds["cpu:0"]["float32"] > 1e8
    (cached,) = (tmp_path / "swarmp2p" / "speed").glob("*.json")
    at = json.loads(cached.read_text())["at"]
    assert speed_probe.measure(record, threads=1, env=env) == speeds
    assert json.loads(cached.read_text())["at"] == at  # the cache answered
    speed_probe.measure(record, threads=1, env=env, fresh=True)
    assert json.loads(cached.read_text())["at"] > at  # measured again
    # a day old (or dated ahead of the clock): measured again at the next start
    for age in (TIMINGS.speed_cache_s + 60, -3600):
        data = json.loads(cached.read_text())
        cached.write_text(json.dumps({**data, "at": time.time() - age}))
        before = time.time()
        speed_probe.measure(record, threads=1, env=env)
        assert json.loads(cached.read_text())["at"] >= before, age
    assert not speed_probe.can_probe({"SWARM_SPEED_PROBE": "off"})


@pytest.mark.torch
def test_a_stopping_node_kills_its_probe_and_stops_waiting_for_anothers(tmp_path):
    import fcntl
    import threading
    import time

    record, _ = _record()
    env = {"XDG_CACHE_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    stop = threading.Event()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            speed_probe.measure(record, threads=1, env=env, stop=stop)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.3)  # the probe subprocess is importing torch (seconds)
    stopped = time.monotonic()
    stop.set()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - stopped < 2.0
    assert [type(e) for e in outcome] == [speed_probe.ProbeStopped]
    assert not list((tmp_path / "swarmp2p" / "speed").glob("*.json"))  # nothing half-cached

    # another daemon holds the cache's lock (it measures): a stopping one stops waiting
    (lock_file,) = (tmp_path / "swarmp2p" / "speed").glob("*.lock")
    with open(lock_file, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stop.set()
        with pytest.raises(speed_probe.ProbeStopped):
            speed_probe.measure(record, threads=1, env=env, stop=stop)
