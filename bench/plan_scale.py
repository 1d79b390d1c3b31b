"""How long planning takes at swarm scale: 64 nodes, an 80-layer model, dense and MoE.

Plans a LoRA job with `plan_job` (every split mode; `cost` does the most work) over 64
single-GPU nodes of mixed cards and reports the median wall time of each. Prints a markdown
table, then as its last line one JSON object: {"dense_ms": ..., "moe_ms": ...} (the medians of
the `cost` split, the slowest mode). Target: under 50 ms each.

    python bench/plan_scale.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from swarmp2p.plan import Device, Node, Plan, from_config, parse_job, plan_job

GiB = 2**30
CARDS = [
    ("RTX A5000", "8.6", 24),
    ("RTX 3090", "8.6", 24),
    ("RTX A4000", "8.6", 16),
    ("GTX 1660 SUPER", "7.5", 6),
    ("RTX 2080 Ti", "7.5", 11),
    ("RTX 4090", "8.9", 24),
]

DENSE = {  # Llama-2-70B's shape
    "model_type": "llama",
    "num_hidden_layers": 80,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}
MOE = {  # an 80-layer MoE: 3 dense layers, then 64 routed experts (top 8) plus 2 shared
    "model_type": "deepseek_v2",
    "num_hidden_layers": 80,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "num_experts_per_tok": 8,
    "n_shared_experts": 2,
    "first_k_dense_replace": 3,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 102400,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def cluster(n: int = 64) -> list[Node]:
    nodes = []
    for i in range(n):
        name, cc, gb = CARDS[i % len(CARDS)]
        free = int((gb - 0.4 - (i % 5) * 0.1) * GiB)
        dev = Device(
            kind="cuda",
            index=0,
            name=name,
            memory_total=gb * GiB,
            memory_free=free,
            compute_capability=cc,
        )
        nodes.append(
            Node(
                node_id=f"node-{i:03d}",
                name=f"host{i}",
                ram=64 * GiB,
                disk_free=500 * GiB,
                devices=(dev,),
            )
        )
    return nodes


def job(mode: str):
    return parse_job(
        {
            "name": f"bench-{mode}",
            "model": {"pretrained": "bench", "lora": {"enabled": True, "r": 16}},
            "split": {"stages": "auto", "mode": mode, "compression": "fixed_int8"},
            "train": {"batch_size": 8, "seq_len": 1024, "micro_batches": 8},
        }
    )


def measure(shape, nodes, mode: str, repeats: int) -> tuple[float, Plan]:
    j = job(mode)
    result = plan_job(j, nodes, shape=shape)  # warm-up, and the plan to report
    if not isinstance(result, Plan):
        raise SystemExit(f"{shape.name} {mode}: blocked: {result.placement_blocked_reason}")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan_job(j, nodes, shape=shape)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats (a smoke check)")
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    nodes = cluster()
    shapes = {"dense": from_config(DENSE, name="dense-80"), "moe": from_config(MOE, name="moe-80")}
    rows, medians = [], {}
    for label, shape in shapes.items():
        for mode in ("equal", "weighted", "cost"):
            ms, plan = measure(shape, nodes, mode, repeats)
            sizes = [s.layer_end - s.layer_start for s in plan.stages]
            rows.append((label, mode, len(plan.stages), min(sizes), max(sizes), plan.dtype, ms))
            if mode == "cost":
                medians[f"{label}_ms"] = round(ms, 2)
    print(f"plan_job over {len(nodes)} nodes, 80 layers, LoRA, median of {repeats}\n")
    print("| model | split | stages | min layers | max layers | dtype | median ms |")
    print("|---|---|---|---|---|---|---|")
    for label, mode, n, lo, hi, dtype, ms in rows:
        print(f"| {label} | {mode} | {n} | {lo} | {hi} | {dtype} | {ms:.2f} |")
    print()
    print(json.dumps(medians))


if __name__ == "__main__":
    main()
