"""What the GPU tests share: the skip without CUDA, tiny models with a tokenizer built here
(the GPU machine has no embedded model and no network), a learnable token file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from swarm_harness import tiny_llama


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


MARKS = [
    pytest.mark.gpu,
    pytest.mark.torch,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (torch sees none)"),
]
"""Every GPU test module's ``pytestmark``."""

TEXT = (
    "The lighthouse keeper climbed the stairs at dusk. The lamp was cold and the sea was loud. "
    "He wound the clock, trimmed the wick and watched the ships pass the rocks in the dark. "
    "In the morning the gulls came back, the fog lifted and the boats went out to fish. "
)
EOS = "<|endoftext|>"


def tiny_tokenizer(folder: Path, vocab: int = 320) -> int:
    """A byte-level BPE tokenizer trained on ``TEXT``, saved as the fast tokenizer files the API
    and ``AutoTokenizer`` read; its vocabulary size (at most ``vocab``), EOS id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([TEXT] * 4, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS})
    )
    return tokenizer.get_vocab_size()


def tiny_model(folder: Path, *, layers: int = 4, hidden: int = 64, **config) -> Path:
    """A random tiny Llama (grouped-query heads) with ``tiny_tokenizer``'s vocabulary; its
    weights drawn wide (``initializer_range`` 0.5) so greedy choices are not near-ties that
    half precision could flip."""
    vocab = tiny_tokenizer(folder)
    config.setdefault("initializer_range", 0.5)
    return tiny_llama(
        folder,
        vocab=vocab,
        layers=layers,
        hidden=hidden,
        max_positions=512,
        shard_size="200KB",
        eos_token_id=0,
        bos_token_id=0,
        **config,
    )


def bigram_tokens(path: Path, vocab: int, n: int, successors: int = 4) -> Path:
    """A ``.npy`` of ``n`` token ids from a random bigram chain (each id has ``successors``
    next ids): a corpus a tiny model learns in a few steps, its loss falling towards
    ln(successors)."""
    import numpy as np

    rng = np.random.default_rng(0)
    table = rng.integers(0, vocab, (vocab, successors))
    picks = rng.integers(0, successors, n)
    ids = np.empty(n, dtype=np.int64)
    ids[0] = 0
    for i in range(1, n):
        ids[i] = table[ids[i - 1], picks[i]]
    np.save(path, ids)
    return path
