"""Held-out evaluation through the pipeline: forward only, scored at the last stage, reported by
every stage (reference, "Held-out evaluation").

Passes: ``base`` (boundary compressors bypassed), ``calibrated_boundary`` (through them, only
with a compressor, after calibration) and ``trained`` (after the last step). Each gives the mean
token cross-entropy, its perplexity, the top-1 next-token accuracy and the tokens scored.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from swarmp2p.plan.memory import DEFAULT_LOSS_CHUNK_TOKENS
from swarmp2p.runtime.torch.train.bundle import StageBundle
from swarmp2p.workers.events import Evaluated

EVAL_PASSES = ("base", "calibrated_boundary", "trained")


def _result(name: str, loss_sum: float, hits: int, tokens: int) -> Evaluated:
    if tokens == 0:
        return Evaluated(name=name, loss=math.nan, perplexity=math.nan, top1=math.nan, tokens=0)
    loss = loss_sum / tokens
    return Evaluated(
        name=name,
        loss=loss,
        perplexity=math.exp(min(loss, 700.0)),
        top1=hits / tokens,
        tokens=tokens,
    )


def score_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS
) -> tuple[float, int, int]:
    """Summed float32 cross-entropy, top-1 hits and token count, chunk by chunk."""
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1).to(flat.device)
    loss_sum, hits = 0.0, 0
    for start in range(0, flat.shape[0], chunk_tokens):
        part = flat[start : start + chunk_tokens].float()
        part_labels = flat_labels[start : start + chunk_tokens]
        loss_sum += float(torch.nn.functional.cross_entropy(part, part_labels, reduction="sum"))
        hits += int((part.argmax(dim=-1) == part_labels).sum())
    return loss_sum, hits, int(flat_labels.numel())


def evaluate_stage(
    bundle: StageBundle,
    name: str,
    *,
    prev=None,
    next=None,
    batches: Iterable[torch.Tensor] | None = None,
    through_compressors: bool = True,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
) -> Evaluated:
    """One evaluation pass on this stage; every stage returns the last stage's numbers.

    The first stage sends each ``[B, T + 1]`` batch of ``batches`` through (none: an empty pass,
    so its peers never wait); the last scores; the result travels back stage by stage.
    """
    if name not in EVAL_PASSES:
        raise ValueError(f"evaluation pass {name!r} is not one of {', '.join(EVAL_PASSES)}")
    was_training = bundle.stage.training
    bundle.stage.eval()
    loss_sum, hits, tokens = 0.0, 0, 0
    try:
        with torch.no_grad():
            for ids, labels in _eval_inputs(bundle, prev, batches):
                x = bundle.adopt(ids)  # hidden states arrive in the compute dtype
                if bundle.index > 0 and through_compressors:
                    x = bundle.receive(x)
                out = bundle.stage(x)
                if bundle.is_last:
                    s, h, t = score_logits(out, labels, chunk_tokens)
                    loss_sum, hits, tokens = loss_sum + s, hits + h, tokens + t
                else:
                    payload = bundle.send(out) if through_compressors else out
                    next.send_control("eval", [payload, labels])
        if not bundle.is_last:
            next.send_control("eval_end")
            header, _ = next.recv_control("eval_result")
            loss_sum, hits, tokens = header["loss_sum"], header["hits"], header["tokens"]
        if prev is not None:
            prev.send_control("eval_result", loss_sum=loss_sum, hits=hits, tokens=tokens)
    finally:
        bundle.stage.train(was_training)
    return _result(name, loss_sum, hits, tokens)


def _eval_inputs(bundle, prev, batches):
    if bundle.index == 0:
        for tokens in batches or ():
            yield tokens[:, :-1], tokens[:, 1:]
        return
    while True:
        header, tensors = prev.recv_control_any(("eval", "eval_end"))
        if header["name"] == "eval_end":
            return
        yield tensors[0], tensors[1]
