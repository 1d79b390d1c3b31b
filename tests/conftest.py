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

try:  # tqdm's monitor thread outlives every progress bar; it is not ours to leak
    import tqdm

    tqdm.tqdm.monitor_interval = 0
except ImportError:
    pass

SERIAL_GROUPS = (
    ("tests/integration/test_install.py", "hosts"),
    ("tests/system/", "hosts"),
    ("tests/integration/", "daemons"),
    ("tests/security/", "daemons"),
)
"""Under the suite's command (``pytest -n 2 --dist loadgroup --no-loadscope-reorder``) the
tests that start daemons run one at a time per group, a group to a worker: daemons on this
machine's loopback (mDNS on 127.0.0.1) in one stream; network-namespace hosts and the installs
(fresh HOMEs, no mDNS; about as long together as the loopback stream) in the other. Unit tests
fill both workers around them. Two loopback swarms at once would see each other's adverts."""

GROUP_ORDER = {"daemons": 0, "hosts": 1, None: 2}
"""The order the groups are handed out in: xdist gives each worker two units at the start, so
the two streams come first (one to each worker), then the unit tests to whichever is free."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parents[1]
    groups = {}
    for item in items:
        where = Path(str(item.fspath)).resolve().relative_to(root).as_posix()
        groups[item.nodeid] = None
        for prefix, group in SERIAL_GROUPS:
            if where.startswith(prefix):
                item.add_marker(pytest.mark.xdist_group(group))
                groups[item.nodeid] = group
                break
    items.sort(key=lambda item: GROUP_ORDER[groups[item.nodeid]])


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
