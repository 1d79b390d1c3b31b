"""Wire benchmark: codec throughput, ZmqLink loopback throughput (CURVE on/off) beside raw TCP,
4 KB round-trip latency, and bytes on the wire per token per codec.

    python bench/wire.py [--quick] [--repeats N]

Compared runs (raw TCP, plain ZmqLink, CURVE ZmqLink) alternate within each repeat and the
medians are reported, because a neighbour on a shared core skews any single run. Prints
markdown tables, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a fresh checkout

import numpy as np

from swarmp2p.net import SecureContext, SwarmSecret, ZmqLink, stop_zero_copy_collector
from swarmp2p.wire import (
    CODECS,
    TensorFrame,
    decode_tensor,
    encode_tensor,
    fake_quantize,
    wire_nbytes,
)

MB = 1024 * 1024
TOKENS, HIDDEN = 4096, 576
"""The codec tensor: a 4096-token batch of SmolLM2-135M's hidden width."""


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_codecs(repeats: int) -> tuple[dict[str, float], float]:
    x = np.random.default_rng(0).standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    size_mb = x.nbytes / MB
    out = {}
    for codec in CODECS:

        def once(codec=codec):
            frame = encode_tensor(x, codec)
            decode_tensor(TensorFrame.from_parts(frame.to_parts()))

        out[codec] = size_mb / _median_time(once, repeats)
    q = fake_quantize(x, 8)

    def exact():
        frame = encode_tensor(q, "int8", exact=True)
        assert frame.codec == "int8"
        decode_tensor(TensorFrame.from_parts(frame.to_parts()))

    return out, size_mb / _median_time(exact, repeats)


def _tcp_mb_s(n: int, payload: bytes) -> float:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    tx = socket.create_connection(srv.getsockname())
    rx, _ = srv.accept()
    srv.close()
    total = n * len(payload)

    def send():
        for _ in range(n):
            tx.sendall(payload)

    buf = bytearray(4 * MB)
    view = memoryview(buf)
    t0 = time.perf_counter()
    th = threading.Thread(target=send)
    th.start()
    got = 0
    while got < total:
        k = rx.recv_into(view)
        if not k:
            break
        got += k
    dt = time.perf_counter() - t0
    th.join()
    tx.close()
    rx.close()
    return total / MB / dt


def _link_pair(ctx, secret, secure: bool) -> tuple[ZmqLink, ZmqLink]:
    a = ZmqLink.bind(ctx, secret, "127.0.0.1", 0, secure=secure)
    b = ZmqLink.dial(ctx, secret, a.endpoint, secure=secure)
    b.send([b"warm-up"])
    a.recv(10.0)
    return a, b


def _zmq_mb_s(ctx, secret, secure: bool, n: int, payload: bytes) -> float:
    a, b = _link_pair(ctx, secret, secure)

    def send():
        for _ in range(n):
            b.send([payload])

    t0 = time.perf_counter()
    th = threading.Thread(target=send)
    th.start()
    for _ in range(n):
        a.recv(60.0)
    dt = time.perf_counter() - t0
    th.join()
    a.close()
    b.close()
    return n * len(payload) / MB / dt


def _rtt_ms(ctx, secret, secure: bool, n: int) -> float:
    a, b = _link_pair(ctx, secret, secure)
    msg = [bytes(4096)]
    stop = threading.Event()

    def echo():
        while not stop.is_set():
            try:
                a.send(a.recv(0.2))
            except TimeoutError:
                continue

    th = threading.Thread(target=echo)
    th.start()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        b.send(msg)
        b.recv(10.0)
        times.append(time.perf_counter() - t0)
    stop.set()
    th.join()
    a.close()
    b.close()
    return statistics.median(times) * 1000


def bench_links(repeats: int, n: int, rtt_n: int) -> dict[str, float]:
    secret = SwarmSecret.generate()
    payload = np.random.default_rng(1).bytes(MB)
    runs: dict[str, list[float]] = {"tcp": [], "plain": [], "curve": []}
    rtts: dict[str, list[float]] = {"plain": [], "curve": []}
    ctx = SecureContext()
    try:
        for _ in range(repeats):  # alternate the compared runs
            runs["tcp"].append(_tcp_mb_s(n, payload))
            runs["plain"].append(_zmq_mb_s(ctx, secret, False, n, payload))
            runs["curve"].append(_zmq_mb_s(ctx, secret, True, n, payload))
            rtts["curve"].append(_rtt_ms(ctx, secret, True, rtt_n))
            rtts["plain"].append(_rtt_ms(ctx, secret, False, rtt_n))
    finally:
        ctx.destroy(linger=0)
        stop_zero_copy_collector()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "tcp_mb_s": med["tcp"],
        "zmq_plain_mb_s": med["plain"],
        "zmq_curve_mb_s": med["curve"],
        # ratios per repeat, then their median: robust to one slow repeat
        "zmq_over_tcp": statistics.median(p / t for p, t in zip(runs["plain"], runs["tcp"])),
        "curve_over_plain": statistics.median(c / p for c, p in zip(runs["curve"], runs["plain"])),
        "rtt_4k_ms": statistics.median(rtts["curve"]),
        "rtt_4k_plain_ms": statistics.median(rtts["plain"]),
    }


def bytes_per_token() -> dict[str, dict[str, float]]:
    """Payload bytes per token relative to float32, for one token and for a 4096-token frame."""
    out = {}
    for codec in CODECS:
        one = wire_nbytes((1, HIDDEN), codec) / (4 * HIDDEN)
        many = wire_nbytes((TOKENS, HIDDEN), codec) / (4 * HIDDEN * TOKENS)
        out[codec] = {"1_token": one, f"{TOKENS}_tokens": many}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, to check it runs")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 5)
    n = 20 if args.quick else 300
    rtt_n = 30 if args.quick else 500

    codec_mb_s, exact_mb_s = bench_codecs(max(1, repeats if not args.quick else 1))
    links = bench_links(repeats, n, rtt_n)
    ratios = bytes_per_token()

    print(f"## Codecs: encode+decode of a {TOKENS}x{HIDDEN} float32 tensor (median of {repeats})\n")
    print("| codec | MB/s | bytes/token vs float32 (1 token) | (4096 tokens) |")
    print("|---|---:|---:|---:|")
    for codec in CODECS:
        r = ratios[codec]
        label = "none (a view, no copy)" if codec == "none" else codec
        print(
            f"| {label} | {codec_mb_s[codec]:.0f} | {r['1_token']:.4f} | {r[f'{TOKENS}_tokens']:.4f} |"
        )
    print(f"| int8, exact (wire v2 re-encode) | {exact_mb_s:.0f} | | |")
    print(
        f"\nint8 for one token: (d + 4) / 4d = {(HIDDEN + 4) / (4 * HIDDEN):.4f} (d = {HIDDEN})\n"
    )
    print(f"## Loopback, 1 MB frames x {n}, median of {repeats} alternated runs\n")
    print("| transport | MB/s | vs raw TCP |")
    print("|---|---:|---:|")
    print(f"| raw TCP sendall | {links['tcp_mb_s']:.0f} | 1.00 |")
    print(f"| ZmqLink, CURVE off | {links['zmq_plain_mb_s']:.0f} | {links['zmq_over_tcp']:.2f} |")
    curve_ratio = links["zmq_curve_mb_s"] / links["tcp_mb_s"]
    print(f"| ZmqLink, CURVE on | {links['zmq_curve_mb_s']:.0f} | {curve_ratio:.2f} |")
    print(
        f"\nCURVE / plain throughput: {links['curve_over_plain']:.2f}. "
        f"4 KB round trip: {links['rtt_4k_ms']:.3f} ms with CURVE, "
        f"{links['rtt_4k_plain_ms']:.3f} ms without.\n"
    )
    result = {
        **{k: round(v, 4) for k, v in links.items()},
        "codec_mb_s": {k: round(v, 1) for k, v in codec_mb_s.items()},
        "exact_int8_mb_s": round(exact_mb_s, 1),
        "bytes_per_token_vs_f32": {k: round(v["1_token"], 5) for k, v in ratios.items()},
        "frames": n,
        "repeats": repeats,
        "quick": args.quick,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
