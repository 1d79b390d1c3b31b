"""Pick the next token from the last position's logits with transformers' logits processors:
logit bias, repetition penalty, OpenAI's presence/frequency penalties, a structured output's
grammar mask, then (when sampling) temperature, top-k, top-p and min-p; greedy is the argmax of
the penalised logits, as in ``model.generate``. Each session has its own :class:`SessionSampler`
(parameters, seeded generator, the token counts a penalty needs, kept incrementally, and its
grammar's matcher, advanced by every token it generates).

A sampled session's draw for position ``t`` comes from its generator seeded afresh with
``(seed, t)`` (:func:`position_seed`), not from one stream: the token at ``t`` is a function of
the seed, the logits and ``t`` alone. So a seed gives the same tokens however the session was
batched or drafted (a draft's length depends on the rows beside it), and a session replayed
onto a new ring after a failover goes on with the very tokens it would have had."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from swarmp2p.serve.decoding.grammar import Grammar, GrammarError, Matcher, ll_tokenizer
from swarmp2p.serve.protocol import SamplingParams, TokenLogprobs


def new_generator(params: SamplingParams) -> torch.Generator | None:
    """A CPU generator seeded with ``params.seed`` (a fresh random seed when None); None when
    greedy, which draws nothing."""
    if params.greedy:
        return None
    return torch.Generator(device="cpu").manual_seed(session_seed(params))


def session_seed(params: SamplingParams) -> int:
    """``params.seed``, or a fresh random one when None."""
    return params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of the draw at ``position`` of a session seeded ``seed``: splitmix64
    of the pair (neighbouring positions get unrelated streams), 63 bits."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _warpers(params: SamplingParams) -> list:
    """transformers' sampling warpers for ``params``, in ``generate``'s order."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers: list = []
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(params.temperature)))
    if params.top_k:
        warpers.append(TopKLogitsWarper(top_k=params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=float(params.top_p)))
    if params.min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p=float(params.min_p)))
    return warpers


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Float32 scores of one ``[vocab]`` row after temperature, top-k, top-p and min-p
    (transformers' warpers, in its order); removed tokens are -inf, the most likely survives."""
    scores = logits.float()[None]
    for warper in _warpers(params):
        scores = warper(None, scores)
    return scores[0]


class OpenAIPenaltyLogitsProcessor:
    """OpenAI's ``presence_penalty`` and ``frequency_penalty`` over the tokens generated so far
    (``logit -= frequency * count + presence * (count > 0)``; vLLM's rule). transformers has no
    processor for them; it is one with the same call shape, fed counts kept incrementally."""

    def __init__(self, presence: float, frequency: float, counts: torch.Tensor) -> None:
        self.presence, self.frequency, self.counts = presence, frequency, counts

    def __call__(self, input_ids: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
        counts = self.counts[: scores.shape[-1]].to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class SessionSampler:
    """One session's token picking at the last stage. ``observe`` feeds it the session's
    tokens as they become known (prompt chunks, then each sampled token); ``pick`` returns the
    next token (and its log-probabilities when asked)."""

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        prompt_len: int | None = None,
        matcher: Matcher | None = None,
    ):
        self.params = params
        self.matcher = matcher
        """The session's grammar (None: unconstrained): every pick is masked with it, and
        every generated token it observes advances it (a replay's included)."""
        self.generator = new_generator(params)
        self._seed = None if self.generator is None else self.generator.initial_seed()
        self.prompt_len = prompt_len
        """Tokens of the session that are prompt (penalties of OpenAI's kind skip them)."""
        self.seen = 0
        self._ids: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._processors: list = []
        if params.logit_bias:
            from transformers.generation.logits_process import SequenceBiasLogitsProcessor

            bias = [[[token], float(value)] for token, value in params.logit_bias]
            self._processors.append(SequenceBiasLogitsProcessor(sequence_bias=bias))
        if params.repetition_penalty != 1.0:
            from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

            self._ids = torch.zeros((1, 64), dtype=torch.long)
            self._processors.append(
                RepetitionPenaltyLogitsProcessor(penalty=float(params.repetition_penalty))
            )
        if params.presence_penalty or params.frequency_penalty:
            self._counts = torch.zeros(vocab_size, dtype=torch.float32)
            self._processors.append(
                OpenAIPenaltyLogitsProcessor(
                    float(params.presence_penalty), float(params.frequency_penalty), self._counts
                )
            )
        self._warpers = [] if params.greedy else _warpers(params)

    def observe(self, tokens: Sequence[int], count: int | None = None) -> None:
        """The session's next ``tokens`` (in order; a replay starts a new sampler); just how
        many (``count``) when the ids did not travel, which a sampler without penalties needs
        no more than."""
        if not tokens and count:
            if self._ids is not None or self._counts is not None:
                raise ValueError("a penalty needs the session's token ids, and they did not come")
            if self.matcher is not None and self.prompt_len is not None:
                raise ValueError(
                    "a replayed grammar session needs its token ids, they did not come"
                )
            self.seen += count
            return
        if self.matcher is not None and self.prompt_len is not None:
            for token in tokens[max(0, self.prompt_len - self.seen) :]:
                self.matcher.advance(token)
        if self._ids is not None:
            need = self.seen + len(tokens)
            if need > self._ids.shape[1]:  # doubling: O(1) amortised per token
                grown = torch.zeros((1, max(need, 2 * self._ids.shape[1])), dtype=torch.long)
                grown[:, : self.seen] = self._ids[:, : self.seen]
                self._ids = grown
            self._ids[0, self.seen : need] = torch.tensor(tokens, dtype=torch.long)
        if self._counts is not None:
            start = self.prompt_len if self.prompt_len is not None else None
            for i, token in enumerate(tokens, self.seen):
                if start is not None and i >= start and token < self._counts.shape[0]:
                    self._counts[token] += 1
        self.seen += len(tokens)

    def end_of_prompt(self) -> None:
        """The tokens seen so far are the prompt (unless a replay said how many were)."""
        if self.prompt_len is None:
            self.prompt_len = self.seen

    def next(self, logits: torch.Tensor) -> tuple[int, TokenLogprobs | None]:
        """:meth:`pick` the session's next token, then :meth:`observe` it."""
        token, logprobs = self.pick(logits)
        self.observe((token,))
        return token, logprobs

    def pick(
        self, logits: torch.Tensor, allowed: bytes | None = None
    ) -> tuple[int, TokenLogprobs | None]:
        """The next token from a ``[vocab]`` logits row, and its log-probabilities (under the
        model's own distribution, before any processor) when the session asked for them.
        ``allowed``: a structured output's bitmask of the ids its grammar allows next
        (``serve.decoding.grammar``; the session's matcher's when None): every other id is
        excluded before the choice, greedy or not."""
        if logits.dim() != 1:
            raise ValueError(f"pick takes one [vocab] row, got shape {tuple(logits.shape)}")
        if allowed is None and self.matcher is not None:
            allowed = self.matcher.mask()
        scores = self._scores(logits, allowed)
        if self.params.greedy:
            token = int(torch.argmax(scores[0]))
        else:
            token = self._draw(self._probs(scores))
        return token, self._logprobs(logits, token)

    def forced(self, limit: int) -> tuple[int, ...]:
        """Up to ``limit`` ids the session's grammar forces after the tokens observed (the
        manager drafts them next; () without a grammar, or once it is done)."""
        if self.matcher is None or limit <= 0 or self.matcher.done:
            return ()
        return tuple(self.matcher.forced()[:limit])

    def _draw(self, probs: torch.Tensor) -> int:
        """A token from ``probs`` with the draw of the position after the tokens seen."""
        assert self.generator is not None and self._seed is not None
        self.generator.manual_seed(position_seed(self._seed, self.seen))
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))

    def verify(
        self, logits: torch.Tensor, draft: Sequence[int]
    ) -> tuple[int, int, TokenLogprobs | None]:
        """Speculative decoding's check of ``draft`` against ``logits``, ``[len(draft) + 1,
        vocab]`` (row i: after the session's tokens and ``draft[:i]``): ``(kept, token,
        logprobs)``, the drafts kept and the token after them. Greedy keeps the drafts the
        argmax agrees with (plain decoding's tokens exactly); sampling draws each row's token
        as plain sampling would at that position and keeps the draft where they agree. For a
        deterministic draft ``x`` that is the rejection rule exactly (``verify``: kept with
        probability ``p(x)``, else a token from ``p`` without ``x``), and with position-keyed
        draws the tokens are plain sampling's token for token, drafts or none. Each row is
        scored with the processors after the drafts before it (a penalty sees them) and masked
        with the grammar's state after them (a draft the grammar does not allow is never kept,
        and a kept one advances the matcher as a picked one would), and the kept drafts are
        observed; the caller observes ``token``, as after :meth:`pick`."""
        from swarmp2p.runtime.torch.serve.verify import check_rows

        check_rows(logits, draft)
        for i, drafted in enumerate(draft):
            allowed = self.matcher.mask() if self.matcher is not None else None
            scores = self._scores(logits[i], allowed)
            if self.params.greedy:
                token = int(torch.argmax(scores[0]))
                rejected = None if token == drafted else token
            else:
                token = self._draw(self._probs(scores))
                rejected = None if token == drafted else token
            if rejected is not None:
                return i, rejected, self._logprobs(logits[i], rejected)
            self.observe((drafted,))
        token, logprobs = self.pick(logits[len(draft)])
        return len(draft), token, logprobs

    def _scores(self, logits: torch.Tensor, allowed: bytes | None) -> torch.Tensor:
        """``[1, vocab]`` float32 scores of one logits row after the processors (bias,
        penalties over the tokens observed so far) and a grammar's ``allowed`` mask."""
        scores = logits.float()[None]
        ids = self._ids[:, : self.seen] if self._ids is not None else None
        for processor in self._processors:
            scores = processor(ids, scores)
        if allowed is not None:
            keep = allowed_ids(allowed, scores.shape[-1]).to(scores.device)  # a GPU stage's logits
            scores = torch.where(keep, scores, float("-inf"))
        return scores

    def _probs(self, scores: torch.Tensor) -> torch.Tensor:
        """The sampling distribution ``[vocab]`` of processed ``scores`` (the warpers, then
        softmax); ValueError when it is not finite."""
        for warper in self._warpers:
            scores = warper(None, scores)
        probs = scores[0].softmax(dim=-1)
        if not torch.isfinite(probs).all():
            raise ValueError(
                f"sampling with {self.params} gave probabilities that are not finite; "
                "use a larger temperature or smaller penalties and biases"
            )
        return probs

    def _logprobs(self, logits: torch.Tensor, token: int) -> TokenLogprobs | None:
        """``token``'s log-probability under the model's own distribution (and the top ones'),
        when the session asked for them."""
        if self.params.logprobs is None:
            return None
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if self.params.logprobs:
            values, indices = torch.topk(logprobs, self.params.logprobs)
            top = tuple(zip(indices.tolist(), values.tolist()))
        return TokenLogprobs(logprob=float(logprobs[token]), top=top)


def allowed_ids(mask: bytes, vocab: int) -> torch.Tensor:
    """A ``[vocab]`` bool tensor of the ids a little-endian bitmask allows (id i: bit i % 8 of
    byte i // 8); ids past the mask's end are not allowed. ValueError when it allows none."""
    # numpy end to end, one view into torch: a torch.zeros + slice copy cost ~10x (51 us
    # against 4.5 us a token for 49k ids, one thread; bench/grammar.py)
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    if bits.shape[0] < vocab:
        bits = np.concatenate([bits, np.zeros(vocab - bits.shape[0], dtype=np.uint8)])
    bits = bits[:vocab]
    if not bits.any():
        raise ValueError("the structured output's grammar allows no token of this vocabulary")
    return torch.from_numpy(bits.view(np.bool_))


class GrammarTokenizer:
    """The model's tokenizer as llguidance reads it, for a last stage's grammars: made from the
    model folder's own ``tokenizer.json`` and end-of-sequence ids (``TextCodec.from_folder``, as
    the issuing node reads them), on a thread from the start (~1 s for a 50k vocabulary), so the
    first grammar session does not stall the stage's loop."""

    def __init__(self, folder: str | Path, vocab_size: int) -> None:
        self.folder, self.vocab_size = Path(folder), vocab_size
        self._made, self._error = None, None
        self._thread = threading.Thread(target=self._make, name="grammar-tokenizer", daemon=True)
        self._thread.start()

    def _make(self) -> None:
        from swarmp2p.serve.text import TextCodec

        try:
            codec = TextCodec.from_folder(self.folder)
            if not codec.eos_ids:
                raise ValueError(f"{self.folder} names no end-of-sequence id")
            self._made = ll_tokenizer(
                codec.tokenizer, vocab_size=self.vocab_size, eos_ids=codec.eos_ids
            )
        except Exception as e:  # reported to every grammar session that asks
            self._error = f"{type(e).__name__}: {e}"

    def matcher(self, text: str, what: str) -> Matcher:
        """A new matcher of grammar ``text``; GrammarError naming ``what`` when there is none."""
        self._thread.join()
        if self._made is None:
            raise GrammarError(f"{what}: this stage cannot run grammars: {self._error}")
        return Matcher(self._made, Grammar(text=text, what=what))


def session_matcher(tokenizer: GrammarTokenizer | None, grammar: str | None, sid: int):
    """Session ``sid``'s matcher of ``grammar`` (None without one); GrammarError when this
    stage cannot run it."""
    if grammar is None:
        return None
    if tokenizer is None:
        raise GrammarError(f"session {sid}: this stage was started without a grammar tokenizer")
    return tokenizer.matcher(grammar, f"session {sid}'s grammar")
