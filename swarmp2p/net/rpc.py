"""Request/response control RPC over CURVE ROUTER/DEALER sockets (asyncio).

A node has one control port: an :class:`RpcServer` (ROUTER). Peers talk to it through an
:class:`RpcClient` (DEALER) that numbers its requests and pairs each reply with its request by
``id``. A request that is malformed, of an unknown type, of a newer protocol version or with a
bad field is answered with an :class:`~swarmp2p.wire.ErrorReply` (code from
:class:`~swarmp2p.wire.WireError`); a handler that raises :class:`RpcError` answers with its
code, any other exception with code ``"internal"``. Nothing a peer sends stops the loop.
A frame larger than ``MAX_MESSAGE_BYTES`` never reaches the loop: ``zmq.MAXMSGSIZE`` drops
the connection, and the sender's request times out. A :class:`~swarmp2p.net.guard.ConnectionGuard`
caps the server's live connections per source address (a flood of idle connections from one
host cannot take the daemon's file descriptors).

Small requests (heartbeats, votes, hellos: under ``LARGE_BYTES``) are decoded and handled as
they arrive. A large one waits in its sender's own queue: one sender's large requests are
decoded one at a time, off the event loop, within a byte budget per second
(:class:`ByteBudget`), and past ``MAX_QUEUED_LARGE`` waiting ones more are refused with code
"busy" unread. A burst of near-cap messages from one member so costs the loop a bounded share
and never delays another node's heartbeat behind it (issue 24: 40 messages of 4 MB made a
node look dead for 3 s).

The handler gets each request with its authenticated sender: the z85 public key ZAP admitted
for the connection it came on (the frame's ``User-Id`` property; "" on a socket without
CURVE). A server decides per request what that key may do (``node/daemon.py``), so a key
revoked after its handshake is refused from its next message on. The connection's source
address (the frame's ``Peer-Address``) is :data:`peer_address` while the handler runs: a
pairing port counts code guesses per address with it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import errno
import itertools
import logging
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from swarmp2p._tasks import cancel_all
from swarmp2p.errors import SwarmError, Unavailable
from swarmp2p.net.auth import (
    ClientCredentials,
    ClientKeys,
    ServerCredentials,
    make_client_socket,
    make_server_socket,
)
from swarmp2p.net.guard import MAX_PER_SOURCE, ConnectionGuard
from swarmp2p.timings import TIMINGS
from swarmp2p.wire.messages import MAX_MESSAGE_BYTES, ErrorReply, Message, WireError, decode, encode

log = logging.getLogger(__name__)

MAX_INFLIGHT_REQUESTS = 256
"""Requests an RpcServer handles at once; more are answered with code "busy"."""
LARGE_BYTES = 64 * 1024
"""A request of this many bytes or more is large: it waits its turn in its sender's queue."""
LARGE_BYTES_PER_S = 8 * 1024 * 1024
"""Bytes of large requests per second one sender gets read (a burst up to two at the cap)."""
MAX_QUEUED_LARGE = 8
"""Large requests one sender may have waiting; more are refused with code "busy" unread."""


class ByteBudget:
    """A token bucket of bytes (or of anything counted: the leader's submissions per node):
    ``rate`` per second, holding at most ``burst``."""

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate, self.burst, self._clock = rate, burst, clock
        self._tokens, self._at = burst, clock()

    def wait_s(self, n: int) -> float:
        """Seconds until ``n`` bytes (at most ``burst``) are in the bucket; 0: take them now
        (they are taken)."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        need = min(float(n), self.burst)
        if self._tokens >= need:
            self._tokens -= need
            return 0.0
        return (need - self._tokens) / self.rate


def peek_id(payload: bytes) -> int:
    """A request's ``id`` read from the first entries of its msgpack map without unpacking
    the rest (0 when it is not there): a refusal of an unread request still pairs."""
    import msgpack

    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(payload))
        unpacker.feed(payload)
        for _ in range(min(unpacker.read_map_header(), 4)):
            key = unpacker.unpack()
            if key == "id":
                value = unpacker.unpack()
                return value if type(value) is int and 0 <= value < 2**63 else 0
            unpacker.skip()
    except Exception:
        return 0
    return 0


Handler = Callable[[Message, str], Awaitable["Message | None"]]
"""``async handler(request, sender_key) -> reply`` (None: send no reply); ``sender_key`` is
the z85 public key the request was authenticated with."""

peer_address: contextvars.ContextVar[str] = contextvars.ContextVar("peer_address", default="")
"""The source IP address of the request a handler is answering ("" when unknown)."""


class RpcTimeout(Unavailable, TimeoutError):
    """No reply arrived in time (peer down, overloaded, or not in our swarm)."""

    default_code = "timeout"


class RpcError(SwarmError):
    """The peer answered with an ErrorReply; raise one in a handler to answer with one. Its
    ``code`` is one of ``swarmp2p.errors.CODES`` (or a wire error code)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail, code=code)
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}"

    @classmethod
    def from_reply(cls, reply: ErrorReply) -> RpcError:
        return cls(reply.code, reply.detail)


class AddressInUse(OSError):
    """A fixed port that another process still listened on after ``Timings.rpc_rebind_s`` of retries."""

    def __init__(self, port: int) -> None:
        super().__init__(errno.EADDRINUSE, f"port {port} is in use by another process")
        self.port = port


async def _bind(sock: zmq.asyncio.Socket, addr: str, port: int) -> None:
    deadline = time.monotonic() + TIMINGS.rpc_rebind_s
    while True:
        try:
            sock.bind(addr)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
            if time.monotonic() >= deadline:
                raise AddressInUse(port) from None
        await asyncio.sleep(0.05)


class RpcServer:
    """ROUTER on ``tcp://host:port`` (port 0: a random free port, see :attr:`port`)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        secret: ServerCredentials,
        host: str,
        port: int,
        handler: Handler,
        *,
        max_per_source: int = MAX_PER_SOURCE,
    ) -> None:
        self._ctx = ctx
        self._max_per_source = max_per_source
        self.guard: ConnectionGuard | None = None
        self._secret = secret
        self._host = host
        self._requested_port = port
        self._handler = handler
        self._sock: zmq.asyncio.Socket | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._large: dict[str, collections.deque[tuple[bytes, bytes]]] = {}
        """Sender -> its large requests waiting (identity, payload)."""
        self._budgets: dict[str, ByteBudget] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}
        self.port = 0
        self.endpoint = ""

    async def start(self) -> None:
        """Bind and start serving."""
        if self._sock is not None:
            raise RuntimeError("RpcServer already started")
        sock = make_server_socket(self._ctx, zmq.ROUTER, self._secret)
        try:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            if self._requested_port == 0:
                self.port = sock.bind_to_random_port(f"tcp://{self._host}")
            else:
                await _bind(
                    sock, f"tcp://{self._host}:{self._requested_port}", self._requested_port
                )
                self.port = self._requested_port
        except BaseException:
            sock.close(0)
            raise
        self._sock = sock
        self.endpoint = f"tcp://{self._host}:{self.port}"
        self.guard = ConnectionGuard(
            sock, port=self.port, what=f"control port {self.port}", per_source=self._max_per_source
        )
        await self.guard.start()
        self._loop_task = asyncio.create_task(self._serve(), name=f"rpc-server:{self.port}")

    async def close(self) -> None:
        """Stop serving, cancel running handlers, close the socket."""
        await cancel_all(self._loop_task, *self._tasks, *self._readers.values())
        self._tasks.clear()
        self._readers.clear()
        self._large.clear()
        self._loop_task = None
        if self.guard is not None:
            await self.guard.close()
            self.guard = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    async def __aenter__(self) -> RpcServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            # copy=False keeps the frames' properties: "User-Id" is the key ZAP admitted
            frames = await self._sock.recv_multipart(copy=False)
            if len(frames) != 2:
                # a DEALER sends exactly one frame; anything else is not one of ours
                if len(frames) >= 1:
                    await self._reply(
                        frames[0].bytes, ErrorReply(code="malformed", detail="expected one frame")
                    )
                continue
            identity, payload = frames[0].bytes, frames[1].bytes
            try:
                sender = frames[1].get("User-Id") or ""
            except zmq.ZMQError:  # no ZAP on this socket (secure=False)
                sender = ""
            try:
                address = frames[1].get("Peer-Address") or ""
            except zmq.ZMQError:
                address = ""
            if len(payload) >= LARGE_BYTES:
                await self._queue_large(identity, sender, payload, address)
                continue
            try:
                request = decode(payload)
            except WireError as e:
                await self._reply(
                    identity, ErrorReply(id=e.msg_id or 0, code=e.code, detail=e.detail)
                )
                continue
            await self._start(identity, sender, request, address)
            # a burst of queued requests is read one per loop turn: a ready socket returns
            # at once, and without this the loop decodes the whole burst before it answers
            # anything else (the local API, heartbeats, the requests it already took)
            await asyncio.sleep(0)

    async def _start(self, identity: bytes, sender: str, request: Message, address: str) -> None:
        if len(self._tasks) >= MAX_INFLIGHT_REQUESTS:
            await self._reply(
                identity,
                ErrorReply(id=request.id, code="busy", detail="too many requests in flight"),
            )
            return
        peer_address.set(address)  # the task copies the context as it is now
        task = asyncio.create_task(self._handle(identity, sender, request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _queue_large(
        self, identity: bytes, sender: str, payload: bytes, address: str
    ) -> None:
        """A large request waits in its sender's queue (a socket without CURVE: its
        connection's); a full queue refuses it unread."""
        who = sender or identity.hex()
        queue = self._large.setdefault(who, collections.deque())
        if len(queue) >= MAX_QUEUED_LARGE:
            detail = (
                f"{MAX_QUEUED_LARGE} large requests from this node already wait (each "
                f"{LARGE_BYTES} bytes or more, read at {LARGE_BYTES_PER_S} bytes/s per node); "
                "send fewer at once"
            )
            await self._reply(identity, ErrorReply(id=peek_id(payload), code="busy", detail=detail))
            return
        queue.append((identity, payload, address))
        if who not in self._readers:
            task = asyncio.create_task(self._read_large(who, sender), name=f"rpc-large:{self.port}")
            self._readers[who] = task
            task.add_done_callback(
                lambda t: self._readers.pop(who, None) if self._readers.get(who) is t else None
            )

    async def _read_large(self, who: str, sender: str) -> None:
        """One sender's large requests, one at a time within its byte budget, each decoded in
        a thread (the loop keeps answering small requests meanwhile)."""
        budget = self._budgets.setdefault(who, ByteBudget(LARGE_BYTES_PER_S, 2 * MAX_MESSAGE_BYTES))
        queue = self._large.get(who)
        while queue:
            identity, payload, address = queue[0]
            while (wait := budget.wait_s(len(payload))) > 0:
                await asyncio.sleep(wait)
            queue.popleft()
            try:
                request = await asyncio.to_thread(decode, payload)
            except WireError as e:
                await self._reply(
                    identity, ErrorReply(id=e.msg_id or 0, code=e.code, detail=e.detail)
                )
                continue
            await self._start(identity, sender, request, address)
        self._large.pop(who, None)  # with no await since the queue emptied: a request that
        self._readers.pop(who, None)  # comes next starts a new reader
        if len(self._budgets) > 4096:  # senders without CURVE each have their own
            self._budgets.clear()

    async def _handle(self, identity: bytes, sender: str, request: Message) -> None:
        try:
            reply = await self._handler(request, sender)
        except asyncio.CancelledError:
            raise
        except RpcError as e:
            reply = ErrorReply(code=e.code, detail=e.detail)
        except SwarmError as e:  # a refusal with a stable code crosses as that code
            reply = ErrorReply(code=e.code, detail=e.message)
        except Exception as e:
            log.exception("rpc handler failed on %s", type(request).TYPE)
            reply = ErrorReply(code="internal", detail=f"{type(e).__name__}: {e}")
        if reply is None:
            return
        if not isinstance(reply, Message):
            reply = ErrorReply(
                code="internal", detail=f"handler returned {type(reply).__name__}, not a Message"
            )
        await self._reply(identity, dataclasses.replace(reply, id=request.id))

    async def _reply(self, identity: bytes, reply: Message) -> None:
        try:
            data = encode(reply)
        except WireError as e:
            data = encode(ErrorReply(id=reply.id, code=e.code, detail=e.detail))
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                await self._sock.send_multipart([identity, data], flags=zmq.NOBLOCK)


class RpcClient:
    """DEALER to one server; ``request`` pairs replies by id, so requests may overlap."""

    def __init__(self, ctx: zmq.asyncio.Context, secret: ClientCredentials, endpoint: str) -> None:
        self.endpoint = endpoint
        self.server_key: str = secret.server if isinstance(secret, ClientKeys) else ""
        """The server key it expects (ClientKeys), "" for a SwarmSecret's."""
        self._sock: zmq.asyncio.Socket | None = make_client_socket(ctx, zmq.DEALER, secret)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def request(self, msg: Message, timeout: float) -> Message:
        """Send ``msg`` (given a fresh id) and return its reply.

        Raises RpcTimeout when none arrives within ``timeout`` seconds and RpcError when the
        reply is an ErrorReply.
        """
        if self._sock is None:
            raise RuntimeError(f"RpcClient to {self.endpoint} is closed")
        if self._reader is None:
            self._reader = asyncio.create_task(self._read(), name=f"rpc-client:{self.endpoint}")
        msg_id = next(self._ids)
        data = encode(dataclasses.replace(msg, id=msg_id))
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = future
        try:
            reply = await asyncio.wait_for(self._send_and_wait(data, future), timeout)
        except asyncio.TimeoutError:
            raise RpcTimeout(
                f"no reply from {self.endpoint} to {type(msg).TYPE} within {timeout:g} s "
                "(peer down, busy, or not holding this swarm's secret)"
            ) from None
        finally:
            self._pending.pop(msg_id, None)
        if isinstance(reply, ErrorReply):
            raise RpcError.from_reply(reply)
        return reply

    async def _send_and_wait(self, data: bytes, future: asyncio.Future[Message]) -> Message:
        assert self._sock is not None
        await self._sock.send(data)
        return await future

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            payload = await self._sock.recv()
            try:
                reply = decode(payload)
            except WireError as e:
                if e.msg_id in self._pending:
                    self._resolve(e.msg_id, ErrorReply(code=e.code, detail=e.detail))
                else:
                    log.warning("dropped an unreadable reply from %s: %s", self.endpoint, e)
                continue
            self._resolve(reply.id, reply)

    def _resolve(self, msg_id: int, reply: Message) -> None:
        future = self._pending.get(msg_id)
        if future is not None and not future.done():
            future.set_result(reply)

    async def close(self) -> None:
        """Stop reading, fail pending requests, close the socket."""
        await cancel_all(self._reader)
        self._reader = None
        for future in self._pending.values():
            if not future.done():
                future.cancel()
        self._pending.clear()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    async def __aenter__(self) -> RpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def request_sync(
    ctx: zmq.Context, secret: ClientCredentials, endpoint: str, msg: Message, timeout: float
) -> Message:
    """One blocking request on a fresh DEALER (for CLIs and scripts); same errors as RpcClient."""
    if isinstance(ctx, zmq.asyncio.Context):
        raise TypeError("request_sync needs a sync zmq.Context; in async code use RpcClient")
    sock = make_client_socket(ctx, zmq.DEALER, secret)
    try:
        sock.connect(endpoint)
        request = dataclasses.replace(msg, id=1)
        sock.send(encode(request))
        deadline = time.monotonic() + timeout
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not sock.poll(left_ms):
                raise RpcTimeout(
                    f"no reply from {endpoint} to {type(msg).TYPE} within {timeout:g} s "
                    "(peer down, busy, or not holding this swarm's secret)"
                )
            try:
                reply = decode(sock.recv())
            except WireError as e:
                raise RpcError(e.code, f"unreadable reply from {endpoint}: {e.detail}") from None
            if reply.id == request.id:
                break
        if isinstance(reply, ErrorReply):
            raise RpcError.from_reply(reply)
        return reply
    finally:
        sock.close(0)
