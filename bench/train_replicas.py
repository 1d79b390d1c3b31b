"""Replicas of a pipeline (issue 29), stage workers driven directly on this machine, side by side
in one run: one pipeline of 2 stages, 2 replicas x 2 stages synchronised per step (float32
gradients), and 2 x 2 with DiLoCo (int8 parameter changes every H steps). Real worker processes,
CURVE links between stages and between replicas, a tiny random Llama learning a bigram chain.

    python bench/train_replicas.py [--quick] [--steps N] [--every H]

Reports per run: tokens/s (every replica's tokens over the wall time between the last stage's
step ends), the bytes replica 0's members sent their replicas per 100 steps (headers
included), sync seconds per step, and the held-out loss after the run. Ratios: DiLoCo's bytes
against step mode's, and its held-out loss against step mode's after the same tokens. On one
shared 2-core machine four workers share the cores, so the tokens/s of 2 x 2 over 1 x 2 says
nothing about separate machines (the issue's netns measure); the bytes and the losses do.
Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_pipeline import ROOT, learnable_tokens, start_worker, tiny_folder

from swarmp2p.net import SwarmSecret
from swarmp2p.plan import load_model_shape, parse_job
from swarmp2p.plan.worker_spec import local_plan, worker_spec


def _job(folder: Path, tokens: Path, args, replicas: int, sync: dict) -> dict:
    return {
        "name": "bench-replicas",
        "model": {"pretrained": str(folder)},
        "data": {"source": str(tokens)},
        "split": {"replicas": replicas},
        "train": {
            "steps": args.steps,
            "batch_size": args.batch,
            "seq_len": args.seq,
            "micro_batches": 2,
            "lr": 3e-3,
            "eval_batches": 2,
            "recompute": False,
            "sync": sync,
        },
    }


def _read_until_ready(proc) -> dict:
    for line in proc.stdout:
        event = json.loads(line)
        if event["event"] == "ready":
            return event
        if event["event"] == "error":
            raise SystemExit(f"worker failed: {event}")
    raise SystemExit("a worker exited before it was ready")


def run(folder: Path, tokens: Path, args, replicas: int, sync: dict) -> dict:
    """One run of ``replicas`` x 2 worker stages; what replica 0's stages reported."""
    job = parse_job(_job(folder, tokens, args, replicas, sync))
    plan = local_plan(job, load_model_shape(str(folder)), cuts=[2])
    token = SwarmSecret.generate().token
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs: dict[tuple[int, int], subprocess.Popen] = {}
    ready: dict[tuple[int, int], dict] = {}
    for r in range(replicas):
        port = None
        for i in (1, 0):
            local: dict = {"replica": r, "link_timeout_s": 300}
            if r > 0:  # dial replica r - 1's bound ring ends; the last also replica 0's
                local["ring_prev"] = f"tcp://127.0.0.1:{ready[(r - 1, i)]['ring_next_port']}"
            if r > 0 and r == replicas - 1:
                local["ring_next"] = f"tcp://127.0.0.1:{ready[(0, i)]['ring_prev_port']}"
            nxt = f"tcp://127.0.0.1:{port}" if port is not None else None
            data_path = str(tokens) if i == 0 else None
            spec = worker_spec(job, plan, i, token=token, next_endpoint=nxt,
                               tokens_path=data_path, **local).to_dict()  # fmt: skip
            procs[(r, i)] = proc = start_worker(spec, env)
            ready[(r, i)] = _read_until_ready(proc)
            port = ready[(r, i)]["port"]
    events: dict[tuple[int, int], list[dict]] = {}
    for key, proc in procs.items():
        events[key] = [json.loads(line) for line in proc.stdout]
        proc.wait()
        proc.stdout.close()
        if bad := [e for e in events[key] if e["event"] == "error"]:
            raise SystemExit(f"worker {key} failed: {bad[0]}")
    last = [e for e in events[(0, 1)] if e["event"] == "step"]
    ends = [e["at"] for e in last]
    wall = statistics.median(b - a for a, b in zip(ends[args.warmup - 1 :], ends[args.warmup :]))
    steps = {i: [e for e in events[(0, i)] if e["event"] == "step"] for i in (0, 1)}
    sent = sum(e["sync_bytes"] for i in (0, 1) for e in steps[i])
    held = [e for e in events[(0, 1)] if e["event"] == "eval" and e["pass"] == "trained"]
    return {
        "tokens_per_s": replicas * args.batch * args.seq / wall,
        "sync_bytes_per_100_steps": sent * 100 / args.steps,
        "sync_ms_per_step": 1e3 * statistics.mean(e["sync_s"] for e in steps[1]),
        "held_out_loss": held[0]["loss"] if held else None,
        "train_loss_last": last[-1]["loss"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (CI)")
    parser.add_argument("--steps", type=int, default=None, help="default 100 (quick 20)")
    parser.add_argument("--every", type=int, default=None, help="DiLoCo's H (50; quick 10)")
    parser.add_argument("--batch", type=int, default=4, help="each replica's batch")
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args(argv)
    args.steps = args.steps or (20 if args.quick else 100)
    args.every = args.every or (10 if args.quick else 50)
    args.warmup = 2
    folder = tiny_folder()
    # enough windows for two replicas' batches every step, and a held-out share
    tokens = learnable_tokens(
        folder, types.SimpleNamespace(precision_steps=args.steps, batch=2 * args.batch,
                                      seq=args.seq), quick=True)  # fmt: skip
    diloco = {"mode": "diloco", "every": args.every, "bits": 8}
    runs = {
        "1 x 2": run(folder, tokens, args, 1, {"mode": "step"}),
        "2 x 2 step": run(folder, tokens, args, 2, {"mode": "step"}),
        f"2 x 2 diloco H={args.every} int8": run(folder, tokens, args, 2, diloco),
    }
    step, dil = runs["2 x 2 step"], runs[f"2 x 2 diloco H={args.every} int8"]
    fewer = step["sync_bytes_per_100_steps"] / max(dil["sync_bytes_per_100_steps"], 1)
    loss_ratio = (
        dil["held_out_loss"] / step["held_out_loss"]
        if dil["held_out_loss"] and step["held_out_loss"]
        else None
    )
    print(
        f"## Replicas, stage workers driven directly: tiny random Llama (4 x 128), batch "
        f"{args.batch} x {args.seq} tokens per replica, {args.steps} steps, one shared machine\n"
    )
    print("| run | tokens/s | vs 1 x 2 | sync bytes / 100 steps | sync ms / step | held-out loss |")
    print("|---|---|---|---|---|---|")
    base = runs["1 x 2"]["tokens_per_s"]
    for name, r in runs.items():
        loss = f"{r['held_out_loss']:.4f}" if r["held_out_loss"] is not None else "-"
        print(
            f"| {name} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f}x | "
            f"{r['sync_bytes_per_100_steps']:,.0f} | {r['sync_ms_per_step']:.2f} | {loss} |"
        )
    print(f"\nDiLoCo sends {fewer:.0f}x fewer bytes than step mode", end="")
    if loss_ratio is not None:
        print(f"; its held-out loss is {100 * (loss_ratio - 1):+.1f}% of step mode's", end="")
    print(".")
    result = {
        "runs": runs,
        "diloco_bytes_fewer": fewer,
        "diloco_over_step_held_out_loss": loss_ratio,
        "replicas_over_one_tokens_per_s": step["tokens_per_s"] / base,
        "steps": args.steps,
        "every": args.every,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
