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


def hub_llama(folder: Path, *, layers: int = 6, seed: int = 0) -> Path:
    """A small random Llama for the Hub tests (hidden 128: ~0.6 MB a block, one shard each, so
    a safetensors header read is a small part of a file) with the word-level tokenizer."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_id=1,
        pad_token_id=2,
    )
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    model.save_pretrained(folder, max_shard_size="700KB")
    return tokenizer(folder)
