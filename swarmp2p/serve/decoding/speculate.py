"""Speculative decoding's light half: drafting by prompt lookup and how many tokens to draft.

A lap of the ring costs about the same for one token or a few: a decode step is bound by
reading each stage's weights, not by the rows it computes. So the issuing node drafts ``k``
likely next tokens, one lap verifies them all (every stage runs ``k + 1`` positions), and the
last stage keeps the longest prefix the model agrees with plus one token of its own
(``runtime.torch.serve.verify``). Greedy output is the plain decoding's token for token.

Drafts come from the text itself (prompt lookup, as vLLM's ``ngram`` proposer and transformers'
``prompt_lookup_num_tokens``): the longest recent n-gram that ends the session's tokens and
occurred before is looked up, and what followed it then is the draft. :class:`NgramIndex` keeps
that lookup O(1) per token. :class:`DraftLength` adapts ``k`` to the acceptance a session
measures and stops drafting where it does not pay. Pure: no torch, no sockets.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

MAX_NGRAM = 4
"""The longest suffix matched (vLLM's ``prompt_lookup_max`` default is 5; 4 costs less here)."""
MIN_NGRAM = 2
"""The shortest: one token matches too often to predict anything."""
MAX_DRAFT = 10
"""At most this many tokens drafted a lap (transformers' default is 10)."""
VERIFY_ROW_LAPS = 0.2
"""What one drafted position's extra row in every stage's forward (and the wider messages)
costs, in plain laps: bench/speculate.py --draft measured a drafted token of the embedded
model drafting for itself at 0.88-1.0 plain laps of the 2-stage CPU ring, its forward alone at
0.74."""
DRAFT_FORWARD_LAPS = 0.74
"""The served model's own forward for one token in one process, in plain laps of its ring
(bench/speculate.py --draft: 57.6 ms against a 78 ms lap of the embedded model on 2 stages, 1
thread each); a draft model's forward costs this times its share of the compute."""


def draft_lap_cost(compute_share: float) -> float:
    """A token drafted by stage 0's draft model, in plain laps, for a draft model that
    computes ``compute_share`` of the served model's multiply-adds a token (``ServePlan
    .draft_compute``): its forward plus the verified row (measured: 0.42 for the embedded
    model's first 4 blocks + head, 0.94 for the model drafting for itself)."""
    if not compute_share >= 0:
        raise ValueError(f"a draft model's compute share of {compute_share!r}")
    return VERIFY_ROW_LAPS + DRAFT_FORWARD_LAPS * compute_share


DRAFT_LAP_COST = draft_lap_cost(0.3)
"""A drafted token's cost when the draft model's share is not known (a drafter a third the
served model's compute: 0.42 plain laps)."""


class NgramIndex:
    """The session's tokens and, for each n-gram of ``min_n..max_n`` tokens, where it last
    ended: :meth:`draft` finds the longest n-gram that ends the tokens and occurred before."""

    def __init__(
        self, tokens: Iterable[int] = (), *, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM
    ):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes {min_n}..{max_n}: need 1 <= min_n <= max_n")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}
        """n-gram -> the index just past its latest occurrence but the current suffix's."""
        self._pending: list[tuple[tuple[int, ...], int]] = []
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append the session's next tokens (prompt, then what was generated)."""
        for token in tokens:
            # the suffixes that ended at the previous token become "earlier occurrences" now
            for gram, end in self._pending:
                self._last[gram] = end
            self.tokens.append(int(token))
            end = len(self.tokens)
            self._pending = [
                (tuple(self.tokens[end - n : end]), end)
                for n in range(self.min_n, min(self.max_n, end) + 1)
            ]

    def truncate(self, length: int) -> None:
        """Forget every token from ``length`` on (a rejected draft is never appended, but a
        replay or a stop string may cut the session): rebuilt, O(length)."""
        if length < len(self.tokens):
            kept = self.tokens[:length]
            self.tokens, self._last, self._pending = [], {}, []
            self.extend(kept)

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier occurrence of the current
        suffix (its latest one); [] when no suffix of ``min_n`` or more tokens recurs."""
        if k <= 0:
            return []
        end = len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            at = self._last.get(tuple(self.tokens[end - n : end]))
            if at is not None:
                return self.tokens[at : at + k]
        return []


@dataclass(slots=True)
class DraftLength:
    """How many tokens a session drafts each lap, from what its laps accepted.

    A lap that verifies ``k`` drafts costs ``1 + lap_cost * k`` plain laps (the extra rows of
    every stage's forward) and yields ``accepted + 1`` tokens. The expected number accepted
    follows from the acceptance rate ``a`` per drafted token (each is kept only if every one
    before it was): ``a + a^2 + ... + a^k``. ``k`` is the one that maximises tokens per unit of
    cost under the running rate; 0 (no drafting) when nothing beats a plain lap, retried after
    ``retry_after`` plain laps (the text may turn repetitive later)."""

    max_k: int = MAX_DRAFT
    lap_cost: float = 0.05
    """A drafted row's cost in plain laps (measured by bench/serve.py; small on weight-bound
    decode, larger on a compute-bound CPU)."""
    smoothing: float = 0.3
    """Weight of the newest lap in the running acceptance rate."""
    retry_after: int = 16
    rate: float = 0.5
    """The running acceptance rate per drafted token."""
    laps: int = 0
    drafted: int = 0
    accepted: int = 0
    _idle: int = field(default=0, repr=False)

    def next_k(self, available: int | None = None) -> int:
        """How many to draft now (at most ``available``, what the proposer has)."""
        limit = self.max_k if available is None else min(self.max_k, available)
        k = best_k(self.rate, self.lap_cost, limit)
        if k == 0:
            self._idle += 1
            if self._idle >= self.retry_after:  # try again: the text may have changed
                self._idle = 0
                return min(1, limit)
        return k

    def record(self, drafted: int, accepted: int) -> None:
        """One lap's outcome: ``accepted`` of the ``drafted`` tokens were kept."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafted tokens")
        if drafted == 0:
            return
        self.laps += 1
        self.drafted += drafted
        self.accepted += accepted
        # the per-token rate that makes `accepted` the expected count of a prefix rule
        observed = _rate_for(accepted, drafted)
        self.rate = (1 - self.smoothing) * self.rate + self.smoothing * observed

    @property
    def acceptance(self) -> float:
        """The share of drafted tokens kept, over the session (0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding of one ring so far: decode laps answered (a row each), tokens they
    gave, tokens drafted and accepted."""

    laps: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        """The share of drafted tokens the last stage kept (0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_lap(self) -> float:
        """Mean tokens a decode lap gave a session (1 without speculation)."""
        return self.tokens / self.laps if self.laps else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "laps": self.laps,
            "tokens": self.tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": round(self.acceptance, 4),
            "tokens_per_lap": round(self.tokens_per_lap, 4),
        }


def step_drafts(members: Sequence, room: int, may_draft) -> tuple[tuple, tuple[int, ...]]:
    r"""A decode step's ``(drafts, asks)`` for its rows (the scheduler's ``SessionState``\ s;
    each () when none drafts), setting each row's ``draft``/``ask``: a row whose grammar forces
    ids next (``forced``, where ``may_draft(row)``) drafts those; a row with a prompt lookup
    drafts its guess, one drafting with stage 0's draft model asks for ``k``; ``k`` from the
    row's adaptive length (MAX_DRAFT without one), at most ``room``: every row of a step runs
    as many positions as the longest draft, so none may pass the room of the row with the
    least. Drafts and asks do not share a step: where a row asks, no row sends a draft."""
    for s in members:
        s.draft, s.ask, s.draft_forced = (), 0, False
    if room <= 0:
        return (), ()
    for s in members:
        if s.forced and may_draft(s):
            s.draft, s.draft_forced, s.forced = s.forced[:room], True, ()
        elif s.drafter is not None or s.model_drafts:
            k = min(s.draft_len.next_k() if s.draft_len is not None else MAX_DRAFT, room)
            if s.model_drafts:
                s.ask = k
            else:
                s.draft = tuple(s.drafter.draft(k))
    if any(s.ask for s in members):
        for s in members:
            s.draft, s.draft_forced = (), False
        return (), tuple(s.ask for s in members)
    if not any(s.draft for s in members):
        return (), ()
    return tuple(s.draft for s in members), ()


def lap_drafts(session, msg, row: int) -> tuple[tuple[int, ...], int, str]:
    """One row's drafts as the last stage's ``Tokens`` answer ``msg`` settles them: ``(kept
    ids, tokens drafted, error)`` (error: the answer cannot be right, the session fails).
    Clears the row's draft and ask; the adaptive length learns from the lap unless its draft
    was the grammar's forced ids."""
    draft, session.draft = session.draft, ()
    asked, session.ask = session.ask, 0
    forced, session.draft_forced = session.draft_forced, False
    kept = msg.kept[row] if msg.kept else 0
    if not msg.kept:  # the drafts went no further than stage 0 (spec_off says why)
        asked = 0
    if asked:  # stage 0's draft model drafted `asked`; the answer names the kept ones
        draft = msg.accepted[row] if msg.accepted else ()
        if kept > asked or len(draft) != kept:
            return (
                (),
                0,
                (
                    f"the last stage accepted {kept} drafted tokens ({len(draft)} ids) of the "
                    f"{asked} stage 0 was asked for"
                ),
            )
    elif kept > len(draft):
        return (), 0, f"the last stage accepted {kept} drafted tokens of the {len(draft)} sent"
    drafted = asked or len(draft)
    if drafted and session.draft_len is not None and not forced:
        session.draft_len.record(drafted, kept)
    return tuple(draft[:kept]), drafted, ""


def expected_accepted(rate: float, k: int) -> float:
    """Drafts kept in a lap of ``k`` when each is kept with ``rate`` once its predecessors
    were: ``rate + rate^2 + ... + rate^k``."""
    return sum(rate**i for i in range(1, k + 1))


def best_k(rate: float, lap_cost: float, limit: int) -> int:
    """The draft length with the most tokens per unit of lap cost; 0 when no drafting beats
    a plain lap (1 token per unit)."""
    best, value = 0, 1.0
    for k in range(1, limit + 1):
        v = (1 + expected_accepted(rate, k)) / (1 + lap_cost * k)
        if v > value + 1e-9:
            best, value = k, v
    return best


def _rate_for(accepted: int, drafted: int) -> float:
    """The per-token rate whose expected prefix length over ``drafted`` is ``accepted``
    (bisection; monotone in the rate)."""
    if accepted == 0:
        return 0.0
    if accepted == drafted:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if expected_accepted(mid, drafted) < accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def accepted_prefix(draft: Sequence[int], verified: Sequence[int]) -> int:
    """Greedy verification: how many drafted tokens the model's own choices confirm
    (``verified[i]`` is its token after the prefix plus ``draft[:i]``)."""
    n = 0
    while n < len(draft) and n < len(verified) and draft[n] == verified[n]:
        n += 1
    return n


__all__ = [
    "DRAFT_FORWARD_LAPS",
    "DRAFT_LAP_COST",
    "MAX_DRAFT",
    "MAX_NGRAM",
    "MIN_NGRAM",
    "VERIFY_ROW_LAPS",
    "DraftLength",
    "NgramIndex",
    "SpecStats",
    "accepted_prefix",
    "best_k",
    "draft_lap_cost",
    "expected_accepted",
    "lap_drafts",
    "step_drafts",
]
