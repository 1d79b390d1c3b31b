"""Builders shared by the planner tests: nodes, devices, jobs, tiny model configs."""

from __future__ import annotations

import copy
from typing import Any

from swarmp2p.plan import Device, Node, parse_job

GiB = 2**30


def gpu(name: str, cc: str, free_gb: float, index: int = 0, total_gb: float | None = None):
    free = int(free_gb * GiB)
    return Device(
        kind="cuda",
        index=index,
        name=name,
        memory_total=int((total_gb or free_gb) * GiB),
        memory_free=free,
        compute_capability=cc,
    )


def cpu(free_gb: float, name: str = "x86-64 CPU") -> Device:
    return Device(
        kind="cpu",
        index=0,
        name=name,
        memory_total=int(free_gb * GiB),
        memory_free=int(free_gb * GiB),
    )


def node(node_id: str, *devices: Device, disk_gb: float = 500, caps=None, name=None) -> Node:
    kwargs: dict[str, Any] = {}
    if caps is not None:
        kwargs["capabilities"] = frozenset(caps)
    return Node(
        node_id=node_id,
        name=name or node_id,
        ram=64 * GiB,
        disk_free=int(disk_gb * GiB),
        devices=tuple(devices),
        **kwargs,
    )


A5000 = ("RTX A5000", "8.6")
GTX1660S = ("GTX 1660 SUPER", "7.5")
GTX1080 = ("GTX 1080", "6.1")


def mixed_pair(free_a: float = 23.0, free_b: float = 5.5) -> list[Node]:
    return [
        node("n1", gpu(*A5000, free_a), name="fellow-1"),
        node("n2", gpu(*GTX1660S, free_b), name="fellow-2"),
    ]


BASE_JOB: dict[str, Any] = {
    "name": "t",
    "model": {"pretrained": "embedded"},
    "train": {"steps": 1, "batch_size": 4, "seq_len": 128, "micro_batches": 4},
}


def job(**sections: Any):
    """BASE_JOB with sections merged in one level deep: job(split={"mode": "equal"})."""
    data = copy.deepcopy(BASE_JOB)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    return parse_job(data)


def llama_config(layers: int = 8, hidden: int = 64, vocab: int = 256, **extra: Any) -> dict:
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "max_position_embeddings": 512,
        "torch_dtype": "bfloat16",
    }
    cfg.update(extra)
    return cfg
