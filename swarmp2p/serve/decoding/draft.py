"""A draft model's fitness for a served model: the same tokenizer (speculative decoding by a
draft model, ``runtime.torch.serve.draft``). Light: JSON files only, so the issuing node
refuses a mismatch before any stage loads a thing."""

from __future__ import annotations

import json
from pathlib import Path


def _file(ref: Path, name: str) -> Path | None:
    """``name`` in a model folder, or in the local Hub cache's snapshot of a Hub id."""
    if ref.is_dir():
        return ref / name if (ref / name).is_file() else None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(str(ref), name)
    return Path(cached) if isinstance(cached, str) else None


def _vocab_of(folder: Path) -> tuple[dict | None, int | None]:
    """A model's tokenizer vocabulary (tokenizer.json; None without one) and its config's
    vocab_size."""
    vocab = None
    tok = _file(folder, "tokenizer.json")
    if tok is not None:
        data = json.loads(tok.read_text())
        model = data.get("model") or {}
        vocab = dict(model.get("vocab") or {})
        for added in data.get("added_tokens") or ():
            vocab[added.get("content")] = added.get("id")
    size = None
    cfg = _file(folder, "config.json")
    if cfg is not None:
        config = json.loads(cfg.read_text())
        size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return vocab, size


def check_draft_compatible(target: str | Path, draft: str | Path) -> None:
    """ValueError naming both models unless ``draft`` tokenizes as ``target`` does: the same
    tokenizer vocabulary (tokenizer.json, ids included) where both have one, else the same
    vocab_size. A draft's ids are the target's ids, so any other tokenizer drafts nonsense."""
    target, draft = Path(target), Path(draft)
    (tv, ts), (dv, ds) = _vocab_of(target), _vocab_of(draft)
    if tv is not None and dv is not None:
        if tv != dv:
            only = sorted(set(dv.items()) ^ set(tv.items()), key=str)[:3]
            raise ValueError(
                f"draft model {draft} does not share the tokenizer of {target}: their "
                f"vocabularies differ ({len(dv)} against {len(tv)} tokens; e.g. {only}); a draft "
                "model must use the served model's tokenizer"
            )
        return
    if ts is None or ds is None or ts != ds:
        raise ValueError(
            f"draft model {draft} (vocab_size {ds}) does not share the vocabulary of {target} "
            f"(vocab_size {ts}); a draft model must use the served model's tokenizer"
        )


__all__ = ["check_draft_compatible"]
