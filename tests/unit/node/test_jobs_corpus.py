"""A job's text corpus tokenized in a subprocess into the token file stage 0 reads: its
training rows and its held-out rows (the last, one in twenty) as two streams."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from swarmp2p.data import HELD_OUT_EVERY, load_rows, tokenize_rows
from swarmp2p.node.training.corpus import prepare_tokens

pytestmark = [pytest.mark.slow, pytest.mark.torch]


def test_the_embedded_corpus_becomes_two_int32_streams_with_eos_between_documents(tmp_path):
    out = tmp_path / "data" / "corpus.npz"
    asyncio.run(prepare_tokens("embedded", "embedded", "text", out))
    with np.load(out, allow_pickle=False) as saved:
        assert sorted(saved.files) == ["train", "validation"]
        ids, held = saved["train"], saved["validation"]
    assert ids.ndim == 1 and ids.dtype == np.int32 and len(ids) > 10_000
    assert held.dtype == np.int32 and 0 < len(held) < len(ids)
    eos = _tokenizer().eos_token_id
    assert ids[-1] == eos and (ids == eos).sum() > 50  # one per pydoc topic
    n_rows = len(load_rows("embedded"))
    assert (held == eos).sum() == n_rows // HELD_OUT_EVERY  # the last topics, one in twenty
    assert [p.name for p in out.parent.iterdir()] == ["corpus.npz"]  # no temp file left
    mtime = out.stat().st_mtime_ns
    asyncio.run(prepare_tokens("embedded", "embedded", "text", out))
    assert out.stat().st_mtime_ns == mtime  # made once per job folder


def _tokenizer():
    from transformers import AutoTokenizer

    from swarmp2p.models import resolve_model_ref

    return AutoTokenizer.from_pretrained(resolve_model_ref("embedded"))


def _rows(n: int) -> list[str]:
    """Rows of different lengths, the last ones short, so rows and token windows disagree."""
    return [f"row {i}: " + "lorem ipsum dolor " * (12 if i < n - 3 else 1) for i in range(n)]


@pytest.mark.parametrize(("n", "held"), [(41, 2), (20, 1), (19, 0)])
def test_a_jsonl_corpus_holds_out_its_last_rows_one_in_twenty(tmp_path, n, held):
    """Reference: a bucket file's validation split is its last rows, one in twenty; training is
    every row before them; fewer than 20 rows: no validation split."""
    rows = _rows(n)
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"body": r}) + "\n" for r in rows))
    out = tmp_path / "corpus.npz"
    asyncio.run(prepare_tokens("embedded", str(source), "body", out))
    with np.load(out, allow_pickle=False) as saved:
        train, validation = saved["train"], saved["validation"]
    tok = _tokenizer()
    np.testing.assert_array_equal(train, tokenize_rows(rows[: n - held], tok))
    if held:
        np.testing.assert_array_equal(validation, tokenize_rows(rows[n - held :], tok))
    else:
        assert validation.shape == (0,) and validation.dtype == np.int32


def test_a_text_corpus_counts_paragraphs_as_its_rows(tmp_path):
    rows = _rows(40)
    source = tmp_path / "corpus.txt"
    source.write_text("\n\n".join(rows) + "\n")
    out = tmp_path / "corpus.npz"
    asyncio.run(prepare_tokens("embedded", str(source), "text", out))
    with np.load(out, allow_pickle=False) as saved:
        validation = saved["validation"]
    np.testing.assert_array_equal(validation, tokenize_rows(rows[38:], _tokenizer()))


def test_a_missing_corpus_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.txt"):
        asyncio.run(
            prepare_tokens("embedded", str(tmp_path / "nope.txt"), "text", tmp_path / "t.npy")
        )
