"""Where a daemon logs: one destination under systemd (the journal), both by hand."""

from __future__ import annotations

import os

import pytest

from swarmp2p.node.config import log_destinations


def test_by_hand_the_foreground_logs_to_the_file_and_stderr():
    assert log_destinations(True, {}) == (True, True)
    assert log_destinations(False, {}) == (True, False)


def test_under_systemd_the_journal_alone(tmp_path):
    with open(tmp_path / "stderr", "w") as f:
        st = os.fstat(f.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert log_destinations(True, env, stderr_fd=f.fileno()) == (False, True)
        # a child whose stderr was redirected elsewhere inherits the variable: not the journal
        with open(tmp_path / "other", "w") as g:
            assert log_destinations(True, env, stderr_fd=g.fileno()) == (True, True)


@pytest.mark.parametrize(
    ("value", "want"), [("file", (True, False)), ("stderr", (False, True)), ("Both", (True, True))]
)
def test_swarm_log_decides(value, want):
    assert log_destinations(True, {"SWARM_LOG": value, "JOURNAL_STREAM": "1:2"}) == want


def test_a_bad_swarm_log_is_refused():
    with pytest.raises(ValueError, match="SWARM_LOG='journal' is not one of file, stderr, both"):
        log_destinations(True, {"SWARM_LOG": "journal"})
