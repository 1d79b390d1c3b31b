"""Fixtures of the serving tests: tiny checkpoints (the runtime tests' builders) and rings of
stage servers on threads joined by in-process links."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parent))  # ring_helpers, in any import mode


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
