"""Training and evaluation data: text/JSONL files, the embedded corpus, HF datasets.

Light: imports the stdlib and numpy only; torch tensors are made by the caller.

    splits = load_splits("embedded")                       # or a .txt/.jsonl file, hf:NAME
    train = TokenWindows.from_rows(splits.train, tokenizer, seq_len=128,
                                   max_tokens=tokens_needed(steps=100, batch_size=4, seq_len=128))
    ids, labels = train.batch(step, batch_size=4, seed=0)  # int64 [4, 128] each
"""

from swarmp2p.data.sources import (
    DATASETS_INSTALL,
    DEFAULT_TEXT_FIELD,
    EMBEDDED_CORPUS,
    HF_PREFIX,
    HfSource,
    embedded_rows,
    load_rows,
    load_splits,
    parse_hf_source,
)
from swarmp2p.data.split import HELD_OUT_EVERY, Splits, split_rows, validation_start
from swarmp2p.data.windows import TokenWindows, tokenize_rows, tokens_needed

__all__ = [
    "DATASETS_INSTALL",
    "DEFAULT_TEXT_FIELD",
    "EMBEDDED_CORPUS",
    "HELD_OUT_EVERY",
    "HF_PREFIX",
    "HfSource",
    "Splits",
    "TokenWindows",
    "embedded_rows",
    "load_rows",
    "load_splits",
    "parse_hf_source",
    "split_rows",
    "tokenize_rows",
    "tokens_needed",
    "validation_start",
]
