"""Seconds to ship a job's data file from the submitting node to stage 0's node.

Two real daemons on loopback (`swarm up --foreground`, static peers, no mDNS); node b submits
a 2-stage job whose ``data.source`` is a text file only b names, stage 0 lands on node a, and
a fetches the file (CURVE RPC, 1 MiB chunks, sha256-checked, content-addressed in its state
dir). Timed from `swarm train --detach` (which hashes the file first) to the whole copy on a;
beside it, in the same run, a plain local copy of the same file (``shutil.copyfile``: the
disk's own speed) and the sha256 of the file, so the ratio shows the swarm's overhead.

Prints a markdown table, then as its last line one JSON object.

    python bench/inputs.py [--quick] [--mb N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _swarm import ROOT, LoopbackSwarm, wait

CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
"""A model without weights: it plans, and the job fails once the file has arrived."""


def _text(path: Path, mb: int) -> None:
    line = ("the quick brown fox jumps over the lazy dog " * 20 + "\n\n").encode()
    with open(path, "wb") as out:
        for _ in range(mb * 2**20 // len(line)):
            out.write(line)


def run(args) -> dict:
    from swarmp2p.net.security import SwarmSecret

    tmp = Path(tempfile.mkdtemp(prefix="swarm-inputs-"))
    data = tmp / "corpus.txt"
    _text(data, args.mb)
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    size = data.stat().st_size
    t = time.monotonic()
    shutil.copyfile(data, tmp / "copy.txt")
    copy_s = time.monotonic() - t
    t = time.monotonic()
    hashlib.sha256(data.read_bytes()).hexdigest()
    hash_s = time.monotonic() - t
    token = SwarmSecret.generate().token
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    env.update(PYTHONPATH=str(ROOT), SWARM_TOKEN=token, OMP_NUM_THREADS="1")
    try:
        with LoopbackSwarm("ab", tmp, env=env) as sw:
            wait(lambda: sw.ready("a"), 60, "the swarm")
            job = {
                "name": "ship",
                "model": {"pretrained": str(model)},
                "data": {"source": str(data)},
                "split": {"stages": 2, "mode": "equal"},
                "train": {"steps": 1},
            }
            (tmp / "job.json").write_text(json.dumps(job))
            inbox = tmp / "a" / "inputs"
            start = time.monotonic()
            out = sw.cli("b", "train", str(tmp / "job.json"), "--detach", "--json")
            if out.returncode:
                raise SystemExit(f"submit failed: {out.stderr}")

            def arrived():
                files = [p for p in inbox.glob("*.txt")] if inbox.is_dir() else []
                return files and files[0].stat().st_size == size

            wait(arrived, 600, "the data file on node a")
            ship_s = time.monotonic() - start
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "mb": round(size / 2**20, 1),
        "ship_s": round(ship_s, 2),
        "ship_mb_per_s": round(size / 2**20 / ship_s, 1),
        "local_copy_s": round(copy_s, 3),
        "sha256_s": round(hash_s, 3),
        "ratio_ship_to_copy": round(ship_s / max(copy_s, 1e-6), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 10 MB file (CI)")
    parser.add_argument("--mb", type=int, default=100)
    args = parser.parse_args()
    if args.quick:
        args.mb = 10
    r = run(args)
    print("| file MB | ship s (submit to copy) | MB/s | local copy s | sha256 s | ship / copy |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {r['mb']} | {r['ship_s']} | {r['ship_mb_per_s']} | {r['local_copy_s']} | "
        f"{r['sha256_s']} | {r['ratio_ship_to_copy']} |"
    )
    print(json.dumps(r))


if __name__ == "__main__":
    main()
