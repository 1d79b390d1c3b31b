"""write_atomic: the old file or the new one, never half; secrets never readable by others."""

from __future__ import annotations

import os
import stat

import pytest

from swarmp2p._atomic import write_atomic


def _leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("data", [b"\x00bytes", "text é"])
def test_bytes_and_text_replace_the_file(tmp_path, data):
    path = tmp_path / "sub" / "f"
    write_atomic(path, "old")
    write_atomic(path, data)
    expected = data if isinstance(data, bytes) else data.encode()
    assert path.read_bytes() == expected and _leftovers(path.parent) == []


def test_a_writer_function_gets_the_temp_path(tmp_path):
    path = tmp_path / "f.bin"
    seen = []

    def write(tmp: str) -> None:
        seen.append(tmp)
        with open(tmp, "wb") as f:
            f.write(b"payload")

    write_atomic(path, write)
    assert path.read_bytes() == b"payload"
    assert seen[0] != str(path) and os.path.dirname(seen[0]) == str(tmp_path)


def test_a_failing_writer_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "state.json"
    write_atomic(path, "old")

    def broken(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomic(path, broken)
    assert path.read_text() == "old" and _leftovers(tmp_path) == []


def test_mode_is_set_before_any_byte_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        write_atomic(tmp_path / "secret", "s3cret", mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600
