"""Data links between stages: send and receive multipart messages (TensorFrames) in order.

A :class:`Link` is synchronous (stage workers run it from their own thread) and carries lists
of buffers; a TensorFrame goes over it as ``link.send(frame.to_parts())`` and comes back as
``TensorFrame.from_parts(link.recv(timeout))``. :class:`ZmqLink` is the direct stage-to-stage
link: a DEALER pair over TCP, CURVE-authenticated and encrypted, reconnecting by itself, with
bounded queues (high-water marks) and ``zmq.MAXMSGSIZE`` on every part. Messages in flight
when a connection drops may be lost; the runtime's step/micro ids detect that.
:class:`InProcLink` is the same contract inside one process, for tests.

A link is used from one thread at a time (ZeroMQ sockets are not thread-safe). The bind side
expects one dialer: were two members to dial it, its sends would alternate between them.
"""

from __future__ import annotations

import abc
import queue
import time
from collections.abc import Mapping, Sequence

import zmq
from zmq.utils.garbage import gc as _zmq_gc

from swarmp2p.net.auth import (
    ClientCredentials,
    ClientKeys,
    KeyCheck,
    ServerCredentials,
    ServerKeys,
    make_client_socket,
    make_server_socket,
)
from swarmp2p.net.security import check_public_key
from swarmp2p.timings import TIMINGS

Buffer = bytes | bytearray | memoryview

DATA_MAX_PART_BYTES = 2**31
"""Largest single part a data link accepts (2 GiB); a larger one drops the connection."""
DATA_HWM = 64
"""Messages queued per direction before ``send`` blocks."""


class LinkTimeout(TimeoutError):
    """Nothing arrived (or could be queued) within the timeout."""


class LinkClosed(ConnectionError):
    """The link was closed."""


class Link(abc.ABC):
    """Ordered, reliable-while-connected delivery of multipart messages to one peer."""

    bytes_sent: int
    bytes_received: int

    @abc.abstractmethod
    def send(self, parts: Sequence[Buffer], timeout: float | None = None) -> None:
        """Queue one multipart message; LinkTimeout if the queue stays full past ``timeout``.

        Large buffers are handed over without copying: do not modify one after sending it.
        """

    @abc.abstractmethod
    def recv(self, timeout: float) -> list[memoryview]:
        """The next message's parts; LinkTimeout when none arrives within ``timeout`` s."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the link; idempotent. Later send/recv raise LinkClosed."""

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nbytes(parts: Sequence[Buffer]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def _ms(timeout: float | None) -> int:
    return -1 if timeout is None else max(0, int(timeout * 1000))


class ZmqLink(Link):
    """A CURVE DEALER<->DEALER link; make one with :meth:`bind` or :meth:`dial`."""

    def __init__(self, sock: zmq.Socket, endpoint: str, port: int) -> None:
        self._sock: zmq.Socket | None = sock
        self.endpoint = endpoint
        self.port = port
        self.bytes_sent = 0
        self.bytes_received = 0

    @staticmethod
    def _tune(sock: zmq.Socket, hwm: int) -> None:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.RECONNECT_IVL, TIMINGS.zmq_reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, TIMINGS.zmq_reconnect_ivl_max_ms)

    @classmethod
    def bind(
        cls,
        ctx: zmq.Context,
        secret: ServerCredentials,
        host: str,
        port: int = 0,
        *,
        secure: bool = True,
        hwm: int = DATA_HWM,
        max_part_bytes: int = DATA_MAX_PART_BYTES,
    ) -> ZmqLink:
        """Listen on ``tcp://host:port`` (0: random port, see ``.port``) for the one peer.

        ``ctx`` must be a :class:`~swarmp2p.net.SecureContext` (ZAP). ``secure=False`` turns
        CURVE off and exists only for benchmarks.
        """
        sock = make_server_socket(
            ctx, zmq.DEALER, secret, max_message_bytes=max_part_bytes, secure=secure
        )
        try:
            cls._tune(sock, hwm)
            if port == 0:
                port = sock.bind_to_random_port(f"tcp://{host}")
            else:
                sock.bind(f"tcp://{host}:{port}")
        except BaseException:
            sock.close(0)
            raise
        return cls(sock, f"tcp://{host}:{port}", port)

    @classmethod
    def dial(
        cls,
        ctx: zmq.Context,
        secret: ClientCredentials,
        endpoint: str,
        *,
        secure: bool = True,
        hwm: int = DATA_HWM,
        max_part_bytes: int = DATA_MAX_PART_BYTES,
    ) -> ZmqLink:
        """Connect to a peer's bound link; reconnects by itself if the connection drops."""
        sock = make_client_socket(
            ctx, zmq.DEALER, secret, max_message_bytes=max_part_bytes, secure=secure
        )
        try:
            cls._tune(sock, hwm)
            sock.connect(endpoint)
        except BaseException:
            sock.close(0)
            raise
        tail = endpoint.rsplit(":", 1)[-1]
        return cls(sock, endpoint, int(tail) if tail.isdigit() else 0)

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            raise LinkClosed(f"link {self.endpoint} is closed")
        return self._sock

    def send(self, parts: Sequence[Buffer], timeout: float | None = None) -> None:
        sock = self._socket()
        if not parts:
            raise ValueError("a link message has at least one part")
        sock.setsockopt(zmq.SNDTIMEO, _ms(timeout))
        try:
            sock.send_multipart(parts, copy=False)
        except zmq.Again:
            raise LinkTimeout(
                f"link {self.endpoint}: could not queue a message within {timeout:g} s "
                "(peer not connected or not reading)"
            ) from None
        self.bytes_sent += _nbytes(parts)

    def recv(self, timeout: float) -> list[memoryview]:
        sock = self._socket()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # POLLIN means a message *may* be there: seen right after a connect, then a blocking
            # recv that never returned (a reader that could not stop); so the recv never blocks
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if sock.poll(_ms(left), zmq.POLLIN):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    time.sleep(0.001)
            if deadline is not None and time.monotonic() >= deadline:
                raise LinkTimeout(f"link {self.endpoint}: nothing received within {timeout:g} s")
        parts = [f.buffer for f in frames]
        self.bytes_received += _nbytes(parts)
        return parts

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close(0)


class InProcLink(Link):
    """One end of an in-process link (a pair of queues); :meth:`pair` makes both ends."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue) -> None:
        self._inbox = inbox
        self._outbox = outbox
        self._closed = False
        self.bytes_sent = 0
        self.bytes_received = 0

    @classmethod
    def pair(cls, hwm: int = DATA_HWM) -> tuple[InProcLink, InProcLink]:
        a: queue.Queue = queue.Queue(hwm)
        b: queue.Queue = queue.Queue(hwm)
        return cls(a, b), cls(b, a)

    def _check(self) -> None:
        if self._closed:
            raise LinkClosed("in-process link is closed")

    def send(self, parts: Sequence[Buffer], timeout: float | None = None) -> None:
        self._check()
        if not parts:
            raise ValueError("a link message has at least one part")
        # a snapshot, as a network link delivers: later writes to the sender's buffers don't leak
        message = [memoryview(bytes(memoryview(p))) for p in parts]
        try:
            self._outbox.put(message, timeout=timeout)
        except queue.Full:
            raise LinkTimeout(f"in-process link: queue full for {timeout:g} s") from None
        self.bytes_sent += _nbytes(message)

    def recv(self, timeout: float) -> list[memoryview]:
        self._check()
        try:
            message = self._inbox.get(timeout=max(0.0, timeout))
        except queue.Empty:
            raise LinkTimeout(f"in-process link: nothing received within {timeout:g} s") from None
        self.bytes_received += _nbytes(message)
        return message

    def close(self) -> None:
        self._closed = True


def link_credentials(keys: Mapping[str, str]) -> tuple[ServerKeys, ClientKeys | None]:
    """The bound and the dialling side's credentials of a stage worker from its node's key
    pair and its neighbours' public keys (``{"public", "secret", "prev", "next"}``): the bound
    link admits only the stage before's node, the dialled one must be the next stage's node."""
    try:
        public, secret = keys["public"], keys["secret"]
        prev, nxt = keys.get("prev", ""), keys.get("next", "")
    except (KeyError, TypeError):
        raise ValueError("link keys need 'public' and 'secret'") from None
    for name, key in (("public", public), ("prev", prev), ("next", nxt)):
        if key:
            check_public_key(key, f"link key {name!r}")
    server = ServerKeys(
        public=public,
        secret=secret,
        admits=KeyCheck.only(prev) if prev else KeyCheck(lambda k: False),
        domain=f"swarmp2p-link-{prev or 'nobody'}",
    )
    client = ClientKeys(public=public, secret=secret, server=nxt) if nxt else None
    return server, client


def stop_zero_copy_collector(timeout: float = 2.0) -> bool:
    """Stop pyzmq's zero-copy garbage-collector thread once no sent buffer is still in use.

    ``send`` hands large buffers to libzmq without copying; pyzmq then starts one
    process-wide thread that releases them when libzmq is done. It restarts by itself on
    the next large send. Call this after closing every link (test teardown, worker exit);
    returns False, leaving it running, if buffers are still held after ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    while _zmq_gc.refs:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    _zmq_gc.stop()
    return True
