"""Suite-wide fixtures: every test leaves no thread and no child process behind."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

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


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fail a test that leaks a Python thread or a child process."""
    threads, children = _threads(), _children()
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        new_threads = _threads() - threads
        new_children = _children() - children
        if (not new_threads and not new_children) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    problems = []
    if new_threads:
        problems.append("threads: " + ", ".join(sorted(t.name for t in new_threads)))
    if new_children:
        problems.append("child processes: " + ", ".join(map(str, sorted(new_children))))
    if problems:
        pytest.fail(f"{request.node.nodeid} leaked " + "; ".join(problems), pytrace=False)
