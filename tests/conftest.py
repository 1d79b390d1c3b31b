"""Suite-wide fixtures: every test leaves no thread and no child process behind."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

# No test downloads from a hub; a test that tries fails instead of hanging on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):  # set by xdist before it reads this file
    # The suite's xdist workers share the machine's cores: one torch (OpenMP) thread each, and
    # for what they start unless a test says otherwise (the daemons' workers mostly do). Two
    # threads per worker, spinning beside the other worker's, ran tests/unit/train 3.7x slower
    # (88 s against 24 s, two pytest processes side by side on the 2-core box).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

try:  # tqdm's monitor thread outlives every progress bar; it is not ours to leak
    import tqdm

    tqdm.tqdm.monitor_interval = 0
except ImportError:
    pass


def _group(where: str) -> tuple[int, str | None]:
    """(the order its group is handed out in, the group) of a test file, for the suite's
    command: ``pytest -n 2 --dist loadgroup --no-loadscope-reorder``. A group runs on one
    worker, one test at a time.

    - The network-namespace hosts share one bridge and its addresses: one group, first (the
      longest stream).
    - Every other file that starts processes is a group of its own, so its module fixtures
      (a pipx install, a trained model) are built once: the installs next (the longest file),
      then the daemon and worker files. Their daemons run on loopback without mDNS (the
      harness passes ``--no-mdns``; the one mDNS file sees only its own nodes), so two files
      side by side do not see each other.
    - Unit tests last, to whichever worker is free, one test at a time (xdist hands each
      worker two at the start, so the two longest come first). A unit file whose module
      fixture is too dear to build twice names its own ``xdist_group`` (test_embedded.py: a
      conversion in a fresh cache, 27 s); whole files as groups ran the suite 2 min slower."""
    if where.startswith("tests/system/"):
        return 0, "hosts"
    if where.startswith(("tests/integration/", "tests/security/")):
        return (1 if where.endswith("/test_install.py") else 2), where
    return 3, None


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parents[1]
    rank = {}
    for item in items:
        where = Path(str(item.fspath)).resolve().relative_to(root).as_posix()
        rank[item.nodeid], group = _group(where)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: rank[item.nodeid])


LEAK_GRACE_S = 2.0
"""How long a test's threads and children get to finish after it returns."""


def _children() -> set[int]:
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            pass
    return pids


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fail a test that leaks a Python thread, a child process, or a changed umask."""
    threads, children, umask = _threads(), _children(), _umask()
    yield
    if "swarmp2p.net.links" in sys.modules:
        # zero-copy sends start pyzmq's process-wide collector thread; it is ours to stop
        from swarmp2p.net.links import stop_zero_copy_collector

        assert stop_zero_copy_collector(), "a zero-copy send buffer was never released"
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        new_threads = _threads() - threads
        new_children = _children() - children
        if (not new_threads and not new_children) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    problems = []
    if _umask() != umask:
        problems.append(f"the process umask: {oct(umask)} became {oct(_umask())}")
        os.umask(umask)
    if new_threads:
        problems.append("threads: " + ", ".join(sorted(t.name for t in new_threads)))
    if new_children:
        problems.append("child processes: " + ", ".join(map(str, sorted(new_children))))
    if problems:
        pytest.fail(f"{request.node.nodeid} leaked " + "; ".join(problems), pytrace=False)
