"""Pick the next token from the last position's logits: greedy, temperature, top-k, top-p."""

from __future__ import annotations

import os

import torch

from swarmp2p.serve.protocol import SamplingParams


def new_generator(params: SamplingParams) -> torch.Generator | None:
    """A CPU generator seeded with ``params.seed`` (a fresh random seed when None); None when
    greedy, which draws nothing."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator(device="cpu").manual_seed(seed)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Float32 scores over the vocabulary after temperature, top-k, then top-p (transformers'
    order); removed tokens are -inf and at least one token always survives."""
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - params.top_p
        drop[-1] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return scores


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """The next token id from a ``[vocab]`` logits row."""
    if logits.dim() != 1:
        raise ValueError(f"sample_token takes one [vocab] row, got shape {tuple(logits.shape)}")
    if params.greedy:
        return int(torch.argmax(logits))
    if generator is None:
        raise ValueError("sampling with temperature > 0 needs a generator (new_generator)")
    probs = filter_logits(logits, params).softmax(dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
