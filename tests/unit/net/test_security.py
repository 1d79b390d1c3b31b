"""Swarm secret: token round trip, typo detection, derived ids/keys, 0600 files."""

from __future__ import annotations

import os
import stat

import pytest
import zmq

from swarmp2p.net import SwarmSecret
from swarmp2p.net.security import TOKEN_PREFIX


def test_token_round_trip_and_shape():
    s = SwarmSecret.generate()
    tok = s.token
    assert tok.startswith(TOKEN_PREFIX) and tok == tok.lower() and "=" not in tok
    assert SwarmSecret.from_token(tok) == s
    assert SwarmSecret.from_token("  " + tok.upper().replace("SWARM1-", "swarm1-") + "\n") == s
    assert SwarmSecret.generate() != s


@pytest.mark.parametrize(
    ("mangle", "match"),
    [
        (lambda t: t.replace("swarm1-", "swarm2-"), "must start with 'swarm1-'"),
        (lambda t: t[:-3], "cut short"),
        (lambda t: t + t[7:], "cut short or pasted twice"),
        (lambda t: t[:-1] + ("1" if t[-1] != "1" else "8"), "not base32"),
        (lambda t: t[:20] + ("a" if t[20] != "a" else "b") + t[21:], "checksum does not match"),
        (lambda t: t[:10] + t[11] + t[10] + t[12:], "checksum|not base32"),
    ],
)
def test_mistyped_tokens_are_refused_clearly(mangle, match):
    tok = SwarmSecret.generate().token
    bad = mangle(tok)
    if bad == tok:  # a swap of two equal characters is no typo
        return
    with pytest.raises(ValueError, match=match):
        SwarmSecret.from_token(bad)


def test_every_single_character_typo_is_caught():
    tok = SwarmSecret.generate().token
    alphabet = "abcdefghijklmnopqrstuvwxyz234567"
    caught = 0
    for i in range(len(TOKEN_PREFIX), len(tok)):
        c = alphabet[(alphabet.index(tok[i]) + 1) % 32]
        try:
            SwarmSecret.from_token(tok[:i] + c + tok[i + 1 :])
        except ValueError:
            caught += 1
    assert caught == len(tok) - len(TOKEN_PREFIX)  # including the last, partly-padding one


def test_derived_values_are_stable_distinct_and_public_safe():
    s = SwarmSecret(bytes(range(32)))
    t = SwarmSecret(bytes(range(1, 33)))
    assert len(s.swarm_id) == 16 and int(s.swarm_id, 16) >= 0
    assert s.swarm_id == SwarmSecret(bytes(range(32))).swarm_id != t.swarm_id
    pub, sec = s.curve_keypair()
    assert len(pub) == len(sec) == 40
    assert zmq.curve_public(sec) == pub
    assert s.curve_keypair() == SwarmSecret(bytes(range(32))).curve_keypair() != t.curve_keypair()
    assert bytes(range(32)).hex() not in repr(s) and s.token not in repr(s)


def test_constructor_checks_length():
    with pytest.raises(ValueError, match="32 bytes, got 31"):
        SwarmSecret(b"x" * 31)


def test_save_is_0600_atomic_and_loads_back(tmp_path):
    s = SwarmSecret.generate()
    path = tmp_path / "sub" / "swarm.secret"
    old = os.umask(0o000)
    try:
        s.save(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert SwarmSecret.load(path) == s
    assert [p.name for p in path.parent.iterdir()] == ["swarm.secret"]  # no temp left
    s2 = SwarmSecret.generate()
    s2.save(path)  # replaces
    assert SwarmSecret.load(path) == s2


def test_load_refuses_a_file_others_can_read(tmp_path):
    path = tmp_path / "swarm.secret"
    SwarmSecret.generate().save(path)
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        SwarmSecret.load(path)


def test_load_reports_a_corrupt_file(tmp_path):
    path = tmp_path / "swarm.secret"
    path.write_text("swarm1-nonsense\n")
    os.chmod(path, 0o600)
    with pytest.raises(ValueError, match=str(path)):
        SwarmSecret.load(path)
