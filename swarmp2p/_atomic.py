"""Atomic file writes: a temp file beside the target, fsync, one rename, fsync of the folder.
Standard library.

Every write of state, secrets, shards and manifests goes through ``write_atomic`` so a crash
leaves the old file or the new one, never half of either (DESIGN: Failure model, Files).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(
    path: str | os.PathLike[str],
    data: bytes | str | Callable[[str], None],
    *,
    mode: int | None = None,
) -> None:
    """Replace ``path`` with ``data`` atomically.

    ``data`` is bytes, text (UTF-8), or a function that writes the temp file at the path it is
    given (``torch.save``, ``np.save``, ``save_file``). ``mode`` (e.g. ``0o600``) is set on the
    temp file before anything is written, so a secret is never readable by others.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        if callable(data):
            os.close(fd)
            fd = -1
            data(tmp)
            fd = os.open(tmp, os.O_RDONLY)
        else:
            os.write(fd, data.encode() if isinstance(data, str) else data)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable: until its folder is synced, a power cut may undo it
    (ext4 and xfs journal the file's data, not the directory entry; see fsync(2))."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a platform whose folders cannot be opened (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a folder (EINVAL); the data is synced
        pass
    finally:
        os.close(fd)
