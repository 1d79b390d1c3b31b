"""RPC over real CURVE ZeroMQ sockets on 127.0.0.1: replies, typed errors, timeouts, bad input."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import msgpack
import pytest
import zmq
import zmq.asyncio

from swarmp2p.net import (
    AsyncSecureContext,
    ClientKeys,
    KeyCheck,
    NodeKey,
    RpcClient,
    RpcError,
    RpcServer,
    RpcTimeout,
    SecureContext,
    ServerKeys,
    SwarmSecret,
    make_client_socket,
    request_sync,
)
from swarmp2p.wire import MAX_MESSAGE_BYTES, ErrorReply, Hello, Message, decode, encode, message


@message("test.echo")
class Echo(Message):
    text: str
    delay: float = 0.0


@message("test.boom")
class Boom(Message):
    kind: str


def _hello(**kw):
    base = dict(node_id="n1", name="alpha", versions=[1], capabilities=["wire-v2"])
    base.update(kw)
    return Hello(**base)


async def _handler(seen: list, msg: Message, peer: bytes):
    seen.append(msg)
    if isinstance(msg, Echo):
        if msg.delay:
            await asyncio.sleep(msg.delay)
        return Echo(text=msg.text.upper())
    if isinstance(msg, Boom):
        if msg.kind == "typed":
            raise RpcError("job_unknown", "no job 7; list jobs with `swarm jobs`")
        if msg.kind == "none":
            return None
        raise KeyError("surprise")
    if isinstance(msg, Hello):
        return _hello(node_id="server")
    return None


def run(coro_fn):
    """Run one async scenario with a fresh secure asyncio context, destroyed afterwards."""

    async def main():
        ctx = AsyncSecureContext()
        try:
            return await asyncio.wait_for(coro_fn(ctx), 30)
        finally:
            ctx.destroy(linger=0)

    return asyncio.run(main())


@pytest.fixture
def secret():
    return SwarmSecret.generate()


def test_request_reply_pairs_by_id_even_out_of_order(secret):
    seen: list = []

    async def scenario(ctx):
        async with RpcServer(ctx, secret, "127.0.0.1", 0, lambda m, p: _handler(seen, m, p)) as srv:
            assert srv.port > 0 and srv.endpoint == f"tcp://127.0.0.1:{srv.port}"
            async with RpcClient(ctx, secret, srv.endpoint) as cli:
                slow = asyncio.create_task(cli.request(Echo(text="slow", delay=0.3), timeout=5))
                fast = await cli.request(Echo(text="fast"), timeout=5)
                assert fast.text == "FAST"
                assert not slow.done()  # the fast reply did not satisfy the slow request
                assert (await slow).text == "SLOW"
                hello = await cli.request(_hello(), timeout=5)
                assert isinstance(hello, Hello) and hello.node_id == "server"
                assert hello.id == seen[-1].id > 0  # the reply carries the request's id

    run(scenario)
    assert [type(m).__name__ for m in seen] == ["Echo", "Echo", "Hello"]


def test_handler_errors_are_typed_and_server_keeps_serving(secret):
    seen: list = []

    async def scenario(ctx):
        async with (
            RpcServer(ctx, secret, "127.0.0.1", 0, lambda m, p: _handler(seen, m, p)) as srv,
            RpcClient(ctx, secret, srv.endpoint) as cli,
        ):
            with pytest.raises(RpcError) as typed:
                await cli.request(Boom(kind="typed"), timeout=5)
            assert typed.value.code == "job_unknown" and "no job 7" in typed.value.detail
            with pytest.raises(RpcError) as internal:
                await cli.request(Boom(kind="crash"), timeout=5)
            assert internal.value.code == "internal" and "KeyError" in internal.value.detail
            with pytest.raises(RpcTimeout):  # a handler returning None sends nothing
                await cli.request(Boom(kind="none"), timeout=0.3)
            assert (await cli.request(Echo(text="still"), timeout=5)).text == "STILL"

    run(scenario)


@pytest.mark.parametrize(
    ("payload", "code", "reply_id"),
    [
        (msgpack.packb({"v": 1, "t": "no.such.type", "id": 41}), "unknown_type", 41),
        (msgpack.packb({"v": 99, "t": "test.echo", "id": 42, "text": "x"}), "version", 42),
        (msgpack.packb({"v": 1, "t": "test.echo", "id": 43, "text": 5}), "bad_field", 43),
        (msgpack.packb({"v": 1, "t": "test.echo", "id": 44, "txt": "x"}), "bad_field", 44),
        (b"\xc1\xc1 not msgpack", "malformed", 0),
        (msgpack.packb([1, 2, 3]), "malformed", 0),
    ],
)
def test_bad_requests_get_error_replies_and_the_loop_survives(secret, payload, code, reply_id):
    seen: list = []

    async def scenario(ctx):
        async with RpcServer(ctx, secret, "127.0.0.1", 0, lambda m, p: _handler(seen, m, p)) as srv:
            raw = make_client_socket(ctx, zmq.DEALER, secret)
            try:
                raw.connect(srv.endpoint)
                await raw.send(payload)
                assert await raw.poll(5000)
                reply = decode(await raw.recv())
                assert isinstance(reply, ErrorReply)
                assert reply.code == code and reply.id == reply_id
                await raw.send(encode(Echo(id=7, text="after")))
                assert await raw.poll(5000)
                after = decode(await raw.recv())
                assert isinstance(after, Echo) and after.text == "AFTER" and after.id == 7
            finally:
                raw.close(0)

    run(scenario)
    assert len(seen) == 1  # only the good request reached the handler


def test_timeout_when_nobody_listens(secret):
    async def scenario(ctx):
        with zmq.Context() as probe:  # find a free port, then leave it closed
            s = probe.socket(zmq.ROUTER)
            port = s.bind_to_random_port("tcp://127.0.0.1")
            s.close(0)
        async with RpcClient(ctx, secret, f"tcp://127.0.0.1:{port}") as cli:
            t0 = time.monotonic()
            with pytest.raises(RpcTimeout, match=r"within 0\.3 s"):
                await cli.request(Echo(text="x"), timeout=0.3)
            assert 0.25 < time.monotonic() - t0 < 2.0

    run(scenario)


def test_oversized_request_is_dropped_by_the_transport(secret):
    """A frame over MAXMSGSIZE is cut off before it is buffered; the server keeps serving."""
    seen: list = []

    async def scenario(ctx):
        async with RpcServer(ctx, secret, "127.0.0.1", 0, lambda m, p: _handler(seen, m, p)) as srv:
            big = make_client_socket(ctx, zmq.DEALER, secret, max_message_bytes=-1)
            try:
                big.connect(srv.endpoint)
                await big.send(b"\x00" * (MAX_MESSAGE_BYTES + 4096))
                assert not await big.poll(500)  # no reply: the connection was dropped
            finally:
                big.close(0)
            async with RpcClient(ctx, secret, srv.endpoint) as cli:
                assert (await cli.request(Echo(text="ok"), timeout=5)).text == "OK"

    run(scenario)
    assert [m.text for m in seen] == ["ok"]


def test_a_message_at_the_cap_still_crosses(secret):
    seen: list = []

    async def scenario(ctx):
        async with (
            RpcServer(ctx, secret, "127.0.0.1", 0, lambda m, p: _handler(seen, m, p)) as srv,
            RpcClient(ctx, secret, srv.endpoint) as cli,
        ):
            text = "a" * (MAX_MESSAGE_BYTES - 64)
            reply = await cli.request(Echo(text=text), timeout=10)
            assert reply.text == text.upper()

    run(scenario)


def test_request_sync(secret):
    async def scenario(ctx):
        async with RpcServer(ctx, secret, "127.0.0.1", 0, lambda m, p: _handler([], m, p)) as srv:
            loop = asyncio.get_running_loop()
            with SecureContext() as sync_ctx:
                reply = await loop.run_in_executor(
                    None, request_sync, sync_ctx, secret, srv.endpoint, Echo(text="hi"), 5.0
                )
                assert reply.text == "HI"
                with pytest.raises(RpcError) as err:
                    await loop.run_in_executor(
                        None, request_sync, sync_ctx, secret, srv.endpoint, Boom(kind="typed"), 5.0
                    )
                assert err.value.code == "job_unknown"
                other = SwarmSecret.generate()
                with pytest.raises(RpcTimeout):
                    await loop.run_in_executor(
                        None, request_sync, sync_ctx, other, srv.endpoint, Echo(text="x"), 0.5
                    )

    run(scenario)


def test_the_handler_gets_the_key_each_request_was_authenticated_with():
    """Per-node keys: ZAP admits listed client keys and every request reaches the handler with
    its sender's key (the ``User-Id`` frame property), so a server binds it to a node id."""
    server_key, alice, bob, eve = (NodeKey.generate() for _ in range(4))
    allowed = {alice.public, bob.public}
    senders: list[str] = []

    async def handler(msg, sender):
        senders.append(sender)
        return Echo(text=msg.text.upper())

    async def scenario(ctx):
        keys = ServerKeys(
            public=server_key.public,
            secret=server_key.secret,
            admits=KeyCheck(allowed.__contains__),
            domain="t-members",
        )
        async with RpcServer(ctx, keys, "127.0.0.1", 0, handler) as srv:
            for who in (alice, bob):
                creds = ClientKeys(public=who.public, secret=who.secret, server=server_key.public)
                async with RpcClient(ctx, creds, srv.endpoint) as cli:
                    assert (await cli.request(Echo(text="hi"), timeout=5)).text == "HI"
            creds = ClientKeys(public=eve.public, secret=eve.secret, server=server_key.public)
            async with RpcClient(ctx, creds, srv.endpoint) as cli:  # not listed: no handshake
                with pytest.raises(RpcTimeout):
                    await cli.request(Echo(text="let me in"), timeout=0.5)
            wrong = ClientKeys(public=alice.public, secret=alice.secret, server=eve.public)
            async with RpcClient(ctx, wrong, srv.endpoint) as cli:  # expects another server
                with pytest.raises(RpcTimeout):
                    await cli.request(Echo(text="who are you"), timeout=0.5)

    run(scenario)
    assert senders == [alice.public, bob.public]


def test_a_server_restarted_on_its_port_waits_for_the_old_listener_to_let_go(secret):
    """A re-key restarts the join server on its own port; the port may still be held for a
    moment after the old socket closed (zmq lets go on its I/O thread). The new server binds
    once the port is free, and fails naming the port when it never is."""
    import socket

    from swarmp2p.net import rpc

    async def scenario(ctx):
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        asyncio.get_running_loop().call_later(0.3, holder.close)
        server = RpcServer(ctx, secret, "127.0.0.1", port, lambda m, p: _handler([], m, p))
        t0 = time.monotonic()
        await server.start()
        try:
            assert server.port == port and time.monotonic() - t0 >= 0.25
            async with RpcClient(ctx, secret, server.endpoint) as cli:
                assert (await cli.request(Echo(text="up"), timeout=5)).text == "UP"
        finally:
            await server.close()

        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen()
        try:
            rpc.TIMINGS, saved = replace(rpc.TIMINGS, rpc_rebind_s=0.2), rpc.TIMINGS
            stuck = RpcServer(ctx, secret, "127.0.0.1", held.getsockname()[1], lambda m, p: None)
            with pytest.raises(rpc.AddressInUse, match="in use"):
                await stuck.start()
        finally:
            rpc.TIMINGS = saved
            held.close()

    run(scenario)
