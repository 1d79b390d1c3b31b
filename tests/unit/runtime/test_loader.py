"""Slice loading: a stage reads only its tensors from only its files, equal to the whole load."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch
from tiny_models import FAMILIES, load_whole

from swarmp2p.runtime.torch.model import loader
from swarmp2p.runtime.torch.model.loader import check_free_disk, load_stage_shard, resolve_dtype

pytestmark = pytest.mark.torch

CUTS = ([2], [1, 3])
_BLOCK = re.compile(r"\.(?:h|layers)\.(\d+)\.")
_FIRST = re.compile(r"(?:^|\.)(?:wte|wpe|embed_tokens|embed_in)\.")
_LAST = re.compile(r"(?:^|\.)(?:ln_f|norm|final_layer_norm|lm_head|embed_out)\.")
_SKIP = re.compile(r"(?:^|\.)(?:visual|mtp)\.")


def _expected_files(folder, start, end, first, last, tied):
    """The files holding a stage's tensors, read off the index by name (independent of the loader)."""
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    files = set()
    for key, filename in weight_map.items():
        if _SKIP.search(key):
            continue
        block = _BLOCK.search(key)
        if block:
            owned = start <= int(block.group(1)) < end
        elif _FIRST.search(key):
            owned = first or (last and tied and "wpe" not in key)
        else:
            assert _LAST.search(key), f"unclassified checkpoint key {key}"
            owned = last
        if owned:
            files.add(filename)
    return files, set(weight_map.values())


@pytest.fixture
def opened(monkeypatch):
    """Every checkpoint file the loader opens, by name."""
    names: list[str] = []
    real = loader.safe_open

    def tracing(path, *args, **kwargs):
        names.append(path.rsplit("/", 1)[-1])
        return real(path, *args, **kwargs)

    monkeypatch.setattr(loader, "safe_open", tracing)
    return names


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_slices_equal_the_whole_load_and_read_only_their_files(family, checkpoints, opened):
    folder = checkpoints(family)
    dtype = torch.bfloat16  # the checkpoint is float32: every tensor needs a conversion
    whole = load_whole(folder, dtype)
    whole_params = dict(whole.named_parameters(remove_duplicate=False))
    tied = whole.get_output_embeddings().weight is whole.get_input_embeddings().weight
    n = whole.config.get_text_config().num_hidden_layers
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = whole(ids).logits
    for cuts in CUTS:
        x = ids
        for start, end in itertools.pairwise([0, *cuts, n]):
            opened.clear()
            stage = load_stage_shard(folder, start, end, start == 0, end == n, dtype)
            expected, every = _expected_files(folder, start, end, start == 0, end == n, tied)
            assert set(opened) == expected == set(stage.loaded_files), (family, start, end)
            assert len(opened) == len(set(opened)), "each small file opened once"
            if start > 0 and end < n:
                assert len(expected) < len(every)
            assert not stage.training, "eval mode, as from_pretrained returns a model"
            for name, param in stage.named_parameters():
                assert param.dtype == whole_params[_whole_name(stage, name, whole)].dtype
            with torch.no_grad():
                x = stage(x)
        assert torch.equal(x, reference), (family, cuts)


def _whole_name(stage, name, whole):
    """A stage parameter's name in the whole model."""
    from swarmp2p.runtime.torch.model.introspect import introspect

    names = introspect(whole).names
    part, _, rest = name.partition(".")
    if part == "blocks":
        index, _, rest = rest.partition(".")
        return f"{names['blocks']}.{stage.block_indices[int(index)]}.{rest}"
    return f"{names[part]}.{rest}"


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_a_tied_head_loads_the_input_embedding_on_the_last_stage(family, checkpoints):
    folder = checkpoints(family)
    whole = load_whole(folder)
    stage = load_stage_shard(folder, 2, 4, False, True, torch.float32)
    assert stage.embed is None
    assert torch.equal(stage.head.weight, whole.get_input_embeddings().weight)
    single = load_stage_shard(folder, 0, 4, True, True, torch.float32)
    assert single.head.weight is single.embed.weight, "a single stage keeps the tie"


def test_gpt2_conv1d_blocks_load_unchanged(checkpoints):
    from transformers.pytorch_utils import Conv1D

    folder = checkpoints("gpt2")
    whole = load_whole(folder)
    stage = load_stage_shard(folder, 1, 3, False, False, torch.float32)
    conv = [m for m in stage.modules() if isinstance(m, Conv1D)]
    assert conv, "GPT-2's projections are Conv1D"
    assert torch.equal(
        stage.blocks[0].attn.c_attn.weight, whole.transformer.h[1].attn.c_attn.weight
    )
    assert stage.embed is None and stage.head is None
    assert sum(p.numel() for p in stage.parameters()) == sum(
        p.numel() for block in whole.transformer.h[1:3] for p in block.parameters()
    )


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((1, 1, False, False), ValueError, r"\[1, 1\) is not a non-empty range"),
        ((0, 5, True, True), ValueError, r"of the model's 4 blocks"),
        ((0, 2, False, False), ValueError, "contradicts is_first_stage=False"),
        ((2, 4, False, False), ValueError, "is_last_stage=False"),
    ],
)
def test_bad_layer_ranges_are_refused(checkpoints, args, error, match):
    with pytest.raises(error, match=match):
        load_stage_shard(checkpoints("llama"), *args, torch.float32)


def test_bad_references_and_dtypes_are_refused(tmp_path):
    for ref, message in (
        (str(tmp_path / "nope"), "does not exist; name a folder"),
        ("not a/hub id", "is neither 'embedded', an existing folder, nor a Hub id"),
        ("org/name/extra", "is neither 'embedded', an existing folder, nor a Hub id"),
    ):
        with pytest.raises(ValueError, match=message):
            load_stage_shard(ref, 0, 1, True, True, torch.float32)
    with pytest.raises(ValueError, match="dtype 'int8' is not a torch floating dtype"):
        resolve_dtype("int8")
    assert resolve_dtype("bfloat16") is torch.bfloat16


def test_free_disk_check_names_the_numbers():
    check_free_disk(10**9, 2 * 10**9, "/cache")
    with pytest.raises(OSError, match=r"needs 1.00 GB .* /cache, which has 1.20 GB free"):
        check_free_disk(10**9, 12 * 10**8, "/cache")


def test_a_hub_id_resolves_from_the_local_cache_offline(checkpoints, tmp_path, monkeypatch):
    import shutil

    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--tiny--llama"
    shutil.copytree(checkpoints("llama"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    stage = load_stage_shard("tiny/llama", 1, 3, False, False, torch.float32)
    local = load_stage_shard(checkpoints("llama"), 1, 3, False, False, torch.float32)
    assert stage.loaded_files == local.loaded_files
    for (name, a), (_, b) in zip(stage.state_dict().items(), local.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(
        FileNotFoundError, match=r"'tiny/absent': config\.json is neither in the local"
    ):
        load_stage_shard("tiny/absent", 0, 1, True, False, torch.float32)


def test_embedded_resolves_through_ensure_embedded(checkpoints, monkeypatch, tmp_path):
    from swarmp2p import models

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # not converted yet in this cache
    calls = []
    fake = lambda: calls.append(1) or checkpoints("llama")  # noqa: E731
    monkeypatch.setattr(models, "ensure_embedded", fake)  # the first-use conversion's entry
    stage = load_stage_shard("embedded", 0, 2, True, False, torch.float32)
    assert calls == [1]
    assert stage.block_indices == (0, 1)


def test_long_reads_remap_the_file_and_load_the_same(checkpoints, opened, monkeypatch):
    folder = checkpoints("mixtral")  # fused experts: sources of one weight span handles
    whole = load_stage_shard(folder, 1, 3, False, False, torch.float32)
    files = len(opened)
    opened.clear()
    monkeypatch.setattr(loader, "MAPPED_BYTES_PER_OPEN", 0)  # a fresh handle per tensor
    remapped = load_stage_shard(folder, 1, 3, False, False, torch.float32)
    assert len(opened) > files and set(opened) == set(remapped.loaded_files)
    for (name, a), (_, b) in zip(whole.state_dict().items(), remapped.state_dict().items()):
        assert torch.equal(a, b), name


def test_free_disk_is_checked_before_any_weight_download(checkpoints, tmp_path, monkeypatch):
    import shutil
    import types

    import huggingface_hub
    from huggingface_hub import constants

    commit = "89abcdef0123456789abcdef0123456789abcdef"
    repo = tmp_path / "models--tiny--remote"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors.index.json"):  # weights not downloaded yet
        shutil.copy(checkpoints("llama") / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    asked = []

    def sizes(self, repo_id, paths, **kwargs):
        asked.append((repo_id, sorted(paths)))
        return [types.SimpleNamespace(path=p, size=10**15) for p in paths]

    monkeypatch.setattr(huggingface_hub.HfApi, "get_paths_info", sizes)
    with pytest.raises(OSError, match=r"needs [1-9]000000\.00 GB of checkpoint files .* GB free"):
        load_stage_shard("tiny/remote", 1, 3, False, False, torch.float32)
    expected, _ = _expected_files(checkpoints("llama"), 1, 3, False, False, False)
    assert asked == [("tiny/remote", sorted(expected))], "sizes of exactly the stage's files"
