"""The state directory: modes, a stable node id, pid file."""

from __future__ import annotations

import os
import stat

import pytest

from swarmp2p.node.state import StateDir, default_state_dir, write_private


def test_default_follows_xdg(tmp_path):
    assert default_state_dir({"XDG_STATE_HOME": str(tmp_path)}) == tmp_path / "swarmp2p"


def test_ensure_makes_a_private_dir(tmp_path):
    state = StateDir(root=tmp_path / "s").ensure()
    assert stat.S_IMODE(state.root.stat().st_mode) == 0o700


def test_node_id_is_stable_and_settable(tmp_path):
    state = StateDir(root=tmp_path).ensure()
    first = state.node_id()
    assert first == state.node_id() == StateDir(root=tmp_path).node_id()
    assert state.node_id("b2") == "b2"
    assert state.node_id() == "b2"
    assert stat.S_IMODE(state.node_id_file.stat().st_mode) == 0o600


def test_bad_saved_node_id_names_the_file(tmp_path):
    state = StateDir(root=tmp_path).ensure()
    state.node_id_file.write_text("Not Valid\n")
    with pytest.raises(ValueError, match="node_id: node id 'Not Valid' is not valid"):
        state.node_id()


def test_write_private_is_0600(tmp_path):
    path = tmp_path / "secret"
    write_private(path, "x")
    assert path.read_text() == "x" and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_read_pid(tmp_path):
    state = StateDir(root=tmp_path).ensure()
    assert state.read_pid() is None
    state.pid_file.write_text(str(os.getpid()))
    assert state.read_pid() == os.getpid()
    state.pid_file.write_text("999999999")
    assert state.read_pid() is None
