"""Fuzz the wire decoders: control messages, packed multipart and TensorFrames.

    python bench/fuzz_wire.py [--inputs N] [--seed S] [--write-corpus]

Feeds N generated and mutated inputs (seeded from ``bench/corpus/``) to ``decode``,
``unpack_parts`` + ``TensorFrame.from_parts`` + ``decode_tensor``. Any exception other than
WireError is a crash. Prints a markdown table and, as its last line,
``{"inputs": N, "crashes": K, ...}``.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a fresh checkout

import msgpack
import numpy as np

from swarmp2p.wire import (
    CODECS,
    ErrorReply,
    Hello,
    TensorFrame,
    WireError,
    decode,
    decode_tensor,
    encode,
    encode_tensor,
    fake_quantize,
    message_types,
    pack_parts,
    unpack_parts,
)

CORPUS = Path(__file__).resolve().parent / "corpus"
INTERESTING = [
    0x00,
    0x01,
    0x7F,
    0x80,
    0xFF,
    0xC0,
    0xC1,
    0xC4,
    0xD9,
    0xDC,
    0xDD,
    0xDE,
    0xDF,
    0x90,
    0x80,
]


def seed_inputs() -> dict[str, bytes]:
    """The committed seed corpus: valid messages and packed frames of every kind."""
    rng = np.random.default_rng(0)
    seeds: dict[str, bytes] = {
        "msg-hello.bin": encode(
            Hello(id=7, node_id="n1", name="alpha", versions=[1], capabilities=["wire-v2"])
        ),
        "msg-error.bin": encode(ErrorReply(id=3, code="bad_field", detail="x.y must be int")),
    }
    x = rng.standard_normal((3, 10)).astype(np.float32)
    for codec in CODECS:
        seeds[f"frame-{codec}.bin"] = pack_parts(
            encode_tensor(x, codec, step=5, micro=1).to_parts()
        )
    seeds["frame-int4-exact.bin"] = pack_parts(
        encode_tensor(fake_quantize(x, 4), "int4", exact=True).to_parts()
    )
    seeds["frame-bf16.bin"] = pack_parts(
        encode_tensor(rng.integers(0, 65535, (2, 5)).astype(np.uint16), dtype="bfloat16").to_parts()
    )
    seeds["frame-bool.bin"] = pack_parts(encode_tensor(np.array([True, False, True])).to_parts())
    seeds["frame-int64-scalar.bin"] = pack_parts(encode_tensor(np.array(12, np.int64)).to_parts())
    return seeds


def load_corpus() -> list[bytes]:
    files = sorted(CORPUS.glob("*.bin"))
    if not files:
        raise SystemExit(f"no seed corpus in {CORPUS}; run with --write-corpus once")
    return [f.read_bytes() for f in files]


def _random_plain(rnd: random.Random, depth: int = 0):
    kind = rnd.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rnd.choice([True, False])
    if kind == 2:
        return rnd.choice([0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, rnd.randrange(-1000, 1000)])
    if kind == 3:
        return rnd.choice([0.0, -0.0, 1.5, float("inf"), float("nan"), 1e308])
    if kind == 4:
        return rnd.choice(["", "hello", "error", "float32", "int8", "x" * rnd.randrange(50)])
    if kind == 5:
        return rnd.randbytes(rnd.randrange(16))
    if kind == 6:
        return [_random_plain(rnd, depth + 1) for _ in range(rnd.randrange(4))]
    keys = ["v", "t", "id", "shape", "dtype", "codec", "step", "micro", "flags", "code", "detail"]
    return {
        rnd.choice([*keys, "node_id", "versions", "zz"]): _random_plain(rnd, depth + 1)
        for _ in range(rnd.randrange(6))
    }


def generate(rnd: random.Random) -> bytes:
    """A structurally plausible input: a msgpack map shaped like a message or a header."""
    kind = rnd.randrange(4)
    if kind == 0:
        t = rnd.choice([*message_types(), "nope", ""])
        body = {"v": rnd.choice([1, 1, 2, 0]), "t": t, "id": rnd.choice([0, 5, -1])}
        body.update(
            {
                k: _random_plain(rnd)
                for k in rnd.sample(
                    ["node_id", "name", "versions", "capabilities", "code", "detail", "extra"],
                    rnd.randrange(5),
                )
            }
        )
        return msgpack.packb(body)
    if kind == 1:
        header = {
            "v": 1,
            "shape": [rnd.choice([0, 1, 2, 3, 7, 2**31]) for _ in range(rnd.randrange(4))],
            "dtype": rnd.choice(["float32", "float16", "bfloat16", "int64", "bool", "uint8", "x"]),
            "codec": rnd.choice([*CODECS, "int9", "tokint1"]),
            "step": rnd.choice([0, 1, -1]),
            "micro": 0,
            "flags": 0,
        }
        parts = [msgpack.packb(header)] + [
            rnd.randbytes(rnd.randrange(64)) for _ in range(rnd.randrange(4))
        ]
        return pack_parts(parts)
    if kind == 2:
        return msgpack.packb(_random_plain(rnd))
    return rnd.randbytes(rnd.randrange(64))


def mutate(data: bytes, rnd: random.Random, corpus: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rnd.randrange(1, 5)):
        op = rnd.randrange(8)
        if op == 0 and buf:  # flip a bit
            i = rnd.randrange(len(buf))
            buf[i] ^= 1 << rnd.randrange(8)
        elif op == 1 and buf:  # an interesting byte
            buf[rnd.randrange(len(buf))] = rnd.choice(INTERESTING)
        elif op == 2:  # insert random bytes
            i = rnd.randrange(len(buf) + 1)
            buf[i:i] = rnd.randbytes(rnd.randrange(1, 9))
        elif op == 3 and buf:  # delete a range
            i = rnd.randrange(len(buf))
            del buf[i : i + rnd.randrange(1, 16)]
        elif op == 4:  # truncate
            del buf[rnd.randrange(len(buf) + 1) :]
        elif op == 5:  # splice with another seed
            other = rnd.choice(corpus)
            i, j = rnd.randrange(len(buf) + 1), rnd.randrange(len(other) + 1)
            buf = buf[:i] + other[j:]
        elif op == 6 and len(buf) >= 4:  # overwrite a 4-byte length with an extreme value
            i = rnd.randrange(len(buf) - 3)
            buf[i : i + 4] = rnd.choice(
                [b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x00\x00\x00", b"\x00\x00\x10\x00"]
            )
        elif op == 7 and buf:  # duplicate a chunk
            i = rnd.randrange(len(buf))
            buf[i:i] = buf[i : i + rnd.randrange(1, 32)]
    return bytes(buf)


def feed(data: bytes) -> tuple[str, BaseException | None]:
    """Run every decoder on ``data``; return (outcome, crash)."""
    outcome = "rejected"
    try:
        decode(data)
        outcome = "message"
    except WireError:
        pass
    except Exception as e:  # anything else is a crash
        return "crash", e
    try:
        frame = TensorFrame.from_parts(unpack_parts(data))
        decode_tensor(frame)
        outcome = "frame"
    except WireError:
        pass
    except Exception as e:
        return "crash", e
    return outcome, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write-corpus", action="store_true", help="(re)write bench/corpus/")
    args = parser.parse_args()
    if args.write_corpus:
        CORPUS.mkdir(exist_ok=True)
        for name, data in seed_inputs().items():
            (CORPUS / name).write_bytes(data)
    corpus = load_corpus()
    rnd = random.Random(args.seed)
    frame_seeds = []
    for seed in corpus:
        try:
            frame_seeds.append(unpack_parts(seed))
        except WireError:
            pass
    counts = {"message": 0, "frame": 0, "rejected": 0, "crash": 0}
    first_crashes: list[str] = []
    slowest = 0.0
    t0 = time.perf_counter()
    for i in range(args.inputs):
        r = rnd.random()
        if i < len(corpus):
            data = corpus[i]
        elif r < 0.4:
            data = mutate(rnd.choice(corpus), rnd, corpus)
        elif r < 0.7 and frame_seeds:
            # a link delivers parts already split: mutate one part, keep the framing valid
            parts = [bytes(p) for p in rnd.choice(frame_seeds)]
            k = rnd.randrange(len(parts))
            parts[k] = mutate(parts[k], rnd, corpus)
            data = pack_parts(parts)
        elif r < 0.9:
            data = generate(rnd)
        else:
            data = mutate(generate(rnd), rnd, corpus)
        t = time.perf_counter()
        outcome, crash = feed(data)
        slowest = max(slowest, time.perf_counter() - t)
        counts[outcome] += 1
        if crash is not None and len(first_crashes) < 5:
            first_crashes.append(
                f"{data[:80]!r}: " + "".join(traceback.format_exception_only(crash)).strip()
            )
    elapsed = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"## Wire fuzz: {args.inputs} inputs, seed {args.seed}, {len(corpus)} corpus seeds\n")
    print("| outcome | inputs |")
    print("|---|---:|")
    for k, v in counts.items():
        print(f"| {k} | {v} |")
    print(f"\n{elapsed:.1f} s, slowest input {slowest * 1000:.1f} ms, peak RSS {peak_mb:.0f} MB\n")
    for c in first_crashes:
        print(f"- crash: {c}")
    print(
        json.dumps(
            {
                "inputs": args.inputs,
                "crashes": counts["crash"],
                "accepted_messages": counts["message"],
                "accepted_frames": counts["frame"],
                "seconds": round(elapsed, 1),
                "slowest_ms": round(slowest * 1000, 2),
                "peak_rss_mb": round(peak_mb),
            }
        )
    )
    sys.exit(1 if counts["crash"] else 0)


if __name__ == "__main__":
    main()
