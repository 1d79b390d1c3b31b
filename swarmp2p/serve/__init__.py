"""Serving: the ring protocol, the session manager, text, and the OpenAI-compatible HTTP API.

A light package: it never imports torch (stage servers live in ``swarmp2p.runtime.torch``).
"""

from swarmp2p.serve.protocol import GREEDY, RingMessage, SamplingParams
from swarmp2p.serve.sessions import GenerationError, RingBusy, RingClient, Session
from swarmp2p.serve.spec import BOUNDARY_COMPRESSIONS, StageServeSpec, boundary_codec

__all__ = [
    "BOUNDARY_COMPRESSIONS",
    "GREEDY",
    "GenerationError",
    "RingBusy",
    "RingClient",
    "RingMessage",
    "SamplingParams",
    "Session",
    "StageServeSpec",
    "boundary_codec",
]
