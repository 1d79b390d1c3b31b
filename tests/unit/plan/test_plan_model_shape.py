"""Model shapes from config.json and safetensors headers, with no torch."""

from __future__ import annotations

import json
import struct

import pytest
from _plan_factories import llama_config

from swarmp2p.plan import from_config, load_model_shape, read_safetensors_header
from swarmp2p.plan.model_shape import EMBEDDED_CONFIG


def write_safetensors(path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A real safetensors file: 8-byte little-endian header length, JSON header, zero data."""
    sizes = {"F32": 4, "BF16": 2, "F16": 2}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def llama_tensors(layers: range, h: int, inter: int, kv: int, vocab: int, embed: bool, head: bool):
    t: dict[str, tuple[str, list[int]]] = {}
    if embed:
        t["model.embed_tokens.weight"] = ("BF16", [vocab, h])
    for i in layers:
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = ("BF16", [h, h])
        t[p + "self_attn.k_proj.weight"] = ("BF16", [kv, h])
        t[p + "self_attn.v_proj.weight"] = ("BF16", [kv, h])
        t[p + "self_attn.o_proj.weight"] = ("BF16", [h, h])
        t[p + "mlp.gate_proj.weight"] = ("BF16", [inter, h])
        t[p + "mlp.up_proj.weight"] = ("BF16", [inter, h])
        t[p + "mlp.down_proj.weight"] = ("BF16", [h, inter])
        t[p + "input_layernorm.weight"] = ("BF16", [h])
        t[p + "post_attention_layernorm.weight"] = ("BF16", [h])
    if head:
        t["model.norm.weight"] = ("BF16", [h])
        t["lm_head.weight"] = ("BF16", [vocab, h])
    return t


def test_embedded_builtin_config_is_smollm2_135m(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no converted folder there
    shape = load_model_shape("embedded")
    assert (shape.n_layers, shape.hidden, shape.vocab) == (30, 576, 49152)
    assert (shape.n_heads, shape.n_kv_heads, shape.head_dim) == (9, 3, 64)
    assert shape.tie_embeddings
    assert shape.total_params == 134_515_008
    assert shape.checkpoint_dtype == "float32"
    # the head's matmul costs about 8 of the 30 layers (DESIGN.md pitfall)
    assert 7.5 < shape.head_compute_params / shape.layer_active_params[0] < 8.5


def test_embedded_prefers_the_converted_folder(monkeypatch, tmp_path):
    folder = tmp_path / "swarmp2p" / "models" / "smollm2-135m-instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**EMBEDDED_CONFIG, "num_hidden_layers": 2}))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert load_model_shape("embedded").n_layers == 2


def test_text_config_is_read_through():
    cfg = {"model_type": "qwen3_5", "text_config": llama_config(layers=6, hidden=128)}
    shape = from_config(cfg)
    assert (shape.n_layers, shape.hidden) == (6, 128)


def test_gpt2_config():
    cfg = {
        "model_type": "gpt2",
        "n_layer": 12,
        "n_embd": 768,
        "n_head": 12,
        "vocab_size": 50257,
        "n_positions": 1024,
    }
    shape = from_config(cfg)
    assert shape.tie_embeddings
    assert shape.total_params == 124_439_808  # GPT-2 small, as counted by transformers


def test_moe_layers_dense_first_then_experts():
    cfg = llama_config(
        layers=6,
        hidden=64,
        model_type="deepseek_v3",
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=2,
        n_shared_experts=1,
    )
    shape = from_config(cfg)
    assert shape.moe_layers == (False, False, True, True, True, True)
    dense, moe = shape.layer_params[0], shape.layer_params[2]
    assert moe > dense
    expert = 3 * 64 * 32
    assert moe - shape.layer_active_params[2] == (8 - 2) * expert


@pytest.mark.parametrize(
    ("extra", "flags"),
    [
        ({"num_experts": 4, "mlp_only_layers": [0, 3]}, (False, True, True, False)),
        ({"num_experts": 4, "decoder_sparse_step": 2}, (False, True, False, True)),
        ({"num_local_experts": 4}, (True, True, True, True)),
        ({}, (False, False, False, False)),
    ],
)
def test_moe_layer_selection(extra, flags):
    shape = from_config(llama_config(layers=4, num_experts_per_tok=1, **extra))
    assert shape.moe_layers == flags


def test_bad_config_names_the_key():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        from_config({"hidden_size": 8, "vocab_size": 8, "num_attention_heads": 2})


def test_sharded_folder_headers_and_index(tmp_path):
    h, inter, kv, vocab = 64, 192, 32, 256
    cfg = llama_config(layers=4, hidden=h, vocab=vocab)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    write_safetensors(
        tmp_path / "model-00001-of-00002.safetensors",
        llama_tensors(range(0, 2), h, inter, kv, vocab, True, False),
    )
    write_safetensors(
        tmp_path / "model-00002-of-00002.safetensors",
        llama_tensors(range(2, 4), h, inter, kv, vocab, False, True),
    )
    weight_map = {}
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        for tensor in read_safetensors_header(tmp_path / name):
            weight_map[tensor] = name
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    shape = load_model_shape(str(tmp_path))
    config_only = from_config(cfg)
    assert shape.layer_params == config_only.layer_params
    assert shape.total_params == config_only.total_params
    assert shape.checkpoint_dtype == "bfloat16"
    assert shape.layer_bytes == tuple(2 * p for p in shape.layer_params)
    assert shape.embed_bytes == 2 * vocab * h
    assert shape.head_bytes == 2 * (vocab * h + h)
    assert shape.layer_files[0] == ("model-00001-of-00002.safetensors",)
    assert shape.layer_files[3] == ("model-00002-of-00002.safetensors",)
    assert shape.head_files == ("model-00002-of-00002.safetensors",)


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"\x01\x00", "shorter than 8 bytes"),
        (struct.pack("<Q", 100) + b"{}", "truncated"),
        (struct.pack("<Q", 3) + b"abc", "not JSON"),
        (struct.pack("<Q", 2**40), "implausibly large"),
    ],
)
def test_bad_safetensors_headers(tmp_path, payload, fragment):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(payload)
    with pytest.raises(ValueError, match=fragment):
        read_safetensors_header(path)


def test_hub_id_from_the_local_cache_only(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        load_model_shape("org/tiny")
    snap = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(llama_config(layers=3)))
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc123")
    shape = load_model_shape("org/tiny")
    assert shape.n_layers == 3 and shape.name == "org/tiny"


def test_unknown_reference():
    with pytest.raises(ValueError, match="neither"):
        load_model_shape("no such thing at all")


def test_vision_tower_and_mtp_tensors_belong_to_no_stage(tmp_path):
    h, inter, kv, vocab = 64, 192, 32, 256
    cfg = {"model_type": "qwen3_5", "text_config": llama_config(layers=2, hidden=h, vocab=vocab)}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = {
        k.replace("model.", "model.language_model.", 1): v
        for k, v in llama_tensors(range(2), h, inter, kv, vocab, True, True).items()
    }
    tensors["model.visual.blocks.0.attn.qkv.weight"] = ("BF16", [3 * h, h])
    tensors["mtp.layers.0.mlp.up_proj.weight"] = ("BF16", [inter, h])
    write_safetensors(tmp_path / "model.safetensors", tensors)
    shape = load_model_shape(str(tmp_path))
    plain = from_config(cfg)
    assert shape.layer_params == plain.layer_params
    assert shape.total_params == plain.total_params
