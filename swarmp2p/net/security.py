"""Keys: the swarm secret (which only admits) and each node's own CURVE key pair (who it is).

Every member of a swarm holds the same 32 random bytes, the secret. From them it derives, with
keyed BLAKE2b (RFC 7693) and a distinct label per use:

- the token ``swarm1-<base32(secret + 4-byte checksum)>`` that scripts pass to join;
- ``swarm_id``, 16 hex characters, safe to advertise over mDNS (it reveals nothing of the
  secret, and swarms on one LAN tell each other apart by it);
- the *admission* Curve25519 key pair: the join port's server key and its only client key, so
  only a holder of the secret completes a join handshake (see :mod:`swarmp2p.node.cluster.join`).

Each node also has its own key pair (:class:`NodeKey`, ``node.key`` in its state dir, 0600):
its control port's server key and its client key towards every member. The job table lists
every member with its public key; ZAP admits only listed keys, and a message's claimed node id
must be its key's (issue 15).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

import zmq
import zmq.utils.z85
from zmq.utils.z85 import Z85CHARS

from swarmp2p._atomic import write_atomic

SECRET_BYTES = 32
TOKEN_PREFIX = "swarm1-"
_CHECKSUM_BYTES = 4
_TOKEN_BODY_CHARS = 58  # base32 of 36 bytes, unpadded


def _derive(secret: bytes, label: bytes, size: int) -> bytes:
    return hashlib.blake2b(label, key=secret, digest_size=size, person=b"swarmp2p").digest()


def _checksum(secret: bytes) -> bytes:
    return hashlib.blake2b(secret, digest_size=_CHECKSUM_BYTES, person=b"swarmp2p-tok").digest()


class SwarmSecret:
    """32 secret bytes shared by every node of one swarm."""

    __slots__ = ("_raw",)

    def __init__(self, raw: bytes) -> None:
        if not isinstance(raw, bytes) or len(raw) != SECRET_BYTES:
            got = len(raw) if isinstance(raw, bytes) else type(raw).__name__
            raise ValueError(f"a swarm secret is {SECRET_BYTES} bytes, got {got}")
        self._raw = raw

    @classmethod
    def generate(cls) -> SwarmSecret:
        """A fresh secret from the OS's CSPRNG."""
        return cls(secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def from_token(cls, token: str) -> SwarmSecret:
        """Parse a join token; ValueError saying what is wrong (prefix, length, typo)."""
        if not isinstance(token, str):
            raise ValueError(f"a swarm token is a string, got {type(token).__name__}")
        text = token.strip()
        if not text.lower().startswith(TOKEN_PREFIX):
            shown = text[:12] + ("..." if len(text) > 12 else "")
            raise ValueError(
                f"swarm token must start with {TOKEN_PREFIX!r}, got {shown!r}; copy the whole "
                "token printed by the first node's `swarm up`"
            )
        body = text[len(TOKEN_PREFIX) :].upper()
        if len(body) != _TOKEN_BODY_CHARS:
            raise ValueError(
                f"swarm token has {len(body)} characters after {TOKEN_PREFIX!r}, expected "
                f"{_TOKEN_BODY_CHARS}; it was cut short or pasted twice, copy it again"
            )
        try:
            raw = base64.b32decode(body + "=" * (-len(body) % 8))
        except (binascii.Error, ValueError):
            bad = sorted({c for c in body if c not in "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"})
            raise ValueError(
                f"swarm token contains characters that are not base32: {''.join(bad) or '?'}; "
                "tokens use a-z and 2-7 only, copy it again"
            ) from None
        secret, check = raw[:SECRET_BYTES], raw[SECRET_BYTES:]
        canonical = base64.b32encode(raw).decode("ascii").rstrip("=")
        # the last character carries 2 unused bits; a typo there must not slip through
        if canonical != body or not hmac.compare_digest(check, _checksum(secret)):
            raise ValueError(
                "swarm token checksum does not match: it has a typo; copy it again from the "
                "first node's `swarm up` output"
            )
        return cls(secret)

    @property
    def token(self) -> str:
        """``swarm1-`` + lower-case unpadded base32 of the secret and its checksum."""
        body = base64.b32encode(self._raw + _checksum(self._raw)).decode("ascii").rstrip("=")
        return TOKEN_PREFIX + body.lower()

    @property
    def swarm_id(self) -> str:
        """Public id of the swarm (16 hex chars), a keyed hash of the secret."""
        return _derive(self._raw, b"swarm-id", 8).hex()

    def curve_keypair(self) -> tuple[bytes, bytes]:
        """The swarm's admission Curve25519 key pair ``(public, secret)``, both z85-encoded
        (40 bytes)."""
        secret_key = zmq.utils.z85.encode(_derive(self._raw, b"curve-key", 32))
        return zmq.curve_public(secret_key), secret_key

    @property
    def admission_key(self) -> str:
        """The public half of the admission key pair (z85): what the job table records so
        every member agrees on which secret admits (``swarm token --rotate`` changes it)."""
        return self.curve_keypair()[0].decode("ascii")

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the token to ``path`` atomically with mode 0600 (temp file + rename)."""
        path = Path(path)
        write_atomic(path, self.token + "\n", mode=0o600)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SwarmSecret:
        """Read a secret saved by :meth:`save`; refuses a file others can read (like ssh does)."""
        path = Path(path)
        check_private(path, "swarm secret", "consider the swarm compromised")
        try:
            return cls.from_token(path.read_text(encoding="ascii"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"swarm secret {path} is not a valid token file: {e}") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SwarmSecret) and hmac.compare_digest(self._raw, other._raw)

    def __hash__(self) -> int:
        return hash(self.swarm_id)

    def __repr__(self) -> str:
        return f"SwarmSecret(swarm_id={self.swarm_id!r})"  # never the secret itself


KEY_CHARS = 40
"""A z85-encoded Curve25519 key."""
KEY_PATTERN = "[" + "".join("\\" + c if c in "-[]\\^" else c for c in Z85CHARS.decode()) + "]{40}"
"""A z85 public key (for schema fields)."""


def check_public_key(key: str, what: str = "key") -> str:
    """``key`` if it is a z85-encoded 32-byte Curve25519 public key; ValueError naming it."""
    if not isinstance(key, str) or len(key) != KEY_CHARS:
        shown = key if isinstance(key, str) else type(key).__name__
        raise ValueError(f"{what} {shown!r} is not a {KEY_CHARS}-character z85 CURVE key")
    try:
        zmq.utils.z85.decode(key.encode("ascii"))
    except (ValueError, UnicodeEncodeError, KeyError, IndexError):
        raise ValueError(f"{what} {key!r} is not z85 (a CURVE public key)") from None
    return key


def fingerprint(public_key: str) -> str:
    """A short, stable, human-comparable form of a public key: ``ab12-cd34-ef56-7890``."""
    digest = hashlib.blake2b(
        public_key.encode("ascii"), digest_size=8, person=b"swarmp2p-fp"
    ).hexdigest()
    return "-".join(digest[i : i + 4] for i in range(0, 16, 4))


def check_private(path: Path, what: str, if_read: str) -> None:
    """PermissionError when users other than the owner may read ``path`` (like ssh), naming
    ``what`` it holds, the fix, and ``if_read``: what to do if others read it."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise PermissionError(
            f"{what} {path} has mode {mode:04o}, readable by other users; run "
            f"`chmod 600 {path}` (and {if_read} if others read it)"
        )


def read_secret(
    what: str,
    *,
    option: str | None,
    file: str | None,
    env: Mapping[str, str],
    flag: str,
    file_flag: str,
    env_name: str,
    stdin: TextIO | None = None,
) -> str | None:
    """A secret handed to a command (the swarm token, an API key): ``flag -`` (stdin, a
    prompt on a terminal), ``file_flag FILE`` (mode 0600) or ``$env_name``; None when none was
    given. ValueError naming what is wrong for the secret itself in argv (every local user
    reads argv with ``ps``), for two ways at once, for nothing on stdin or a missing file;
    PermissionError for a file others may read. ``what`` names it in errors ("the swarm
    token")."""
    given = [
        name
        for name, value in ((flag, option), (file_flag, file), (env_name, env.get(env_name)))
        if value is not None
    ]
    if option is not None and option != "-":
        raise ValueError(
            f"{flag} takes only '-' (read {what} from stdin): {what} in the command line is "
            f"readable by every local user with `ps`. Pass it as {env_name}=... in the "
            f"environment, with {file_flag} FILE (mode 0600), or give {flag} - and paste it"
        )
    if len(given) > 1:
        raise ValueError(f"{what} is given twice ({' and '.join(given)}); give it one way")
    if option == "-":
        stdin = sys.stdin if stdin is None else stdin
        if stdin.isatty():
            import getpass

            text = getpass.getpass(f"{what.removeprefix('the ')}: ")
        else:
            text = stdin.readline()
        if not text.strip():
            raise ValueError(f"{flag} -: nothing on stdin; pipe or paste {what}")
        return text.strip()
    if file is not None:
        path = Path(file)
        try:
            if stat.S_ISREG(path.stat().st_mode):
                check_private(path, file_flag, f"consider {what} seen")
            text = path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            raise ValueError(f"{file_flag} {path}: no such file") from None
        except IsADirectoryError:
            raise ValueError(f"{file_flag} {path} is a folder, not a file holding {what}") from None
        if not text.strip():
            raise ValueError(f"{file_flag} {path} is empty: it should hold {what}")
        return text.strip()
    value = env.get(env_name)
    return None if value is None else value.strip()


class NodeKey:
    """A node's own Curve25519 key pair, z85-encoded; saved 0600 as two lines."""

    __slots__ = ("public", "secret")

    def __init__(self, public: str, secret: str) -> None:
        check_public_key(public, "node public key")
        if zmq.curve_public(secret.encode("ascii")).decode("ascii") != public:
            raise ValueError("node key: the secret key does not match the public key")
        self.public, self.secret = public, secret

    @classmethod
    def generate(cls) -> NodeKey:
        public, secret = zmq.curve_keypair()
        return cls(public.decode("ascii"), secret.decode("ascii"))

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public)

    def save(self, path: str | os.PathLike[str]) -> None:
        write_atomic(Path(path), f"{self.public}\n{self.secret}\n", mode=0o600)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> NodeKey:
        """Read a key saved by :meth:`save`; refuses a file others can read."""
        path = Path(path)
        check_private(path, "node key", "`swarm remove` this node from another member")
        try:
            public, secret = path.read_text(encoding="ascii").split()
            return cls(public, secret)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"node key {path} is not a saved key pair ({exc}); move it away and this node "
                "gets a new identity (it joins again)"
            ) from None

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> NodeKey:
        try:
            return cls.load(path)
        except FileNotFoundError:
            key = cls.generate()
            key.save(path)
            return key

    def __repr__(self) -> str:
        return f"NodeKey(fingerprint={self.fingerprint!r})"  # never the secret key
