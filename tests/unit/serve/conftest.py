"""Fixtures of the serving tests: tiny checkpoints (the runtime tests' builders) and rings of
stage servers on threads joined by in-process links."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parent))  # ring_helpers, in any import mode


CORPUS = [
    "the capital of France is Paris",
    "hello world, hello there",
    "one two three four five six",
    "naïve café – déjà vu ✓",
]
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tokenizer_folder(tmp_path_factory):
    """A model folder's text files only: a byte-level BPE tokenizer trained on CORPUS (ids
    0-2 are <unk>, <s>, </s>), a chat template, end-of-sequence ids 2 and 7."""
    import json

    from tiny_models import byte_bpe

    tok = byte_bpe(CORPUS)
    out = tmp_path_factory.mktemp("tok")
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(family) -> Path``: a tiny random model saved once per session."""
    from tiny_models import SHARD_SIZE, build_model

    saved: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in saved:
            folder = tmp_path_factory.mktemp(f"serve-{family}")
            build_model(family).save_pretrained(folder, max_shard_size=SHARD_SIZE)
            saved[family] = folder
        return saved[family]

    return get


@pytest.fixture(scope="session")
def tiny_whole(tiny_checkpoint):
    """``tiny_whole(family)``: the whole tiny model as transformers loads it (float32, eval)."""
    from tiny_models import load_whole

    loaded = {}

    def get(family: str):
        if family not in loaded:
            loaded[family] = load_whole(tiny_checkpoint(family))
        return loaded[family]

    return get
