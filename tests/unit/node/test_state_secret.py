"""The swarm secret in the state dir: created once, reused, refused for another swarm."""

from __future__ import annotations

import stat

import pytest

from swarmp2p.client.control import join_command, swarm_secret
from swarmp2p.net.security import SwarmSecret
from swarmp2p.node.state import StateDir


def test_created_once_then_reused(tmp_path):
    state = StateDir(root=tmp_path).ensure()
    secret, created = swarm_secret(state, None)
    assert created and stat.S_IMODE(state.secret_file.stat().st_mode) == 0o600
    again, created_again = swarm_secret(state, None)
    assert again == secret and not created_again
    assert join_command().startswith("swarm up --token -")
    assert secret.token not in join_command()


def test_token_joins_and_is_saved(tmp_path):
    state = StateDir(root=tmp_path).ensure()
    token = SwarmSecret.generate().token
    secret, created = swarm_secret(state, token)
    assert not created and secret.token == token
    assert swarm_secret(state, None)[0] == secret
    assert swarm_secret(state, token)[0] == secret


def test_other_swarms_token_is_refused(tmp_path):
    state = StateDir(root=tmp_path).ensure()
    swarm_secret(state, None)
    with pytest.raises(ValueError, match=r"already belongs to swarm .* use another --state-dir"):
        swarm_secret(state, SwarmSecret.generate().token)
