"""The pipeline boundary: a ``torch.autograd.Function`` over a channel to the next stage.

Forward sends the stage's payload (with the labels, which travel forward to the last stage);
backward receives the next stage's reply (the loss and the gradient of the payload) and returns
the gradient. Every frame carries (step, micro); a reply for another (step, micro) raises
``StaleReply`` rather than applying a stale gradient.

A ``Channel`` speaks this protocol over any ``swarmp2p.net`` link (``send(parts, timeout)`` /
``recv(timeout)``): a message is a JSON header (kind, step, micro, parts per tensor) then each
tensor as a wire ``TensorFrame``. A quantized payload (intN / tokintN / fp16) crosses as its
codes (wire v2, ``encode_tensor(exact=True)``), which decode to exactly the floats training
computed; if a round trip were ever not exact, the plain floats go instead (reference, "What a
distributed job sends").

Off a card, a tensor is copied into pinned host memory on the channel's own CUDA stream (one
per channel: each channel sends one direction, activations forward or gradients back), so the
copy runs at the pinned rate beside the compute stream's next kernels instead of queued behind
them; the send waits for that copy alone. No copy and no stream on the CPU: the bytes sent are
the same. A gradient comes back on the device and in the dtype of the payload it is for.

A stage that fails sends its neighbours an ``abort`` control message (best effort); whatever a
neighbour was waiting for, receiving it raises ``PipelineAborted`` naming the stage, the step and
the reason, so the whole pipeline stops at once instead of after the link timeout.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from swarmp2p.codec_layout import sent_codec
from swarmp2p.serve.spec import fixed_bits
from swarmp2p.timings import TIMINGS
from swarmp2p.timings.workers import WORKER_TIMINGS
from swarmp2p.wire import DTYPES, TensorFrame, decode_tensor, encode_tensor

ACT, GRAD, CONTROL = "act", "grad", "control"
"""Message kinds: an activation (upstream to downstream), a reply (back), a control message."""

ABORT = "abort"
"""The control message a failing stage sends its neighbours."""


class BoundaryError(RuntimeError):
    """A boundary protocol failure."""


class StaleReply(BoundaryError):
    """A message arrived for another (step, micro) or of another kind than the one awaited."""


class LinkTimeout(BoundaryError, TimeoutError):
    """The neighbour said nothing within the link timeout."""


class PipelineAborted(BoundaryError):
    """Another stage failed and said so; ``channel`` is the link the word came over."""

    def __init__(self, *, stage: int | None, step: int | None, reason: str, channel: Any) -> None:
        self.stage, self.step, self.reason, self.channel = stage, step, reason, channel
        where = "" if step is None else f" at step {step}"
        super().__init__(f"stage {stage} failed{where}: {reason}")

    @property
    def event_fields(self) -> dict[str, Any]:
        """What the worker's ``error`` event carries besides the message."""
        return {"failed_stage": self.stage, "step": self.step, "reason": self.reason}


def to_frame(
    tensor: torch.Tensor, codec: str = "none", *, step: int = 0, micro: int = 0
) -> TensorFrame:
    """A tensor as a wire TensorFrame; a quantizing ``codec`` is used only if lossless (wire v2:
    the peer decodes exactly ``tensor``), else the plain floats go. Only a float32 tensor takes
    a codec (``swarmp2p.codec_layout.sent_codec``, the rule the planner prices with)."""
    t = tensor.detach().to("cpu").contiguous()
    codec = sent_codec(codec, str(t.dtype).removeprefix("torch."))
    if t.dtype == torch.bfloat16:
        return encode_tensor(
            t.view(torch.int16).numpy().view(np.uint16), dtype="bfloat16", step=step, micro=micro
        )
    if t.dtype not in _WIRE_DTYPES:
        raise TypeError(f"cannot send a tensor of dtype {t.dtype}; the wire takes {sorted(DTYPES)}")
    return encode_tensor(t.numpy(), codec, exact=True, step=step, micro=micro)


def from_frame(frame: TensorFrame) -> torch.Tensor:
    """The tensor a TensorFrame carries (a fresh, writable copy)."""
    try:
        arr = decode_tensor(frame)
    except ValueError as exc:  # WireError is a ValueError
        raise BoundaryError(f"bad tensor frame: {exc}") from None
    if frame.dtype == "bfloat16":
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(arr, copy=True))


class HostCopy:
    """Tensors as host memory for the wire: the CPU's as they are; a card's through pinned
    memory on this copier's own CUDA stream (one per device), waiting only for that copy."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            return tensor
        stream = self._streams.get(tensor.device)
        if stream is None:
            stream = self._streams[tensor.device] = torch.cuda.Stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the payload's producer
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # the allocator keeps its memory until the copy is done
        stream.synchronize()
        return host


_WIRE_DTYPES = {
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.int8,
    torch.bool,
}


@dataclass
class Channel:
    """The boundary protocol over one link to a neighbour stage.

    Counts the bytes it sends of each kind (``sent_bytes[ACT]``, ``sent_bytes[GRAD]``, ...) and
    the seconds spent blocked on the link (``wait_s``: waiting for the neighbour, not computing).
    """

    link: Any
    timeout: float = TIMINGS.link_timeout_s
    sent_bytes: dict[str, int] = field(default_factory=lambda: {ACT: 0, GRAD: 0, CONTROL: 0})
    wait_s: float = 0.0
    host_copy: HostCopy = field(default_factory=HostCopy)

    def _send(self, header: dict[str, Any], payloads: list[tuple[torch.Tensor, str]]) -> None:
        step, micro = header.get("step") or 0, header.get("micro") or 0
        counts, parts = [], []
        for tensor, codec in payloads:
            host = self.host_copy(tensor)
            frame_parts = to_frame(host, codec, step=step, micro=micro).to_parts()
            counts.append(len(frame_parts))
            parts.extend(frame_parts)
        message = [json.dumps({**header, "tensors": counts}).encode(), *parts]
        self.sent_bytes[header["kind"]] += sum(memoryview(p).nbytes for p in message)
        started = time.perf_counter()
        try:
            self.link.send(message, timeout=self.timeout)
        except TimeoutError as exc:
            raise LinkTimeout(
                f"could not send to the neighbour within {self.timeout:g} s: {exc}"
            ) from None
        finally:
            self.wait_s += time.perf_counter() - started

    def _recv(self, kind: str, step: int | None, micro: int | None) -> tuple[dict, list]:
        started = time.perf_counter()
        try:
            message = self.link.recv(self.timeout)
        except TimeoutError:
            raise LinkTimeout(
                f"no message from the neighbour within {self.timeout:g} s (waiting for {kind}"
                + ("" if step is None else f" of step {step}, micro {micro}")
                + "); is it alive?"
            ) from None
        finally:
            self.wait_s += time.perf_counter() - started
        if not message:
            raise BoundaryError("empty message on the boundary link")
        try:
            header = json.loads(bytes(message[0]))
        except ValueError as exc:
            raise BoundaryError(f"bad boundary message header: {exc}") from None
        counts = header.get("tensors") if isinstance(header, dict) else None
        if not isinstance(counts, list) or not all(isinstance(c, int) and c >= 1 for c in counts):
            raise BoundaryError(f"bad boundary message header {header!r}")
        if header.get("kind") == CONTROL and header.get("name") == ABORT:
            stage, step = header.get("failed_stage"), header.get("step")
            raise PipelineAborted(
                stage=stage if isinstance(stage, int) else None,
                step=step if isinstance(step, int) else None,
                reason=str(header.get("reason")),
                channel=self,
            )
        got = (header.get("kind"), header.get("step"), header.get("micro"))
        want = (kind, step, micro)
        if header.get("kind") != kind or (step is not None and got[1:] != want[1:]):
            raise StaleReply(
                f"expected {kind} for (step {step}, micro {micro}), got {got[0]} for "
                f"(step {got[1]}, micro {got[2]}); the stages are out of step"
            )
        if sum(counts) != len(message) - 1:
            raise BoundaryError(
                f"boundary message has {len(message) - 1} tensor parts, its header lists {sum(counts)}"
            )
        tensors, at = [], 1
        for n in counts:
            try:
                frame = TensorFrame.from_parts(message[at : at + n])
            except ValueError as exc:
                raise BoundaryError(f"bad tensor frame: {exc}") from None
            if step is not None and (frame.step, frame.micro) != (step, micro):
                raise StaleReply(
                    f"tensor frame of (step {frame.step}, micro {frame.micro}) in a message for "
                    f"(step {step}, micro {micro})"
                )
            tensors.append(from_frame(frame))
            at += n
        return header, tensors

    def send_activation(
        self,
        step: int,
        micro: int,
        payload: torch.Tensor,
        labels: torch.Tensor,
        codec: str = "none",
    ) -> None:
        """Send a micro-batch's payload and labels to the next stage."""
        header = {"kind": ACT, "step": step, "micro": micro}
        self._send(header, [(payload, codec), (labels, "none")])

    def recv_activation(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The payload and labels of (step, micro) from the stage before."""
        _, (payload, labels) = self._recv(ACT, step, micro)
        return payload, labels

    def send_reply(self, step: int, micro: int, grad: torch.Tensor | None, loss: float) -> None:
        """Answer the stage before: the loss and the gradient of what it sent (None: no grad)."""
        header = {"kind": GRAD, "step": step, "micro": micro, "loss": float(loss)}
        self._send(header, [] if grad is None else [(grad, "none")])

    def recv_reply(self, step: int, micro: int) -> tuple[torch.Tensor | None, float]:
        """The next stage's reply to (step, micro): gradient (or None) and loss."""
        header, tensors = self._recv(GRAD, step, micro)
        loss = header.get("loss")
        if not isinstance(loss, (int, float)) or len(tensors) > 1:
            raise BoundaryError(f"bad reply header {header!r}")
        return (tensors[0] if tensors else None), float(loss)

    def send_control(self, name: str, tensors: list[torch.Tensor] = (), **fields: Any) -> None:
        """A named control message (calibration frames, evaluation numbers)."""
        header = {"kind": CONTROL, "step": None, "micro": None, "name": name, **fields}
        self._send(header, [(t, "none") for t in tensors])

    def send_abort(self, *, stage: int | None, step: int | None, reason: str) -> None:
        """Tell the neighbour this pipeline stops (best effort: it may be gone already)."""
        old, self.timeout = self.timeout, min(self.timeout, WORKER_TIMINGS.abort_send_s)
        try:
            self.send_control(ABORT, failed_stage=stage, step=step, reason=reason)
            time.sleep(WORKER_TIMINGS.abort_flush_s)  # the link drops queued messages on close
        except Exception:
            pass
        finally:
            self.timeout = old

    def recv_control(self, name: str) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The next control message, which must be ``name``."""
        return self.recv_control_any((name,))

    def recv_control_any(self, names: tuple[str, ...]) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The next control message, which must be one of ``names``."""
        header, tensors = self._recv(CONTROL, None, None)
        if header.get("name") not in names:
            want = " or ".join(repr(n) for n in names)
            raise StaleReply(f"expected control message {want}, got {header.get('name')!r}")
        return header, tensors


def print_cause(exc: BaseException) -> None:
    """The traceback of ``exc`` on stderr (the stage's log), once."""
    if getattr(exc, "cause_printed", False):
        return
    traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.flush()
    exc.cause_printed = True


def tell_neighbours(
    exc: BaseException, *, stage: int, step: int | None, prev: Channel | None, next: Channel | None
) -> None:
    """Send the neighbours an abort naming the failed stage, step and reason (once per error).

    A ``PipelineAborted`` is passed on away from the link it came over; an error with
    ``stage``/``step``/``reason`` attributes (``NonFiniteError``) names its own stage and step.
    """
    if getattr(exc, "neighbours_told", False):
        return
    exc.neighbours_told = True
    # the stage's log gets the cause first: once a neighbour reports the abort, the job may
    # fail and this worker be stopped before its exit would have printed it
    print_cause(exc)
    if all(hasattr(exc, k) for k in ("stage", "step", "reason")):  # its own stage and step
        stage, step, reason = exc.stage, exc.step, exc.reason
    else:
        reason = f"{type(exc).__name__}: {exc}"
    for channel in (prev, next):
        if channel is not None and channel is not getattr(exc, "channel", None):
            channel.send_abort(stage=stage, step=step, reason=reason)


@dataclass
class _Session:
    channel: Channel
    step: int
    micro: int
    labels: torch.Tensor
    codec: str
    loss: float | None = None
    received: bool = False

    def receive(self) -> torch.Tensor | None:
        if self.received:
            raise BoundaryError(f"reply for (step {self.step}, micro {self.micro}) taken twice")
        grad, self.loss = self.channel.recv_reply(self.step, self.micro)
        self.received = True
        return grad


class PipelineBoundary(torch.autograd.Function):
    """Forward sends the payload and labels; backward returns the reply's gradient."""

    @staticmethod
    def forward(ctx, payload: torch.Tensor, session: _Session) -> torch.Tensor:
        session.channel.send_activation(
            session.step, session.micro, payload, session.labels, session.codec
        )
        ctx.session = session
        ctx.shape, ctx.dtype, ctx.device = payload.shape, payload.dtype, payload.device
        return payload.new_zeros(())

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        session = ctx.session
        grad = session.receive()
        if grad is None:
            raise BoundaryError(
                f"the next stage sent no gradient for (step {session.step}, micro {session.micro})"
            )
        if tuple(grad.shape) != tuple(ctx.shape):
            raise BoundaryError(
                f"gradient shape {tuple(grad.shape)} != payload shape {tuple(ctx.shape)}"
            )
        # autograd refuses a gradient on another device than its input (the wire's is the CPU)
        return grad.to(device=ctx.device, dtype=ctx.dtype), None


class SentMicroBatch:
    """A micro-batch sent through the boundary; ``backward()`` waits for its reply."""

    def __init__(self, token: torch.Tensor, session: _Session) -> None:
        self._token, self._session = token, session

    @property
    def loss(self) -> float:
        """The loss the reply carried (after ``backward()``)."""
        if self._session.loss is None:
            raise BoundaryError("no reply received yet")
        return self._session.loss

    def backward(self) -> None:
        """Receive the reply and backpropagate its gradient into this stage."""
        if self._token.requires_grad:
            self._token.backward()
        else:  # nothing on this side needs a gradient; keep the protocol in step all the same
            self._session.receive()


def send_through(
    channel: Channel,
    payload: torch.Tensor,
    *,
    step: int,
    micro: int,
    labels: torch.Tensor,
    codec: str = "none",
) -> SentMicroBatch:
    """Send ``payload`` through the boundary as (step, micro); call ``backward()`` on the result
    when the schedule says so."""
    session = _Session(channel, step, micro, labels, codec)
    token = PipelineBoundary.apply(payload, session)
    return SentMicroBatch(token, session)


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
