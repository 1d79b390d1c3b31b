"""`swarm export` writes the base model's tokenizer beside the weights, so the folder serves."""

from __future__ import annotations

import json

import pytest

from swarmp2p.runtime.torch.train.export import _save_tokenizer

pytestmark = pytest.mark.torch


def test_the_base_tokenizer_is_saved_beside_the_export(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    base = tmp_path / "base"
    base.mkdir()
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "paris": 1, "france": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(base / "tokenizer.json"))
    (base / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"})
    )
    out = tmp_path / "out"
    out.mkdir()
    assert _save_tokenizer(str(base), out) is True
    saved = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert saved.encode("paris france").ids == [1, 2]


def test_a_base_without_a_tokenizer_exports_weights_only(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "out").mkdir()
    assert _save_tokenizer(str(tmp_path / "base"), tmp_path / "out") is False
    assert not (tmp_path / "out" / "tokenizer.json").exists()
