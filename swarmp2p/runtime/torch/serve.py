"""A stage server: one stage of a serving ring, with a cache per session.

It reads ring messages (``swarmp2p.serve.protocol``) from the link before it, runs its blocks
on the session's cache (prefill, then one token per decode step), and sends the hidden state
on, through the boundary's compression, to the link after it (a trained learned bottleneck:
the receive half runs on what arrives, the send half on what leaves, so only the k-dim code
crosses, as its codes when ``send_codes``). The last stage samples the next
token, so only a token id goes back to the session manager. Sessions interleave freely: while
one session's step runs on stage 1, stage 0 runs another's. Decode steps are not batched
across sessions (each step is its own forward).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from swarmp2p.net import Link, LinkTimeout
from swarmp2p.runtime.torch.boundary import to_frame
from swarmp2p.runtime.torch.sampling import new_generator, sample_token
from swarmp2p.runtime.torch.stage import Stage, StageCache
from swarmp2p.serve.protocol import RingMessage, SamplingParams
from swarmp2p.serve.spec import boundary_codec, fixed_bits
from swarmp2p.wire import CODECS, TensorFrame, WireError, decode_tensor, encode_tensor

POLL_S = 0.1
"""How often an idle server looks at its stop event."""
SESSION_IDLE_S = 300.0
"""A full stage evicts a session idle this long to admit a new one."""


def fake_quantize_per_token(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The fixed_intN boundary in the graph: per-token scale ``max|x| / qmax``, round half to
    even, clip; bit-identical to the wire's ``tokintN`` codec (``swarmp2p.wire.codec``)."""
    qmax = 2 ** (bits - 1) - 1
    x32 = x.float()
    if not torch.isfinite(x32).all():
        raise ValueError("cannot quantize a boundary hidden state holding inf or nan")
    scale = x32.abs().amax(dim=-1, keepdim=True) / qmax
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.clamp(torch.round(x32 / scale), -qmax, qmax) + 0.0
    return (codes * scale).to(x.dtype)


def apply_boundary(hidden: torch.Tensor, compression: str) -> torch.Tensor:
    """What the next stage receives when the boundary is applied in the graph."""
    bits = fixed_bits(compression)
    if bits is not None:
        return fake_quantize_per_token(hidden, bits)
    if compression == "fp16":
        return hidden.to(torch.float16).to(hidden.dtype)
    if compression == "none":
        return hidden
    raise ValueError(f"boundary compression {compression!r} cannot be served in the graph")


@dataclass(kw_only=True, slots=True)
class _Session:
    cache: StageCache
    params: SamplingParams | None
    generator: torch.Generator | None
    last_used: float


class SessionRefused(RuntimeError):
    """The stage cannot take this step (no room, context full, out of order)."""


class StageServer:
    """Serve one stage between two links. ``handle`` is the whole protocol for one message;
    ``serve_forever`` loops it until a stop event. A last stage computes its head for the last
    position only."""

    def __init__(
        self,
        stage: Stage,
        *,
        inbound: Link,
        outbound: Link,
        send_compression: str = "none",
        send_codes: bool = False,
        max_sessions: int = 16,
        max_context: int = 2048,
        send_timeout: float = 30.0,
        receiver: torch.nn.Module | None = None,
        sender: torch.nn.Module | None = None,
        send_codec: str = "none",
    ) -> None:
        if receiver is not None and stage.is_first_stage:
            raise ValueError(
                "receiver: the first stage reads token ids, it has no boundary before it"
            )
        if sender is not None and (stage.is_last_stage or send_compression != "none"):
            raise ValueError(
                "sender: a learned boundary's send half replaces send_compression "
                f"({send_compression!r}); the last stage sends no hidden state"
            )
        if send_codec != "none" and (sender is None or send_codec not in CODECS):
            raise ValueError(
                f"send_codec: {send_codec!r} goes with a sender, as one of the wire's codecs"
            )
        self.stage = stage
        self.inbound = inbound
        self.outbound = outbound
        self.receiver = receiver
        self.sender = sender
        self.send_compression = "none" if stage.is_last_stage else send_compression
        if sender is not None:
            # the sender's output crosses as its codes (exact, wire v2) or as plain floats
            self.codec = send_codec if send_codes else "none"
        else:
            self.codec = boundary_codec(self.send_compression, send_codes)
        self.max_sessions = max_sessions
        self.max_context = max_context
        self.send_timeout = send_timeout
        self.sessions: dict[int, _Session] = {}
        self.steps = 0
        self._dtype = next(
            (p.dtype for p in stage.parameters() if p.is_floating_point()), torch.float32
        )
        self._device = next((p.device for p in stage.parameters()), torch.device("cpu"))

    # -- the loop ------------------------------------------------------------------------------

    def serve_forever(self, stop: threading.Event, poll_s: float = POLL_S) -> None:
        """Handle messages until ``stop`` is set."""
        while not stop.is_set():
            try:
                parts = self.inbound.recv(poll_s)
            except LinkTimeout:
                continue
            for reply in self.handle(parts):
                try:
                    self.outbound.send(reply, timeout=self.send_timeout)
                except LinkTimeout as e:  # the next stage is gone: its sessions time out at
                    # the manager, which re-places it; this stage keeps serving the rest
                    print(f"stage {self.stage.layer_start}: dropped a reply: {e}", file=sys.stderr)

    def handle(self, parts: list) -> list[list]:
        """The messages to send on after receiving ``parts`` (none, or one)."""
        try:
            msg = RingMessage.decode(parts[0])
        except (WireError, IndexError) as e:
            print(
                f"stage {self.stage.layer_start}: dropped a malformed message: {e}", file=sys.stderr
            )
            return []
        if msg.op == "error":
            self.sessions.pop(msg.sid, None)
            return [[msg.encode()]]  # on to the manager, which fails the request
        if msg.op == "end":
            self.sessions.pop(msg.sid, None)
            return [] if self.stage.is_last_stage else [[msg.encode()]]
        if msg.op == "token":
            return self._error(msg.sid, "a stage received a token message; the ring is miswired")
        try:
            return [self._step(msg, parts[1:])]
        except (SessionRefused, WireError, ValueError) as e:
            return self._error(msg.sid, str(e))
        except Exception as e:  # a failing forward ends the session, never the server
            return self._error(msg.sid, f"{type(e).__name__}: {e}")

    def _error(self, sid: int, message: str) -> list[list]:
        self.sessions.pop(sid, None)
        where = f"stage [{self.stage.layer_start}, {self.stage.layer_end})"
        return [[RingMessage(op="error", sid=sid, message=f"{where}: {message}").encode()]]

    # -- one step --------------------------------------------------------------------------------

    def _session(self, msg: RingMessage) -> _Session:
        if msg.op == "prefill":
            self.sessions.pop(msg.sid, None)
            if len(self.sessions) >= self.max_sessions:
                self._evict_idle()
            if len(self.sessions) >= self.max_sessions:
                raise SessionRefused(
                    f"already holds {len(self.sessions)} sessions (max_sessions "
                    f"{self.max_sessions}); retry when one ends"
                )
            if msg.pos != 0:
                raise SessionRefused(f"a prefill starts at position 0, got pos {msg.pos}")
            params = msg.sampling if msg.sampling is not None else SamplingParams()
            session = _Session(
                cache=self.stage.new_cache(),
                params=params,
                generator=new_generator(params) if self.stage.is_last_stage else None,
                last_used=time.monotonic(),
            )
            self.sessions[msg.sid] = session
            return session
        session = self.sessions.get(msg.sid)
        if session is None:
            raise SessionRefused(f"session {msg.sid} is not open here (no prefill, or it ended)")
        if session.cache.seen_tokens != msg.pos:
            raise SessionRefused(
                f"session {msg.sid} step at position {msg.pos}, but the cache holds "
                f"{session.cache.seen_tokens} tokens (a message was lost)"
            )
        session.last_used = time.monotonic()
        return session

    def _evict_idle(self) -> None:
        """Drop the least recently used session if it has been idle past SESSION_IDLE_S (its
        manager went away without an ``end``)."""
        sid, session = min(self.sessions.items(), key=lambda item: item[1].last_used)
        if time.monotonic() - session.last_used > SESSION_IDLE_S:
            del self.sessions[sid]

    def _input(self, msg: RingMessage, payload: list) -> torch.Tensor:
        if self.stage.is_first_stage:
            if not msg.tokens:
                raise ValueError(f"{msg.op} for session {msg.sid} carries no token ids")
            return torch.tensor([msg.tokens], dtype=torch.long, device=self._device)
        if not payload:
            raise ValueError(f"{msg.op} for session {msg.sid} carries no hidden state")
        array = decode_tensor(TensorFrame.from_parts(payload))
        tensor = torch.from_numpy(np.array(array, copy=True))
        if tensor.dtype == torch.uint16:  # bfloat16 travels as its raw 16 bits
            tensor = tensor.view(torch.bfloat16)
        if tensor.dim() != 3 or tensor.shape[0] != 1:
            raise ValueError(f"hidden state of shape {tuple(tensor.shape)} is not [1, T, H]")
        return tensor.to(device=self._device, dtype=self._dtype)

    def _step(self, msg: RingMessage, payload: list) -> list:
        session = self._session(msg)
        x = self._input(msg, payload)
        length = x.shape[1]
        if session.cache.seen_tokens + length > self.max_context:
            self.sessions.pop(msg.sid, None)
            raise SessionRefused(
                f"session {msg.sid} would hold {session.cache.seen_tokens + length} tokens, "
                f"over max_context {self.max_context}"
            )
        with torch.inference_mode():
            if self.receiver is not None:  # a learned boundary's receive half: code -> hidden
                x = self.receiver(x)
            # the head over the last position only (generate's logits_to_keep=1): a long
            # prompt's prefill skips T-1 rows of the vocabulary-wide matmul
            out = self.stage(x, cache=session.cache, logits_to_keep=1)
            if self.stage.is_last_stage:
                token = sample_token(out[0, -1], session.params, session.generator)
            else:
                hidden = out
                if self.sender is not None:
                    hidden = self.sender(hidden)
                elif self.codec == "none":
                    hidden = apply_boundary(hidden, self.send_compression)
        self.steps += 1
        if self.stage.is_last_stage:
            return [RingMessage(op="token", sid=msg.sid, pos=msg.pos, token=token).encode()]
        forward = RingMessage(op=msg.op, sid=msg.sid, pos=msg.pos, sampling=msg.sampling)
        return [forward.encode(), *self._frame(hidden).to_parts()]

    def _frame(self, hidden: torch.Tensor) -> TensorFrame:
        hidden = hidden.detach().cpu().contiguous()
        if self.sender is not None:
            return to_frame(hidden, self.codec)  # codes only where they decode exactly
        if self.codec != "none":
            return encode_tensor(hidden.float().numpy(), self.codec)
        if hidden.dtype == torch.bfloat16:
            return encode_tensor(hidden.view(torch.uint16).numpy(), dtype="bfloat16")
        return encode_tensor(hidden.numpy())
