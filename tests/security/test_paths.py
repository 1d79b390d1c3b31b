"""The one path-confinement check: every trick a name from a peer can play, refused by name."""

from __future__ import annotations

import os
import re

import pytest

from swarmp2p.paths import (
    MAX_COMPONENT_BYTES,
    MAX_ID_CHARS,
    MAX_NAME_CHARS,
    UnsafeName,
    check_id,
    confine,
)

ESCAPES = [
    ("..", "climbs out"),
    ("../secret", "climbs out"),
    ("x/../../y", "climbs out"),
    ("x/../y", "climbs out"),  # stays inside, but a name from a peer has no reason to climb
    ("a/b/..", "climbs out"),
    ("/etc/passwd", "absolute"),
    ("//etc/passwd", "absolute"),
    ("a\x00b", "NUL"),
    ("secret\n", "control"),
    ("\nsecret", "control"),
    ("a\rb", "control"),
    ("a\tb", "control"),
    ("\x7f", "control"),
    ("a\u202eb", "format"),  # right-to-left override: shows another name than it is
    ("a\u200bb", "format"),  # zero-width space
    ("a\u2028b", "control or format"),  # line separator
    ("\u2025", "NFKC"),  # two dot leader, folds into '..'
    ("\u2024\u2024", "NFKC"),  # one dot leader twice
    ("\uff0e\uff0e/x", "NFKC"),  # fullwidth full stops
    ("x\uff0fy", "NFKC"),  # fullwidth solidus folds into '/'
    ("..\\..\\x", "backslash"),
    ("a\\b", "backslash"),
    ("", "empty"),
    (".", "'.' component"),
    ("./x", "'.' component"),
    ("a//b", "empty or '.'"),
    ("a/", "empty or '.'"),
    ("x" * (MAX_NAME_CHARS + 1), "longer than"),
    ("x" * (MAX_COMPONENT_BYTES + 1), "over 255 bytes"),
    ("\u00e9" * 128, "over 255 bytes"),  # 128 characters, 256 UTF-8 bytes
]


@pytest.mark.parametrize(("name", "why"), ESCAPES)
def test_confine_refuses_every_escape(tmp_path, name, why):
    with pytest.raises(UnsafeName, match=why) as info:
        confine(tmp_path, name, what="file name")
    assert str(info.value).startswith("file name ")
    assert info.value.what == "file name" and info.value.value == name
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("name", [None, 3, b"x", ["x"], object()])
def test_confine_refuses_what_is_not_a_string(tmp_path, name):
    with pytest.raises(UnsafeName, match="must be a string"):
        confine(tmp_path, name, what="stage name")


@pytest.mark.parametrize(
    "name",
    [
        "manifest.json",
        "model-00001-of-00002.safetensors",
        "snapshots/stage-0/step-00000010.pt",
        "stage-1.log",
        ".hidden",
        "...",  # three dots is a plain name, not a parent
        "a..b",
        "mod\u00e8le.bin",  # NFC text is NFKC-stable
        "x" * MAX_COMPONENT_BYTES,
    ],
)
def test_confine_accepts_plain_relative_names(tmp_path, name):
    assert confine(tmp_path, name, what="file name") == tmp_path / name


def test_confine_refuses_a_symlink_out_of_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret").write_text("x")
    (root / "out").symlink_to(outside)
    (root / "dangling").symlink_to(tmp_path / "nowhere-yet")
    (root / "etc").symlink_to("/etc")
    for name in ("out", "out/secret", "out/new-file", "dangling", "etc/passwd"):
        with pytest.raises(UnsafeName, match="symlink leads it out"):
            confine(root, name, what="file name")


def test_confine_accepts_a_symlink_that_stays_inside(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    assert confine(tmp_path, "alias/x", what="file name") == tmp_path / "alias" / "x"


def test_confine_through_a_symlinked_root(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert confine(tmp_path / "link", "a/b", what="file name") == tmp_path / "link" / "a" / "b"


def test_confine_refuses_a_symlink_loop(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "self").symlink_to("self")
    for name in ("a", "a/x", "self"):
        with pytest.raises(UnsafeName, match="symlink loop"):
            confine(tmp_path, name, what="file name")


def test_confine_refuses_a_file_on_the_way_only_at_open(tmp_path):
    (tmp_path / "f").write_text("x")
    path = confine(tmp_path, "f/x", what="file name")  # lexically fine; open() says ENOTDIR
    with pytest.raises(NotADirectoryError):
        path.open()


def test_confine_message_names_what_and_value(tmp_path):
    with pytest.raises(UnsafeName) as info:
        confine(tmp_path, "x/../../y", what="stage folder")
    assert (
        str(info.value) == "stage folder 'x/../../y' is refused: it climbs out of its folder ('..')"
    )


def test_confine_shortens_a_huge_value_in_its_message(tmp_path):
    with pytest.raises(UnsafeName) as info:
        confine(tmp_path, "x" * 100_000, what="file name")
    assert len(str(info.value)) < 300 and "100000 chars" in str(info.value)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("..", "holds '.'"),
        (".", "holds '.'"),
        ("j1/..", "holds './'"),
        ("../../x", "holds './'"),
        ("j1\n", "holds '\\n'"),
        ("j1\x00", "holds '\\x00'"),
        ("/j1", "holds '/'"),
        ("j 1", "holds ' '"),
        ("j\u00e91", "holds"),
        ("\uff0e\uff0e", "holds"),
        ("", "empty"),
        ("x" * (MAX_ID_CHARS + 1), "longer than"),
        (None, "must be a string"),
        (7, "must be a string"),
    ],
)
def test_check_id_refuses(value, why):
    with pytest.raises(UnsafeName, match=re.escape(why)) as info:
        check_id(value, what="job id")
    assert str(info.value).startswith("job id ")


@pytest.mark.parametrize("value", ["j000001-a1b2c3", "s1", "A_b-9", "x" * MAX_ID_CHARS])
def test_check_id_accepts(value):
    assert check_id(value, what="job id") == value


def test_confine_writes_nothing(tmp_path):
    before = sorted(os.listdir(tmp_path))
    for name, _ in ESCAPES:
        with pytest.raises(UnsafeName):
            confine(tmp_path, name, what="file name")
    confine(tmp_path, "new/folder/file", what="file name")
    assert sorted(os.listdir(tmp_path)) == before
