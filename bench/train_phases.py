"""From `swarm train` to the first step, phase by phase (issue 31): three loopback daemons run
the embedded SmolLM2-135M LoRA job of ``examples/lora.json`` (a few steps); the job's view is
polled every 0.25 s through the local API, and each change of state or of a stage's phase is
timed from the submission.

Prints a markdown table (seconds since `swarm train`, state, each stage's phase), then one JSON
object as the last line. Noisy box: the phases' order and shares say more than the seconds.

    python bench/train_phases.py [--steps N] [--eval-batches B] [--quick]
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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _swarm import LoopbackSwarm, wait  # noqa: E402


def _phases(view: dict) -> tuple[str, ...]:
    stages = ((view.get("metrics") or {}).get("phases") or {}).get("stages") or {}
    out = []
    for stage, p in sorted(stages.items(), key=lambda kv: int(kv[0])):
        word = f"s{stage} {p['phase']}"
        if p.get("total"):
            word += f" {p['done'] / 1e6:.0f}/{p['total'] / 1e6:.0f} MB"
        out.append(word)
    return tuple(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--eval-batches", type=int, default=2)
    parser.add_argument(
        "--quick", action="store_true", help="one step, no evaluation (CI: the script runs)"
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.eval_batches = 1, 0
    from swarmp2p.net.security import SwarmSecret

    env = {
        **os.environ,
        "SWARM_TOKEN": SwarmSecret.generate().token,
        "SWARM_DASHBOARD_PORT": "off",
        "SWARM_SPEED_PROBE": "off",
        "OMP_NUM_THREADS": "1",
    }
    job = json.loads((ROOT / "examples" / "lora.json").read_text())
    job["train"].update(steps=args.steps, eval_batches=args.eval_batches)
    with tempfile.TemporaryDirectory() as tmp, LoopbackSwarm("abc", Path(tmp), env=env) as sw:
        wait(lambda: all(sw.ready(n) for n in "abc"), 90, "the swarm")
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        began = time.monotonic()
        out = sw.cli("b", "train", str(Path(tmp) / "job.json"), "--detach", "--json")
        if out.returncode != 0:
            raise SystemExit(out.stderr + sw.log_tail())
        job_id = json.loads(out.stdout)["job_id"]
        rows: list[tuple[float, str, tuple[str, ...]]] = []
        while time.monotonic() - began < 600:
            view = sw.api("b", "job", job_id=job_id)
            now = (view["state"], _phases(view))
            if not rows or rows[-1][1:] != now:
                rows.append((round(time.monotonic() - began, 1), *now))
            if view["state"] in ("COMPLETED", "FAILED", "CANCELLED") or view["step"] >= 1:
                break
            time.sleep(0.25)
    print("| s since `swarm train` | state | phases |\n|---|---|---|")
    for at, state, phases in rows:
        print(f"| {at} | {state} | {' · '.join(phases) or '-'} |")
    first = rows[-1][0] if rows and rows[-1][1] != "FAILED" else None
    print(json.dumps({"first_step_s": first, "changes": [list(r) for r in rows]}))


if __name__ == "__main__":
    main()
