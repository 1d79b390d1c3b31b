"""A job's text corpus tokenized in a subprocess into the token file stage 0 reads."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from swarmp2p.node.training.corpus import prepare_tokens

pytestmark = [pytest.mark.slow, pytest.mark.torch]


def test_the_embedded_corpus_becomes_one_int32_stream_with_eos_between_documents(tmp_path):
    out = tmp_path / "data" / "tokens.npy"
    asyncio.run(prepare_tokens("embedded", "embedded", "text", out))
    ids = np.load(out, allow_pickle=False)
    assert ids.ndim == 1 and ids.dtype == np.int32 and len(ids) > 10_000
    from transformers import AutoTokenizer

    from swarmp2p.models import resolve_model_ref

    eos = AutoTokenizer.from_pretrained(resolve_model_ref("embedded")).eos_token_id
    assert ids[-1] == eos and (ids == eos).sum() > 50  # one per pydoc topic
    assert [p.name for p in out.parent.iterdir()] == ["tokens.npy"]  # no temp file left
    mtime = out.stat().st_mtime_ns
    asyncio.run(prepare_tokens("embedded", "embedded", "text", out))
    assert out.stat().st_mtime_ns == mtime  # made once per job folder


def test_a_missing_corpus_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.txt"):
        asyncio.run(
            prepare_tokens("embedded", str(tmp_path / "nope.txt"), "text", tmp_path / "t.npy")
        )
