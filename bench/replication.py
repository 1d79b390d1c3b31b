"""Bytes per second the leader sends to replicate the job table during a 3-stage training job.

Three real daemons on loopback (each `swarm up --foreground`, static peers, no mDNS) train a
3-stage LoRA job on a tiny random Llama through `swarm train`; the leader's
``status["replication"]`` counters (bytes of every table message it sent: deltas and whole
tables) are read before the submission and after completion. The job reports every 0.2 s
like any job; the table sees only lifecycle events and a progress sample every few seconds.

``--persist`` measures instead what one append costs on disk, with no daemons: the whole
table rewritten at every append (``jobtable.save``, as before the log) beside the log's
append (``node/table/store.py``, its periodic snapshots included), on tables of growing size,
side by side in one run: bytes written and milliseconds per append.

Prints a markdown table, then as its last line one JSON object.

    python bench/replication.py [--quick] [--steps N] [--persist]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a fresh checkout
sys.path.insert(0, str(ROOT / "bench"))

from _swarm import LoopbackSwarm, wait  # noqa: E402


def _tiny_llama(folder: Path) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def run(args) -> dict:
    from swarmp2p.net.security import SwarmSecret

    tmp = Path(tempfile.mkdtemp(prefix="swarm-repl-"))
    model = tmp / "model"
    _tiny_llama(model)
    token = SwarmSecret.generate().token
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    env.update(PYTHONPATH=str(ROOT), SWARM_TOKEN=token, OMP_NUM_THREADS="1")
    with LoopbackSwarm("abc", tmp, env=env, failure_timeout=2.0) as sw:
        wait(lambda: sw.ready("a"), 60, "the swarm")
        job = {
            "name": "repl",
            "model": {"pretrained": str(model), "lora": {"enabled": True, "r": 4}},
            "data": {"source": "random"},
            "split": {"stages": 3, "mode": "equal"},
            "train": {
                "steps": args.steps,
                "batch_size": 4,
                "seq_len": 16,
                "micro_batches": 2,
                "checkpoint_every": max(args.steps // 3, 1),
                "eval_batches": 1,
            },
        }
        (tmp / "job.json").write_text(json.dumps(job))
        before = sw.status("a")["replication"]
        start = time.monotonic()
        out = sw.cli("c", "train", str(tmp / "job.json"), "--detach", "--json")
        if out.returncode:
            raise SystemExit(f"submit failed: {out.stderr}")
        job_id = json.loads(out.stdout)["job_id"]

        def done():
            jobs = {j["job_id"]: j for j in sw.status("a")["jobs"]}
            state = jobs[job_id]["state"]
            if state in ("failed", "cancelled"):
                raise SystemExit(f"job {state}: {jobs[job_id]['record'].get('error')}")
            return state == "completed" and jobs[job_id]["record"].get("model")

        wait(done, 900, "the job")
        seconds = time.monotonic() - start
        after = sw.status("a")["replication"]
    sent = {k: after[k] - before.get(k, 0) for k in after}
    return {
        "steps": args.steps,
        "job_s": round(seconds, 2),
        "table_bytes": sent["bytes_sent"],
        "table_bytes_per_s": round(sent["bytes_sent"] / seconds, 1),
        "deltas": sent.get("deltas"),
        "snapshots": sent.get("snapshots"),
        "events": sent.get("events"),
    }


def persist(args) -> dict:
    """Bytes and time per append: the whole table rewritten vs the log (snapshots included)."""
    sys.path.insert(0, str(ROOT / "tests" / "unit" / "node"))
    from _tables import running

    from swarmp2p.node.table import events as ev
    from swarmp2p.node.table import jobtable
    from swarmp2p.node.table.store import TableStore

    appends = 50 if args.quick else 300
    rows = []
    for jobs in (1, 50, 400) if args.quick else (1, 50, 400, 1600):
        table = running().table
        job = table.jobs["j1"].job
        version = table.version
        for i in range(jobs - 1):
            version += 1
            event = ev.JobSubmitted(job_id=f"k{i}", job=job, submitted_by="cli", at=1.0)
            table = jobtable.apply(table, ev.Entry(version=version, term=1, event=event))
        entries, tables = [], [table]
        for step in range(1, appends + 1):
            event = ev.StepsReported(job_id="j1", attempt=1, step=step, loss=4.0, at=1.0 * step)
            entries.append(ev.Entry(version=tables[-1].version + 1, term=1, event=event))
            tables.append(jobtable.apply(tables[-1], entries[-1]))
        row = {"jobs": jobs}
        with tempfile.TemporaryDirectory(prefix="swarm-persist-") as tmp:
            path = Path(tmp) / "whole.json"
            start, written = time.perf_counter(), 0
            for t in tables[1:]:
                jobtable.save(path, t)
                written += path.stat().st_size
            row["whole_ms"] = (time.perf_counter() - start) * 1e3 / appends
            row["whole_bytes"] = written / appends
            store = TableStore(Path(tmp) / "jobs.json")
            store.snapshot(tables[0])
            store.bytes_written = 0
            start = time.perf_counter()
            for base, t, entry in zip(tables, tables[1:], entries):
                store.write(t, base, [entry])
            row["log_ms"] = (time.perf_counter() - start) * 1e3 / appends
            row["log_bytes"] = store.bytes_written / appends
            row["table_bytes"] = len(jobtable.encode(tables[-1]))
        row["bytes_ratio"] = row["whole_bytes"] / row["log_bytes"]
        row["time_ratio"] = row["whole_ms"] / row["log_ms"]
        rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    return {"appends": appends, "rows": rows}


def main_persist(args) -> None:
    result = persist(args)
    print(f"{result['appends']} appends of one StepsReported each, fsync'd")
    print(
        "| jobs | table bytes | whole: bytes/append | log: bytes/append | bytes ratio "
        "| whole: ms/append | log: ms/append | time ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(
            f"| {r['jobs']} | {r['table_bytes']} | {r['whole_bytes']:.0f} | {r['log_bytes']:.0f} "
            f"| {r['bytes_ratio']:.1f}x | {r['whole_ms']:.2f} | {r['log_ms']:.2f} "
            f"| {r['time_ratio']:.1f}x |"
        )
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps (CI)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--persist", action="store_true", help="append cost on disk, no daemons")
    args = parser.parse_args()
    if args.persist:
        return main_persist(args)
    if args.quick:
        args.steps = 6
    result = run(args)
    print("| steps | job s | table bytes | bytes/s | deltas | whole tables | events |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {result['steps']} | {result['job_s']} | {result['table_bytes']} | "
        f"{result['table_bytes_per_s']} | {result['deltas']} | {result['snapshots']} | "
        f"{result['events']} |"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
