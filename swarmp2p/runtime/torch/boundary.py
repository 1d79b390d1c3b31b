"""The pipeline boundary: a ``torch.autograd.Function`` over a channel to the next stage.

Forward sends the stage's payload (with the labels, which travel forward to the last stage);
backward receives the next stage's reply (the loss and the gradient of the payload) and returns
the gradient. Every frame carries (step, micro); a reply for another (step, micro) raises
``StaleReply`` rather than applying a stale gradient.

A ``Channel`` speaks this protocol over any link with ``send(frames)`` / ``recv(timeout)``:
a message is a list of byte frames, a JSON header then one raw frame per tensor. A quantized
payload (intN / tokintN) crosses as its codes plus float32 scale(s), after the sender checks the
round trip is exact; if it ever were not, the plain floats go instead (reference, "What a
distributed job sends").
"""

from __future__ import annotations

import json
import queue
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from swarmp2p.runtime.torch.compression import dequantize, quantize

ACT, GRAD, CONTROL = "act", "grad", "control"
"""Message kinds: an activation (upstream to downstream), a reply (back), a control message."""

DEFAULT_LINK_TIMEOUT_S = 60.0
"""How long a stage waits for its neighbour before it gives up with ``LinkTimeout``."""

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class BoundaryError(RuntimeError):
    """A boundary protocol failure."""


class StaleReply(BoundaryError):
    """A message arrived for another (step, micro) or of another kind than the one awaited."""


class LinkTimeout(BoundaryError):
    """The neighbour said nothing within the link timeout."""


class Link(Protocol):
    """What a channel needs of a link (``swarmp2p.net`` links satisfy it)."""

    def send(self, frames: list[bytes]) -> None: ...

    def recv(self, timeout: float) -> list[bytes]: ...


class _QueueLink:
    """One end of an in-process link pair (two queues)."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue) -> None:
        self._inbox, self._outbox = inbox, outbox
        self.sent_bytes = 0
        self.received_bytes = 0

    def send(self, frames: list[bytes]) -> None:
        frames = [bytes(f) for f in frames]
        self.sent_bytes += sum(len(f) for f in frames)
        self._outbox.put(frames)

    def recv(self, timeout: float) -> list[bytes]:
        try:
            frames = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise LinkTimeout(f"no message from the neighbour within {timeout:g} s") from None
        self.received_bytes += sum(len(f) for f in frames)
        return frames

    def close(self) -> None:
        pass


def local_link_pair() -> tuple[_QueueLink, _QueueLink]:
    """Two connected in-process link ends (for stages run as threads of one process)."""
    a, b = queue.Queue(), queue.Queue()
    return _QueueLink(a, b), _QueueLink(b, a)


def _tensor_meta(t: torch.Tensor) -> dict[str, Any]:
    if t.dtype not in _DTYPE_NAMES:
        raise TypeError(f"cannot send a tensor of dtype {t.dtype}")
    return {"shape": list(t.shape), "dtype": _DTYPE_NAMES[t.dtype]}


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def _tensor_from(meta: dict[str, Any], raw: bytes) -> torch.Tensor:
    dtype = _DTYPES.get(meta.get("dtype"))
    shape = meta.get("shape")
    if dtype is None or not isinstance(shape, list):
        raise BoundaryError(f"bad tensor header {meta!r}")
    numel = 1
    for n in shape:
        if not isinstance(n, int) or n < 0:
            raise BoundaryError(f"bad tensor shape {shape!r}")
        numel *= n
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(raw) != numel * itemsize:
        raise BoundaryError(
            f"tensor frame holds {len(raw)} bytes, header {shape} {meta['dtype']} needs "
            f"{numel * itemsize}"
        )
    if dtype == torch.bfloat16:
        flat = torch.frombuffer(bytearray(raw), dtype=torch.int16).view(torch.bfloat16)
    elif numel == 0:
        flat = torch.empty(0, dtype=dtype)
    else:
        flat = torch.frombuffer(bytearray(raw), dtype=dtype)
    return flat.reshape(shape)


def encode_payload(payload: torch.Tensor, codec: str) -> tuple[dict[str, Any], list[bytes]]:
    """The header entry and frames for one payload, quantized losslessly when ``codec`` allows."""
    meta = _tensor_meta(payload)
    if codec.startswith(("int", "tokint")) and payload.dtype == torch.float32:
        per_token = codec.startswith("tokint")
        bits = int(codec.removeprefix("tok").removeprefix("int"))
        codes, scale = quantize(payload, bits, per_token=per_token)
        if torch.equal(dequantize(codes, scale), payload.detach()):
            meta["codec"] = codec
            return meta, [_tensor_bytes(codes.to(torch.int8)), _tensor_bytes(scale)]
    if codec == "fp16" and payload.dtype == torch.float32:
        half = payload.detach().to(torch.float16)
        if torch.equal(half.to(torch.float32), payload.detach()):
            meta["codec"] = "fp16"
            return meta, [_tensor_bytes(half)]
    meta["codec"] = "none"
    return meta, [_tensor_bytes(payload)]


def decode_payload(meta: dict[str, Any], frames: list[bytes]) -> torch.Tensor:
    """Inverse of ``encode_payload``."""
    codec = meta.get("codec", "none")
    shape = meta.get("shape")
    if codec == "none":
        (raw,) = frames
        return _tensor_from(meta, raw)
    if codec == "fp16":
        (raw,) = frames
        return _tensor_from({"shape": shape, "dtype": "float16"}, raw).to(torch.float32)
    if codec.startswith(("int", "tokint")):
        raw_codes, raw_scale = frames
        codes = _tensor_from({"shape": shape, "dtype": "int8"}, raw_codes)
        scale_shape = [*shape[:-1], 1] if codec.startswith("tokint") else []
        scale = _tensor_from({"shape": scale_shape, "dtype": "float32"}, raw_scale)
        return dequantize(codes, scale)
    raise BoundaryError(f"unknown payload codec {codec!r}")


def _frames_per(meta: dict[str, Any]) -> int:
    codec = meta.get("codec", "none")
    return 2 if codec.startswith(("int", "tokint")) else 1


@dataclass
class Channel:
    """The boundary protocol over one link to a neighbour stage.

    Counts the bytes it sends of each kind (``sent_bytes[ACT]``, ``sent_bytes[GRAD]``, ...).
    """

    link: Any
    timeout: float = DEFAULT_LINK_TIMEOUT_S
    sent_bytes: dict[str, int] = field(default_factory=lambda: {ACT: 0, GRAD: 0, CONTROL: 0})

    def _send(self, header: dict[str, Any], payloads: list[tuple[torch.Tensor, str]]) -> None:
        metas, frames = [], []
        for tensor, codec in payloads:
            meta, raw = encode_payload(tensor, codec)
            metas.append(meta)
            frames.extend(raw)
        header = {**header, "tensors": metas}
        message = [json.dumps(header).encode(), *frames]
        self.sent_bytes[header["kind"]] += sum(len(f) for f in message)
        self.link.send(message)

    def _recv(self, kind: str, step: int | None, micro: int | None) -> tuple[dict, list]:
        message = self.link.recv(self.timeout)
        if not message:
            raise BoundaryError("empty message on the boundary link")
        try:
            header = json.loads(message[0])
        except ValueError as exc:
            raise BoundaryError(f"bad boundary message header: {exc}") from None
        if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
            raise BoundaryError(f"bad boundary message header {header!r}")
        got = (header.get("kind"), header.get("step"), header.get("micro"))
        want = (kind, step, micro)
        if header.get("kind") != kind or (step is not None and got[1:] != want[1:]):
            raise StaleReply(
                f"expected {kind} for (step {step}, micro {micro}), got {got[0]} for "
                f"(step {got[1]}, micro {got[2]}); the stages are out of step"
            )
        tensors, at = [], 1
        for meta in header["tensors"]:
            n = _frames_per(meta)
            if at + n > len(message):
                raise BoundaryError("boundary message has fewer frames than its header lists")
            tensors.append(decode_payload(meta, message[at : at + n]))
            at += n
        if at != len(message):
            raise BoundaryError(f"boundary message has {len(message) - at} trailing frame(s)")
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
        ctx.shape, ctx.dtype = payload.shape, payload.dtype
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
        return grad.to(ctx.dtype), None


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
