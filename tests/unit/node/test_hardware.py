"""Hardware probe: a fake NVML module, the real no-NVML path, SWARM_FAKE_DEVICES parsing."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

from swarmp2p.node import hardware
from swarmp2p.node.hardware import (
    GIB,
    parse_fake_devices,
    probe,
    probe_gpus,
    summary,
)
from swarmp2p.node.records import NO_HELD, Held, MemoryReport, NodeRecord
from swarmp2p.plan.hardware import Device
from swarmp2p.schema import to_data
from swarmp2p.timings import TIMINGS


class _NVMLError(Exception):
    pass


class _LibraryNotFound(_NVMLError):
    pass


def _fake_nvml(gpus, *, init_error=None, capability_error_at=None):
    """A module with NVML's surface: gpus is a list of (name, total, free, (major, minor))."""
    calls = []
    mod = types.SimpleNamespace(NVMLError=_NVMLError, calls=calls)

    def init():
        calls.append("init")
        if init_error is not None:
            raise init_error

    def capability(handle):
        if handle == capability_error_at:
            raise _NVMLError("not supported")
        return gpus[handle][3]

    mod.nvmlInit = init
    mod.nvmlShutdown = lambda: calls.append("shutdown")
    mod.nvmlSystemGetDriverVersion = lambda: b"550.54"
    mod.nvmlDeviceGetCount = lambda: len(gpus)
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetName = lambda h: gpus[h][0]
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=gpus[h][1], free=gpus[h][2])
    mod.nvmlDeviceGetCudaComputeCapability = capability
    return mod


def test_fake_nvml_reports_each_gpu():
    nvml = _fake_nvml(
        [
            ("NVIDIA RTX A5000", 24 * GIB, 20 * GIB, (8, 6)),
            (b"GTX 1660 SUPER", 6 * GIB, 5 * GIB, (7, 5)),
        ],
        capability_error_at=None,
    )
    devices, driver = probe_gpus(nvml)
    assert driver == "550.54"
    assert [d["name"] for d in devices] == ["NVIDIA RTX A5000", "GTX 1660 SUPER"]
    assert [d["compute_capability"] for d in devices] == ["8.6", "7.5"]
    assert devices[1] == {
        "kind": "cuda",
        "index": 1,
        "name": "GTX 1660 SUPER",
        "memory_total": 6 * GIB,
        "memory_free": 5 * GIB,
        "compute_capability": "7.5",
    }
    assert nvml.calls == ["init", "shutdown"]


def test_unknown_capability_is_empty_string():
    nvml = _fake_nvml([("X", GIB, GIB, (9, 0))], capability_error_at=0)
    devices, _ = probe_gpus(nvml)
    assert devices[0]["compute_capability"] == ""


def test_nvml_library_missing_is_cpu_only_quietly():
    nvml = _fake_nvml([], init_error=_LibraryNotFound("libnvidia-ml.so.1 not found"))
    assert probe_gpus(nvml) == ([], "")


def test_non_nvml_error_is_not_swallowed():
    nvml = _fake_nvml([], init_error=RuntimeError("bug"))
    with pytest.raises(RuntimeError, match="bug"):
        probe_gpus(nvml)


NODE_KEYS = {
    "node_id",
    "name",
    "ram",
    "disk_free",
    "capabilities",
    "version",
    "devices",
    "link_speed",
}
DEVICE_KEYS = {f.name for f in dataclasses.fields(Device)}  # the planner's device record


def test_real_probe_on_this_machine_without_nvml():
    # this machine has no NVIDIA driver: the real pynvml raises NVMLError_LibraryNotFound
    found, host = probe(node_id="a1", name="box", version="0.1.0", env={})
    record = found.to_data()
    assert set(record) == NODE_KEYS  # exactly the cluster.json node record of plan/
    assert record["node_id"] == "a1" and record["name"] == "box"
    assert record["capabilities"] == [] and record["version"] == "0.1.0"
    assert [d["kind"] for d in record["devices"]] == ["cpu"]
    assert record["ram"] > 0 and record["disk_free"] > 0
    assert host.driver == "" and host.cpu_cores >= 1 and host.machine
    cpu = record["devices"][0]
    assert 0 < cpu["memory_free"] <= cpu["memory_total"] == record["ram"]
    assert set(cpu) == DEVICE_KEYS
    assert NodeRecord.from_data(record, "") == found


def test_probe_with_fake_devices_env_marks_them_fake():
    record, host = probe(
        node_id="a1", name="box", version="0.1.0", env={"SWARM_FAKE_DEVICES": "A5000:24:8.6"}
    )
    gpu, cpu = record.to_data()["devices"]
    assert gpu["fake"] is True and "fake" not in cpu
    assert gpu["memory_total"] == 24 * GIB and gpu["compute_capability"] == "8.6"
    assert record.fake == {"cuda:0"}
    assert summary(record, host).startswith("1xcuda:24G,cpu:")
    assert all(set(d) == DEVICE_KEYS for d in to_data(record.node)["devices"])  # the planner's


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A5000:24", [("A5000", 24 * GIB, "")]),
        ("A5000:24:8.6, 1660S:6:7.5", [("A5000", 24 * GIB, "8.6"), ("1660S", 6 * GIB, "7.5")]),
        ("T4:0.5", [("T4", GIB // 2, "")]),
        (
            json.dumps([{"name": "M1", "kind": "mps", "memory_total": 1000, "memory_free": 10}]),
            [("M1", 1000, "")],
        ),
    ],
)
def test_fake_devices_forms(text, expected):
    devices = parse_fake_devices(text)
    assert [(d["name"], d["memory_total"], d["compute_capability"]) for d in devices] == expected
    assert all(d["fake"] is True for d in devices)
    assert [d["index"] for d in devices] == list(range(len(expected)))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is empty"),
        ("A5000", "item 0 'A5000' is not NAME:GIB"),
        ("A5000:24,oops", "item 1 'oops'"),
        ("A5000:0", "memory must be > 0"),
        ("A5000:24:eight", "is not NAME:GIB"),
        ("[1,", "not valid JSON"),
        ("[]", "non-empty JSON list"),
        ('[{"name": "x"}]', r"\[0\]\.memory_total must be a positive integer"),
        ('[{"name": "x", "memory_total": 10, "memory_free": 11}]', "memory_free must be"),
        ('[{"name": "x", "memory_total": 10, "kind": "tpu"}]', "kind 'tpu' is not one of"),
        ('[{"name": "x", "memory_total": 10, "compute_capability": "8"}]', "compute_capability"),
        ('[{"name": "x", "memory_total": 10, "vram": 1}]', r"unknown field\(s\) \['vram'\]"),
        ('[{"name": "", "memory_total": 10}]', r"\.name must be a non-empty string"),
    ],
)
def test_fake_devices_errors_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        parse_fake_devices(text)


def test_bad_env_fails_the_probe():
    with pytest.raises(ValueError, match="SWARM_FAKE_DEVICES"):
        probe(node_id="a", name="a", version="0", env={"SWARM_FAKE_DEVICES": "nope"})


def test_model_cache_dir_follows_hf_env(tmp_path):
    assert hardware.model_cache_dir({"HF_HUB_CACHE": str(tmp_path)}) == tmp_path
    assert hardware.model_cache_dir({"HF_HOME": str(tmp_path)}) == tmp_path / "hub"


def test_live_memory_re_reads_nvml_and_ram_at_most_once_a_second(tmp_path):
    gpus = [("RTX A5000", 24 * GIB, 20 * GIB, (8, 6))]
    nvml = _fake_nvml(gpus)
    calls = nvml.calls
    record, _ = hardware.probe(node_id="n1", name="n1", version="0", env={}, nvml=nvml)
    calls.clear()
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable: 64 kB\n")
    now = [0.0]
    live = hardware.LiveMemory(record, nvml=nvml, clock=lambda: now[0], meminfo=meminfo)
    assert live.read() == {"cuda:0": 20 * GIB, "cpu:0": 64 * 1024}
    gpus[0] = ("RTX A5000", 24 * GIB, 3 * GIB, (8, 6))  # a served model loaded meanwhile
    meminfo.write_text("MemAvailable: 32 kB\n")
    assert live.read()["cuda:0"] == 20 * GIB  # within the second: the last reading
    now[0] = TIMINGS.live_memory_every_s
    assert live.read() == {"cuda:0": 3 * GIB, "cpu:0": 32 * 1024}
    assert calls.count("init") == 1  # NVML stays initialised between readings


def test_a_fake_device_keeps_its_memory_and_a_report_lands_in_the_record():
    env = {hardware.FAKE_DEVICES_ENV: "A5000:24:8.6"}
    record, _ = hardware.probe(node_id="n1", name="n1", version="0", env=env)
    assert hardware.LiveMemory(record).read()["cuda:0"] == 24 * GIB
    cpu_free = record.node.devices[1].memory_free
    report = MemoryReport(free={"cuda:0": 30 * GIB}, held=Held(serve={"cuda:0": GIB}))
    after = record.with_memory(report)
    gpu, cpu = after.node.devices
    assert gpu.memory_free == 24 * GIB  # never above the total
    assert cpu.memory_free == cpu_free  # not told: kept
    assert after.held == Held(serve={"cuda:0": GIB}) and after.fake == record.fake
    assert record.held == NO_HELD  # records are frozen: a new one
