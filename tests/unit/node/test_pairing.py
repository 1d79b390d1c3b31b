"""Pairing codes: parsing, the SPAKE2 exchange with an invite book, tries per source address
and burning, replay."""

from __future__ import annotations

import secrets

import pytest
from spake2 import SPAKE2_A

from swarmp2p.errors import SwarmError, UserError
from swarmp2p.node.cluster import pairing
from swarmp2p.node.cluster.pairing import Invites, PairFinish, PairStart, parse_code
from swarmp2p.timings import TIMINGS


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _joiner(code: str, nameplate: str, book: Invites, source: str = "10.0.0.2"):
    """The joiner's half up to its check of the inviter's MAC: (ok, session, key, mine, reply)."""
    joiner = SPAKE2_A(code.encode(), **pairing._IDS)
    mine, session = joiner.start(), secrets.token_bytes(16)
    reply = book.start(PairStart(nameplate=nameplate, session=session, spake=mine), source)
    key = joiner.finish(reply.spake)
    ok = reply.confirm == pairing._mac(key, b"inviter", session + mine + reply.spake)
    return ok, session, key, mine, reply


def _finish(book, session, key, mine, reply):
    confirm = pairing._mac(key, b"joiner", session + mine + reply.spake)
    return book.finish(PairFinish(session=session, confirm=confirm))


@pytest.mark.parametrize(
    ("typed", "expected"),
    [
        ("42-otter-violin-maple", ("42", "42-otter-violin-maple")),
        ("  42 Otter VIOLIN  maple ", ("42", "42-otter-violin-maple")),
        ("42_otter-violin maple", ("42", "42-otter-violin-maple")),
    ],
)
def test_a_code_is_read_however_it_was_typed(typed, expected):
    assert parse_code(typed) == expected


@pytest.mark.parametrize(
    ("typed", "message"),
    [
        ("otter-violin-maple", "number and 3 words"),
        ("42-otter-violin", "number and 3 words"),
        ("42-otter-violin-mapel", "mapel are not code words"),
        ("", "number and 3 words"),
    ],
)
def test_a_bad_code_says_what_is_wrong(typed, message):
    with pytest.raises(UserError, match=message):
        parse_code(typed)


def test_the_right_code_pairs_once_and_the_invite_is_gone():
    clock = Clock()
    book = Invites(clock)
    invite = book.create()
    ok, *rest = _joiner(invite.code, invite.nameplate, book)
    assert ok
    got, key = _finish(book, *rest)
    assert got is invite and key == rest[1]
    assert invite.nameplate not in book.by_plate  # one time
    clock.now += 5
    with pytest.raises(UserError, match="no open invite"):
        _joiner(invite.code, invite.nameplate, book)


def _wrong(invite) -> str:
    plate = invite.nameplate
    wrong = f"{plate}-otter-otter-otter"
    return wrong if invite.code != wrong else f"{plate}-lion-lion-lion"


def test_three_wrong_codes_from_one_address_lock_it_out_but_not_the_joiner():
    """A bystander throws junk at an advertised nameplate: its own address runs out of tries,
    rate-limited, and the real joiner on another address still pairs (issue 24)."""
    clock = Clock()
    book = Invites(clock)
    invite = book.create()
    plate, wrong = invite.nameplate, _wrong(invite)
    lefts = []
    for i in range(pairing.MAX_TRIES):
        ok, session, key, mine, reply = _joiner(wrong, plate, book, "10.0.0.66")
        assert not ok  # the joiner sees the wrong code from the inviter's MAC
        lefts.append(reply.tries_left)
        if i == 0:
            with pytest.raises(SwarmError, match="one try per"):
                _joiner(wrong, plate, book, "10.0.0.66")  # at once again: slowed, no try used
        with pytest.raises(UserError, match="does not match"):
            _finish(book, session, key, mine, reply)  # and a finish anyway is refused
        clock.now += TIMINGS.pairing_try_every_s
    assert lefts == [2, 1, 0]
    with pytest.raises(UserError, match=r"10\.0\.0\.66\) used its 3 tries"):
        _joiner(invite.code, plate, book, "10.0.0.66")  # the bystander has no try left
    assert plate in book.by_plate
    ok, *rest = _joiner(invite.code, plate, book, "10.0.0.2")  # the joiner, same second
    assert ok and _finish(book, *rest)[0] is invite


def test_an_invite_burns_after_its_guesses_from_all_addresses():
    clock = Clock()
    book = Invites(clock)
    invite = book.create()
    plate, wrong = invite.nameplate, _wrong(invite)
    sources = [f"10.0.1.{i}" for i in range(pairing.MAX_GUESSES // pairing.MAX_TRIES)]
    for _ in range(pairing.MAX_TRIES):
        for source in sources:
            ok, session, key, mine, reply = _joiner(wrong, plate, book, source)
            assert not ok
            with pytest.raises(UserError, match="does not match"):
                _finish(book, session, key, mine, reply)
        clock.now += TIMINGS.pairing_try_every_s
    assert invite.guesses_left == 0 and reply.tries_left == 0
    with pytest.raises(UserError, match=r"no open invite|burnt"):
        _joiner(invite.code, plate, book, "10.0.0.2")  # the right code now: too late
    assert plate not in book.by_plate
    # the whole budget is small against the words (the nameplate is public)
    assert pairing.MAX_GUESSES / len(pairing.WORDS) ** pairing.CODE_WORDS < 1e-6


def test_one_address_holds_few_exchanges_at_once():
    clock = Clock()
    book = Invites(clock)
    invites = [book.create() for _ in range(pairing.MAX_SOURCE_SESSIONS + 1)]
    for invite in invites[:-1]:  # started, never finished: held for pairing_session_ttl_s
        _joiner(_wrong(invite), invite.nameplate, book, "10.0.0.66")
    with pytest.raises(SwarmError, match="too many pairings"):
        _joiner(invites[-1].code, invites[-1].nameplate, book, "10.0.0.66")
    ok, *_ = _joiner(invites[-1].code, invites[-1].nameplate, book, "10.0.0.2")
    assert ok


def test_a_replayed_exchange_gets_nothing():
    """A listener replays the joiner's messages: the inviter's half is fresh, so the key
    differs; the old MAC does not match; and once the invite was used it is gone."""
    clock = Clock()
    book = Invites(clock)
    invite = book.create(ttl=600)
    ok, session, key, mine, reply = _joiner(invite.code, invite.nameplate, book)
    assert ok
    clock.now += 2
    replay = book.start(
        PairStart(nameplate=invite.nameplate, session=secrets.token_bytes(16), spake=mine)
    )
    assert replay.spake != reply.spake and replay.confirm != reply.confirm
    with pytest.raises(UserError, match=r"no pairing in progress|does not match"):
        book.finish(
            PairFinish(
                session=b"x" * 16,
                confirm=pairing._mac(key, b"joiner", session + mine + reply.spake),
            )
        )


def test_an_invite_expires():
    clock = Clock()
    book = Invites(clock)
    invite = book.create(ttl=60)
    clock.now += 61
    with pytest.raises(UserError, match="no open invite"):
        _joiner(invite.code, invite.nameplate, book)


def test_the_sealed_token_opens_only_with_the_key():
    key = secrets.token_bytes(32)
    nonce, box = pairing.seal(key, b"swarm1-abc")
    assert pairing.unseal(key, nonce, box) == b"swarm1-abc"
    with pytest.raises(SwarmError, match="does not open"):
        pairing.unseal(secrets.token_bytes(32), nonce, box)


def test_an_open_swarm_never_burns():
    clock = Clock()
    book = Invites(clock)
    book.open_swarm()
    for _ in range(5):
        ok, *rest = _joiner(pairing._OPEN_PASSWORD, pairing.OPEN, book)
        assert ok
        _finish(book, *rest)
        clock.now += TIMINGS.pairing_try_every_s
    assert pairing.OPEN in book.by_plate
