"""Sources: .txt paragraphs, JSONL rows with their errors, the embedded corpus, `hf:`."""

from __future__ import annotations

import json
import sys

import pytest

from swarmp2p.data import (
    DATASETS_INSTALL,
    EMBEDDED_CORPUS,
    HfSource,
    embedded_rows,
    load_rows,
    load_splits,
    parse_hf_source,
)


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_text_file_rows_are_paragraphs(tmp_path):
    path = _write(
        tmp_path / "book.txt",
        "First paragraph,\nsecond line.\n\n\n  \nSecond one.\r\n\r\nThird\n  indented\n",
    )
    assert load_rows(path) == (
        "First paragraph,\nsecond line.",
        "Second one.",
        "Third\n  indented",
    )
    assert load_rows(str(path)) == load_rows(path)


def test_jsonl_rows_use_text_field_and_skip_blank_lines(tmp_path):
    path = _write(
        tmp_path / "rows.jsonl",
        '{"text": "one", "id": 1}\n\n{"text": "two"}\n{"text": "   "}\n{"text": "three"}\n',
    )
    assert load_rows(path) == ("one", "two", "three")
    other = _write(tmp_path / "other.jsonl", '{"body": "a"}\n{"body": "b"}\n')
    assert load_rows(other, text_field="body") == ("a", "b")


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"text": "ok"}', "", '{"text": "ok", '], r"line 3: not valid JSON"),
        (['{"text": "ok"}', '["text"]'], r"line 2: expected a JSON object, got list"),
        (['"just a string"'], r"line 1: expected a JSON object, got str"),
        (
            ['{"text": "ok"}', '{"body": "x", "id": 2}'],
            r"line 2: no field 'text' \(fields: 'body', 'id'\)",
        ),
        (
            ['{"text": "ok"}', '{"text": "ok"}', '{"text": 7}'],
            r"line 3: field 'text' is int, expected a string",
        ),
        (['{"text": null}'], r"line 1: field 'text' is NoneType"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, lines, message):
    path = _write(tmp_path / "bad.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message) as info:
        load_rows(path)
    assert str(path) in str(info.value)


def test_bad_files_get_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist; name a \.txt or \.jsonl file"):
        load_rows(tmp_path / "missing.txt")
    with pytest.raises(
        ValueError, match=r"unsupported file type '\.csv'; use one of \.txt, \.jsonl"
    ):
        load_rows(_write(tmp_path / "table.csv", "a,b\n"))
    with pytest.raises(ValueError, match=r"has no rows"):
        load_rows(_write(tmp_path / "blank.txt", "\n   \n\n"))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"is not UTF-8 text \(byte 3"):
        load_rows(latin)
    with pytest.raises(ValueError, match="text_field must be a non-empty string"):
        load_rows(EMBEDDED_CORPUS, text_field="")


def test_embedded_corpus_is_pydoc_topics_sorted():
    from pydoc_data.topics import topics

    rows = embedded_rows()
    assert rows == tuple(topics[key] for key in sorted(topics))
    assert load_rows(EMBEDDED_CORPUS) == rows
    size = sum(len(row.encode("utf-8")) for row in rows)
    assert 350_000 < size < 600_000, f"embedded corpus is {size} bytes, expected about 465 KB"
    assert len(rows) >= 20, "the embedded corpus must be large enough to hold rows back"


def test_embedded_corpus_splits_by_the_held_out_rule():
    rows = load_rows(EMBEDDED_CORPUS)
    splits = load_splits(EMBEDDED_CORPUS)
    assert len(splits.validation) == len(rows) // 20 > 0
    assert splits.train + splits.validation == rows


def test_small_file_has_no_validation_split(tmp_path):
    path = _write(
        tmp_path / "few.jsonl", "".join(json.dumps({"text": f"r{i}"}) + "\n" for i in range(19))
    )
    assert load_splits(path).validation == ()
    _write(path, "".join(json.dumps({"text": f"r{i}"}) + "\n" for i in range(20)))
    assert load_splits(path).validation == ("r19",)


@pytest.mark.parametrize(
    ("source", "parsed"),
    [
        ("hf:wikitext", HfSource(name="wikitext")),
        (
            "hf:Salesforce/wikitext:wikitext-103-raw-v1",
            HfSource(name="Salesforce/wikitext", config="wikitext-103-raw-v1"),
        ),
    ],
)
def test_hf_sources_parse(source, parsed):
    assert parse_hf_source(source) == parsed


@pytest.mark.parametrize("source", ["hf:", "hf::cfg", "hf:name:", "hf:a:b:c"])
def test_bad_hf_sources_are_rejected(source):
    with pytest.raises(ValueError, match=r"expected 'hf:NAME' or 'hf:NAME:CONFIG'"):
        load_rows(source)


def test_hf_source_without_datasets_says_how_to_install(monkeypatch):
    # None in sys.modules makes `import datasets` raise ImportError, installed or not.
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError) as info:
        load_rows("hf:Salesforce/wikitext:wikitext-103-raw-v1")
    message = str(info.value)
    assert "'hf:Salesforce/wikitext:wikitext-103-raw-v1' needs the 'datasets' library" in message
    assert DATASETS_INSTALL in message
    assert "online" in message or "network" in message
