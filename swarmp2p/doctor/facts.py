"""`swarm doctor`'s facts (effects): NVML, a worker-environment subprocess, interfaces, the
daemon's status, TCP connects to peers, free disk; ``diagnose`` gathers them and runs the
checks. The CLI never imports torch: the worker's torch, CUDA and bitsandbytes are probed in a
subprocess of the same Python the daemon runs workers in."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from swarmp2p._install import detect, has_nvidia
from swarmp2p.doctor.checks import (
    FAIL,
    STATUSES,
    Check,
    Facts,
    Interface,
    WorkerProbe,
    peers_of,
    run_checks,
)
from swarmp2p.timings import TIMINGS

# --- gathering facts (effects) -----------------------------------------------------------------

_WORKER_PROBE = r"""
import json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda_version"] = torch.version.cuda
    out["cuda_available"] = bool(torch.cuda.is_available())
    out["devices"] = [
        [torch.cuda.get_device_name(i), "%d.%d" % torch.cuda.get_device_capability(i)]
        for i in range(torch.cuda.device_count())
    ] if out["cuda_available"] else []
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
if out.get("cuda_version"):  # what the CUDA build installed beside torch: nvidia-*, triton
    import importlib.metadata as md
    cuda = {}
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("nvidia-") or name == "triton":
            size = 0
            for f in dist.files or ():
                try:
                    size += f.locate().stat().st_size
                except OSError:
                    pass
            cuda[name] = size
    out["cuda_packages"] = cuda
print(json.dumps(out), flush=True)
try:
    import bitsandbytes
    out = {"bitsandbytes": getattr(bitsandbytes, "__version__", "?")}
except Exception as exc:
    out = {"bitsandbytes_error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(out), flush=True)
"""


def probe_worker(
    python: str = sys.executable, timeout: float = TIMINGS.doctor_worker_probe_s
) -> WorkerProbe:
    """Import torch and bitsandbytes in a fresh ``python``; a native crash is reported, not raised."""
    try:
        out = subprocess.run(
            [python, "-c", _WORKER_PROBE],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return WorkerProbe(torch_error=f"{python}: {exc}", bitsandbytes_error="not reached")
    facts: dict[str, Any] = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            try:
                facts.update(json.loads(line))
            except ValueError:
                pass
    if out.returncode != 0:
        died = f"the probe died ({_exit_text(out.returncode)}); stderr: {out.stderr.strip()[-300:]}"
        if "torch" not in facts:
            facts.setdefault("torch_error", died)
        facts.setdefault("bitsandbytes_error", died)
    return WorkerProbe(
        python=facts.get("python", ""),
        torch=facts.get("torch"),
        torch_error=facts.get("torch_error", ""),
        cuda_available=bool(facts.get("cuda_available", False)),
        cuda_version=facts.get("cuda_version"),
        devices=tuple((str(n), str(c)) for n, c in facts.get("devices", [])),
        cuda_packages=tuple(
            (str(n), int(b)) for n, b in sorted((facts.get("cuda_packages") or {}).items())
        ),
        bitsandbytes=facts.get("bitsandbytes"),
        bitsandbytes_error=facts.get("bitsandbytes_error", ""),
    )


def _exit_text(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _flags(name: str) -> int | None:
    try:
        return int(Path(f"/sys/class/net/{name}/flags").read_text().strip(), 16)
    except (OSError, ValueError):
        return None


def _interfaces(pin: str | None) -> tuple[tuple[Interface, ...], str]:
    from swarmp2p.net.discovery import list_interfaces, select_interfaces

    try:
        chosen = select_interfaces(list_interfaces(), pin)
    except ValueError as exc:
        return (), str(exc)
    return tuple(Interface(name=n, ip=ip, flags=_flags(n)) for n, ip in chosen), ""


def _reach(daemon: Mapping[str, Any], timeout: float) -> dict[str, str]:
    reach = {}
    for peer in peers_of(daemon):
        host, _, port = str(peer.get("address", "")).rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                reach[peer["node_id"]] = ""
        except (OSError, ValueError) as exc:
            reach[peer["node_id"]] = (
                getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            )
    return reach


def gather(
    state_dir: Path,
    *,
    interface: str | None = None,
    worker: bool = True,
    env: Mapping[str, str] | None = None,
    probe: Callable[[], WorkerProbe] = probe_worker,
) -> Facts:
    """Collect the facts on this machine (and from its daemon, when one runs)."""
    from swarmp2p.models import EmbeddedModelMissing, embedded_gguf, embedded_ready
    from swarmp2p.node import api, hardware
    from swarmp2p.node.state import StateDir
    from swarmp2p.plan.model_shape import cache_dir

    env = os.environ if env is None else env
    fake = env.get(hardware.FAKE_DEVICES_ENV)
    gpus, driver, gpu_error = [], "", ""
    try:
        if fake is not None:
            gpus = hardware.parse_fake_devices(fake)
        else:
            gpus, driver = hardware.probe_gpus()
    except Exception as exc:  # a bad variable, or NVML failing past "not installed"
        gpu_error = f"{type(exc).__name__}: {exc}"
    try:
        daemon = api.request(StateDir(root=state_dir).api_socket, "status", timeout=5.0)
    except (api.ApiError, ValueError, OSError):
        daemon = None
    if interface is None and daemon is not None:
        me = next((p for p in daemon["peers"] if p["node_id"] == daemon["node_id"]), None)
        if me and not str(me["address"]).startswith("0.0.0.0"):
            interface = str(me["address"]).rpartition(":")[0]
    interfaces, interface_error = _interfaces(interface)
    try:
        embedded_gguf()
        installed = True
    except EmbeddedModelMissing:
        installed = False
    hub = hardware.model_cache_dir(env)
    ours = cache_dir()
    return Facts(
        gpus=tuple(gpus),
        driver=driver,
        fake_devices=fake is not None,
        gpu_error=gpu_error,
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        worker=probe() if worker else WorkerProbe(skipped=True),
        interfaces=interfaces,
        interface_error=interface_error,
        daemon=daemon,
        reach=_reach(daemon, TIMINGS.doctor_connect_s) if daemon else {},
        disks=(
            ("Hugging Face hub cache", hub, hardware.disk_free(hub)),
            ("swarmp2p cache", ours, hardware.disk_free(ours)),
        ),
        embedded_installed=installed,
        embedded_converted=embedded_ready(),
        install=detect(),
        nvidia=has_nvidia(),
    )


def diagnose(state_dir: Path, **kwargs: Any) -> list[Check]:
    """Gather the facts and run every check (``kwargs`` as :func:`gather` takes them)."""
    return run_checks(gather(state_dir, **kwargs))


def report(checks: Sequence[Check]) -> dict[str, Any]:
    """What `swarm doctor --json` prints."""
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    return {"ok": counts[FAIL] == 0, "counts": counts, "checks": [asdict(c) for c in checks]}


def format_checks(checks: Sequence[Check]) -> str:
    """A plain text report: one line per check, its fix indented below."""
    width = max((len(c.name) for c in checks), default=0)
    lines = []
    for c in checks:
        lines.append(f"{c.status}  {c.name.ljust(width)}  {c.detail}")
        if c.fix:
            lines.append(f"      {' ' * width}  fix: {c.fix}")
    counts = report(checks)["counts"]
    lines.append("")
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)
