"""Names from the network, the table or a request, confined to their folder. Standard library.

Every job id, serve id, stage name, file name and export path that a peer, the replicated
table or a request hands this node passes :func:`confine` (a relative path inside a root) or
:func:`check_id` (one strict path component) before it touches a file. Whatever is not
plainly a relative name inside its folder is refused with :class:`UnsafeName` (a
``ValueError``) naming what it was, the value, and why; nothing is rewritten into something
"safe", because a rewritten name would name a file the sender never meant.
"""

from __future__ import annotations

import errno
import os
import re
import unicodedata
from pathlib import Path

__all__ = ["MAX_ID_CHARS", "MAX_NAME_CHARS", "UnsafeName", "check_id", "confine"]

MAX_NAME_CHARS = 1024
"""Characters in a relative name (PATH_MAX is 4096 bytes; names from peers need far fewer)."""
MAX_COMPONENT_BYTES = 255
"""UTF-8 bytes in one component: NAME_MAX of ext4, xfs and btrfs."""
MAX_ID_CHARS = 128
"""Characters in an id (job ids, serve ids): ids are short and generated."""

_ID = re.compile(r"[A-Za-z0-9_-]+")
# control (Cc), format (Cf: zero-width, bidi overrides), line/paragraph separators, surrogates
_BAD_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


class UnsafeName(ValueError):
    """A name that is not a plain relative path inside its folder (or not a strict id)."""

    def __init__(self, what: str, value: object, why: str) -> None:
        shown = repr(value)
        if len(shown) > 120:
            shown = shown[:100] + f"...' ({len(value) if isinstance(value, str) else '?'} chars)"
        super().__init__(f"{what} {shown} is refused: {why}")
        self.what = what
        self.value = value
        self.why = why


def _check_string(value: object, what: str, max_chars: int) -> str:
    """``value`` if it is a string of 1..``max_chars`` characters, else UnsafeName."""
    if not isinstance(value, str):
        raise UnsafeName(what, value, f"it must be a string, not {type(value).__name__}")
    if not value:
        raise UnsafeName(what, value, "it is empty")
    if len(value) > max_chars:
        raise UnsafeName(what, value, f"it is longer than {max_chars} characters")
    return value


def check_id(value: object, *, what: str) -> str:
    """``value`` if it is one strict path component: 1..MAX_ID_CHARS of ``[A-Za-z0-9_-]``.

    For job ids, serve ids and the like: no dot at all (so never ``.`` or ``..``), no slash,
    no other character, matched whole (a trailing newline is refused too).
    """
    value = _check_string(value, what, MAX_ID_CHARS)
    if not _ID.fullmatch(value):
        bad = sorted({c for c in value if not _ID.fullmatch(c)})
        raise UnsafeName(
            what,
            value,
            f"it holds {''.join(bad)!r}; an id is letters A-Z a-z, digits, '_' and '-' only",
        )
    return value


def _check_text(name: object, what: str) -> str:
    """The lexical rules: a relative POSIX path of plain components, nothing to normalise."""
    name = _check_string(name, what, MAX_NAME_CHARS)
    for c in name:
        if c == "\x00":
            raise UnsafeName(what, name, "it holds a NUL byte")
        if unicodedata.category(c) in _BAD_CATEGORIES:
            raise UnsafeName(what, name, f"it holds the control or format character {c!r}")
    if "\\" in name:
        raise UnsafeName(what, name, "it holds a backslash; use '/' between folders")
    if unicodedata.normalize("NFKC", name) != name:
        # fullwidth or leader dots, ligatures...: another layer may fold them into '.', '/'
        raise UnsafeName(
            what, name, "it holds characters that Unicode NFKC folds into others (lookalikes)"
        )
    if name.startswith("/"):
        raise UnsafeName(what, name, "it is an absolute path; it must be relative to its folder")
    for part in name.split("/"):
        if part == "..":
            raise UnsafeName(what, name, "it climbs out of its folder ('..')")
        if part in ("", "."):
            raise UnsafeName(
                what, name, "it has an empty or '.' component; write it as 'a/b', not 'a//b'"
            )
        if len(part.encode()) > MAX_COMPONENT_BYTES:
            raise UnsafeName(what, name, f"a component is over {MAX_COMPONENT_BYTES} bytes")
    return name


def confine(root: str | os.PathLike[str], name: object, *, what: str) -> Path:
    """``root / name`` once ``name`` is shown to stay inside ``root``; else UnsafeName.

    ``name`` must be a relative POSIX path of plain components: no ``..``, ``.`` or empty
    component, not absolute, no NUL, control, format or NFKC-unstable character, no
    backslash, at most MAX_NAME_CHARS characters and MAX_COMPONENT_BYTES bytes a component.
    Then the path is resolved: a symlink on the way (existing or dangling) that leads out of
    ``root``, or a symlink loop, is refused. The returned path is ``root / name`` as written
    (not resolved), so callers' ``relative_to(root)`` keeps working. ``root`` itself is
    trusted (it comes from this node's configuration, never from a peer).
    """
    text = _check_text(name, what)
    base = Path(root)
    real_root = os.path.realpath(base)
    path = base / text
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
        raise UnsafeName(what, name, f"a symlink leads it out of {base} (to {real})")
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeName(what, name, "it runs into a symlink loop") from None
        # absent, or a folder on the way is a file: the caller's open() says so
    return path
