"""The record a serving stage worker starts from (JSON on its stdin): the serve plan every
peer checked, which stage, and what only that stage's node knows. Light plane, no torch.

``serve_spec(plan, stage, ...)`` is the one way to make one: the daemon builds it for each
stage it starts, :class:`~swarmp2p.serve.local.LocalRing` and the tests for theirs, and the
worker (``python -m swarmp2p.runtime.serve_worker``) parses it with :func:`parse_serve_spec`
before it imports torch. The dtype, the quantization, the blocks, the boundary and the cache
sizes are the plan's; nothing here is a second copy of them.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from swarmp2p.plan.serve import (
    BOUNDARY_COMPRESSIONS,
    ServePlan,
    boundary_codec,
    fixed_bits,
)
from swarmp2p.plan.split import StageOfPlan
from swarmp2p.schema import FieldError, SchemaError, field, parse, to_data


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeSpec(StageOfPlan):
    """One serving stage: the plan, which stage, the files and the link this node uses."""

    plan: ServePlan
    stage: int = field(ge=0)
    model: str = field(min_len=1, max_len=4096)
    """What this node loads the stage from: a checkpoint folder, a Hub id in the local cache,
    or "embedded"."""
    token: str = field(min_len=1, max_len=256)
    """The swarm token: every link is CURVE-authenticated with keys derived from it."""
    host: str = field(default="127.0.0.1", min_len=1, max_len=64)
    """The IP address the stage's input link binds to."""
    port: int = field(default=0, ge=0, le=65535)
    """0: a free port, reported in the worker's ``ready`` event."""
    device: str = field(default="cpu", pattern=r"cpu|cuda(:\d+)?|mps(:\d+)?")
    """Where the worker computes ("cuda:0" with CUDA_VISIBLE_DEVICES narrowed to its GPU; a
    fake GPU of a test runs on "cpu")."""
    threads: int = field(default=0, ge=0, le=4096)
    """torch intra-op threads; 0 leaves torch's default."""
    shard: str | None = field(default=None, min_len=1, max_len=4096)
    """A local folder holding this stage's exported shard (``swarm train``'s export): then
    ``model`` is the base the job trained from, and the worker loads the base slice and the
    shard on top (weights, adapters, boundary compressors, per its manifest)."""
    tied_head: str | None = field(default=None, min_len=1, max_len=4096)
    """A safetensors file holding one tensor, the tied output head's weight under its
    whole-model name (the first stage's trained embedding; a copy of the first stage's
    ``weights.safetensors`` works too, its embedding is picked by name): only for the last stage
    of a tied-embedding model served from a shard that includes its weights."""
    link_keys: dict | None = None
    """Per-node link keys (issue 15), z85: ``{"public", "secret"}`` of this stage's node,
    ``"prev"`` the public key of the node that sends into this stage (the only client its input
    link admits), ``"next"`` that of the node it sends to. None: the token's keys (one machine,
    ``LocalRing``, tests)."""
    draft: str | None = field(default=None, min_len=1, max_len=4096)
    """Stage 0 only, when the plan has a draft model: the folder this node loads it from."""

    def __post_init__(self) -> None:
        errors = self.stage_errors()
        n = len(self.plan.stages)
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            errors.append(FieldError(path="host", message=f"{self.host!r} is not an IP address"))
        if self.link_keys is not None and not all(
            isinstance(self.link_keys.get(k), str) and self.link_keys.get(k)
            for k in ("public", "secret", "prev", "next")
        ):
            errors.append(
                FieldError(
                    path="link_keys",
                    message="must map public, secret, prev and next to keys, or be null",
                )
            )
        if self.tied_head is not None and self.shard is None:
            errors.append(
                FieldError(
                    path="tied_head", message="only a stage served from a shard takes a tied head"
                )
            )
        if self.tied_head is not None and self.stage != n - 1:
            errors.append(
                FieldError(path="tied_head", message="only the last stage has an output head")
            )
        if self.draft is not None and (self.stage != 0 or self.plan.draft is None):
            errors.append(
                FieldError(
                    path="draft", message="only stage 0 of a plan with a draft model loads one"
                )
            )
        if errors:
            raise SchemaError(errors)

    # --- what the stage runs, read from the plan ------------------------------------------------

    @property
    def quantization(self) -> dict | None:
        q = self.plan.quantization
        return None if q is None else q.to_dict()

    def to_dict(self) -> dict[str, Any]:
        return to_data(self)


def parse_serve_spec(data: Any) -> ServeSpec:
    """A validated ServeSpec, or SchemaError listing every bad field with its path."""
    return parse(ServeSpec, data, title="invalid serve spec")


def serve_spec(
    plan: ServePlan,
    stage: int,
    *,
    model: str,
    token: str,
    host: str = "127.0.0.1",
    port: int = 0,
    device: str = "cpu",
    threads: int = 0,
    shard: str | None = None,
    tied_head: str | None = None,
    link_keys: dict[str, str] | None = None,
    draft: str | None = None,
) -> ServeSpec:
    """The spec of stage ``stage`` of ``plan`` on this node (the fields only it knows)."""
    return ServeSpec(
        plan=plan,
        stage=stage,
        model=model,
        token=token,
        host=host,
        port=port,
        device=device,
        threads=threads,
        shard=shard,
        tied_head=tied_head,
        link_keys=link_keys,
        draft=draft,
    )


__all__ = [
    "BOUNDARY_COMPRESSIONS",
    "ServeSpec",
    "boundary_codec",
    "fixed_bits",
    "parse_serve_spec",
    "serve_spec",
]
