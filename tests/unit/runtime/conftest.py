"""Fixtures of the runtime tests: each tiny checkpoint is saved once per session, sharded."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import SHARD_SIZE, build_model

try:  # tqdm's monitor thread outlives a test and trips the suite's thread-leak check
    import tqdm

    tqdm.tqdm.monitor_interval = 0
except ImportError:
    pass


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """``checkpoints(family, wide=False) -> Path``: each tiny model saved once per session,
    sharded (``wide``: hidden 64, for bitsandbytes' CPU 4-bit kernels)."""
    saved: dict[tuple[str, bool], Path] = {}

    def get(family: str, wide: bool = False) -> Path:
        if (family, wide) not in saved:
            folder = tmp_path_factory.mktemp(f"{family}-wide" if wide else family)
            build_model(family, wide=wide).save_pretrained(folder, max_shard_size=SHARD_SIZE)
            saved[family, wide] = folder
        return saved[family, wide]

    return get
