"""Serving, planned like training (``planner``: ``plan_serve`` and its rules) over the records
``swarm serve`` asks and the planner answers (``records``). Pure, standard library only."""

from swarmp2p.plan.serve.planner import (
    BOUNDARY_COMPRESSIONS,
    NAME_PATTERN,
    PREFIX_CACHE_MB,
    SERVE_SPLIT,
    ServeInputs,
    ServePlan,
    ServeRequest,
    ServeStagePlan,
    boundary_codec,
    fixed_bits,
    parse_serve_request,
    plan_serve,
)

__all__ = [
    "BOUNDARY_COMPRESSIONS",
    "NAME_PATTERN",
    "PREFIX_CACHE_MB",
    "SERVE_SPLIT",
    "ServeInputs",
    "ServePlan",
    "ServeRequest",
    "ServeStagePlan",
    "boundary_codec",
    "fixed_bits",
    "parse_serve_request",
    "plan_serve",
]
