"""What goes round a serving ring: one msgpack control map per message, then a TensorFrame.

A ring is the session manager, then stage 0 .. stage N-1, then the manager again. Messages:

| op        | from -> to                  | fields                                   | tensor after it |
|-----------|-----------------------------|------------------------------------------|-----------------|
| `prefill` | manager -> stage 0 -> ...   | sid, pos, tokens, more, sampling*, prompt_len*, grammar*, prefix* | hidden [1, T, H] (stage > 0) |
| `decode`  | manager -> stage 0 -> ...   | group, step, sids, positions, tokens, sizes, drafts*, asks*, spec_off* | hidden [B, 1 + k, H] (stage > 0) |
| `end`     | manager -> every stage      | sid                                      | none            |
| `tokens`  | last stage -> manager       | group, step, sids, positions, tokens, sizes, logprobs, kept*, accepted*, spec_off* | none |
| `error`   | any stage -> ... -> manager | sids, message                            | none            |

(*) only on the first chunk of a session: ``pos == 0``, or with ``prefix`` (the prefix cache's
plan, :class:`~swarmp2p.serve.decoding.prefix.PrefixPlan`) at ``pos`` = its reused tokens, the
positions every stage copies in from its cached blocks instead of computing them. ``grammar`` is
a structured output's llguidance grammar (``serve.decoding.grammar``): the last stage masks
every token it samples for the session with it. A ``prefill`` carries the token ids of
its chunk (stage 0 embeds them; they go on to the last stage only when a penalty of the session
needs them, or a grammar session's replay, whose generated tokens advance its grammar, else only
their count, the hidden state's length, does); the manager sends a session's whole prompt as one prefill, and stage 0 cuts it into
chunks (``more`` is true on all but the last), so a long prompt never stalls other sessions'
decode steps for long. A ``prefill`` at ``pos == 0`` of a session a stage already holds starts
it over (failover replays a session's tokens this way).

A ``decode`` is one step of a *group* of sessions, one row each: ``positions[i]`` is how many
tokens row i's caches held before the step (a stage whose cache disagrees refuses that row,
so a lost or reordered message never produces wrong text) and ``tokens[i]`` its newest token
(for stage 0 only: later stages get no ids).
Every stage runs the group as one batched forward and appends its batch size to ``sizes``.
``tokens`` answers a group's step (or a prefill's last chunk, with ``group == -1``) with each
row's next token at ``positions[i]`` (the number of tokens before it). A stage that cannot run
a row drops it from the step and sends an ``error`` naming that row's session instead.

Speculative decoding (``serve.decoding.speculate``): a ``decode`` may carry ``drafts``, per
row the token ids the manager guesses follow its newest token (empty: none). Every stage runs
``1 + k`` positions per row (``k`` the longest draft; shorter rows are padded, their padding
rejected like a wrong draft), and the drafts travel to the last stage, which verifies them and
answers with ``kept[i]`` (how many of row i's drafts it accepted) and ``tokens[i]``, its own
token after them: row i's tokens at ``positions[i]`` on are ``drafts[i][:kept[i]] +
[tokens[i]]``. The last stage drops the rejected positions from its caches at once; an earlier
stage learns how many were kept from the row's next ``decode``, whose position lies inside the
positions the speculative step wrote (a stage rolls a row back only that far, never further).
A stage with recurrent (linear-attention) blocks cannot take tokens back: it runs the first
position only, drops the drafts and says why in ``spec_off``, which the stages after it pass
on and the last stage returns in ``tokens``, so the manager stops drafting for the ring.

With a draft model (``swarm serve --draft``) the drafts are made by stage 0, which holds the
draft model beside its blocks (the manager is the light plane: no torch): the manager's
``decode`` carries ``asks[i]``, how many tokens stage 0 drafts for row i (0: none), stage 0
drafts exactly that many greedily and sends the step on with ``drafts`` (no ``asks``), and the
last stage's ``tokens`` carries ``accepted[i]``, the drafted ids it kept (``kept[i]`` of them),
so the manager learns the tokens it never saw drafted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from swarmp2p.serve.decoding.grammar import MAX_GRAMMAR_BYTES
from swarmp2p.serve.decoding.prefix import BLOCK_NAME_BYTES, BLOCK_TOKENS, PrefixPlan
from swarmp2p.wire import WireError, unpack_plain

OPS = ("prefill", "decode", "end", "tokens", "error")
MAX_CONTROL_BYTES = 1 << 22
"""Largest control map (a prefill of ~500k token ids)."""
MAX_SID = 2**63 - 1
MAX_POSITION = 2**40
"""Far beyond any context; bounds every position so that no integer overflows downstream."""
MAX_TOKEN_ID = 2**31 - 1
"""Token ids are int32 in every tokenizer we serve; a stage checks its own vocabulary too."""
MAX_BATCH = 4096
"""Rows one decode step may carry."""
MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on ``top_logprobs``."""
MAX_DRAFT_TOKENS = 64
"""Drafted tokens one row of a decode step may carry (the drafter sends at most 10)."""
MAX_REASON_CHARS = 1000
"""Longest ``spec_off`` reason."""
MAX_LOGIT_BIAS = 1024
"""Entries of ``logit_bias`` one request may set."""
MAX_PREFIX_BLOCKS = 1 << 16
"""Block names one list of a prefix plan may carry (a million tokens of 16-token blocks)."""
GREEDY_BELOW = 1e-5
"""A temperature under this is greedy: dividing logits by less overflows float32 (vLLM's
``_SAMPLING_EPS``)."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, field: str, value: Any, want: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {value!r} is not {want}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How the last stage picks each token. ``temperature == 0`` is greedy (argmax). The
    logits processors run in transformers' order: repetition, presence and frequency penalties,
    logit bias, then temperature, top-k, top-p and min-p."""

    temperature: float = 1.0
    """0 (or anything below GREEDY_BELOW) is greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one; 0 keeps all."""
    seed: int | None = None
    """Same seed, same prompt, same model: same tokens. None draws a fresh seed."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted once from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once per time it was generated."""
    repetition_penalty: float = 1.0
    """transformers' (CTRL's): logits of tokens in the prompt or the output divided by it."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias added to its logit) pairs."""
    logprobs: int | None = None
    """None: no log-probabilities; k: the sampled token's and the k most likely ones'."""

    def __post_init__(self) -> None:
        _check(
            _is_number(self.temperature) and 0 <= self.temperature <= 100,
            "temperature",
            self.temperature,
            "a number in [0, 100] (0 is greedy)",
        )
        _check(
            _is_number(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            self.top_p,
            "a number in (0, 1]",
        )
        _check(
            type(self.top_k) is int and 0 <= self.top_k <= MAX_TOKEN_ID,
            "top_k",
            self.top_k,
            f"an integer in [0, {MAX_TOKEN_ID}]",
        )
        _check(
            _is_number(self.min_p) and 0 <= self.min_p <= 1,
            "min_p",
            self.min_p,
            "a number in [0, 1]",
        )
        _check(
            self.seed is None or (type(self.seed) is int and 0 <= self.seed <= MAX_SID),
            "seed",
            self.seed,
            "an integer in [0, 2**63) or null",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, value, "a number in [-2, 2]")
        _check(
            _is_number(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 10,
            "repetition_penalty",
            self.repetition_penalty,
            "a number in [0.01, 10] (1 is none)",
        )
        bias = self.logit_bias
        _check(
            isinstance(bias, tuple)
            and len(bias) <= MAX_LOGIT_BIAS
            and all(
                isinstance(pair, tuple)
                and len(pair) == 2
                and type(pair[0]) is int
                and 0 <= pair[0] <= MAX_TOKEN_ID
                and _is_number(pair[1])
                and -100 <= pair[1] <= 100
                for pair in bias
            ),
            "logit_bias",
            bias if len(str(bias)) < 200 else f"{str(bias)[:200]}...",
            f"up to {MAX_LOGIT_BIAS} (token id, bias in [-100, 100]) pairs",
        )
        _check(
            self.logprobs is None
            or (type(self.logprobs) is int and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
            "logprobs",
            self.logprobs,
            f"null or an integer in [0, {MAX_TOP_LOGPROBS}]",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def needs_history(self) -> bool:
        """Whether the last stage must know the session's earlier tokens (penalties)."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        defaults = _DEFAULTS
        for name in _FIELDS:
            value = getattr(self, name)
            if value != defaults[name]:
                out[name] = [list(p) for p in value] if name == "logit_bias" else value
        return out

    @classmethod
    def from_dict(cls, data: Any) -> SamplingParams:
        if not isinstance(data, dict):
            raise ValueError(f"sampling: must be a map, got {type(data).__name__}")
        unknown = sorted(map(str, set(data) - set(_FIELDS)))
        if unknown:
            raise ValueError(f"sampling: unknown field(s) {', '.join(unknown)}")
        data = dict(data)
        if "logit_bias" in data:
            bias = data["logit_bias"]
            if not isinstance(bias, list) or len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: must be a list of up to {MAX_LOGIT_BIAS} pairs")
            data["logit_bias"] = tuple(tuple(p) if isinstance(p, list) else p for p in bias)
        return cls(**data)


_FIELDS = tuple(SamplingParams.__dataclass_fields__)
_DEFAULTS = {name: f.default for name, f in SamplingParams.__dataclass_fields__.items()}
GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenLogprobs:
    """The sampled token's log-probability under the model, and the most likely tokens'."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# --- messages ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Prefill:
    """A chunk of one session's tokens (the whole prompt when the manager sends it)."""

    op: ClassVar[str] = "prefill"
    sid: int
    pos: int = 0
    tokens: tuple[int, ...] = ()
    more: bool = False
    """More chunks of this session follow: the last stage samples nothing yet."""
    sampling: SamplingParams | None = None
    prompt_len: int | None = None
    """With pos 0: how many of the session's tokens are its prompt (the rest were generated
    before a failover replayed them); None: all of them."""
    grammar: str | None = None
    """With the first chunk: the llguidance grammar every token of the session must follow (a
    structured output or a forced tool call); None: unconstrained."""
    prefix: PrefixPlan | None = None
    """The prefix cache's part in this session (its first chunk only, at ``pos`` = the reused
    tokens): the cached blocks every stage copies in, keeps once the prompt ran, drops first."""

    def __post_init__(self) -> None:
        if self.prefix is not None and self.pos != self.prefix.reused_tokens:
            raise ValueError(
                f"prefix: a plan reusing {len(self.prefix.reuse)} block(s) goes with the chunk at "
                f"position {self.prefix.reused_tokens}, not {self.pos}"
            )

    @property
    def first(self) -> bool:
        """The session's first chunk (it opens the session at a stage)."""
        return self.pos == 0 or self.prefix is not None

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"sid": self.sid, "pos": self.pos, "tokens": list(self.tokens)}
        if self.more:
            body["more"] = True
        if self.sampling is not None:
            body["sampling"] = self.sampling.to_dict()
        if self.prompt_len is not None:
            body["prompt_len"] = self.prompt_len
        if self.grammar is not None:
            body["grammar"] = self.grammar
        if self.prefix is not None:
            p = self.prefix
            body["prefix"] = {"reuse": list(p.reuse), "keep": list(p.keep), "drop": list(p.drop)}
        return body

    def encode(self) -> bytes:
        return _pack(self.op, self.body())


@dataclass(frozen=True, kw_only=True, slots=True)
class _Step:
    """The rows of one step of a group, a session and its position each (Decode going round
    the ring, Tokens coming back from its last stage)."""

    group: int
    step: int
    """The group's step counter: a late answer to an older step is recognised and dropped."""
    sids: tuple[int, ...]
    positions: tuple[int, ...]
    tokens: tuple[int, ...] = ()
    """Each row's token: in a Decode its newest, for stage 0 (empty after it); in Tokens the
    one sampled next (required there)."""
    sizes: tuple[int, ...] = ()
    """The batch size each stage so far ran this step with."""
    spec_off: str = ""
    """Why a stage of the ring cannot verify drafts (it dropped them, and says so to the
    stages after it and, in Tokens, to the manager); empty when none could not."""

    def body(self) -> dict[str, Any]:
        body = {
            "group": self.group,
            "step": self.step,
            "sids": list(self.sids),
            "positions": list(self.positions),
            "tokens": list(self.tokens),
            "sizes": list(self.sizes),
        }
        if self.spec_off:
            body["spec_off"] = self.spec_off
        return body


@dataclass(frozen=True, kw_only=True, slots=True)
class Decode(_Step):
    """One decode step of a group of sessions (a row each), run as one batched forward."""

    op: ClassVar[str] = "decode"
    drafts: tuple[tuple[int, ...], ...] = ()
    """Per row, the drafted tokens after its newest one (speculative decoding); empty when no
    row drafts, else one entry (maybe empty) per row."""
    asks: tuple[int, ...] = ()
    """Per row, how many tokens stage 0's draft model drafts (the manager's step only; empty:
    none). A step carries ``drafts`` or ``asks``, not both."""

    def __post_init__(self) -> None:
        _same_lengths(self.sids, self.positions, self.tokens or self.sids)
        if self.drafts and len(self.drafts) != len(self.sids):
            raise ValueError(f"drafts: {len(self.drafts)} entries for {len(self.sids)} rows")
        if self.asks and len(self.asks) != len(self.sids):
            raise ValueError(f"asks: {len(self.asks)} entries for {len(self.sids)} rows")
        if self.asks and self.drafts:
            raise ValueError("a decode step carries drafts or asks, not both")
        if any(not 0 <= a <= MAX_DRAFT_TOKENS for a in self.asks):
            raise ValueError(f"asks: each is an integer in [0, {MAX_DRAFT_TOKENS}]")

    @property
    def width(self) -> int:
        """Positions every row runs this step: its newest token and the longest draft."""
        return 1 + max((len(d) for d in self.drafts), default=0)

    def encode(self) -> bytes:
        body = self.body()
        if self.drafts:
            body["drafts"] = [list(d) for d in self.drafts]
        if self.asks:
            body["asks"] = list(self.asks)
        return _pack(self.op, body)


@dataclass(frozen=True, kw_only=True, slots=True)
class End:
    """A session is over: every stage frees its caches."""

    op: ClassVar[str] = "end"
    sid: int

    def encode(self) -> bytes:
        return _pack(self.op, {"sid": self.sid})


@dataclass(frozen=True, kw_only=True, slots=True)
class Tokens(_Step):
    """The next token of each row of a step (``group == -1``: after a prefill's last chunk)."""

    op: ClassVar[str] = "tokens"
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    """Empty when no row asked for log-probabilities, else one entry (or None) per row."""
    kept: tuple[int, ...] = ()
    """Per row, how many of its drafts the last stage accepted (empty: the step had none)."""
    accepted: tuple[tuple[int, ...], ...] = ()
    """Per row, the drafted ids it accepted (``kept[i]`` of them), when stage 0's draft model
    drafted them (empty otherwise: the manager drafted, it knows them)."""
    forced: tuple[tuple[int, ...], ...] = ()
    """Per row, the ids its grammar forces after its token (empty: no row has a grammar that
    forces any): the manager's next draft for the row, verified as any draft is."""

    def __post_init__(self) -> None:
        _same_lengths(self.sids, self.positions, self.tokens)
        if self.forced and len(self.forced) != len(self.sids):
            raise ValueError(f"forced: {len(self.forced)} entries for {len(self.sids)} rows")
        if self.logprobs and len(self.logprobs) != len(self.sids):
            raise ValueError(f"logprobs: {len(self.logprobs)} entries for {len(self.sids)} rows")
        if self.kept and len(self.kept) != len(self.sids):
            raise ValueError(f"kept: {len(self.kept)} entries for {len(self.sids)} rows")
        if self.accepted and tuple(len(a) for a in self.accepted) != self.kept:
            raise ValueError(
                f"accepted: {[len(a) for a in self.accepted]} ids per row, but kept is "
                f"{list(self.kept)}"
            )

    def encode(self) -> bytes:
        body = self.body()
        if self.kept:
            body["kept"] = list(self.kept)
        if self.accepted:
            body["accepted"] = [list(a) for a in self.accepted]
        if self.forced:
            body["forced"] = [list(f) for f in self.forced]
        if self.logprobs:
            body["logprobs"] = [
                None if lp is None else [lp.logprob, [list(t) for t in lp.top]]
                for lp in self.logprobs
            ]
        return _pack(self.op, body)


@dataclass(frozen=True, kw_only=True, slots=True)
class Failed:
    """Sessions a stage could not serve, with the reason; travels on to the manager."""

    op: ClassVar[str] = "error"
    sids: tuple[int, ...]
    message: str

    def encode(self) -> bytes:
        return _pack(self.op, {"sids": list(self.sids), "message": self.message})


RingMessage = Prefill | Decode | End | Tokens | Failed


def _same_lengths(sids, positions, tokens) -> None:
    if not len(sids) == len(positions) == len(tokens):
        raise ValueError(
            f"rows: {len(sids)} sids, {len(positions)} positions and {len(tokens)} tokens "
            "must be as many"
        )


def _pack(op: str, body: dict[str, Any]) -> bytes:
    return msgpack.packb({"op": op, **body}, use_bin_type=True)


# --- parsing ----------------------------------------------------------------------------------

_ALLOWED = {
    "prefill": (
        {"sid", "pos", "tokens"},
        {"more", "sampling", "prompt_len", "grammar", "prefix"},
    ),
    "decode": (
        {"group", "step", "sids", "positions", "tokens", "sizes"},
        {"drafts", "asks", "spec_off"},
    ),
    "end": ({"sid"}, set()),
    "tokens": (
        {"group", "step", "sids", "positions", "tokens", "sizes"},
        {"logprobs", "kept", "accepted", "forced", "spec_off"},
    ),
    "error": ({"sids", "message"}, set()),
}


def _bad(field: str, why: str) -> WireError:
    return WireError("bad_field", f"{field}: {why}")


def _int(obj: dict, field: str, lo: int, hi: int) -> int:
    value = obj[field]
    if type(value) is not int or not lo <= value <= hi:
        raise _bad(field, f"{value!r} is not an integer in [{lo}, {hi}]")
    return value


def _ints(obj: dict, field: str, lo: int, hi: int, most: int) -> tuple[int, ...]:
    value = obj[field]
    if type(value) is not list or len(value) > most:
        raise _bad(field, f"must be a list of at most {most} integers")
    if not all(type(v) is int and lo <= v <= hi for v in value):
        raise _bad(field, f"must be a list of integers in [{lo}, {hi}]")
    return tuple(value)


def _logprobs(value: Any, rows: int) -> tuple[TokenLogprobs | None, ...]:
    if type(value) is not list or len(value) != rows:
        raise _bad("logprobs", f"must be a list of one entry per row ({rows})")
    out: list[TokenLogprobs | None] = []
    for entry in value:
        if entry is None:
            out.append(None)
            continue
        if (
            type(entry) is not list
            or len(entry) != 2
            or not isinstance(entry[0], float)
            or type(entry[1]) is not list
            or len(entry[1]) > MAX_TOP_LOGPROBS
        ):
            raise _bad("logprobs", "an entry is [logprob, [[token id, logprob], ...]] or null")
        top = []
        for pair in entry[1]:
            if (
                type(pair) is not list
                or len(pair) != 2
                or type(pair[0]) is not int
                or not 0 <= pair[0] <= MAX_TOKEN_ID
                or not isinstance(pair[1], float)
            ):
                raise _bad("logprobs", "a top entry is [token id, logprob]")
            top.append((pair[0], pair[1]))
        out.append(TokenLogprobs(logprob=entry[0], top=tuple(top)))
    return tuple(out)


def _drafts(value: Any, rows: int, field: str = "drafts") -> tuple[tuple[int, ...], ...]:
    if type(value) is not list or len(value) != rows:
        raise _bad(field, f"must be a list of one draft per row ({rows})")
    out = []
    for draft in value:
        if (
            type(draft) is not list
            or len(draft) > MAX_DRAFT_TOKENS
            or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in draft)
        ):
            raise _bad(
                field,
                f"a draft is a list of at most {MAX_DRAFT_TOKENS} token ids in [0, {MAX_TOKEN_ID}]",
            )
        out.append(tuple(draft))
    return tuple(out)


def decode_message(data: bytes | memoryview) -> RingMessage:
    """Parse one control map; WireError naming the field on anything wrong."""
    obj = unpack_plain(bytes(data), MAX_CONTROL_BYTES)
    if type(obj) is not dict:
        raise WireError("malformed", f"a ring message is a map, got {type(obj).__name__}")
    op = obj.pop("op", None)
    if op not in OPS:
        raise WireError("unknown_type", f"op: {op!r} is not one of {', '.join(OPS)}")
    required, optional = _ALLOWED[op]
    extra = sorted(map(str, set(obj) - required - optional))
    if extra:
        raise WireError("bad_field", f"{op}: unexpected field(s) {', '.join(extra)}")
    missing = sorted(required - set(obj))
    if missing:
        raise WireError("bad_field", f"{op}: missing field(s) {', '.join(missing)}")
    try:
        if op == "prefill":
            return _parse_prefill(obj)
        if op == "end":
            return End(sid=_int(obj, "sid", 0, MAX_SID))
        if op == "error":
            if type(obj["message"]) is not str:
                raise _bad("message", "must be a string")
            return Failed(sids=_ints(obj, "sids", 0, MAX_SID, MAX_BATCH), message=obj["message"])
        rows = {
            "group": _int(obj, "group", -1, MAX_BATCH),
            "step": _int(obj, "step", 0, MAX_SID),
            "sids": _ints(obj, "sids", 0, MAX_SID, MAX_BATCH),
            "positions": _ints(obj, "positions", 0, MAX_POSITION, MAX_BATCH),
            "tokens": _ints(obj, "tokens", 0, MAX_TOKEN_ID, MAX_BATCH),
            "sizes": _ints(obj, "sizes", 0, MAX_BATCH, 256),
            "spec_off": obj.get("spec_off", ""),
        }
        if type(rows["spec_off"]) is not str or len(rows["spec_off"]) > MAX_REASON_CHARS:
            raise _bad("spec_off", f"must be a string of at most {MAX_REASON_CHARS} characters")
        if op == "decode":
            drafts = _drafts(obj["drafts"], len(rows["sids"])) if "drafts" in obj else ()
            asks = ()
            if "asks" in obj:
                asks = _ints(obj, "asks", 0, MAX_DRAFT_TOKENS, MAX_BATCH)
                if len(asks) != len(rows["sids"]):
                    raise _bad("asks", f"must be a list of one count per row ({len(rows['sids'])})")
            return Decode(**rows, drafts=drafts, asks=asks)
        logprobs = _logprobs(obj["logprobs"], len(rows["sids"])) if "logprobs" in obj else ()
        kept = ()
        if "kept" in obj:
            kept = _ints(obj, "kept", 0, MAX_DRAFT_TOKENS, MAX_BATCH)
            if len(kept) != len(rows["sids"]):
                raise _bad("kept", f"must be a list of one count per row ({len(rows['sids'])})")
        accepted = ()
        if "accepted" in obj:
            accepted = _drafts(obj["accepted"], len(rows["sids"]), "accepted")
        forced = _drafts(obj["forced"], len(rows["sids"]), "forced") if "forced" in obj else ()
        return Tokens(**rows, logprobs=logprobs, kept=kept, accepted=accepted, forced=forced)
    except ValueError as e:
        if isinstance(e, WireError):
            raise
        raise WireError("bad_field", str(e)) from None


def _parse_prefill(obj: dict) -> Prefill:
    more = obj.get("more", False)
    if type(more) is not bool:
        raise _bad("more", f"{more!r} is not true or false")
    pos = _int(obj, "pos", 0, MAX_POSITION)
    sampling = obj.get("sampling")
    if sampling is not None:
        sampling = SamplingParams.from_dict(sampling)
    prompt_len = obj.get("prompt_len")
    if prompt_len is not None:
        prompt_len = _int(obj, "prompt_len", 0, MAX_POSITION)
    prefix = _prefix(obj["prefix"]) if "prefix" in obj else None
    first = pos == 0 if prefix is None else pos == prefix.reused_tokens
    if prefix is not None and not first:
        raise _bad(
            "prefix",
            f"reuses {prefix.reused_tokens} tokens, so it goes with the chunk at that position, "
            f"not {pos}",
        )
    if not first and (sampling is not None or prompt_len is not None):
        raise _bad("sampling", "sampling and prompt_len go with the first chunk (pos 0) only")
    grammar = obj.get("grammar")
    if grammar is not None:
        if type(grammar) is not str or not grammar or len(grammar) > MAX_GRAMMAR_BYTES:
            raise _bad(
                "grammar", f"must be a grammar's text of 1 to {MAX_GRAMMAR_BYTES} characters"
            )
        if not first:
            raise _bad("grammar", "a grammar goes with the session's first chunk only")
    return Prefill(
        sid=_int(obj, "sid", 0, MAX_SID),
        pos=pos,
        tokens=_ints(obj, "tokens", 0, MAX_TOKEN_ID, MAX_CONTROL_BYTES),
        more=more,
        sampling=sampling,
        prompt_len=prompt_len,
        grammar=grammar,
        prefix=prefix,
    )


def _prefix(value: Any) -> PrefixPlan:
    """A prefix plan from ``{"reuse", "keep", "drop"}``: lists of block names, each name of
    BLOCK_NAME_BYTES bytes; WireError naming the list that is wrong."""
    if type(value) is not dict:
        raise _bad("prefix", f"must be a map of reuse, keep and drop, got {type(value).__name__}")
    extra = sorted(map(str, set(value) - {"reuse", "keep", "drop"}))
    if extra:
        raise _bad("prefix", f"unexpected field(s) {', '.join(extra)}")
    lists = {}
    for key in ("reuse", "keep", "drop"):
        names = value.get(key, [])
        if type(names) is not list or len(names) > MAX_PREFIX_BLOCKS:
            raise _bad(f"prefix.{key}", f"must be a list of at most {MAX_PREFIX_BLOCKS} names")
        if not all(type(n) is bytes and len(n) == BLOCK_NAME_BYTES for n in names):
            raise _bad(f"prefix.{key}", f"every block name is {BLOCK_NAME_BYTES} bytes")
        if len(set(names)) != len(names):
            raise _bad(f"prefix.{key}", "names a block twice")
        lists[key] = tuple(names)
    if set(lists["reuse"]) & set(lists["keep"]):
        raise _bad("prefix.keep", "keeps a block it reuses")
    if len(lists["reuse"]) * BLOCK_TOKENS > MAX_POSITION:
        raise _bad("prefix.reuse", "reuses more positions than any context holds")
    return PrefixPlan(**lists)
