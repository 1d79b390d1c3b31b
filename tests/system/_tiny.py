"""Tiny models for the system tests: a random Llama with a word-level tokenizer of the same
small vocabulary (so a data file can be tokenized), and a text corpus in that vocabulary."""

from __future__ import annotations

import json
import random
from pathlib import Path

import swarm_harness

WORDS = [f"w{i}" for i in range(120)]
"""The corpus's words; with [UNK], [EOS] and [PAD] the vocabulary has 123 of the model's 128."""


def corpus(paragraphs: int = 60, seed: int = 0) -> str:
    """Paragraphs of random words, blank-line separated (``data.source`` .txt rows)."""
    rng = random.Random(seed)
    return "\n\n".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 40))) for _ in range(paragraphs)
    )


def tokenizer(folder: Path) -> Path:
    """A word-level fast tokenizer (tokenizer.json + tokenizer_config.json) in ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[EOS]": 1, "[PAD]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "[UNK]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "model_max_length": 64,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def tiny_llama(folder: Path, *, layers: int = 6, vocab: int = 128) -> Path:
    """A random tiny Llama (hidden 32, several safetensors shards) with the tokenizer."""
    swarm_harness.tiny_llama(folder, vocab=vocab, layers=layers, eos_token_id=1, pad_token_id=2)
    return tokenizer(folder)


def weight_files(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.safetensors")}
