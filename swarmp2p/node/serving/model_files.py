"""Making a served model's files local on a stage node. Never imports torch.

A stage node serves its own copy of a model only when every file matches the issuing node's
listing (size and sha256); otherwise it fetches the files over the swarm's CURVE RPC in chunks,
checks each against its sha256, and moves it into place atomically. The same reader fetches a
trained stage's shard from a node that holds it, and one tensor group out of a remote
safetensors file (a tied head's embedding) without copying the rest of that file.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import struct
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmp2p.plan.inputs import MODEL_FILE as _MODEL_FILE
from swarmp2p.timings import TIMINGS

if TYPE_CHECKING:
    from swarmp2p.wire.messages import Message

MODEL_FILE = re.compile(rf"^(?:{_MODEL_FILE.pattern})$")
"""The files of a model folder a stage loads or a tokenizer reads (``plan.inputs``)."""
HEADER_LIMIT = 100 * 2**20
_BLOCK_TENSOR = re.compile(r"\.\d+\.")
"""A tensor name with a numeric path component belongs to a block (``model.layers.3.…``)."""

Reader = Callable[[str, int, int], Awaitable[tuple[bytes, int]]]
FileListing = dict[str, list[int | str]]
"""A model folder's files: ``{name: [bytes, sha256]}``."""
"""``read(file, offset, size) -> (data, total bytes of the file)``."""

_hashes: dict[tuple[str, int, int], str] = {}
"""(path, size, mtime_ns) -> sha256: a file is hashed once while it stays unchanged."""


def sha256_file(path: Path) -> str:
    """The file's sha256, cached by path, size and modification time."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _hashes:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(8 * 2**20):
                digest.update(chunk)
        _hashes[key] = digest.hexdigest()
    return _hashes[key]


def folder_listing(folder: str | os.PathLike) -> FileListing:
    """``{name: [bytes, sha256]}`` of the model files in ``folder`` (slow the first time: it
    hashes every weight file). The embedded model's completion marker supplies its hashes."""
    folder = Path(folder)
    marker = _marker(folder)
    out: FileListing = {}
    for path in sorted(folder.iterdir()):
        if not path.is_file() or not MODEL_FILE.match(path.name):
            continue
        size = path.stat().st_size
        known = marker.get(path.name)
        if known is not None and known.get("bytes") == size and known.get("sha256"):
            out[path.name] = [size, known["sha256"]]
        else:
            out[path.name] = [size, sha256_file(path)]
    if "config.json" not in out:
        raise ValueError(f"{folder} has no config.json: it is not a model folder")
    return out


def _marker(folder: Path) -> dict[str, Any]:
    from swarmp2p.models import read_marker

    marker = read_marker(folder)
    return marker["files"] if marker else {}


def matches(folder: str | os.PathLike, listing: Mapping[str, Any]) -> bool:
    """Whether ``folder`` holds every listed file with the listed size and sha256."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    marker = _marker(folder)
    for name, (size, sha) in listing.items():
        path = folder / name
        try:
            if path.stat().st_size != size:
                return False
        except OSError:
            return False
        known = marker.get(name)
        if known is not None and known.get("bytes") == size and known.get("sha256") == sha:
            continue
        if sha256_file(path) != sha:
            return False
    return True


def check_listing(listing: object) -> FileListing:
    """A listing from the wire, checked: safe names, sizes, hex digests; ValueError else."""
    if not isinstance(listing, dict) or "config.json" not in listing:
        raise ValueError("files: a model folder listing must be a map naming config.json")
    for name, entry in listing.items():
        if not isinstance(name, str) or not MODEL_FILE.match(name):
            raise ValueError(f"files: {name!r} is not a model file name")
        ok = isinstance(entry, (list, tuple)) and len(entry) == 2
        if not ok or type(entry[0]) is not int or not _hex64(entry[1]):
            raise ValueError(f"files: {name!r} needs [bytes, sha256], got {entry!r}")
    return {k: list(v) for k, v in listing.items()}


def _hex64(value: object) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


MAX_UNLISTED_BYTES = 16 * 2**20
"""The most a file the table lists no size or sha256 for (a shard's ``manifest.json``) may be."""


def disk_headroom(total: int) -> int:
    """Bytes a pull leaves free on a filesystem of ``total`` bytes: 5%, at most 1 GiB."""
    return min(2**30, total // 20)


def disk_room(path: Path) -> int:
    """Bytes a pull may still write on ``path``'s filesystem (its nearest existing folder),
    its headroom kept."""
    import shutil

    here = Path(path).absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    usage = shutil.disk_usage(here)
    return max(0, usage.free - disk_headroom(usage.total))


def check_size(
    file: str, total: int, *, size: int | None, limit: int | None, room: int, have: int = 0
) -> None:
    """Refuse a pull of ``file`` (``total`` bytes at its source) before a byte is written:
    ValueError unless it has the listed ``size`` (when one is listed), is at most ``limit``
    (when given) and its ``total - have`` missing bytes fit the disk's ``room``."""
    if total < 0:
        raise ValueError(f"{file}: the source reports a size of {total} bytes")
    if size is not None and total != size:
        raise ValueError(
            f"{file}: the source offers {total} bytes, but the table lists {size}; refused"
        )
    if limit is not None and total > limit:
        raise ValueError(
            f"{file}: the source offers {total} bytes, over the {limit} bytes such a file may "
            "have; refused"
        )
    if total - have > room:
        raise ValueError(
            f"{file}: {total - have} bytes do not fit the {room} bytes free on this disk "
            "(its headroom kept); free some space"
        )


async def pull_file(
    read: Reader,
    file: str,
    dest: Path,
    sha256: str | None,
    chunk: int,
    *,
    progress: Callable[[int], None] | None = None,
    size: int | None = None,
    limit: int | None = None,
) -> None:
    """Copy ``file`` to ``dest`` through ``read``, checking its sha256; atomic. The first
    chunk's total is checked (``check_size``: the listed ``size``, a ``limit``, the free disk)
    before a folder or a byte is written here. With a known sha256 an interrupted copy resumes
    from its ``.part`` file (the next call continues where the last one stopped);
    ``progress(n)`` hears of every n bytes that arrive."""
    if sha256 is None and size is None and limit is None:
        limit = MAX_UNLISTED_BYTES
    tmp = dest.with_name(f".{dest.name}.part")
    digest = hashlib.sha256()
    offset = 0
    if sha256 is not None and tmp.is_file():
        with open(tmp, "rb") as part:
            while block := part.read(8 * 2**20):
                digest.update(block)
                offset += len(block)
    first, expected = await read(file, offset, chunk)
    check_size(file, expected, size=size, limit=limit, room=disk_room(dest.parent), have=offset)
    if offset and progress is not None:
        progress(offset)
    dest.parent.mkdir(parents=True, exist_ok=True)
    keep = False
    pending: tuple[bytes, int] | None = (first, expected)
    try:
        with open(tmp, "ab" if offset else "wb") as out:
            while True:
                if pending is not None:
                    (data, total), pending = pending, None
                else:
                    data, total = await read(file, offset, chunk)
                if total != expected:
                    raise ValueError(
                        f"{file}: the source changed size from {expected} to {total} bytes; fetch again"
                    )
                if offset > total:
                    raise ValueError(f"{file}: the source shrank to {total} bytes; fetch again")
                if offset + len(data) > total:
                    raise ValueError(f"{file}: the source sent more than its {total} bytes")
                out.write(data)
                digest.update(data)
                offset += len(data)
                if progress is not None and data:
                    progress(len(data))
                if offset >= total or not data:
                    break
            if offset != total:
                raise ValueError(f"{file}: got {offset} of {total} bytes")
        if sha256 is not None and digest.hexdigest() != sha256:
            raise ValueError(f"{file}: the copy does not match its sha256; the source is damaged")
        os.replace(tmp, dest)
    except (OSError, asyncio.TimeoutError, ConnectionError) as exc:
        keep = sha256 is not None and not isinstance(exc, FileNotFoundError)
        raise
    except Exception as exc:
        from swarmp2p.errors import SwarmError

        keep = sha256 is not None and isinstance(exc, SwarmError) and exc.kind == "unavailable"
        raise
    finally:
        if tmp.exists() and not keep:
            tmp.unlink()


async def pull_files(
    read: Reader, files: Mapping[str, str | None], dest: Path, chunk: int, *, last: str = ""
) -> None:
    """Every file of ``files`` (name -> sha256 or None) into ``dest``; a file already there
    with its sha256 stays; ``last`` is fetched after all others (a completion manifest)."""
    names = sorted(n for n in files if n != last) + ([last] if last in files else [])
    for name in names:
        target = dest / name
        want = files[name]
        if want is not None and target.is_file() and sha256_file(target) == want:
            continue
        await pull_file(read, name, target, want, chunk)  # unlisted: MAX_UNLISTED_BYTES


async def pull_non_block_tensors(read: Reader, file: str, dest: Path, chunk: int) -> list[str]:
    """Copy the tensors of the safetensors ``file`` that belong to no block (embeddings, final
    norm, head) into a new safetensors file ``dest``, reading only their bytes; their names."""
    head, total = await read(file, 0, 8)
    if len(head) != 8:
        raise ValueError(f"{file}: not a safetensors file ({total} bytes)")
    (length,) = struct.unpack("<Q", head)
    if length > HEADER_LIMIT or 8 + length > total:
        raise ValueError(f"{file}: implausible safetensors header of {length} bytes")
    raw = b""
    while len(raw) < length:
        data, _ = await read(file, 8 + len(raw), min(chunk, length - len(raw)))
        if not data:
            break
        raw += data
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: safetensors header is not JSON: {exc}") from None
    base = 8 + length
    wanted = sorted(n for n in header if n != "__metadata__" and not _BLOCK_TENSOR.search(n))
    if not wanted:
        raise ValueError(f"{file} holds no embedding or head tensor")
    out_header: dict[str, Any] = {}
    pieces: list[bytes] = []
    at = 0
    for name in wanted:
        entry = header[name]
        start, end = entry["data_offsets"]
        data = b""
        while len(data) < end - start:
            got, _ = await read(file, base + start + len(data), min(chunk, end - start - len(data)))
            if not got:
                raise ValueError(f"{file}: {name} is truncated")
            data += got
        out_header[name] = {
            "dtype": entry["dtype"],
            "shape": entry["shape"],
            "data_offsets": [at, at + len(data)],
        }
        pieces.append(data)
        at += len(data)
    blob = json.dumps(out_header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)

    def write(path: str) -> None:
        with open(path, "wb") as handle:
            handle.write(struct.pack("<Q", len(blob)))
            handle.write(blob)
            for piece in pieces:
                handle.write(piece)

    from swarmp2p._atomic import write_atomic

    check_size(str(dest), at + 8 + len(blob), size=None, limit=None, room=disk_room(dest.parent))
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(dest, write)
    return wanted


def rpc_reader(
    call: Callable[[str, Message, float], Awaitable[Message]],
    endpoint: str,
    request: Callable[[str, int, int], Message],
    timeout: float | None = None,
) -> Reader:
    """A Reader over the swarm's RPC: ``request(file, offset, size)`` is the message sent to
    ``endpoint`` with ``call``, waiting ``timeout`` (None: ``TIMINGS.file_chunk_s``) for each
    chunk; the answer must be a ``job.shard_chunk``."""
    from swarmp2p.node.messages import ShardChunk

    timeout = TIMINGS.file_chunk_s if timeout is None else timeout

    async def read(file: str, offset: int, size: int) -> tuple[bytes, int]:
        reply = await call(endpoint, request(file, offset, size), timeout)
        if not isinstance(reply, ShardChunk):
            raise ValueError(f"{endpoint} answered {type(reply).TYPE} to a read of {file}")
        return reply.data, reply.total

    return read


def local_reader(folder: Path) -> Reader:
    """A Reader over files of a local folder (the node that already holds them)."""

    async def read(file: str, offset: int, size: int) -> tuple[bytes, int]:
        with open(folder / file, "rb") as handle:
            total = os.fstat(handle.fileno()).st_size
            handle.seek(offset)
            return handle.read(size), total

    return read
