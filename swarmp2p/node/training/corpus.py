"""A job's text corpus as the token file its first stage reads, made on that stage's node.

The daemon never imports a tokenizer: ``prepare_tokens`` runs ``python -m
swarmp2p.node.training.corpus`` (which imports transformers) in a subprocess and waits for it. The file
is a ``.npz`` of two 1-D int32 streams (each row's tokens, then EOS), written atomically:
``train``, the source's training rows, and ``validation``, its held-out rows - the last rows,
one in twenty (``swarmp2p.data.split``); a source of fewer than 20 rows has an empty
``validation`` and evaluates nothing. The worker cuts each stream into windows of its own, so
no training window holds a validation token.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from swarmp2p._atomic import write_atomic
from swarmp2p._module_main import run_main
from swarmp2p.timings import TIMINGS


async def run_module(
    module: str, args: list[str], timeout: float = TIMINGS.corpus_prepare_s
) -> None:
    """``python -m module args...`` in a subprocess (the daemon never imports torch);
    ValueError with its last stderr line when it fails."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise ValueError(f"{module} took over {timeout:g} s") from None
    if proc.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        raise ValueError(lines[-1] if lines else f"{module} exited with {proc.returncode}")


async def prepare_tokens(model: str, source: str, text_field: str, out: Path) -> Path:
    """Tokenize ``source`` with ``model``'s tokenizer into ``out``, a ``.npz`` of its training
    and validation rows' tokens (kept if already there)."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "swarmp2p.node.training.corpus",
        model,
        source,
        text_field,
        str(out),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), TIMINGS.corpus_prepare_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise ValueError(
            f"data.source {source!r}: tokenizing took over {TIMINGS.corpus_prepare_s:g} s"
        ) from None
    if proc.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        raise ValueError(f"data.source {source!r}: {lines[-1] if lines else 'tokenizing failed'}")
    return out


def main(argv: list[str]) -> int:
    """``python -m swarmp2p.node.training.corpus MODEL SOURCE TEXT_FIELD OUT.npz``."""
    import numpy as np
    from transformers import AutoTokenizer

    from swarmp2p.data import load_splits, tokenize_rows
    from swarmp2p.models import resolve_model_ref

    model, source, text_field, out = argv
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_ref(model))
    splits = load_splits(source, text_field=text_field)
    streams = {
        "train": tokenize_rows(splits.train, tokenizer),
        "validation": tokenize_rows(splits.validation, tokenizer),
    }
    path = Path(out)

    def save(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **streams)

    write_atomic(path, save)
    return 0


if __name__ == "__main__":
    run_main(main, errors=(ValueError, OSError, ImportError))
