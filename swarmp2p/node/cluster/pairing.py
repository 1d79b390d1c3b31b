"""Pairing codes: a new machine joins with a few words instead of a copied token. No torch.

``swarm invite`` on any member makes a one-time code, ``<nameplate>-<word>-<word>-<word>``
(e.g. ``42-otter-violin-maple``), valid for ``Timings.invite_ttl_s``. The member advertises only
the nameplate (mDNS TXT ``inv=42:PORT``) and opens a **pairing port** keyed by its own node key
(advertised beside it). ``swarm up --code ...`` on the new machine finds that advert and runs
SPAKE2 (RFC 9382; the ``spake2`` package) with the whole code as the password:

1. ``pair.start``: the joiner's SPAKE2 message. The inviter counts a try, answers with its own
   message and a confirmation MAC over the transcript under the shared key.
2. The joiner checks that MAC: a wrong code shows here, and the joiner stops (it sends nothing
   that depends on the key, so an impostor inviter learns nothing either).
3. ``pair.finish``: the joiner's MAC. The inviter checks it, burns the invite, and answers
   with the swarm token sealed (ChaCha20-Poly1305) under a key derived from the shared key.

A listener sees two SPAKE2 messages, two MACs and a sealed box: none lets it test a guess of
the code offline, and replaying them gets nothing (the inviter's SPAKE2 half is fresh every
time, and a used invite is gone).

Online guessing is bounded per source address and in all. The nameplate is public (it is in
the advert), so a guesser faces the 3 words: 313**3 = 3.07e7 codes. Each source address gets
:data:`MAX_TRIES` starts on an invite, at most one per ``Timings.pairing_try_every_s``; the invite
allows :data:`MAX_GUESSES` starts in all, then it is burnt. So a bystander on the LAN who
throws junk at an advertised nameplate uses up only its own address's tries: the real joiner,
on another machine, still pairs (issue 24: three junk tries used to burn the invite for
everyone). Burning it now takes junk from :data:`MAX_GUESSES` / :data:`MAX_TRIES` = 4
addresses, and the whole budget wins with odds 12 / 3.07e7, about 1 in 2.6 million invites.
(Binding an invite to "the joiner's session" cannot tell the joiner from a bystander: only
knowing the code does, and each test of a code is a guess; some addresses cost a LAN
attacker more than fresh CURVE keys, which are free.) ``--open`` (a trusted home LAN only) runs the same
exchange with a well-known password: no code, no limit on uses, and no protection against an
active impostor on the LAN.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as _field
from typing import TYPE_CHECKING, Annotated

from swarmp2p.errors import Failed, Unavailable, UserError
from swarmp2p.net.auth import ClientKeys, KeyCheck, ServerKeys
from swarmp2p.net.rpc import RpcClient, RpcError, RpcServer, RpcTimeout, peer_address
from swarmp2p.net.security import NodeKey, SwarmSecret
from swarmp2p.node.cluster.join import JOIN_PORT_OFFSET
from swarmp2p.node.cluster.words import WORDS
from swarmp2p.schema import Bounds, Data, field
from swarmp2p.timings import TIMINGS
from swarmp2p.wire.messages import Message, message

if TYPE_CHECKING:
    from swarmp2p.net.discovery import Seen
    from swarmp2p.node.context import NodeContext

log = logging.getLogger("swarmp2p.node.cluster.pairing")

MAX_TRIES = 3
"""Exchanges one source address may start on one invite (a joiner's typos); past them that
address is refused, and the invite stays open for others."""
MAX_GUESSES = 12
"""Exchanges one invite allows from all addresses together; then it is burnt. 12 guesses at
3 words of 313 (the nameplate is public) win once in ~2.6e6 invites."""
MAX_SESSIONS = 64
"""Exchanges in progress at once (a bound on memory: each source holds at most
:data:`MAX_SOURCE_SESSIONS`, so a flood from a few addresses does not shut out the joiner)."""
MAX_SOURCE_SESSIONS = 4
CODE_WORDS = 3
"""3 words of 313 and a nameplate of 90; the nameplate is advertised, so the words are the
secret: 3.07e7 codes (offline guessing is what SPAKE2 rules out)."""
SLOW_DOWN_RETRIES = 3
"""How many times the joiner retries a start refused for the rate (someone else's try on the
same invite from its address, e.g. a second `swarm up` started at once)."""
OPEN = "open"
"""The nameplate of an open swarm's standing invite (`swarm up --open`)."""

_IDS = {"idA": b"swarmp2p-joiner", "idB": b"swarmp2p-inviter"}
_OPEN_PASSWORD = "swarmp2p-open-swarm"


# --- codes -----------------------------------------------------------------------------------


def new_code(rand: Callable[[int], int] = secrets.randbelow) -> str:
    """A fresh code: a nameplate 10-99 and :data:`CODE_WORDS` words."""
    words = [WORDS[rand(len(WORDS))] for _ in range(CODE_WORDS)]
    return "-".join([str(10 + rand(90)), *words])


def parse_code(text: str) -> tuple[str, str]:
    """``(nameplate, canonical code)`` from what a user typed (spaces or dashes, any case);
    UserError naming what is wrong."""
    if not isinstance(text, str):
        raise UserError("a pairing code is text like 42-otter-violin-maple", code="bad_code")
    parts = [p for p in re.split(r"[\s\-_]+", text.strip().lower()) if p]
    if not parts or not parts[0].isdigit() or len(parts) != CODE_WORDS + 1:
        raise UserError(
            f"pairing code {text.strip()[:40]!r} is not a number and {CODE_WORDS} words like "
            "42-otter-violin-maple; copy it from `swarm invite` on a member",
            code="bad_code",
        )
    unknown = [w for w in parts[1:] if w not in WORDS]
    if unknown:
        raise UserError(
            f"pairing code word(s) {', '.join(unknown)} are not code words: check the spelling "
            "against `swarm invite`'s output",
            code="bad_code",
        )
    return parts[0], "-".join(parts)


def _mac(key: bytes, who: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, b"swarmp2p-pair-" + who + b"\0" + transcript, hashlib.sha256).digest()


def _box_key(key: bytes) -> bytes:
    return hashlib.blake2b(b"token-box", key=key, digest_size=32, person=b"swarmp2p-pair").digest()


def seal(key: bytes, plaintext: bytes) -> tuple[bytes, bytes]:
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    nonce = secrets.token_bytes(12)
    return nonce, ChaCha20Poly1305(_box_key(key)).encrypt(nonce, plaintext, b"swarmp2p-token")


def unseal(key: bytes, nonce: bytes, box: bytes) -> bytes:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    try:
        return ChaCha20Poly1305(_box_key(key)).decrypt(nonce, box, b"swarmp2p-token")
    except InvalidTag:
        raise Failed(
            "the sealed token does not open with the pairing key", code="bad_code"
        ) from None


# --- messages (on a pairing port) ------------------------------------------------------------


PairSession = Annotated[bytes, Bounds(max_len=32)]
"""A pairing session's id (random, one per attempt at a code)."""
SpakeMessage = Annotated[bytes, Bounds(max_len=128)]
"""One side's SPAKE2 message."""
Confirmation = Annotated[bytes, Bounds(max_len=64)]
"""One side's key confirmation (an HMAC of the transcript)."""


@message("pair.start")
class PairStart(Message):
    nameplate: str = field(max_len=16)
    session: PairSession
    spake: SpakeMessage


@message("pair.reply")
class PairReply(Message):
    spake: SpakeMessage
    confirm: Confirmation
    tries_left: int = field(default=0, ge=0, le=MAX_TRIES)


@message("pair.finish")
class PairFinish(Message):
    session: PairSession
    confirm: Confirmation


@message("pair.welcome")
class PairWelcome(Message):
    """The sealed token, and where the inviter listens (a first peer for the new node)."""

    nonce: bytes = field(max_len=12)
    box: bytes = field(max_len=256)
    swarm_id: str = field(max_len=16)
    node_id: str = field(max_len=64)
    control_port: int = field(ge=0, le=65535)
    join_port: int = field(ge=0, le=65535)


# --- the inviter's side ------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Invite:
    nameplate: str
    code: str
    """The canonical code: the SPAKE2 password."""
    expires: float
    open: bool = False
    used: Counter[str] = _field(default_factory=Counter)
    """Starts per source address (not kept for an open invite: it has no limit)."""
    last_try: dict[str, float] = _field(default_factory=dict)
    """When each source address last started an exchange (entries older than
    ``Timings.pairing_try_every_s`` are dropped)."""

    @property
    def guesses_left(self) -> int:
        return MAX_GUESSES - sum(self.used.values())

    def tries_left(self, source: str) -> int:
        """Starts left to ``source``: its own and the invite's, whichever is fewer."""
        return max(0, min(MAX_TRIES - self.used[source], self.guesses_left))


@dataclass(kw_only=True, slots=True)
class _Session:
    invite: Invite
    key: bytes
    transcript: bytes
    started: float
    source: str = ""


class Invites:
    """The invites a member holds (in memory: a restart forgets them, as it should)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.by_plate: dict[str, Invite] = {}
        self._sessions: dict[bytes, _Session] = {}

    def create(self, ttl: float = TIMINGS.invite_ttl_s) -> Invite:
        self.prune()
        while True:
            code = new_code()
            plate = code.split("-", 1)[0]
            if plate not in self.by_plate:
                break
        invite = Invite(nameplate=plate, code=code, expires=self.clock() + ttl)
        self.by_plate[plate] = invite
        return invite

    def open_swarm(self) -> Invite:
        invite = Invite(nameplate=OPEN, code=_OPEN_PASSWORD, expires=float("inf"), open=True)
        self.by_plate[OPEN] = invite
        return invite

    def prune(self) -> list[str]:
        """Drop expired invites, stale sessions and burnt invites; the nameplates dropped."""
        now = self.clock()
        self._sessions = {
            s: x
            for s, x in self._sessions.items()
            if now - x.started < TIMINGS.pairing_session_ttl_s
        }
        busy = {x.invite.nameplate for x in self._sessions.values()}
        gone = [
            p
            for p, inv in self.by_plate.items()
            if now > inv.expires or (inv.guesses_left <= 0 and not inv.open and p not in busy)
        ]
        for plate in gone:
            del self.by_plate[plate]
        return gone

    def start(self, msg: PairStart, source: str = "") -> PairReply:
        """Count a try of ``source`` (the connection's address) and answer the joiner's
        SPAKE2 message."""
        from spake2 import SPAKE2_B

        self.prune()
        now = self.clock()
        invite = self.by_plate.get(msg.nameplate)
        if invite is None:
            raise UserError(
                f"no open invite {msg.nameplate!r} here (expired, used or burnt after {MAX_GUESSES} wrong tries); run `swarm invite` again",
                code="no_invite",
            )
        if not invite.open and invite.guesses_left <= 0:
            raise UserError(
                f"invite {msg.nameplate} is burnt: {MAX_GUESSES} tries used; run `swarm invite` again",
                code="no_invite",
            )
        if not invite.open and invite.used[source] >= MAX_TRIES:
            raise UserError(
                f"invite {msg.nameplate}: this machine ({source or 'unknown address'}) used its {MAX_TRIES} tries; check the code, then run `swarm invite` again for a new one",
                code="no_invite",
            )
        invite.last_try = {
            a: t for a, t in invite.last_try.items() if now - t < TIMINGS.pairing_try_every_s
        }
        if source in invite.last_try:
            raise Unavailable(
                f"invite {msg.nameplate}: one try per {TIMINGS.pairing_try_every_s:g} s from one machine; retry in a moment",
                code="slow_down",
            )
        mine_now = sum(1 for x in self._sessions.values() if x.source == source)
        if (
            len(self._sessions) >= MAX_SESSIONS
            or mine_now >= MAX_SOURCE_SESSIONS
            or len(msg.session) < 16
        ):
            raise Unavailable("too many pairings at once; retry in a moment", code="slow_down")
        invite.last_try[source] = now
        if not invite.open:
            invite.used[source] += 1
        inviter = SPAKE2_B(invite.code.encode(), **_IDS)
        mine = inviter.start()
        try:
            key = inviter.finish(msg.spake)
        except Exception as exc:  # a malformed SPAKE2 element
            raise UserError(
                f"pair.start: not a SPAKE2 message ({type(exc).__name__})", code="bad_field"
            ) from None
        transcript = msg.session + msg.spake + mine
        self._sessions[msg.session] = _Session(
            invite=invite, key=key, transcript=transcript, started=now, source=source
        )
        left = MAX_TRIES if invite.open else invite.tries_left(source)
        if not invite.open and invite.guesses_left == 0:
            log.warning(
                "invite %s: last of %d tries in use (from %d addresses)",
                invite.nameplate,
                MAX_GUESSES,
                len(invite.used),
            )
        return PairReply(spake=mine, confirm=_mac(key, b"inviter", transcript), tries_left=left)

    def finish(self, msg: PairFinish) -> tuple[Invite, bytes]:
        """The invite and the shared key, once the joiner proved it holds the same code."""
        session = self._sessions.pop(msg.session, None)
        if session is None:
            raise UserError("no pairing in progress for this session (expired?)", code="no_invite")
        if not hmac.compare_digest(msg.confirm, _mac(session.key, b"joiner", session.transcript)):
            self.prune()
            raise UserError("the pairing code does not match", code="bad_code")
        invite = session.invite
        if not invite.open:
            self.by_plate.pop(invite.nameplate, None)  # one time
        return invite, session.key

    def advertised(self, port: int) -> str:
        return ",".join(f"{p}:{port}" for p in sorted(self.by_plate))


class PairingPort:
    """A member's pairing port: open while it holds invites, keyed by its node key, admitting
    any client key (the SPAKE2 exchange inside is the authentication)."""

    def __init__(self, ctx: NodeContext, host: str, on_change: Callable[[], object]) -> None:
        self.ctx, self.host = ctx, host
        self.invites = Invites(ctx.clock)
        self._on_change = on_change
        """Called when the advertised invites change (re-advertise)."""
        self._server: RpcServer | None = None
        self.port = 0

    async def invite(self, ttl: float = TIMINGS.invite_ttl_s) -> dict[str, Data]:
        invite = self.invites.create(ttl)
        await self._ensure()
        log.info("invite %s open for %.0f s", invite.nameplate, ttl)
        return {"code": invite.code, "expires_in_s": ttl, "nameplate": invite.nameplate}

    async def open_swarm(self) -> None:
        self.invites.open_swarm()
        await self._ensure()
        log.warning("this swarm is OPEN: any machine on the LAN joins with `swarm up --open`")

    @property
    def advertised(self) -> str:
        return self.invites.advertised(self.port) if self._server is not None else ""

    async def _ensure(self) -> None:
        if self._server is None:
            keys = ServerKeys(
                public=self.ctx.key.public,
                secret=self.ctx.key.secret,
                admits=KeyCheck.anyone(),
                domain=f"swarmp2p-pairing-{self.ctx.node_id}",
            )
            self._server = RpcServer(
                self.ctx.zmq, keys, self.host, 0, self._handle, max_per_source=8
            )
            await self._server.start()
            self.port = self._server.port
        await self._changed()

    async def tick(self) -> None:
        """Drop expired or burnt invites; close the port when none is left."""
        gone = self.invites.prune()
        for plate in gone:
            log.info("invite %s closed (expired, used or burnt)", plate)
        if not self.invites.by_plate and self._server is not None:
            await self.close()
            await self._changed()
        elif gone:
            await self._changed()

    async def _changed(self) -> None:
        with contextlib.suppress(Exception):
            await self._on_change()

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
            self._server = None
            self.port = 0

    async def _handle(self, msg: Message, sender: str) -> Message:
        if isinstance(msg, PairStart):
            try:
                return self.invites.start(msg, peer_address.get())
            except UserError as exc:
                log.warning("pairing refused: %s", exc.message)
                raise
        if isinstance(msg, PairFinish):
            try:
                invite, key = self.invites.finish(msg)
            except UserError as exc:
                log.warning("pairing refused: %s", exc.message)
                raise
            nonce, box = seal(key, self.ctx.secret.token.encode("ascii"))
            log.info(
                "a machine paired with invite %s: it holds the swarm secret now", invite.nameplate
            )
            # the heartbeat's tick() closes the port once no invite is left (not here: the
            # reply still has to leave through it)
            return PairWelcome(
                nonce=nonce,
                box=box,
                swarm_id=self.ctx.secret.swarm_id,
                node_id=self.ctx.node_id,
                control_port=self.ctx.port,
                join_port=self.ctx.join_port,
            )
        raise RpcError(
            "unexpected", f"a pairing port takes pair.start/pair.finish, not {type(msg).TYPE}"
        )


# --- the joiner's side -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Paired:
    """What a pairing gave the new machine."""

    secret: SwarmSecret
    inviter: str
    """The inviting node's id."""
    peer: str
    """``host:port`` of the inviter's control port (a first peer), "" when unknown."""


async def exchange(endpoint: str, server_key: str, code: str, nameplate: str) -> Paired:
    """Run the SPAKE2 exchange with the pairing port at ``endpoint``; the swarm secret."""
    import zmq.asyncio
    from spake2 import SPAKE2_A

    ephemeral = NodeKey.generate()
    ctx = zmq.asyncio.Context()
    client = RpcClient(
        ctx,
        ClientKeys(public=ephemeral.public, secret=ephemeral.secret, server=server_key),
        endpoint,
    )
    try:
        joiner = SPAKE2_A(code.encode(), **_IDS)
        session = secrets.token_bytes(16)
        mine = joiner.start()
        start = PairStart(nameplate=nameplate, session=session, spake=mine)
        for attempt in range(SLOW_DOWN_RETRIES + 1):
            try:
                reply = await client.request(start, TIMINGS.pairing_exchange_s)
                break
            except RpcError as exc:  # nothing depends on the key yet: asking again is safe
                if exc.code != "slow_down" or attempt == SLOW_DOWN_RETRIES:
                    raise
                await asyncio.sleep(TIMINGS.pairing_try_every_s)
        if not isinstance(reply, PairReply):
            raise Failed(
                f"{endpoint} answered {type(reply).TYPE}, not pair.reply", code="bad_reply"
            )
        try:
            key = joiner.finish(reply.spake)
        except Exception:
            raise Failed(f"{endpoint} sent a malformed SPAKE2 message", code="bad_reply") from None
        transcript = session + mine + reply.spake
        if not hmac.compare_digest(reply.confirm, _mac(key, b"inviter", transcript)):
            left = (
                f"{reply.tries_left} tries left"
                if reply.tries_left
                else "no tries left from this machine"
            )
            raise UserError(
                f"the pairing code does not match invite {nameplate} ({left}); check the "
                "words against `swarm invite`'s output, or make a new invite",
                code="bad_code",
            )
        welcome = await client.request(
            PairFinish(session=session, confirm=_mac(key, b"joiner", transcript)),
            TIMINGS.pairing_exchange_s,
        )
        if not isinstance(welcome, PairWelcome):
            raise Failed(
                f"{endpoint} answered {type(welcome).TYPE}, not pair.welcome", code="bad_reply"
            )
        secret = SwarmSecret.from_token(unseal(key, welcome.nonce, welcome.box).decode("ascii"))
        host = endpoint.removeprefix("tcp://").rpartition(":")[0]
        joinable = (
            welcome.control_port and welcome.join_port == welcome.control_port + JOIN_PORT_OFFSET
        )
        peer = f"{host}:{welcome.control_port}" if joinable else ""
        return Paired(secret=secret, inviter=welcome.node_id, peer=peer)
    finally:
        await client.close()
        ctx.destroy(0)


def _offers(seen: list[Seen], nameplate: str) -> list[tuple[str, str, str]]:
    """(endpoint, server key, swarm id) of each advert offering ``nameplate``."""
    out = []
    for s in seen:
        port = s.advert.invite_ports().get(nameplate)
        if port and s.advert.key and s.addresses:
            out.append((f"tcp://{s.addresses[0]}:{port}", s.advert.key, s.advert.swarm_id))
    return out


async def pair(code: str | None, *, browse_s: float = TIMINGS.pairing_browse_s) -> Paired:
    """Find the invite of ``code`` on the LAN (``None``: the single open swarm) and pair with
    it; UserError when none (or, open, more than one swarm) is found or the code is wrong."""
    from swarmp2p.net.discovery import browse

    if code is None:
        nameplate, password = OPEN, _OPEN_PASSWORD
        seen = await browse(min(browse_s, 2.0))
    else:
        nameplate, password = parse_code(code)
        seen = await browse(browse_s, until=lambda s: bool(_offers(s, nameplate)))
    offers = _offers(seen, nameplate)
    if not offers:
        if code is None:
            raise UserError(
                "no open swarm on this LAN (`swarm up --open` on a member opens one)",
                code="no_invite",
            )
        raise UserError(
            f"no member on this LAN offers invite {nameplate} (looked {browse_s:g} s): is it "
            "expired, or is this machine on another network? Run `swarm invite` again",
            code="no_invite",
        )
    swarms = sorted({o[2] for o in offers})
    if code is None and len(swarms) > 1:
        raise UserError(
            f"several open swarms on this LAN ({', '.join(swarms)}); join one with a pairing code from `swarm invite`",
            code="bad_request",
        )
    last: Exception | None = None
    for endpoint, key, _ in offers:  # an impostor's advert fails its exchange; try the next
        try:
            return await exchange(endpoint, key, password, nameplate)
        except (RpcError, RpcTimeout, Failed) as exc:
            last = exc
        except UserError as exc:
            if exc.code != "bad_code" or len(offers) == 1:
                raise
            last = exc
    assert last is not None
    raise last


__all__ = [
    "MAX_GUESSES",
    "MAX_TRIES",
    "OPEN",
    "Invite",
    "Invites",
    "Paired",
    "PairingPort",
    "new_code",
    "pair",
    "parse_code",
]
