"""Data sources: text and JSONL files, the embedded corpus, and Hugging Face datasets.

A source yields rows, one document each, in a fixed order:

| source | rows |
|---|---|
| `path/to/file.txt` | one per paragraph: a run of non-blank lines, ended by a blank line |
| `path/to/file.jsonl` | one per line: a JSON object whose `text_field` (default "text") is a string |
| `embedded` | one per topic of Python's own `pydoc_data.topics` (about 465 KB), sorted by key |
| `hf:NAME[:CONFIG]` | the "train" split of that dataset via the `datasets` library (online) |

A text file is split into paragraphs, not kept whole, so that a single file still has rows
for the held-out rule (`swarmp2p.data.split`) to hold some back. Rows whose text is empty or
only whitespace carry no tokens and are skipped everywhere; blank JSONL lines likewise.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from swarmp2p.data.split import Splits, split_rows

EMBEDDED_CORPUS = "embedded"
"""The source name of the embedded corpus (the text of `pydoc_data.topics`)."""

HF_PREFIX = "hf:"
"""Sources starting with this are Hugging Face datasets: `hf:NAME[:CONFIG]`."""

DATASETS_INSTALL = "pip install datasets"
"""How to get the optional `datasets` library."""

DEFAULT_TEXT_FIELD = "text"
"""The JSON field (JSONL rows, dataset columns) that holds a row's text."""

_FILE_KINDS = (".txt", ".jsonl")


@dataclass(frozen=True, kw_only=True, slots=True)
class HfSource:
    """A parsed `hf:NAME[:CONFIG]` source."""

    name: str
    """The dataset's Hub name, e.g. "Salesforce/wikitext"."""
    config: str | None = None
    """Its configuration, e.g. "wikitext-103-raw-v1"; None for the default."""


def parse_hf_source(source: str) -> HfSource:
    """Parse `hf:NAME[:CONFIG]`; an empty name or config is an error."""
    if not source.startswith(HF_PREFIX):
        raise ValueError(
            f"data source {source!r} is not a Hugging Face dataset ('hf:NAME[:CONFIG]')"
        )
    name, sep, config = source[len(HF_PREFIX) :].partition(":")
    if not name or (sep and not config) or ":" in config:
        raise ValueError(
            f"data source {source!r}: expected 'hf:NAME' or 'hf:NAME:CONFIG', "
            "e.g. 'hf:Salesforce/wikitext:wikitext-103-raw-v1'"
        )
    return HfSource(name=name, config=config or None)


def load_rows(
    source: str | os.PathLike[str], *, text_field: str = DEFAULT_TEXT_FIELD
) -> tuple[str, ...]:
    """The rows (documents) of a source, in their fixed order; a source with none is an error."""
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"text_field must be a non-empty string, got {text_field!r}")
    if isinstance(source, str) and source == EMBEDDED_CORPUS:
        rows = embedded_rows()
    elif isinstance(source, str) and source.startswith(HF_PREFIX):
        rows = _hf_rows(parse_hf_source(source), text_field=text_field)
    else:
        rows = _file_rows(Path(source), text_field=text_field)
    if not rows:
        raise ValueError(f"data source {str(source)!r} has no rows (no non-blank text)")
    return rows


def load_splits(source: str | os.PathLike[str], *, text_field: str = DEFAULT_TEXT_FIELD) -> Splits:
    """A source's rows split by the held-out rule: training rows, then validation rows."""
    return split_rows(load_rows(source, text_field=text_field))


def embedded_rows() -> tuple[str, ...]:
    """The embedded corpus: every `pydoc_data.topics` topic's text, sorted by topic name."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions split pydoc_data into its own package
        raise ImportError(
            "the embedded corpus is Python's pydoc_data.topics, which this Python lacks; install "
            "your distribution's full standard library (e.g. the python3-doc or libpython3-stdlib "
            "package) or use a .txt/.jsonl file"
        ) from exc
    return tuple(topics[key] for key in sorted(topics) if topics[key].strip())


def _file_rows(path: Path, *, text_field: str) -> tuple[str, ...]:
    if not path.exists():
        raise FileNotFoundError(
            f"data source {str(path)!r} does not exist; name a .txt or .jsonl file, "
            f"{EMBEDDED_CORPUS!r}, or 'hf:NAME[:CONFIG]'"
        )
    if path.suffix not in _FILE_KINDS:
        raise ValueError(
            f"data source {str(path)!r}: unsupported file type {path.suffix or '(none)'!r}; "
            f"use one of {', '.join(_FILE_KINDS)}"
        )
    text = _read_text(path)
    if path.suffix == ".txt":
        return _paragraphs(text)
    return _jsonl_rows(text, path=path, text_field=text_field)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"data source {str(path)!r} is not UTF-8 text (byte {exc.start}: {exc.reason}); "
            "convert it to UTF-8"
        ) from exc


def _paragraphs(text: str) -> tuple[str, ...]:
    rows: list[str] = []
    lines: list[str] = []
    for line in text.splitlines():
        if line.strip():
            lines.append(line)
        elif lines:
            rows.append("\n".join(lines))
            lines = []
    if lines:
        rows.append("\n".join(lines))
    return tuple(rows)


def _jsonl_rows(text: str, *, path: Path, text_field: str) -> tuple[str, ...]:
    rows: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}: line {number}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if text_field not in record:
            fields = ", ".join(map(repr, sorted(record))) or "none"
            raise ValueError(
                f"{where}: no field {text_field!r} (fields: {fields}); "
                "set text_field to the field that holds the text"
            )
        value = record[text_field]
        if not isinstance(value, str):
            raise ValueError(
                f"{where}: field {text_field!r} is {type(value).__name__}, expected a string"
            )
        if value.strip():
            rows.append(value)
    return tuple(rows)


def _hf_rows(spec: HfSource, *, text_field: str) -> tuple[str, ...]:
    label = HF_PREFIX + spec.name + (f":{spec.config}" if spec.config else "")
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"data source {label!r} needs the 'datasets' library and network access to the "
            f"Hugging Face Hub: `{DATASETS_INSTALL}`; or use a .txt/.jsonl file or "
            f"{EMBEDDED_CORPUS!r}"
        ) from None
    try:
        table = datasets.load_dataset(spec.name, spec.config, split="train")
    except Exception as exc:  # the library raises many types; each becomes one clear message
        raise RuntimeError(
            f"data source {label!r}: could not load the dataset ({type(exc).__name__}: {exc}); "
            "check the name and config and that this machine can reach the Hugging Face Hub"
        ) from exc
    if text_field not in table.column_names:
        raise ValueError(
            f"data source {label!r}: no column {text_field!r} "
            f"(columns: {', '.join(table.column_names)}); set text_field"
        )
    rows = []
    for index, value in enumerate(table[text_field]):
        if not isinstance(value, str):
            raise ValueError(
                f"data source {label!r}: row {index} column {text_field!r} is "
                f"{type(value).__name__}, expected a string"
            )
        if value.strip():
            rows.append(value)
    return tuple(rows)
