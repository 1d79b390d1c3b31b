"""This node's measured speeds and its share of the CPU. Never imports torch.

The daemon runs ``python -m swarmp2p.runtime.probe`` (a subprocess: torch lives there) once per
hardware and software version: its result is cached in ``$XDG_CACHE_HOME/swarmp2p/speed/``
under a key made of the devices, the CPU model and share, the thread count, this version and
torch's, for a day (``TIMINGS.speed_cache_s``: a probe taken while the machine was busy would
otherwise split every job by it for good); ``swarm doctor --bench`` measures again. The speeds go into the node's hardware record
(``devices[i]["speed"]``, FLOP/s per dtype), which its hello advertises and the planner reads
(``swarmp2p.plan.speed``).

The CPU share is what a node may use of this machine: its affinity, capped by its cgroup's CPU
quota (v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us`` or v2 ``cpu.max``), the way a container
or ``systemd`` slice limits it. ``machine_id`` tells daemons that share one machine apart from
separate ones (a hash of the kernel's boot id: network namespaces and containers share it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TypedDict

from swarmp2p import __version__
from swarmp2p._atomic import write_atomic
from swarmp2p.node.records import Host, NodeRecord, device_key
from swarmp2p.plan.hardware import Device
from swarmp2p.timings import TIMINGS

PROBE_ENV = "SWARM_SPEED_PROBE"
"""``off``: never measure (the planner then splits by free memory); anything else: measure."""
PROBE_SECONDS = 1.0
"""Wall time each (device, dtype) is timed (``runtime.probe.SECONDS``)."""
_CGROUP = Path("/sys/fs/cgroup")


# --- the CPU share -----------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(the cgroup v1 ``cpu`` controller's path, the v2 path) of a /proc/PID/cgroup text."""
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "cpu" in parts[1].split(","):
            v1 = parts[2]
    return v1, v2


def cpu_quota(root: Path = _CGROUP, proc_cgroup: str | None = None) -> float | None:
    """CPUs this process's cgroup may use (quota / period, the tightest up the tree); None
    when unlimited or unknown."""
    if proc_cgroup is None:
        proc_cgroup = _read(Path("/proc/self/cgroup")) or ""
    v1, v2 = _cgroup_paths(proc_cgroup)
    limits = []
    for mount, path, kind in (
        (root / "cpu", v1, 1),
        (root / "cpu,cpuacct", v1, 1),
        (root, v2, 2),
        (root / "unified", v2, 2),
    ):
        if path is None or not mount.is_dir():
            continue
        folder = mount / path.lstrip("/")
        while True:
            if kind == 1:
                quota, period = (
                    _read(folder / "cpu.cfs_quota_us"),
                    _read(folder / "cpu.cfs_period_us"),
                )
            else:
                both = (_read(folder / "cpu.max") or "").split()
                quota, period = [*both, None, None][:2]
            with contextlib.suppress(TypeError, ValueError):
                q, p = int(quota), int(period)
                if q > 0 and p > 0:
                    limits.append(q / p)
            if folder == mount or mount not in folder.parents:
                break
            folder = folder.parent
    return min(limits) if limits else None


def cpu_share(affinity: int, quota: float | None) -> int:
    """Whole CPUs a node may keep busy: its affinity, capped by its quota (at least 1)."""
    if quota is None:
        return max(affinity, 1)
    return max(1, min(affinity, math.ceil(quota - 1e-9)))


def probe_cpus(threads: int, affinity: int, quota: float | None) -> float:
    """CPUs a probe of ``threads`` threads may keep busy: its threads, capped by the affinity
    and by the quota (fractional: 0.35 of a CPU stays 0.35)."""
    cpus = float(max(1, min(threads, affinity)))
    return cpus if quota is None else min(cpus, quota)


def machine_id() -> str:
    """A short hash of the kernel's boot id: the same for every daemon on one machine (network
    namespaces and containers share the kernel), different across machines and reboots."""
    boot = _read(Path("/proc/sys/kernel/random/boot_id")) or _read(Path("/etc/machine-id")) or ""
    return hashlib.sha256(f"swarmp2p-machine:{boot}".encode()).hexdigest()[:16] if boot else ""


def link_speed(interfaces: list[str], sys_net: Path = Path("/sys/class/net")) -> int:
    """Bytes/s of the fastest of ``interfaces`` as the kernel rates it (``speed`` in Mb/s);
    0 when none says (loopback, most virtual interfaces)."""
    best = 0
    for name in interfaces:
        if "/" in name or name in (".", ".."):
            continue
        with contextlib.suppress(TypeError, ValueError):
            mbit = int(_read(sys_net / name / "speed"))  # type: ignore[arg-type]
            best = max(best, mbit * 125_000 if mbit > 0 else 0)
    return best


# --- the probe ---------------------------------------------------------------------------------


def _device_dtypes(device: Device) -> tuple[str, ...]:
    from swarmp2p.plan.hardware import supported_dtypes

    return supported_dtypes(device, explicit="bfloat16" if device.kind == "cpu" else None)


class ProbeDevice(TypedDict):
    """One device to measure: its record key, where the probe runs it, in which dtypes."""

    key: str
    torch_device: str
    dtypes: list[str]


class ProbeRequest(TypedDict):
    """What ``python -m swarmp2p.runtime.probe`` reads on stdin (JSON)."""

    devices: list[ProbeDevice]
    threads: int
    seconds: float
    cpus: float


Speeds = dict[str, dict[str, float]]
"""Device key -> dtype -> FLOP/s."""


def probe_request(record: NodeRecord, threads: int, quota: float | None = None) -> ProbeRequest:
    """What to measure: every device of ``record`` without a given speed, in every dtype it
    trains (a CPU in bfloat16 too: a job may ask for it); a fake GPU runs on the CPU. ``cpus``
    (``probe_cpus``, ``quota``: this process's cgroup quota) keeps a passing load on the
    machine out of a CPU's measured speed (``runtime.probe``)."""
    devices: list[ProbeDevice] = []
    for d in record.node.devices:
        if d.speed:
            continue  # described (a fake device with a speed): kept as given
        where = "cpu" if d.kind == "cpu" or record.is_fake(d) else device_key(d)
        devices.append(
            {"key": device_key(d), "torch_device": where, "dtypes": list(_device_dtypes(d))}
        )
    cpus = probe_cpus(threads, len(os.sched_getaffinity(0)), quota)
    return {"devices": devices, "threads": threads, "seconds": PROBE_SECONDS, "cpus": cpus}


def _cpu_model() -> str:
    text = _read(Path("/proc/cpuinfo")) or ""
    for line in text.splitlines():
        if line.startswith(("model name", "Model", "cpu model")):
            return line.split(":", 1)[-1].strip()
    return ""


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def cache_key(request: ProbeRequest, record: NodeRecord, quota: float | None) -> str:
    """The probe's cache key: the devices, the CPU and its share, the request, the versions."""
    devices = [
        {
            "kind": d.kind,
            "index": d.index,
            "name": d.name,
            "memory_total": d.memory_total,
            "compute_capability": d.compute_capability,
            "fake": True if record.is_fake(d) else None,
        }
        for d in record.node.devices
    ]
    facts = {
        "devices": devices,
        "cpu": _cpu_model(),
        "affinity": len(os.sched_getaffinity(0)),
        "quota": quota,
        "request": request,
        "swarmp2p": __version__,
        "torch": _torch_version(),
        "python": sys.version.split()[0],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def cache_folder(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    xdg = env.get("XDG_CACHE_HOME", "")
    base = (
        Path(xdg) if xdg and os.path.isabs(xdg) else Path(env.get("HOME") or Path.home()) / ".cache"
    )
    return base / "swarmp2p" / "speed"


class ProbeStopped(RuntimeError):
    """The daemon began to stop while its probe ran (or waited for another's): given up."""


def _stopped(stop: threading.Event | None) -> bool:
    return stop is not None and stop.is_set()


def _run_probe(
    request: ProbeRequest, env: Mapping[str, str], stop: threading.Event | None = None
) -> dict[str, object]:
    """The probe subprocess's answer; killed when ``stop`` is set (a daemon's shutdown never
    waits for a probe) or past ``TIMINGS.speed_probe_s``."""
    import subprocess

    run_env = {**env, "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", "")}
    if not any(d["torch_device"].startswith("cuda") for d in request["devices"]):
        run_env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU probe never initialises CUDA
    else:
        run_env.pop("CUDA_VISIBLE_DEVICES")
    run_env["OMP_NUM_THREADS"] = str(request["threads"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmp2p.runtime.probe"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=run_env,
    )
    deadline = time.monotonic() + TIMINGS.speed_probe_s
    sent: str | None = json.dumps(request)
    while True:
        try:
            stdout, stderr = proc.communicate(sent, timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            sent = None  # written once; a later communicate() only reads
            if _stopped(stop) or time.monotonic() > deadline:
                proc.kill()
                proc.communicate()
                if _stopped(stop):
                    raise ProbeStopped("the node is stopping") from None
                raise TimeoutError(
                    f"the speed probe took over {TIMINGS.speed_probe_s:g} s"
                ) from None
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (stderr or stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"the speed probe exited with {proc.returncode}: {' | '.join(tail)}")
    answer = json.loads(lines[-1])
    if not isinstance(answer, dict) or not isinstance(answer.get("speeds"), dict):
        raise RuntimeError(f"the speed probe answered {lines[-1][:200]!r}")
    return answer


def _lock(lock: IO[str], stop: threading.Event | None) -> None:
    """The cache file's lock (daemons starting together on one machine measure once); a
    stopping daemon stops waiting for it."""
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if _stopped(stop):
                raise ProbeStopped("the node is stopping") from None
            time.sleep(0.1)


def measure(
    record: NodeRecord,
    *,
    threads: int,
    env: Mapping[str, str] | None = None,
    fresh: bool = False,
    stop: threading.Event | None = None,
) -> Speeds:
    """``{device key: {dtype: FLOP/s}}`` for ``record``'s devices: from the cache, else (or when
    ``fresh``) measured by the probe subprocess and cached. Blocks for the probe (seconds);
    daemons starting together on one machine measure once (a lock on the cache file).
    ``stop`` set: ``ProbeStopped`` at once, the probe killed."""
    env = os.environ if env is None else env
    quota = cpu_quota()
    request = probe_request(record, threads, quota)
    if not request["devices"]:
        return {}
    path = cache_folder(env) / f"{cache_key(request, record, quota)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        _lock(lock, stop)
        if not fresh:
            cached = _cached(path)
            if cached is not None:
                return cached
        answer = _run_probe(request, env, stop)
        speeds = {
            str(k): {
                str(dt): float(v) for dt, v in per.items() if isinstance(v, (int, float)) and v > 0
            }
            for k, per in answer["speeds"].items()
            if isinstance(per, dict)
        }
        payload = {
            "speeds": speeds,
            "errors": answer.get("errors") or {},
            "at": time.time(),
            "request": request,
            "torch": answer.get("torch"),
        }
        write_atomic(path, json.dumps(payload, indent=1, sort_keys=True))
        return speeds


def _cached(path: Path, now: float | None = None) -> dict[str, dict[str, float]] | None:
    """The speeds cached in ``path``; None when there are none, or they are older than
    ``TIMINGS.speed_cache_s`` (or dated in the future: a clock set back)."""
    try:
        data = json.loads(path.read_text())
        speeds, at = data["speeds"], float(data["at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    age = (time.time() if now is None else now) - at
    if not 0 <= age <= TIMINGS.speed_cache_s:
        return None
    return speeds if isinstance(speeds, dict) else None


def can_probe(env: Mapping[str, str]) -> bool:
    """Whether this node measures: not switched off, and torch is importable here."""
    if env.get(PROBE_ENV, "").strip().lower() in ("off", "0", "no", "false"):
        return False
    return importlib.util.find_spec("torch") is not None


async def measure_node(
    record: NodeRecord,
    host: Host,
    env: Mapping[str, str],
    *,
    fresh: bool = False,
    stop: threading.Event | None = None,
) -> Speeds:
    """``measure`` for a daemon, on a thread with ``OMP_NUM_THREADS`` (else the host's cores)
    threads; each checked as a record takes it (``NodeRecord.with_speeds``). Nothing where the
    node does not measure or it stops; a failed probe is logged (``fresh``: raised)."""
    import asyncio
    import logging

    if not can_probe(env):
        return {}
    omp = str(env.get("OMP_NUM_THREADS", "")).strip()
    threads = int(omp) if omp.isdigit() and int(omp) > 0 else host.cpu_cores
    try:
        speeds = await asyncio.to_thread(
            measure, record, threads=threads, env=env, fresh=fresh, stop=stop
        )
        record.with_speeds(speeds)  # a bad cached speed: ValueError
        return speeds
    except ProbeStopped:
        return {}
    except (OSError, RuntimeError, ValueError, TimeoutError) as exc:
        logging.getLogger("swarmp2p.node").warning(
            "speed probe failed (the planner splits by free memory): %s", exc
        )
        if fresh:
            raise
        return {}


__all__ = [
    "PROBE_ENV",
    "ProbeStopped",
    "cache_folder",
    "can_probe",
    "cpu_quota",
    "cpu_share",
    "link_speed",
    "machine_id",
    "measure",
    "measure_node",
    "probe_cpus",
    "probe_request",
]
