"""prepare_data: a source to training windows sized by the schedule, and held-out windows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from swarmp2p.data import (
    EMBEDDED_CORPUS,
    load_splits,
    prepare_data,
    tokenize_rows,
    tokens_needed,
)

_WORDS = [f"w{i}" for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer():
    """A real word-level Hugging Face fast tokenizer, built here: nothing is downloaded."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "<eos>": 1} | {word: i + 2 for i, word in enumerate(_WORDS)}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, eos_token="<eos>", unk_token="[UNK]"
    )


def _jsonl(path, rows):
    path.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows), encoding="utf-8")
    return path


def test_training_never_sees_validation_rows(tmp_path, tokenizer):
    # 40 rows, each a distinct word repeated: the last 2 rows are held out
    rows = [" ".join([_WORDS[i]] * 7) for i in range(40)]
    data = prepare_data(
        _jsonl(tmp_path / "d.jsonl", rows), tokenizer, seq_len=7, steps=1000, batch_size=2
    )
    assert (data.train_rows, data.validation_rows) == (38, 2)
    held_out = {tokenizer.convert_tokens_to_ids(_WORDS[i]) for i in (38, 39)}
    assert not held_out & set(np.unique(data.train.tokens).tolist())
    assert data.validation is not None
    assert set(np.unique(data.validation.tokens).tolist()) == held_out | {tokenizer.eos_token_id}
    assert data.validation.num_windows == 2  # 2 rows x 8 tokens = 2 windows of 8
    assert data.eval_batches(2, limit=16) == 1 and data.eval_batches(1, limit=16) == 2
    assert data.eval_batches(1, limit=1) == 1


def test_training_stream_is_cut_at_what_the_schedule_needs(tokenizer):
    data = prepare_data(EMBEDDED_CORPUS, tokenizer, seq_len=16, steps=3, batch_size=2)
    assert len(data.train.tokens) == tokens_needed(steps=3, batch_size=2, seq_len=16)
    assert data.train.num_windows == 6
    # the cut stream is the start of the whole training stream
    whole = tokenize_rows(load_splits(EMBEDDED_CORPUS).train, tokenizer)
    assert len(whole) > len(data.train.tokens)
    np.testing.assert_array_equal(data.train.tokens, whole[: len(data.train.tokens)])


def test_a_small_source_evaluates_nothing(tmp_path, tokenizer):
    rows = [" ".join(_WORDS[:5])] * 19
    data = prepare_data(
        _jsonl(tmp_path / "few.jsonl", rows), tokenizer, seq_len=4, steps=5, batch_size=2
    )
    assert data.validation is None and data.validation_rows == 0
    assert data.eval_batches(2, limit=16) == 0


def test_validation_too_short_for_a_window_evaluates_nothing(tmp_path, tokenizer):
    rows = [" ".join(_WORDS[:30])] * 19 + ["w1"]  # the one held-out row has 2 tokens
    data = prepare_data(
        _jsonl(tmp_path / "d.jsonl", rows), tokenizer, seq_len=8, steps=5, batch_size=2
    )
    assert data.validation_rows == 1 and data.validation is None


def test_eval_batches_caps_the_validation_stream(tokenizer):
    data = prepare_data(
        EMBEDDED_CORPUS, tokenizer, seq_len=8, steps=1, batch_size=2, eval_batches=3
    )
    assert data.validation is not None and data.validation.num_windows == 6
    off = prepare_data(EMBEDDED_CORPUS, tokenizer, seq_len=8, steps=1, batch_size=2, eval_batches=0)
    assert off.validation is None and off.validation_rows > 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eval_batches": -1}, "eval_batches must be a non-negative integer or None"),
        ({"steps": 0}, "steps must be a positive integer"),
        ({"seq_len": 0}, "seq_len must be a positive integer"),
    ],
)
def test_bad_settings_are_rejected(tokenizer, kwargs, message):
    settings = {"seq_len": 8, "steps": 1, "batch_size": 2} | kwargs
    with pytest.raises(ValueError, match=message):
        prepare_data(EMBEDDED_CORPUS, tokenizer, **settings)
