"""Linux cgroup CPU quotas for tests: a slower machine, simulated on this one.

``CpuQuota(name, cpus)`` makes ``/sys/fs/cgroup/cpu/<name>`` (cgroup v1) with
``cpu.cfs_quota_us = cpus x cpu.cfs_period_us``; ``add(pid)`` moves a process (all its threads;
its children follow it), ``remove()`` moves what is left back to the root group and deletes the
group. ``why_not()`` says why quotas cannot be made here (not root, no v1 cpu controller).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def why_not() -> str | None:
    """Why this machine cannot make CPU quota groups (None: it can)."""
    if os.geteuid() != 0:
        return "cgroup CPU quotas need root (CI runs these tests as root)"
    if not (ROOT / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {ROOT}"
    try:
        probe = CpuQuota(f"swarmp2p-probe-{secrets.token_hex(3)}", 1.0)
        probe.remove()
    except OSError as exc:
        return f"cannot make a cgroup under {ROOT}: {exc}"
    return None


class CpuQuota:
    """One cgroup whose processes share ``cpus`` CPUs' worth of time."""

    def __init__(self, name: str, cpus: float) -> None:
        self.path = ROOT / name
        self.path.mkdir()
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(int(cpus * PERIOD_US)))

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def add(self, pid: int) -> None:
        self.procs.write_text(str(pid))

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self.procs.read_text().split()]
        except FileNotFoundError:
            return []

    def throttled_us(self) -> int:
        """Microseconds its processes waited for quota (cpu.stat ``throttled_time`` is ns)."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            if line.startswith("throttled_time "):
                return int(line.split()[1]) // 1000
        return 0

    def remove(self) -> None:
        """Move what is left to the root group and delete this one."""
        if not self.path.exists():
            return
        for pid in self.pids():
            try:
                (ROOT / "cgroup.procs").write_text(str(pid))
            except OSError:  # it exited meanwhile
                pass
        self.path.rmdir()


def prefix(quota: CpuQuota) -> list[str]:
    """A command prefix that runs the command inside ``quota`` (``sh`` moves itself in, then
    execs it): for a daemon started under a quota from its first instruction."""
    return ["sh", "-c", f'echo $$ > {quota.procs} && exec "$@"', "cpu-quota"]
