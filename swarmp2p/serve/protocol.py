"""What goes round a serving ring: one msgpack control map per message, then a TensorFrame.

A ring is the session manager, then stage 0 .. stage N-1, then the manager again. Messages:

| op        | from -> to                 | fields                          | tensor after it |
|-----------|----------------------------|---------------------------------|-----------------|
| `prefill` | manager -> stage 0 -> ...  | sid, pos, tokens*, sampling     | hidden (stage > 0) |
| `decode`  | manager -> stage 0 -> ...  | sid, pos, tokens*               | hidden (stage > 0) |
| `end`     | manager -> every stage     | sid                             | none            |
| `token`   | last stage -> manager      | sid, pos, token                 | none            |
| `error`   | any stage -> ... -> manager| sid, message                    | none            |

(*) only stage 0 reads the token ids; it drops them from what it sends on. ``pos`` is how many
tokens the session's caches held before this step: a stage whose cache disagrees refuses the
step (a lost or reordered message never produces wrong text). A ``prefill`` of a session a
stage already holds starts it over (failover replays a session's tokens this way).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import msgpack

from swarmp2p.wire import WireError, unpack_plain

OPS = ("prefill", "decode", "end", "token", "error")
MAX_CONTROL_BYTES = 1 << 22
"""Largest control map (a prefill of ~500k token ids)."""
MAX_SID = 2**63 - 1


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How the last stage picks each token. ``temperature == 0`` is greedy (argmax)."""

    temperature: float = 1.0
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    seed: int | None = None
    """Same seed, same prompt, same model: same tokens. None draws a fresh seed."""

    def __post_init__(self) -> None:
        _check(
            isinstance(self.temperature, (int, float))
            and not isinstance(self.temperature, bool)
            and math.isfinite(self.temperature)
            and 0 <= self.temperature <= 100,
            "temperature",
            self.temperature,
            "a number in [0, 100] (0 is greedy)",
        )
        _check(
            isinstance(self.top_p, (int, float))
            and not isinstance(self.top_p, bool)
            and 0 < self.top_p <= 1,
            "top_p",
            self.top_p,
            "a number in (0, 1]",
        )
        _check(type(self.top_k) is int and self.top_k >= 0, "top_k", self.top_k, "an integer >= 0")
        _check(
            self.seed is None or (type(self.seed) is int and 0 <= self.seed < 2**63),
            "seed",
            self.seed,
            "an integer in [0, 2**63) or null",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> SamplingParams:
        if not isinstance(data, dict):
            raise ValueError(f"sampling: must be a map, got {type(data).__name__}")
        unknown = sorted(set(data) - {"temperature", "top_p", "top_k", "seed"})
        if unknown:
            raise ValueError(f"sampling: unknown field(s) {', '.join(map(str, unknown))}")
        return cls(**data)


def _check(ok: bool, field: str, value: Any, want: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {value!r} is not {want}")


GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class RingMessage:
    """One control map of the ring protocol (see the module docstring for which fields go with
    which op)."""

    op: str
    sid: int
    pos: int = 0
    tokens: tuple[int, ...] = ()
    sampling: SamplingParams | None = None
    token: int = -1
    message: str = ""

    def encode(self) -> bytes:
        body: dict[str, Any] = {"op": self.op, "sid": self.sid}
        if self.op in ("prefill", "decode", "token"):
            body["pos"] = self.pos
        if self.tokens:
            body["tokens"] = list(self.tokens)
        if self.sampling is not None:
            body["sampling"] = self.sampling.to_dict()
        if self.op == "token":
            body["token"] = self.token
        if self.op == "error":
            body["message"] = self.message
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> RingMessage:
        """Parse one control map; WireError naming the field on anything wrong."""
        obj = unpack_plain(bytes(data), MAX_CONTROL_BYTES)
        if type(obj) is not dict:
            raise WireError("malformed", f"a ring message is a map, got {type(obj).__name__}")
        op = obj.get("op")
        if op not in OPS:
            raise WireError("unknown_type", f"op: {op!r} is not one of {', '.join(OPS)}")
        allowed = {"op", "sid"} | {
            "prefill": {"pos", "tokens", "sampling"},
            "decode": {"pos", "tokens"},
            "end": set(),
            "token": {"pos", "token"},
            "error": {"message"},
        }[op]
        extra = sorted(set(obj) - allowed)
        if extra:
            raise WireError("bad_field", f"{op}: unexpected field(s) {', '.join(map(str, extra))}")
        sid = obj.get("sid")
        if type(sid) is not int or not 0 <= sid <= MAX_SID:
            raise WireError("bad_field", f"sid: {sid!r} is not an integer in [0, 2**63)")
        pos = obj.get("pos", 0)
        if type(pos) is not int or pos < 0:
            raise WireError("bad_field", f"pos: {pos!r} is not an integer >= 0")
        tokens = obj.get("tokens", [])
        if type(tokens) is not list or not all(type(t) is int and t >= 0 for t in tokens):
            raise WireError("bad_field", "tokens: must be a list of integers >= 0")
        sampling = obj.get("sampling")
        if sampling is not None:
            try:
                sampling = SamplingParams.from_dict(sampling)
            except (TypeError, ValueError) as e:
                raise WireError("bad_field", str(e)) from None
        token = obj.get("token", -1)
        if op == "token" and (type(token) is not int or token < 0):
            raise WireError("bad_field", f"token: {token!r} is not an integer >= 0")
        message = obj.get("message", "")
        if type(message) is not str:
            raise WireError("bad_field", "message: must be a string")
        return cls(
            op=op,
            sid=sid,
            pos=pos,
            tokens=tuple(tokens),
            sampling=sampling,
            token=token,
            message=message,
        )
