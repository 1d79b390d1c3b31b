"""The record a serving stage worker is started from (JSON on its stdin), and boundary rules."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

_FIXED = {f"fixed_int{n}": n for n in range(2, 9)}
BOUNDARY_COMPRESSIONS = ("none", "fp16", *_FIXED)
"""What a serving boundary applies to the hidden state it sends. A learned bottleneck is not
named here: a stage served from a trained shard runs its compressor halves, per the shard's
manifest (``swarmp2p.runtime.torch.trained``)."""


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


@dataclass(frozen=True, kw_only=True, slots=True)
class StageServeSpec:
    """One serving stage: which blocks of which model, where it listens, what it sends on."""

    model: str
    """A checkpoint folder, a Hub id in the local cache, or "embedded"."""
    stage_index: int
    layer_start: int
    layer_end: int
    is_first_stage: bool
    is_last_stage: bool
    token: str
    """The swarm token: every link is CURVE-authenticated with keys derived from it."""
    host: str = "127.0.0.1"
    """Address the stage's input link binds to."""
    port: int = 0
    """0: a free port, reported in the worker's ``ready`` event."""
    dtype: str = "float32"
    device: str = "cpu"
    """"cpu", "cuda" or "cuda:N" (the daemon narrows CUDA_VISIBLE_DEVICES per worker)."""
    quantization: dict | None = None
    send_compression: str = "none"
    """Compression of the boundary after this stage (ignored on the last stage)."""
    send_codes: bool = False
    """Send a quantized boundary as codes (both peers declared the serve codec)."""
    threads: int = 0
    """torch intra-op threads; 0 leaves torch's default."""
    max_sessions: int = 16
    max_context: int = 2048
    """Tokens a session may hold in this stage's cache."""
    shard: str | None = None
    """A local folder holding this stage's exported shard (``swarm train``'s export): then
    ``model`` is the base the job trained from, and the worker loads the base slice and the
    shard on top (weights, adapters, boundary compressors, per its manifest)."""
    tied_head: str | None = None
    """A safetensors file holding one tensor, the tied output head's weight under its
    whole-model name (the first stage's trained embedding; a copy of the first stage's
    ``weights.safetensors`` works too, its embedding is picked by name): only for the last stage
    of a tied-embedding model served from a shard that includes its weights."""
    link_keys: dict | None = None
    """Per-node link keys (issue 15): ``{"public", "secret"}`` of this stage's node, ``"prev"``
    the public key of the node that sends into this stage (the only client its input link
    admits), ``"next"`` that of the node it sends to. None: the token's keys."""

    def __post_init__(self) -> None:
        errors = []
        if not isinstance(self.model, str) or not self.model:
            errors.append(f"model: {self.model!r} is not a non-empty string")
        for name in ("stage_index", "layer_start", "threads"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                errors.append(f"{name}: {value!r} is not an integer >= 0")
        if type(self.layer_end) is not int or (
            type(self.layer_start) is int and self.layer_end <= self.layer_start
        ):
            errors.append(
                f"layer_end: {self.layer_end!r} is not an integer above layer_start "
                f"{self.layer_start!r}"
            )
        for name in ("is_first_stage", "is_last_stage", "send_codes"):
            if type(getattr(self, name)) is not bool:
                errors.append(f"{name}: {getattr(self, name)!r} is not true or false")
        if self.is_first_stage is True and self.layer_start != 0:
            errors.append(
                f"is_first_stage: the first stage starts at block 0, not {self.layer_start}"
            )
        if not isinstance(self.token, str) or not self.token:
            errors.append("token: the swarm token is required")
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            errors.append(f"host: {self.host!r} is not an IP address")
        if type(self.port) is not int or not 0 <= self.port < 65536:
            errors.append(f"port: {self.port!r} is not in [0, 65535]")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            errors.append(f"dtype: {self.dtype!r} is not float32, bfloat16 or float16")
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            errors.append(f"device: {self.device!r} is not cpu, cuda or cuda:N")
        if self.quantization is not None and not isinstance(self.quantization, dict):
            errors.append(f"quantization: {self.quantization!r} is not a map or null")
        if self.send_compression not in BOUNDARY_COMPRESSIONS:
            errors.append(
                f"send_compression: {self.send_compression!r} is not one of "
                f"{', '.join(BOUNDARY_COMPRESSIONS)}"
            )
        for name in ("shard", "tied_head"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                errors.append(f"{name}: {value!r} is not a non-empty path or null")
        if self.link_keys is not None and not (
            isinstance(self.link_keys, dict)
            and all(
                isinstance(self.link_keys.get(k), str) for k in ("public", "secret", "prev", "next")
            )
        ):
            errors.append("link_keys: a map of public, secret, prev and next keys, or null")
        if self.tied_head is not None and self.shard is None:
            errors.append("tied_head: only a stage served from a shard takes a tied head")
        if self.tied_head is not None and self.is_last_stage is not True:
            errors.append("tied_head: only the last stage has an output head")
        for name in ("max_sessions", "max_context"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                errors.append(f"{name}: {value!r} is not an integer >= 1")
        if errors:
            raise ValueError("stage spec: " + "; ".join(errors))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> StageServeSpec:
        """Build from parsed JSON; unknown or missing fields are named in the ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"stage spec: must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"stage spec: unknown field(s) {', '.join(unknown)}")
        required = ("model", "stage_index", "layer_start", "layer_end", "is_first_stage")
        missing = [n for n in (*required, "is_last_stage", "token") if n not in data]
        if missing:
            raise ValueError(f"stage spec: missing field(s) {', '.join(missing)}")
        return cls(**data)
