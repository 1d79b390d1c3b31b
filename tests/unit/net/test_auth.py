"""CURVE + ZAP on real sockets: only holders of the swarm secret complete a handshake."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from swarmp2p.net import (
    AsyncSecureContext,
    SecureContext,
    SwarmSecret,
    make_client_socket,
    make_server_socket,
)


@pytest.fixture
def secret():
    return SwarmSecret.generate()


@pytest.fixture
def server(secret):
    """A bound CURVE ROUTER on a SecureContext; yields (ctx, sock, endpoint)."""
    ctx = SecureContext()
    sock = make_server_socket(ctx, zmq.ROUTER, secret)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield ctx, sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close(0)
        ctx.term()


def _attackers(ctx: zmq.Context, secret: SwarmSecret) -> dict[str, zmq.Socket]:
    """Clients that do not hold ``secret`` (or only its public server key)."""
    wrong = make_client_socket(ctx, zmq.DEALER, SwarmSecret.generate())
    plain = ctx.socket(zmq.DEALER)
    plain.linger = 0
    # the strongest outsider: knows the server's public key, brings its own key pair
    knows_server_key = ctx.socket(zmq.DEALER)
    knows_server_key.linger = 0
    pub, sec = zmq.curve_keypair()
    knows_server_key.curve_serverkey = secret.curve_keypair()[0]
    knows_server_key.curve_publickey = pub
    knows_server_key.curve_secretkey = sec
    return {"wrong token": wrong, "no token": plain, "own keypair": knows_server_key}


def test_outsiders_cannot_deliver_anything_insiders_can(server, secret):
    _ctx, sock, endpoint = server
    with zmq.Context() as other:
        socks = _attackers(other, secret)
        try:
            for name, s in socks.items():
                s.connect(endpoint)
                s.send(f"injected by {name}".encode(), flags=zmq.NOBLOCK)
            assert sock.poll(800) == 0, sock.recv_multipart()
            good = make_client_socket(other, zmq.DEALER, secret)
            try:
                good.connect(endpoint)
                good.send(b"member")
                assert sock.poll(5000)
                _ident, body = sock.recv_multipart()
                assert body == b"member"
                assert sock.poll(300) == 0  # nothing queued from the outsiders either
            finally:
                good.close(0)
        finally:
            for s in socks.values():
                s.close(0)


def test_zap_refuses_a_foreign_client_key_at_the_handshake(server, secret):
    """The server's monitor sees an authentication failure, not a silent accept."""
    _ctx, sock, endpoint = server
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    with zmq.Context() as other:
        intruder = _attackers(other, secret)["own keypair"]
        try:
            intruder.connect(endpoint)
            assert mon.poll(5000)
            event = recv_monitor_message(mon)
            assert event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            assert event["value"] == 400  # ZAP said no
        finally:
            intruder.close(0)
            sock.disable_monitor()
            mon.close(0)


def test_server_socket_needs_a_secure_context(secret):
    with zmq.Context() as plain, pytest.raises(TypeError, match="ZAP authenticator"):
        make_server_socket(plain, zmq.ROUTER, secret)


def test_authenticator_thread_stops_with_the_context(secret):
    before = set(threading.enumerate())
    ctx = SecureContext()
    s = make_server_socket(ctx, zmq.PAIR, secret)
    assert len(set(threading.enumerate()) - before) == 1
    s.close(0)
    ctx.term()
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive()]


def test_two_swarms_on_one_context_stay_apart():
    a, b = SwarmSecret.generate(), SwarmSecret.generate()
    with SecureContext() as ctx:
        sa = make_server_socket(ctx, zmq.ROUTER, a)
        pa = sa.bind_to_random_port("tcp://127.0.0.1")
        sb = make_server_socket(ctx, zmq.ROUTER, b)
        sb.bind_to_random_port("tcp://127.0.0.1")
        # a client holding b's secret but pointing at a's server key still fails ZAP on a's domain
        cross = ctx.socket(zmq.DEALER)
        cross.linger = 0
        cross.curve_serverkey = a.curve_keypair()[0]
        cross.curve_publickey, cross.curve_secretkey = b.curve_keypair()
        cross.connect(f"tcp://127.0.0.1:{pa}")
        # a refused handshake can drop the pipe before this: then there is nowhere to queue
        # the message (a blocking send would wait forever); either way a receives nothing
        with contextlib.suppress(zmq.Again):
            cross.send(b"cross", zmq.NOBLOCK)
        assert sa.poll(600) == 0
        for s in (sa, sb, cross):
            s.close(0)


def test_async_context_needs_a_running_loop(secret):
    ctx = AsyncSecureContext()
    try:
        with pytest.raises(RuntimeError, match="running event loop"):
            make_server_socket(ctx, zmq.ROUTER, secret)
    finally:
        ctx.term()


def test_async_context_admits_members_only(secret):
    async def scenario():
        ctx = AsyncSecureContext()
        try:
            srv = make_server_socket(ctx, zmq.ROUTER, secret)
            port = srv.bind_to_random_port("tcp://127.0.0.1")
            bad = make_client_socket(ctx, zmq.DEALER, SwarmSecret.generate())
            good = make_client_socket(ctx, zmq.DEALER, secret)
            for s in (bad, good):
                s.connect(f"tcp://127.0.0.1:{port}")
            await bad.send(b"bad")
            await good.send(b"good")
            frames = await asyncio.wait_for(srv.recv_multipart(), 5)
            assert frames[1] == b"good"
            assert await srv.poll(400) == 0
        finally:
            ctx.destroy(linger=0)

    asyncio.run(scenario())
