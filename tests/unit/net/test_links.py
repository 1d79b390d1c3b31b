"""One contract for every Link, plus ZmqLink's security, caps and reconnection."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from swarmp2p.net import SecureContext, SwarmSecret, auth
from swarmp2p.net.links import InProcLink, Link, LinkClosed, LinkTimeout, ZmqLink
from swarmp2p.wire import TensorFrame, decode_tensor, encode_tensor, fake_quantize

LINKS = ["inproc", "zmq-curve", "zmq-plain"]


@pytest.fixture
def secret():
    return SwarmSecret.generate()


@pytest.fixture
def ctx():
    c = SecureContext()
    yield c
    c.destroy(linger=0)


@pytest.fixture(params=LINKS)
def pair(request, ctx, secret):
    """(a, b): two connected ends of one kind of link."""
    if request.param == "inproc":
        a, b = InProcLink.pair()
    else:
        secure = request.param == "zmq-curve"
        a = ZmqLink.bind(ctx, secret, "127.0.0.1", 0, secure=secure)
        b = ZmqLink.dial(ctx, secret, a.endpoint, secure=secure)
    yield a, b
    a.close()
    b.close()


def as_bytes(parts):
    return [bytes(p) for p in parts]


def test_multipart_messages_arrive_whole_and_in_order(pair):
    a, b = pair
    big = np.random.default_rng(0).bytes(8 * 1024 * 1024)
    messages = [[b"one"], [b"h", b"", b"tail"], [big, b"x"], [memoryview(b"view")]]
    for m in messages:
        b.send(m)
    got = [as_bytes(a.recv(5.0)) for _ in messages]
    assert got == [as_bytes(m) for m in messages]
    total = sum(len(bytes(p)) for m in messages for p in m)
    assert b.bytes_sent == total and a.bytes_received == total
    a.send([b"back"])
    assert as_bytes(b.recv(5.0)) == [b"back"]
    assert a.bytes_sent == 4 == b.bytes_received


def test_recv_times_out(pair):
    a, _b = pair
    t0 = time.monotonic()
    with pytest.raises(LinkTimeout, match=r"within 0\.2 s"):
        a.recv(0.2)
    assert 0.15 < time.monotonic() - t0 < 1.5


def test_tensor_frames_cross(pair):
    a, b = pair
    x = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    for codec in ("none", "fp16", "int8", "tokint4"):
        b.send(encode_tensor(x, codec, step=3, micro=1).to_parts())
        frame = TensorFrame.from_parts(a.recv(5.0))
        assert (frame.codec, frame.step, frame.micro) == (codec, 3, 1)
        want = decode_tensor(encode_tensor(x, codec))
        assert np.array_equal(decode_tensor(frame), want)


def test_small_sent_buffers_are_snapshots(pair):
    a, b = pair
    buf = bytearray(b"before")
    b.send([buf])
    time.sleep(0.05)
    buf[:] = b"AFTER!"
    # zmq copies small messages, the in-process link always: the receiver sees what was sent
    assert as_bytes(a.recv(5.0)) == [b"before"]


def test_close_is_idempotent_and_final(pair):
    a, _b = pair
    a.close()
    a.close()
    with pytest.raises(LinkClosed):
        a.send([b"x"])
    with pytest.raises(LinkClosed):
        a.recv(0.1)


def test_empty_message_is_refused(pair):
    _a, b = pair
    with pytest.raises(ValueError, match="at least one part"):
        b.send([])


def test_is_a_link(pair):
    assert all(isinstance(end, Link) for end in pair)


# --- ZmqLink only -----------------------------------------------------------------------------


def test_outsiders_cannot_inject_into_a_data_link(ctx, secret):
    a = ZmqLink.bind(ctx, secret, "127.0.0.1", 0)
    intruders = [
        ZmqLink.dial(ctx, SwarmSecret.generate(), a.endpoint),
        ZmqLink.dial(ctx, secret, a.endpoint, secure=False),
    ]
    try:
        for bad in intruders:
            bad.send([b"forged activation"], timeout=1.0)
        with pytest.raises(LinkTimeout):
            a.recv(0.8)
        good = ZmqLink.dial(ctx, secret, a.endpoint)
        try:
            good.send([b"real"])
            assert as_bytes(a.recv(5.0)) == [b"real"]
        finally:
            good.close()
    finally:
        a.close()
        for bad in intruders:
            bad.close()


def test_a_member_never_sends_to_an_impostor(ctx, secret):
    """A server that accepts anyone but lacks the swarm key cannot read what a member sends."""
    with zmq.Context() as other:
        impostor = other.socket(zmq.DEALER)
        impostor.linger = 0
        impostor.curve_server = True
        impostor.curve_publickey, impostor.curve_secretkey = zmq.curve_keypair()
        port = impostor.bind_to_random_port("tcp://127.0.0.1")
        member = ZmqLink.dial(ctx, secret, f"tcp://127.0.0.1:{port}")
        try:
            member.send([b"secret activations"])
            assert impostor.poll(800) == 0
        finally:
            member.close()
            impostor.close(0)


def test_oversized_part_is_refused_and_the_link_recovers(ctx, secret):
    a = ZmqLink.bind(ctx, secret, "127.0.0.1", 0, max_part_bytes=64 * 1024)
    b = ZmqLink.dial(ctx, secret, a.endpoint)
    try:
        b.send([b"\x01" * (1024 * 1024)])
        with pytest.raises(LinkTimeout):
            a.recv(0.5)
        b.send([b"small"])
        assert as_bytes(a.recv(5.0)) == [b"small"]
        assert a.bytes_received == 5
    finally:
        a.close()
        b.close()


def test_dial_side_reconnects_to_a_restarted_peer(ctx, secret):
    a = ZmqLink.bind(ctx, secret, "127.0.0.1", 0)
    port = a.port
    b = ZmqLink.dial(ctx, secret, a.endpoint)
    try:
        b.send([b"first"])
        assert as_bytes(a.recv(5.0)) == [b"first"]
        a.close()
        time.sleep(0.2)
        a = ZmqLink.bind(ctx, secret, "127.0.0.1", port)
        deadline = time.monotonic() + 10
        while True:  # messages sent while the peer was away may be lost; later ones arrive
            b.send([b"again"], timeout=1.0)
            try:
                assert as_bytes(a.recv(0.3)) == [b"again"]
                break
            except LinkTimeout:
                assert time.monotonic() < deadline
    finally:
        a.close()
        b.close()


def test_send_times_out_when_the_queue_is_full(ctx, secret):
    a = ZmqLink.bind(ctx, secret, "127.0.0.1", 0, hwm=2)  # bound, nobody dialled: no pipe
    try:
        with pytest.raises(LinkTimeout, match="could not queue"):
            a.send([b"x"], timeout=0.2)
    finally:
        a.close()


_CHILD = r"""
import sys
import numpy as np
import zmq
from swarmp2p.net import SwarmSecret, ZmqLink, stop_zero_copy_collector
from swarmp2p.wire import TensorFrame, encode_tensor, fake_quantize

token, endpoint = sys.argv[1], sys.argv[2]
x = np.random.default_rng(42).standard_normal((128, 64)).astype(np.float32)
with zmq.Context() as ctx:
    link = ZmqLink.dial(ctx, SwarmSecret.from_token(token), endpoint)
    link.send(encode_tensor(fake_quantize(x, 8), "int8", exact=True, step=9).to_parts())
    reply = TensorFrame.from_parts(link.recv(10.0))
    print(reply.step, reply.codec)
    link.close()
stop_zero_copy_collector()
"""


def test_a_frame_crosses_between_processes(ctx, secret):
    a = ZmqLink.bind(ctx, secret, "127.0.0.1", 0)
    root = Path(__file__).resolve().parents[3]
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, secret.token, a.endpoint],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )
    try:
        frame = TensorFrame.from_parts(a.recv(30.0))
        x = np.random.default_rng(42).standard_normal((128, 64)).astype(np.float32)
        assert (frame.codec, frame.step) == ("int8", 9)  # codes crossed, not floats
        assert np.array_equal(decode_tensor(frame), fake_quantize(x, 8))
        assert a.bytes_received == frame.nbytes + len(frame.header())
        a.send(encode_tensor(np.zeros(1, np.float32), step=10).to_parts())
        out, err = child.communicate(timeout=30)
        assert child.returncode == 0, err
        assert out.split() == ["10", "none"]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        a.close()


_FROZEN_CHILD = r"""
import sys, time
import zmq
from swarmp2p.net import SwarmSecret, ZmqLink

with zmq.Context() as ctx:
    link = ZmqLink.dial(ctx, SwarmSecret.from_token(sys.argv[1]), sys.argv[2])
    link.send([b"hello"])
    time.sleep(60)  # the parent stops (SIGSTOP) and then kills this process
"""


def test_heartbeats_drop_a_peer_that_went_silent(ctx, secret, monkeypatch):
    """A frozen peer (SIGSTOP: a hung host) is disconnected, not waited on forever."""
    monkeypatch.setattr(
        auth,
        "TIMINGS",
        replace(auth.TIMINGS, zmq_heartbeat_ivl_ms=100, zmq_heartbeat_timeout_ms=500),
    )
    a = ZmqLink.bind(ctx, secret, "127.0.0.1", 0)
    mon = a._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    root = Path(__file__).resolve().parents[3]
    child = subprocess.Popen(
        [sys.executable, "-c", _FROZEN_CHILD, secret.token, a.endpoint],
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )
    try:
        assert as_bytes(a.recv(30.0)) == [b"hello"]
        child.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        assert mon.poll(5000), "the silent peer was never disconnected"
        assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
        assert time.monotonic() - t0 < 3.0
    finally:
        child.kill()
        child.send_signal(signal.SIGCONT)
        child.wait()
        a._sock.disable_monitor()
        mon.close(0)
        a.close()
