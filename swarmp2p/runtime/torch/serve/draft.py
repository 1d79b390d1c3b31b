"""A draft model for speculative decoding, held by stage 0 beside its blocks.

The issuing node is the light plane (no torch), so the small causal LM that drafts runs in
stage 0's worker: a decode step's ``asks[i]`` says how many tokens to draft for row i, and
:meth:`DraftModel.propose` drafts them greedily from the row's newest token (a deterministic
draft: the last stage's verification keeps greedy output and sampling's distribution exactly as
plain decoding's). The draft model keeps its own KV cache per session, cropped back to the
row's position on its next step (the drafts the last stage rejected leave it, as they leave the
stages' caches). Stage 0 sees every token of a session (the prompt's chunks, each step's newest
token, its own kept drafts), so the draft model's cache is filled lazily, on the first step
that drafts. A prefix-cache reuse names blocks, not ids: the ids of the blocks a session keeps
are kept here beside the stage's keys and values, by the same names, dropped with them.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swarmp2p.serve.decoding.draft import check_draft_compatible
from swarmp2p.serve.decoding.prefix import BLOCK_TOKENS


@dataclass(slots=True)
class _Row:
    """One session as the draft model sees it."""

    ids: list[int] = field(default_factory=list)
    """Its tokens so far (the prompt, then generated; past ``cached``: not yet in the cache,
    and after a draft its drafted ids, cut off by the next step's position)."""
    cache: object | None = None
    """The draft model's transformers Cache of ``ids[:cached]``."""
    cached: int = 0


class DraftModel:
    """A causal LM that drafts greedily for stage 0's sessions, with a KV cache each."""

    def __init__(self, model: torch.nn.Module, *, name: str = "draft") -> None:
        self.model = model.eval()
        self.name = name
        self.device = next(model.parameters()).device
        self.vocab = int(model.get_input_embeddings().num_embeddings)
        self.rows: dict[int, _Row] = {}
        self.block_ids: dict[bytes, tuple[int, ...]] = {}
        """Prefix-cache block name -> its token ids (the blocks stage 0 holds)."""
        self.drafted = 0
        """Tokens drafted so far."""
        self.busy_s = 0.0
        """Seconds spent drafting."""
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # -- what stage 0 sees ----------------------------------------------------------------------

    def open(self, sid: int, plan) -> None:
        """A session starts (or starts over); ``plan``: its prefix plan (None: none). KeyError
        naming a reused block whose ids this stage does not hold."""
        row = _Row()
        if plan is not None:
            for name in plan.drop:
                self.block_ids.pop(name, None)
            for name in plan.reuse:
                if name not in self.block_ids:
                    raise KeyError(f"prefix block {name.hex()} has no ids at the draft model")
                row.ids.extend(self.block_ids[name])
        self.rows[sid] = row

    def extend(self, sid: int, pos: int, tokens) -> None:
        """Prompt ids ``tokens`` at ``pos`` (a prefill chunk)."""
        row = self.rows.get(sid)
        if row is None:
            return
        del row.ids[pos:]
        if len(row.ids) == pos:
            row.ids.extend(int(t) for t in tokens)

    def keep(self, sid: int, plan) -> None:
        """The prompt ran: remember the ids of the blocks its plan keeps (after its reused)."""
        row = self.rows.get(sid)
        if row is None or plan is None:
            return
        start = len(plan.reuse) * BLOCK_TOKENS
        for i, name in enumerate(plan.keep):
            ids = row.ids[start + i * BLOCK_TOKENS : start + (i + 1) * BLOCK_TOKENS]
            if len(ids) == BLOCK_TOKENS:
                self.block_ids.setdefault(name, tuple(ids))

    def observe(self, sid: int, pos: int, token: int) -> None:
        """A step that drafts nothing for the session: its newest ``token`` at ``pos``."""
        row = self.rows.get(sid)
        if row is not None and len(row.ids) >= pos:
            del row.ids[pos:]
            row.ids.append(int(token))

    def drop(self, sid: int) -> None:
        self.rows.pop(sid, None)

    # -- drafting -------------------------------------------------------------------------------

    def propose(self, sid: int, pos: int, token: int, k: int) -> tuple[int, ...]:
        """``k`` greedy tokens after the session's first ``pos`` tokens and ``token``.
        ValueError when the draft model does not hold the session's ``pos`` tokens."""
        row = self.rows.get(sid)
        if row is None or len(row.ids) < pos:
            held = "nothing" if row is None else f"{len(row.ids)} tokens"
            raise ValueError(
                f"draft model {self.name}: session {sid} drafts at position {pos}, but it "
                f"holds {held}"
            )
        if k <= 0:
            self.observe(sid, pos, token)
            return ()
        started = time.perf_counter()
        del row.ids[pos:]
        row.ids.append(int(token))
        if row.cache is None:
            row.cache, row.cached = _new_cache(self.model), 0
        elif row.cached > pos:  # the rejected drafts leave the draft model's cache too
            _crop(row.cache, keep=pos, have=row.cached)
            row.cached = pos
        out: list[int] = []
        with torch.inference_mode():
            feed = row.ids[row.cached :]
            for _ in range(k):
                ids = torch.tensor([feed], dtype=torch.long, device=self.device)
                result = self.model(input_ids=ids, use_cache=True, **{self._cache_kw: row.cache})
                row.cached += len(feed)
                nxt = int(result.logits[0, -1].argmax())
                out.append(nxt)
                feed = [nxt]
        row.ids.extend(out)
        self.drafted += k
        self.busy_s += time.perf_counter() - started
        return tuple(out)


def _new_cache(model):
    """An empty transformers DynamicCache the model fills in place."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # an older signature
        return DynamicCache()


def _crop(cache, *, keep: int, have: int) -> None:
    """Cut ``cache`` from ``have`` positions to its first ``keep``: transformers' ``crop``
    took the length to keep (``max_length``) and takes the count to remove, negative, since."""
    if "max_length" in inspect.signature(cache.crop).parameters:
        cache.crop(keep)
    else:
        cache.crop(keep - have)


def load_draft_model(
    folder: str | Path, *, target: str | Path, device: str = "cpu", dtype=torch.float32
) -> DraftModel:
    """The draft model in ``folder`` (a Hugging Face causal LM folder) on ``device``, checked
    against the served model's folder ``target`` first (ValueError naming both)."""
    from transformers import AutoModelForCausalLM

    check_draft_compatible(target, folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device)
    return DraftModel(model, name=str(folder))


def truncated_copy(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A copy of a causal LM keeping its embedding, its first ``layers`` decoder blocks, its
    final norm and head: the served model's own weaker drafter (same tokenizer by
    construction), for benchmarks and tests where no second model is at hand."""
    import copy

    from swarmp2p.runtime.torch.model.introspect import introspect

    draft = copy.deepcopy(model)
    blocks = introspect(draft).blocks
    if not 1 <= layers <= len(blocks):
        raise ValueError(f"a truncated copy of {layers} blocks from a model of {len(blocks)}")
    for parent in draft.modules():
        for name, child in parent.named_children():
            if child is blocks:
                setattr(parent, name, blocks[:layers])
    config = draft.config
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    return draft.eval()


__all__ = ["DraftModel", "load_draft_model", "truncated_copy"]
