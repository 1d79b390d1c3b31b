"""Hardware probe: GPUs through NVML (nvidia-ml-py), CPU cores, RAM, free disk; fake devices.

``probe`` returns this machine's :class:`~swarmp2p.node.records.NodeRecord` (the planner's
node, bytes everywhere, and which devices are fake) and its :class:`~swarmp2p.node.records.Host`
facts, which the planner does not take.

``SWARM_FAKE_DEVICES`` (tests and demos only) replaces the GPUs NVML would report with
described ones, each marked ``"fake": true``. Two forms:

- short: ``"A5000:24,1660S:6"`` -- comma-separated ``NAME:GIB[:CAPABILITY]`` CUDA devices
  (memory in GiB, all free; capability like ``8.6``, ``""`` when left out);
- JSON: a list of device objects with at least ``name`` and ``memory_total`` (bytes);
  ``kind`` defaults to ``"cuda"``, ``memory_free`` to ``memory_total``,
  ``compute_capability`` to ``""``, ``index`` to the position; ``speed`` (FLOP/s per dtype,
  ``{"float32": 2e10}``) stands in for a measurement (the speed probe measures the others).

The host's ``cpu_cores`` is the CPUs this node may keep busy (affinity capped by its cgroup's
quota, ``node.speed_probe``), ``cpu_quota`` that quota (None: unlimited) and ``machine`` a hash
telling daemons on one machine from separate ones.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import TypedDict

from swarmp2p.node.records import Host, NodeRecord, device_key
from swarmp2p.timings import TIMINGS

FAKE_DEVICES_ENV = "SWARM_FAKE_DEVICES"
"""Environment variable describing fake devices (see the module docstring)."""

DEVICE_KINDS = ("cuda", "cpu", "mps")
GIB = 1 << 30


class DeviceData(TypedDict, total=False):
    """A device in cluster.json form as the probe builds it (``fake`` on a described one)."""

    kind: str
    index: int
    name: str
    memory_total: int
    memory_free: int
    compute_capability: str
    speed: dict[str, float]
    fake: bool


_SHORT_ITEM = re.compile(r"^([A-Za-z0-9 ._-]+):(\d+(?:\.\d+)?)(?::(\d+\.\d+))?$")


def parse_fake_devices(text: str) -> list[DeviceData]:
    """Parse a ``SWARM_FAKE_DEVICES`` value into device dicts marked ``fake``; ValueError if bad."""
    text = text.strip()
    if not text:
        raise ValueError(
            f"{FAKE_DEVICES_ENV} is empty; unset it or describe devices like 'A5000:24'"
        )
    if text.startswith("["):
        return _parse_fake_json(text)
    devices = []
    for index, item in enumerate(text.split(",")):
        match = _SHORT_ITEM.match(item.strip())
        if match is None:
            raise ValueError(
                f"{FAKE_DEVICES_ENV} item {index} {item.strip()!r} is not NAME:GIB[:CAPABILITY]; "
                "write e.g. 'A5000:24:8.6,1660S:6' or a JSON list of device objects"
            )
        name, gib, capability = match.group(1).strip(), float(match.group(2)), match.group(3)
        if gib <= 0:
            raise ValueError(f"{FAKE_DEVICES_ENV} item {index} {name!r}: memory must be > 0 GiB")
        memory = int(gib * GIB)
        devices.append(_device("cuda", index, name, memory, memory, capability or "", fake=True))
    return devices


def _parse_fake_json(text: str) -> list[DeviceData]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{FAKE_DEVICES_ENV} is not valid JSON: {exc}") from None
    if not isinstance(items, list) or not items:
        raise ValueError(f"{FAKE_DEVICES_ENV} must be a non-empty JSON list of device objects")
    devices = []
    for index, item in enumerate(items):
        where = f"{FAKE_DEVICES_ENV}[{index}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object, got {type(item).__name__}")
        unknown = set(item) - set(DeviceData.__annotations__)
        if unknown:
            raise ValueError(f"{where} has unknown field(s) {sorted(unknown)}")
        kind = item.get("kind", "cuda")
        if kind not in DEVICE_KINDS:
            raise ValueError(f"{where}.kind {kind!r} is not one of {list(DEVICE_KINDS)}")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name must be a non-empty string")
        total = item.get("memory_total")
        if not isinstance(total, int) or isinstance(total, bool) or total <= 0:
            raise ValueError(
                f"{where}.memory_total must be a positive integer (bytes), got {total!r}"
            )
        free = item.get("memory_free", total)
        if not isinstance(free, int) or isinstance(free, bool) or not 0 <= free <= total:
            raise ValueError(
                f"{where}.memory_free must be an integer in [0, memory_total], got {free!r}"
            )
        capability = item.get("compute_capability", "")
        if not isinstance(capability, str) or (
            capability and not re.match(r"^\d+\.\d+$", capability)
        ):
            raise ValueError(
                f"{where}.compute_capability must be like '8.6' or '', got {capability!r}"
            )
        idx = item.get("index", index)
        if not isinstance(idx, int) or isinstance(idx, bool) or idx < 0:
            raise ValueError(f"{where}.index must be a non-negative integer, got {idx!r}")
        device = _device(kind, idx, name, total, free, capability, fake=True)
        if "speed" in item:  # measured speeds as described: the probe leaves them
            device["speed"] = _fake_speed(item["speed"], f"{where}.speed")
        devices.append(device)
    return devices


def _fake_speed(value: object, where: str) -> dict[str, float]:
    from swarmp2p.plan.hardware import Speeds
    from swarmp2p.schema import SchemaError

    try:
        return Speeds.from_data(value, where).to_data()
    except (SchemaError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _device(
    kind: str, index: int, name: str, total: int, free: int, capability: str, *, fake: bool
) -> DeviceData:
    device: DeviceData = {
        "kind": kind,
        "index": index,
        "name": name,
        "memory_total": total,
        "memory_free": free,
        "compute_capability": capability,
    }
    if fake:
        device["fake"] = True
    return device


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def probe_gpus(nvml: ModuleType | None = None) -> tuple[list[DeviceData], str]:
    """CUDA devices and the driver version from NVML; ``([], "")`` quietly when NVML is absent."""
    if nvml is None:
        try:
            import pynvml as nvml  # provided by nvidia-ml-py
        except ImportError:
            return [], ""
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: a CPU machine
        if isinstance(exc, getattr(nvml, "NVMLError", ())):
            return [], ""
        raise
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        devices = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
                capability = f"{major}.{minor}"
            except nvml.NVMLError:
                capability = ""
            name = _text(nvml.nvmlDeviceGetName(handle))
            devices.append(
                _device(
                    "cuda", index, name, int(memory.total), int(memory.free), capability, fake=False
                )
            )
        return devices, driver
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def model_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where model weights are cached (the Hugging Face hub cache); its disk is what we report."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def disk_free(path: Path) -> int:
    """Free bytes on the disk that holds ``path`` (its nearest existing parent); 0 if none."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return 0


def probe(
    *,
    node_id: str,
    name: str,
    version: str,
    capabilities: list[str] | None = None,
    env: Mapping[str, str] | None = None,
    nvml: ModuleType | None = None,
) -> tuple[NodeRecord, Host]:
    """This machine's node record and host facts; ``SWARM_FAKE_DEVICES`` in ``env`` replaces
    the GPUs. ``capabilities`` are the runtime features this node declares (none by default)."""
    env = os.environ if env is None else env
    fake = env.get(FAKE_DEVICES_ENV)
    if fake is not None:
        gpus, driver = parse_fake_devices(fake), ""
    else:
        gpus, driver = probe_gpus(nvml)
    ram = _ram_bytes()
    cpu = _device("cpu", 0, "cpu", ram, _available_ram(ram), "", fake=False)
    data = {
        "node_id": node_id,
        "name": name,
        "ram": ram,
        "disk_free": disk_free(model_cache_dir(env)),
        "capabilities": sorted(capabilities or []),
        "version": version,
        "devices": [*gpus, cpu],
    }
    from swarmp2p.node.speed_probe import cpu_quota, cpu_share, machine_id

    quota = cpu_quota()
    host = Host(
        cpu_cores=cpu_share(_cpu_cores(), quota),
        cpu_quota=quota,
        machine=machine_id(),
        driver=driver,
    )
    return NodeRecord.from_data(data, ""), host


def _available_ram(total: int, meminfo: Path = Path("/proc/meminfo")) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total


# --- live memory --------------------------------------------------------------------------------


class LiveMemory:
    """This node's free memory per device, re-read: NVML for real GPUs (initialised once),
    MemAvailable for the CPU; a fake device keeps what ``SWARM_FAKE_DEVICES`` says."""

    def __init__(
        self,
        record: NodeRecord,
        *,
        nvml: ModuleType | None = None,
        clock: Callable[[], float] | None = None,
        meminfo: Path = Path("/proc/meminfo"),
    ) -> None:
        import time

        self._devices = record.node.devices
        self._real = [d.index for d in self._devices if d.kind == "cuda" and not record.is_fake(d)]
        self._nvml = nvml
        self._handles: dict[int, object] | None = None
        self._clock = clock or time.monotonic
        self._meminfo = meminfo
        self._at = -1e18
        self._last: dict[str, int] = {}

    def _gpu_free(self) -> dict[int, int]:
        if not self._real:
            return {}
        try:
            if self._handles is None:
                nvml = self._nvml
                if nvml is None:
                    import pynvml as nvml  # provided by nvidia-ml-py
                nvml.nvmlInit()
                self._nvml = nvml
                self._handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in self._real}
            nvml = self._nvml
            assert nvml is not None
            return {i: int(nvml.nvmlDeviceGetMemoryInfo(h).free) for i, h in self._handles.items()}
        except Exception:  # NVML gone (driver reload): keep the last values
            self._handles = None
            return {}

    def read(self) -> dict[str, int]:
        """``{device key: free bytes}`` now (or as of at most ``Timings.live_memory_every_s`` ago)."""
        now = self._clock()
        if now - self._at < TIMINGS.live_memory_every_s and self._last:
            return self._last
        gpus = self._gpu_free()
        out = {}
        for d in self._devices:
            key = device_key(d)
            if d.kind == "cpu":
                out[key] = _available_ram(d.memory_total, self._meminfo)
            elif d.kind == "cuda" and d.index in gpus:
                out[key] = gpus[d.index]
            else:
                out[key] = d.memory_free
        self._at, self._last = now, out
        return out


def free_disk(env: Mapping[str, str] | None = None) -> int:
    """Free bytes where this node keeps model files now."""
    return disk_free(model_cache_dir(env))


def summary(record: NodeRecord, host: Host) -> str:
    """A short hardware line for the mDNS TXT record, e.g. ``"2xcuda:30G,cpu:4c/23G"``."""
    gpus = [d for d in record.node.devices if d.kind != "cpu"]
    parts = []
    if gpus:
        total = sum(d.memory_total for d in gpus) // GIB
        parts.append(f"{len(gpus)}x{gpus[0].kind}:{total}G")
    parts.append(f"cpu:{host.cpu_cores}c/{record.node.ram // GIB}G")
    return ",".join(parts)
