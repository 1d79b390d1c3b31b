"""Serving: the ring protocol, the session manager, text, and the OpenAI-compatible HTTP API.

A light package: it never imports torch (stage servers live in ``swarmp2p.runtime.torch``).
"""

from swarmp2p.serve.api import API_KEY_ENV, ApiServer, build_app, check_bind
from swarmp2p.serve.local import LocalRing, WorkerFailed, even_bounds, local_serve_plan, serve_local
from swarmp2p.serve.metrics import ServeMetrics
from swarmp2p.serve.protocol import (
    GREEDY,
    Decode,
    End,
    Failed,
    Prefill,
    RingMessage,
    SamplingParams,
    TokenLogprobs,
    Tokens,
    decode_message,
)
from swarmp2p.serve.request import ApiError, GenerationRequest, ServedModel, parse_request
from swarmp2p.serve.ring import RingEnds, build_ring
from swarmp2p.serve.scheduler import Outcome, Scheduler, SessionState, next_stage_work
from swarmp2p.serve.session import GenerationError, RingBusy, Session
from swarmp2p.serve.sessions import RingClient
from swarmp2p.serve.spec import (
    BOUNDARY_COMPRESSIONS,
    ServeSpec,
    boundary_codec,
    parse_serve_spec,
    serve_spec,
)
from swarmp2p.serve.text import TextCodec, TextStream

__all__ = [
    "API_KEY_ENV",
    "BOUNDARY_COMPRESSIONS",
    "GREEDY",
    "ApiError",
    "ApiServer",
    "Decode",
    "End",
    "Failed",
    "GenerationError",
    "GenerationRequest",
    "LocalRing",
    "Outcome",
    "Prefill",
    "RingBusy",
    "RingClient",
    "RingEnds",
    "RingMessage",
    "SamplingParams",
    "Scheduler",
    "ServeMetrics",
    "ServeSpec",
    "ServedModel",
    "Session",
    "SessionState",
    "TextCodec",
    "TextStream",
    "TokenLogprobs",
    "Tokens",
    "WorkerFailed",
    "boundary_codec",
    "build_app",
    "build_ring",
    "check_bind",
    "decode_message",
    "even_bounds",
    "local_serve_plan",
    "next_stage_work",
    "parse_request",
    "parse_serve_spec",
    "serve_local",
    "serve_spec",
]
