"""A served model's files made local on a stage node: listings, matching, chunked pulls checked
against sha256, and a tied head's tensors cut out of a remote safetensors file."""

from __future__ import annotations

import asyncio
import hashlib
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from swarmp2p.node.serving import model_files


def _model(folder, seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "seed": seed}))
    save_file(
        {
            "model.embed_tokens.weight": rng.standard_normal((50, 8)).astype(np.float32),
            "model.layers.0.mlp.up_proj.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "model.layers.11.input_layernorm.weight": np.ones(8, np.float32),
            "model.norm.weight": rng.standard_normal(8).astype(np.float32),
        },
        str(folder / "model.safetensors"),
    )
    (folder / "tokenizer.json").write_text("{}")  # travels: stage 0 tokenizes the data
    (folder / "notes.md").write_text("# not a model file: stays where it is")
    return folder


def _counting(read):
    calls = []

    async def counted(file, offset, size):
        calls.append((file, offset, size))
        return await read(file, offset, size)

    return counted, calls


def test_a_listing_names_the_weights_and_config_with_their_sha256(tmp_path):
    folder = _model(tmp_path / "m")
    listing = model_files.folder_listing(folder)
    assert sorted(listing) == ["config.json", "model.safetensors", "tokenizer.json"]
    data = (folder / "model.safetensors").read_bytes()
    assert listing["model.safetensors"] == [len(data), hashlib.sha256(data).hexdigest()]
    assert model_files.check_listing(listing) == listing
    assert model_files.matches(folder, listing)
    other = _model(tmp_path / "other", seed=1)  # same names and sizes, other weights
    assert not model_files.matches(other, listing)
    assert not model_files.matches(tmp_path / "missing", listing)
    with pytest.raises(ValueError, match=r"no config\.json"):
        model_files.folder_listing(tmp_path)


@pytest.mark.parametrize(
    ("listing", "message"),
    [
        ({"model.safetensors": [1, "0" * 64]}, "naming config.json"),
        ({"config.json": [1, "0" * 64], "../x.safetensors": [1, "0" * 64]}, "not a model file"),
        ({"config.json": [1, "xyz"]}, r"needs \[bytes, sha256\]"),
    ],
)
def test_a_bad_listing_is_refused_with_the_name(listing, message):
    with pytest.raises(ValueError, match=message):
        model_files.check_listing(listing)


def test_files_are_pulled_in_chunks_checked_and_kept_when_intact(tmp_path):
    src = _model(tmp_path / "src")
    listing = model_files.folder_listing(src)
    read, calls = _counting(model_files.local_reader(src))
    dest = tmp_path / "dest"
    files = {k: v[1] for k, v in listing.items()}
    asyncio.run(model_files.pull_files(read, files, dest, chunk=256))
    assert model_files.matches(dest, listing)
    assert len(calls) > 4  # chunked
    calls.clear()
    asyncio.run(model_files.pull_files(read, files, dest, chunk=256))
    assert calls == []  # an intact copy is not fetched again


def test_a_damaged_source_leaves_no_file_behind(tmp_path):
    src = _model(tmp_path / "src")
    listing = model_files.folder_listing(src)
    raw = bytearray((src / "model.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (src / "model.safetensors").write_bytes(bytes(raw))
    dest = tmp_path / "dest"
    with pytest.raises(ValueError, match="does not match its sha256"):
        asyncio.run(
            model_files.pull_files(
                model_files.local_reader(src), {k: v[1] for k, v in listing.items()}, dest, 4096
            )
        )
    assert not (dest / "model.safetensors").exists()
    assert [p.name for p in dest.iterdir()] == ["config.json"]  # no partial file


def test_the_last_file_comes_after_the_others(tmp_path):
    src = _model(tmp_path / "src")
    (src / "manifest.json").write_text("{}")
    read, calls = _counting(model_files.local_reader(src))
    names = {"manifest.json": None, "model.safetensors": None, "config.json": None}
    asyncio.run(model_files.pull_files(read, names, tmp_path / "d", 1 << 20, last="manifest.json"))
    assert [c[0] for c in calls] == ["config.json", "model.safetensors", "manifest.json"]


def test_a_tied_head_copies_only_the_embedding_and_head_tensors(tmp_path):
    src = _model(tmp_path / "src")
    read, calls = _counting(model_files.local_reader(src))
    dest = tmp_path / "head.safetensors"
    names = asyncio.run(model_files.pull_non_block_tensors(read, "model.safetensors", dest, 64))
    assert names == ["model.embed_tokens.weight", "model.norm.weight"]
    got, whole = load_file(str(dest)), load_file(str(src / "model.safetensors"))
    assert sorted(got) == names
    for name in names:
        np.testing.assert_array_equal(got[name], whole[name])
    fetched = sum(c[2] for c in calls)
    assert fetched < (src / "model.safetensors").stat().st_size  # the blocks were not read


def test_a_file_that_is_not_safetensors_is_refused(tmp_path):
    (tmp_path / "w.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="implausible safetensors header"):
        asyncio.run(
            model_files.pull_non_block_tensors(
                model_files.local_reader(tmp_path), "w.safetensors", tmp_path / "o", 64
            )
        )
