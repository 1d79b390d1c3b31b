"""What ``swarm serve`` asks and what the serve planner answers, as records: :class:`ServeRequest`
(the CLI's and the daemon's API's, saved for a restart), :class:`ServeStagePlan` and
:class:`ServePlan` (where each stage of the ring runs, in which dtype, with what memory), the
request's bounds and defaults, and the boundary codecs a ring may send. Pure, standard library
only; ``plan.serve.planner`` plans them."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from swarmp2p import PROTOCOL_VERSION
from swarmp2p.plan.memory import (
    StageMemory,
)
from swarmp2p.plan.model_shape import ModelShape
from swarmp2p.plan.quantization import QuantSpec
from swarmp2p.schema import FieldError, SchemaError, field, parse, to_data

_FIXED = {f"fixed_int{n}": n for n in range(2, 9)}
BOUNDARY_COMPRESSIONS = ("none", "fp16", *_FIXED)
"""What a serving boundary applies to the hidden state it sends. A learned bottleneck is not
named here: a stage served from a trained shard runs its compressor halves, per the shard's
manifest (``swarmp2p.runtime.torch.serve.trained``)."""
BoundaryCompression = Literal[
    "none",
    "fp16",
    "fixed_int2",
    "fixed_int3",
    "fixed_int4",
    "fixed_int5",
    "fixed_int6",
    "fixed_int7",
    "fixed_int8",
]
Dtype = Literal["float32", "bfloat16", "float16"]
Speculate = Literal["auto", "ngram", "draft", "none"]
"""Speculative decoding of a served model (``serve.scheduler.SPECULATE_MODES``)."""
SplitMode = Literal["equal", "weighted", "cost"]
PlannedSplit = Literal["equal", "weighted", "cost", "fixed"]

SERVE_SPLIT: SplitMode = "cost"
"""The default split: decode speed is the slowest stage's, so balance compute."""
NAME_PATTERN = r"[\w./:@+-]{1,200}"
"""What a served model's name (the API's ``model``) may be."""
MAX_STAGES = 4096
MAX_SESSIONS = 1 << 20
MAX_CONTEXT = 1 << 24
MAX_PREFIX_CACHE_MB = 1 << 20
"""Bounds of a request's numbers (a model has fewer blocks, no device holds more)."""
PREFIX_CACHE_MB = 64
"""The prefix cache's default budget per stage (MiB): on the embedded model in float32 over
two stages, about 2,900 tokens of cached prompts (a long system prompt and then some). Left to
its default (None) the budget is the largest of 64, 32, ... 1 MiB that the devices have room
for beside the stages and their sessions; an explicit budget is priced as asked."""


def boundary_codec(compression: str, send_codes: bool) -> str:
    """The TensorFrame codec a boundary sends with: codes only when both peers declared the
    serve codec (``send_codes``), else plain floats (already quantized in the graph)."""
    if compression not in BOUNDARY_COMPRESSIONS:
        raise ValueError(
            f"boundary compression {compression!r} is not one of {', '.join(BOUNDARY_COMPRESSIONS)}"
        )
    if not send_codes or compression == "none":
        return "none"
    if compression == "fp16":
        return "fp16"
    return f"tokint{_FIXED[compression]}"  # one float32 scale per token, as plan.split prices it


def fixed_bits(compression: str) -> int | None:
    """``"fixed_int8" -> 8``; None for a compression that is not fixed_intN."""
    return _FIXED.get(compression)


# --- what `swarm serve` asks ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeRequest:
    """``swarm serve MODEL [...]``: parsed once by the CLI and once by the daemon's local API
    (the same record); a restarted daemon serves its saved requests again."""

    model: str = field(min_len=1, max_len=4096)
    """A trained model (``swarm models``), a folder, a Hub id in the cache, or "embedded"."""
    name: str | None = field(default=None, pattern=NAME_PATTERN)
    """The name the API answers to; None: ``model``."""
    stages: int = field(default=0, ge=0, le=MAX_STAGES)
    """0: one stage per usable device (at most one per block)."""
    port: int = field(default=8080, ge=0, le=65535)
    host: str = field(default="127.0.0.1", min_len=1, max_len=255)
    """Where the API listens; beyond loopback only with ``api_key``."""
    max_sessions: int = field(default=4, ge=1, le=MAX_SESSIONS)
    max_context: int = field(default=0, ge=0, le=MAX_CONTEXT)
    """Tokens a session may hold; 0: the model's own limit."""
    dtype: Dtype | None = None
    """None: the best dtype every stage's device runs (a trained model: its training dtype)."""
    quantization: QuantSpec | None = None
    speculate: Speculate = "auto"
    """Speculative decoding: "auto" (the draft model when one is given, else prompt lookup,
    with an adaptive draft length that stops drafting where it does not pay), "ngram" (prompt
    lookup, 10 tokens a lap), "draft" (the draft model, 10 tokens a lap), "none"."""
    draft: str | None = field(default=None, min_len=1, max_len=4096)
    """A draft model for speculative decoding (a folder or "embedded"; the served model's
    tokenizer): stage 0 holds it beside its blocks and drafts with it."""
    prefix_cache_mb: int | None = field(default=None, ge=0, le=MAX_PREFIX_CACHE_MB)
    """MiB of cached prompt blocks each stage keeps for new sessions to reuse; 0: off; None:
    up to PREFIX_CACHE_MB, as much as the devices have room for (never a reason to fail)."""
    api_key: str | None = field(default=None, min_len=1, max_len=4096)
    cwd: str | None = field(default=None, min_len=1, max_len=4096)
    """The CLI's folder: a relative MODEL folder is read from there."""

    @staticmethod
    def __schema_prepare__(data: dict[str, Any]) -> dict[str, Any]:
        # a flag left out arrives as null (or an empty API key from the environment): default
        return {k: v for k, v in data.items() if v is not None and not (k == "api_key" and v == "")}

    @property
    def served_name(self) -> str:
        return self.name or self.model

    def to_dict(self) -> dict[str, Any]:
        """Plain data without the defaults left out (what the daemon saves)."""
        return {k: v for k, v in to_data(self).items() if v is not None}


def parse_serve_request(data: Any) -> ServeRequest:
    """A ServeRequest from plain data; SchemaError naming every bad field."""
    return parse(ServeRequest, data, title="invalid serve request")


# --- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeStagePlan:
    """One stage of a serving ring, placed on one device of one node."""

    index: int = field(ge=0)
    node_id: str = field(min_len=1, max_len=64)
    node: str = field(max_len=256)
    """The node's human name."""
    device: str = field(pattern=r"cpu|cuda(:\d+)?|mps(:\d+)?")
    """The torch device on the node, such as "cuda:0"."""
    device_label: str
    """"GPU 0 (RTX A5000, compute 8.6)"."""
    layers: tuple[int, int]
    """``[start, end)`` of the model's decoder blocks."""
    memory: StageMemory
    device_free: int = field(ge=0)
    """Bytes the device had free when planned."""
    send_compression: BoundaryCompression = "none"
    """The boundary after this stage ("none" on the last)."""
    send_codes: bool = False
    """A quantized boundary after this stage (``send_compression``, or a trained shard's own)
    crosses as codes: both nodes declare the serve codec."""

    def __post_init__(self) -> None:
        if not 0 <= self.layers[0] < self.layers[1]:
            raise ValueError(
                f"layers must be [start, end) with 0 <= start < end, got {list(self.layers)}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ServePlan:
    """A placed serving ring. Same inputs, same ``to_json()`` bytes on every peer;
    ``ServePlan.from_json`` reads them back through the one validator."""

    status: Literal["planned"] = "planned"
    version: int = PROTOCOL_VERSION
    model: str
    """The model's name (its shape's)."""
    dtype: Dtype
    quantization: QuantSpec | None = None
    max_sessions: int = field(ge=1, le=MAX_SESSIONS)
    max_context: int = field(ge=1, le=MAX_CONTEXT)
    """Tokens each session may hold in every stage's KV cache."""
    prefix_blocks: int = field(default=0, ge=0)
    """Prompt blocks (``memory.PREFIX_BLOCK_TOKENS`` tokens each) the prefix cache holds on
    every stage; 0: no prefix cache."""
    draft: str | None = field(default=None, max_len=4096)
    """The draft model stage 0 holds (its shape's name; priced in its ``memory.draft``);
    None: none."""
    draft_compute: float = field(default=0.0, ge=0.0)
    """The draft model's multiply-adds a token over the served model's (its blocks' active
    weights and its head's matmul): what a drafted token costs is priced from it."""
    split_mode: PlannedSplit
    """How the blocks were shared out; "fixed": a trained model's split."""
    stages: tuple[ServeStagePlan, ...] = field(min_len=1)
    notes: tuple[str, ...] = ()
    reason: Literal[None] = None
    """Always null: a plan is not Blocked (the JSON shape both share)."""
    errors: tuple[str, ...] = field(default=(), max_len=0)

    def __post_init__(self) -> None:
        for i, stage in enumerate(self.stages):
            if stage.index != i:
                raise ValueError(f"stages[{i}].index is {stage.index}")
            if i and stage.layers[0] != self.stages[i - 1].layers[1]:
                raise ValueError(
                    f"stages[{i}] starts at block {stage.layers[0]}, not where stage {i - 1} ends"
                )
        if self.stages[0].layers[0] != 0:
            raise ValueError("stages[0] must start at block 0")
        if self.stages[-1].send_compression != "none" or self.stages[-1].send_codes:
            raise ValueError("the last stage sends tokens: its send_compression is none")

    @property
    def n_layers(self) -> int:
        return self.stages[-1].layers[1]

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return [s.layers for s in self.stages]

    def to_dict(self) -> dict[str, Any]:
        return to_data(self)

    def to_json(self) -> str:
        """Canonical bytes: sorted keys, no whitespace; peers compare these."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> ServePlan:
        """A plan from ``to_json()`` bytes; SchemaError when they are not a serve plan."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise SchemaError(
                f"a serve plan must be JSON: {exc}", title="invalid serve plan"
            ) from None
        return parse(cls, data, title="invalid serve plan")


def request_error(path: str, message: str) -> SchemaError:
    return SchemaError([FieldError(path=path, message=message)], title="invalid serve request")


def check_request(
    shape: ModelShape,
    stages: int,
    bounds: Sequence[Sequence[int]] | None,
    holders: Sequence[Sequence[str]] | None,
    compression: Sequence[str],
    codes: bool | Sequence[bool] | None,
) -> int | None:
    """The stage count a request fixes (None: auto) on a model of ``shape``: SchemaError
    naming a bad field (bounds not covering the model, more stages than blocks, a compression
    or codes list not one per boundary)."""
    L = shape.n_layers
    n = None
    if bounds is not None:
        n = len(bounds)
        if (
            not n
            or any(len(b) != 2 or b[0] >= b[1] for b in bounds)
            or bounds[0][0] != 0
            or bounds[-1][1] != L
            or any(x[1] != y[0] for x, y in itertools.pairwise(bounds))
        ):
            raise request_error(
                "bounds",
                f"{[list(b) for b in bounds]} are not contiguous block ranges from 0 to {L}",
            )
        if stages and stages != n:
            raise request_error(
                "stages",
                f"{stages}, but the model is split in {n} stages {[list(b) for b in bounds]}; leave stages at 0 or give {n}",
            )
    elif stages:
        n = stages
        if n > L:
            raise request_error("stages", f"{n} is not in [1, {L}] (the model's blocks)")
    if holders is not None and (n is None or len(holders) != n):
        raise request_error("holders", "one list of nodes per stage of bounds")
    if compression:
        n = len(compression) + 1 if n is None else n  # a spec per boundary fixes the stages
        if len(compression) != n - 1:
            raise request_error(
                "compression",
                f"{len(compression)} spec(s), but the ring has {n} stage(s); give one per boundary",
            )
        bad = [c for c in compression if c not in BOUNDARY_COMPRESSIONS]
        if bad:
            raise request_error(
                "compression", f"{bad[0]!r} is not one of {', '.join(BOUNDARY_COMPRESSIONS)}"
            )
    if codes is not None and not isinstance(codes, bool) and (n is None or len(codes) != n - 1):
        raise request_error("codes", "one flag per boundary")
    return n


__all__ = [
    "BOUNDARY_COMPRESSIONS",
    "MAX_CONTEXT",
    "MAX_PREFIX_CACHE_MB",
    "MAX_SESSIONS",
    "MAX_STAGES",
    "NAME_PATTERN",
    "PREFIX_CACHE_MB",
    "SERVE_SPLIT",
    "BoundaryCompression",
    "Dtype",
    "PlannedSplit",
    "ServePlan",
    "ServeRequest",
    "ServeStagePlan",
    "Speculate",
    "SplitMode",
    "boundary_codec",
    "check_request",
    "fixed_bits",
    "parse_serve_request",
    "request_error",
]
