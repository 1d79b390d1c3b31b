"""``swarm serve MODEL --draft DRAFT`` on the issuing node, before any stage loads: the draft
resolved as every node names it, its shape read for the plan, a tokenizer mismatch and a
``--speculate draft`` without a draft refused by name. No torch."""

from __future__ import annotations

import json

import pytest

from swarmp2p.errors import UserError
from swarmp2p.node.serving.model import _draft_of
from swarmp2p.plan.serve import ServeInputs, parse_serve_request

CONFIG = {
    "model_type": "llama",
    "vocab_size": 4,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def _model(root, name, words):
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    tok = {"model": {"vocab": {w: i for i, w in enumerate(words)}}, "added_tokens": []}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return folder


def test_a_draft_folder_relative_to_the_cli_is_resolved_and_its_shape_read(tmp_path):
    target = _model(tmp_path, "target", "abcd")
    _model(tmp_path, "small", "abcd")
    request = parse_serve_request(
        {"model": str(target), "draft": "small", "speculate": "draft", "cwd": str(tmp_path)}
    )
    draft, shape = _draft_of(request, str(target))
    assert draft == str((tmp_path / "small").resolve())
    assert shape.n_layers == 2 and shape.vocab == 4
    inputs = ServeInputs(shape=shape, draft=draft, draft_shape=shape)
    assert inputs.draft == draft


def test_a_draft_with_another_tokenizer_is_refused_naming_both(tmp_path):
    target = _model(tmp_path, "target", "abcd")
    _model(tmp_path, "other", "abdc")
    request = parse_serve_request({"model": str(target), "draft": str(tmp_path / "other")})
    with pytest.raises(UserError, match=r"draft model .*other.* tokenizer of .*target"):
        _draft_of(request, str(target))


def test_speculate_draft_without_a_draft_model_and_a_missing_folder_are_refused(tmp_path):
    target = _model(tmp_path, "target", "abcd")
    with pytest.raises(UserError, match=r"'draft' needs a draft model \(--draft MODEL\)"):
        _draft_of(parse_serve_request({"model": str(target), "speculate": "draft"}), str(target))
    assert _draft_of(parse_serve_request({"model": str(target)}), str(target)) == (None, None)
    request = parse_serve_request({"model": str(target), "draft": str(tmp_path / "nowhere")})
    with pytest.raises(UserError, match="nowhere"):
        _draft_of(request, str(target))


def test_inputs_carry_a_draft_and_its_shape_together():
    from swarmp2p.plan import from_config

    shape = from_config(CONFIG)
    with pytest.raises(ValueError, match="both or neither"):
        ServeInputs(shape=shape, draft="/x")
