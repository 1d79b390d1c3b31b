"""Training and evaluation data: text/JSONL files, the embedded corpus, HF datasets.

Light: imports the stdlib and numpy only; torch tensors are made by the caller.

    data = prepare_data("embedded", tokenizer, seq_len=128, steps=100, batch_size=4)
    ids, labels = data.train.batch(step, 4, seed=0)       # int64 [4, 128] each, labels shifted
    for i in range(data.eval_batches(4, limit=16)):
        ids, labels = data.validation.batch(i, 4, seed=None)

Sources: a .txt or .jsonl file, "embedded" (Python's pydoc topics), "hf:NAME[:CONFIG]".
"""

from swarmp2p.data.prepare import PreparedData, prepare_data
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
    "PreparedData",
    "Splits",
    "TokenWindows",
    "embedded_rows",
    "load_rows",
    "load_splits",
    "parse_hf_source",
    "prepare_data",
    "split_rows",
    "tokenize_rows",
    "tokens_needed",
    "validation_start",
]
