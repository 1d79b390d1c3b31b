"""Token windows: the stream, shifted labels, deterministic batches, wrap-around."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from swarmp2p.data import TokenWindows, tokenize_rows, tokens_needed

_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "and",
    "runs",
    "far",
    "away",
]


@pytest.fixture(scope="module")
def tokenizer():
    """A real (word-level) Hugging Face fast tokenizer, built here: nothing is downloaded."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "<eos>": 1} | {word: i + 2 for i, word in enumerate(_WORDS)}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, eos_token="<eos>", unk_token="[UNK]"
    )


def test_rows_are_joined_with_eos(tokenizer):
    stream = tokenize_rows(["the fox", "a lazy cat"], tokenizer)
    word = {w: i + 2 for i, w in enumerate(_WORDS)}
    assert stream.tolist() == [word["the"], word["fox"], 1, word["a"], word["lazy"], 0, 1]
    assert stream.dtype == np.int32
    assert tokenize_rows(["the fox"], tokenizer, eos_id=9).tolist() == [2, 5, 9]


def test_max_tokens_cuts_the_stream(tokenizer):
    rows = ["the quick brown fox"] * 1000  # 5 tokens a row with EOS
    stream = tokenize_rows(rows, tokenizer, max_tokens=12)
    assert stream.tolist() == tokenize_rows(rows[:3], tokenizer).tolist()[:12]


def test_a_tokenizer_without_eos_needs_eos_id(tokenizer):
    class NoEos:
        eos_token_id = None

    with pytest.raises(ValueError, match="has no eos_token_id; pass eos_id"):
        tokenize_rows(["x"], NoEos())
    with pytest.raises(ValueError, match="eos_id must be a non-negative integer"):
        tokenize_rows(["x"], tokenizer, eos_id=-1)


def test_windows_and_labels_shift_by_one():
    windows = TokenWindows(tokens=np.arange(100), seq_len=9)
    assert windows.num_windows == 10
    ids, labels = windows.batch(0, 3, seed=None)
    assert ids.shape == labels.shape == (3, 9)
    assert ids.dtype == labels.dtype == np.int64
    assert ids[0].tolist() == list(range(0, 9)) and labels[0].tolist() == list(range(1, 10))
    assert ids[2].tolist() == list(range(20, 29)) and labels[2].tolist() == list(range(21, 30))
    np.testing.assert_array_equal(ids[:, 1:], labels[:, :-1])


def test_leftover_tokens_are_dropped_and_short_streams_rejected():
    assert TokenWindows(tokens=np.arange(29), seq_len=9).num_windows == 2
    with pytest.raises(ValueError, match=r"9 tokens do not fill one window of seq_len \+ 1 = 10"):
        TokenWindows(tokens=np.arange(9), seq_len=9)
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        TokenWindows(tokens=np.arange(9), seq_len=0)


def test_tokens_are_copied_and_read_only():
    source = np.arange(20)
    windows = TokenWindows(tokens=source, seq_len=4)
    source[0] = 99
    assert windows.tokens[0] == 0
    with pytest.raises(ValueError):
        windows.tokens[0] = 5


def test_batches_are_deterministic_by_seed_and_step():
    windows = TokenWindows(tokens=np.arange(50 * 8), seq_len=7)
    first = windows.batch(3, 4, seed=1)
    again = TokenWindows(tokens=np.arange(50 * 8), seq_len=7).batch(3, 4, seed=1)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    other_seed = windows.batch(3, 4, seed=2)
    other_step = windows.batch(4, 4, seed=1)
    assert not np.array_equal(first[0], other_seed[0])
    assert not np.array_equal(first[0], other_step[0])


def test_the_order_is_the_same_in_a_fresh_interpreter():
    """A resumed run on another process (or machine) must get the very same windows."""
    code = (
        "import numpy as np; from swarmp2p.data import TokenWindows;"
        "w = TokenWindows(tokens=np.arange(1000 * 3), seq_len=2);"
        "print([w.window_index(s, 1234) for s in range(3000)])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    windows = TokenWindows(tokens=np.arange(1000 * 3), seq_len=2)
    assert out.stdout.strip() == str([windows.window_index(s, 1234) for s in range(3000)])


@pytest.mark.parametrize("num_windows", [1, 2, 3, 7, 16, 17, 100])
def test_each_epoch_visits_every_window_once_and_wraps_around(num_windows):
    windows = TokenWindows(tokens=np.arange(num_windows * 5), seq_len=4)
    for seed in (0, 1, None):
        epochs = [
            [windows.window_index(e * num_windows + p, seed) for p in range(num_windows)]
            for e in range(3)
        ]
        for order in epochs:
            assert sorted(order) == list(range(num_windows))
    if num_windows >= 7:
        shuffled = [windows.window_index(p, 0) for p in range(2 * num_windows)]
        assert shuffled[:num_windows] != list(range(num_windows)), "seed 0 did not shuffle"
        assert shuffled[:num_windows] != shuffled[num_windows:], "epochs repeat one order"


def test_steps_past_the_data_wrap_into_the_next_epoch():
    windows = TokenWindows(tokens=np.arange(10 * 4), seq_len=3)
    # 10 windows, batches of 4: step 2 holds samples 8, 9 (epoch 0) and 10, 11 (epoch 1)
    ids, _ = windows.batch(2, 4, seed=None)
    assert [row[0] // 4 for row in ids.tolist()] == [8, 9, 0, 1]
    seen = [windows.batch(step, 5, seed=7)[0][:, 0] // 4 for step in range(6)]
    for epoch in range(3):
        assert sorted(np.concatenate(seen[2 * epoch : 2 * epoch + 2]).tolist()) == list(range(10))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step": -1, "batch_size": 2, "seed": 0}, "step must be a non-negative integer"),
        ({"step": 0, "batch_size": 0, "seed": 0}, "batch_size must be a positive integer"),
        ({"step": 0, "batch_size": 2, "seed": 1.5}, "seed must be an integer or None"),
    ],
)
def test_bad_batch_arguments_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TokenWindows(tokens=np.arange(20), seq_len=4).batch(**kwargs)


def test_tokens_needed_for_a_schedule():
    # the reference: 2,000 steps of 4 x 128 need about a million tokens
    assert tokens_needed(steps=2000, batch_size=4, seq_len=128) == 2000 * 4 * 129
    windows = TokenWindows(
        tokens=np.arange(tokens_needed(steps=5, batch_size=3, seq_len=8)), seq_len=8
    )
    assert windows.num_windows == 5 * 3
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        tokens_needed(steps=0, batch_size=1, seq_len=1)


def test_from_rows_builds_windows(tokenizer):
    rows = [" ".join(_WORDS)] * 10  # 14 tokens a row with EOS: one window each
    windows = TokenWindows.from_rows(rows, tokenizer, seq_len=13)
    assert windows.num_windows == 10
    ids, labels = windows.batch(0, 10, seed=3)
    assert (ids[:, 0] == tokenizer.convert_tokens_to_ids("the")).all()
    assert (labels[:, -1] == tokenizer.eos_token_id).all()


def test_data_imports_no_torch():
    code = "import sys, swarmp2p.data; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
