"""The speed probe: ``python -m swarmp2p.runtime.probe`` measures training throughput per device
and dtype in a worker subprocess (the daemon never imports torch).

It reads one JSON request on stdin::

    {"devices": [{"key": "cuda:0", "torch_device": "cuda:0", "dtypes": ["bfloat16", ...]}],
     "threads": 2, "seconds": 1.0, "cpus": 2.0}

and prints one JSON line ``{"speeds": {key: {dtype: FLOP/s}}, "torch": version, "errors":
{key: message}}``. A fake GPU (``SWARM_FAKE_DEVICES``) runs on the CPU, so its request names
``torch_device: "cpu"``. The workload is a residual MLP block (Linear h -> 4h, GELU, Linear 4h -> h),
forward and backward, counted as 6 FLOPs per parameter and token like the planner
(``swarmp2p.plan.speed``); on a CPU in float32 its layers run oneDNN's products, as a training
stage's do (``runtime/torch/model/packed.py``). Each measurement runs ``seconds`` of wall time after
a warm-up, so
a CPU quota (a cgroup's ``cpu.cfs_quota_us`` over its 100 ms period) shows in the result.

On a CPU the request's ``cpus`` (the CPUs the node may keep busy: its threads, capped by its
affinity and its quota, fractional) keeps a passing load out of the result: a probe that got
less CPU time than ``cpus`` x its wall time (other processes took the rest) is rated on the CPU
time it got, at ``cpus``' pace. Measured on 2 cores, beside another probe and a loaded box: a
1-CPU node's wall-time rate read 37-55 GFLOP/s against 66-73 alone, and the speed split it
cached gave a 0.35-CPU node 3 of 8 layers instead of 2.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

SECONDS = 1.0
"""Wall time each (device, dtype) is timed: at least ten 100 ms CFS periods."""
MIN_ITERATIONS = 3
_SIZES = {"cpu": (256, 256), "cuda": (2048, 4096), "mps": (1024, 2048)}
"""(hidden, tokens) of the probe block per device kind: big enough to keep the device's
matmul units busy, small enough that an emulated dtype on a CPU still runs a few times."""


def rate(flops: float, wall_s: float, cpu_s: float, cpus: float | None) -> float:
    """FLOP/s of ``flops`` done in ``wall_s`` seconds using ``cpu_s`` CPU seconds, by a process
    that may keep ``cpus`` CPUs busy (None: a device whose CPU time says nothing, a GPU):
    over the wall time, or over ``cpu_s / cpus`` when others took part of its share."""
    if not cpus or cpus <= 0 or cpu_s <= 0:
        return flops / wall_s
    return flops / min(wall_s, cpu_s / cpus)


def measure(
    torch_device: str, dtype: str, *, seconds: float = SECONDS, cpus: float | None = None
) -> float:
    """Training FLOP/s of the probe block on ``torch_device`` in ``dtype``; ``cpus``: the CPUs
    a CPU measurement may use (``rate``)."""
    import torch

    from swarmp2p.runtime.torch.model.packed import use_onednn

    device = torch.device(torch_device)
    hidden, tokens = _SIZES.get(device.type, _SIZES["cpu"])
    gen = torch.Generator().manual_seed(0)
    up = torch.nn.Linear(hidden, 4 * hidden)
    down = torch.nn.Linear(4 * hidden, hidden)
    block = torch.nn.Sequential(up, torch.nn.GELU(), down).to(
        device=device, dtype=getattr(torch, dtype)
    )
    use_onednn(block)  # on a CPU in float32, the products a training stage runs
    params = sum(p.numel() for p in block.parameters())
    x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=getattr(torch, dtype))
    x.requires_grad_(True)

    def once() -> None:
        out = x + block(x)
        out.float().square().mean().backward()
        block.zero_grad(set_to_none=True)
        x.grad = None

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    once()  # warm-up: allocations, kernel selection
    sync()
    n, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while True:
        once()
        n += 1
        if n >= MIN_ITERATIONS:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
    cpu_s = time.process_time() - cpu_start
    return rate(6.0 * params * tokens * n, elapsed, cpu_s, cpus if device.type == "cpu" else None)


def run(request: dict[str, Any]) -> dict[str, Any]:
    """The probe's answer to one request (see the module docstring)."""
    import torch

    threads = request.get("threads")
    if isinstance(threads, int) and threads >= 1:
        torch.set_num_threads(threads)
    seconds = float(request.get("seconds") or SECONDS)
    cpus = request.get("cpus")
    cpus = float(cpus) if isinstance(cpus, (int, float)) and cpus > 0 else None
    speeds: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    done: dict[tuple[str, str], float] = {}
    for item in request.get("devices", []):
        key, where = str(item["key"]), str(item["torch_device"])
        for dtype in item.get("dtypes", []):
            try:
                if (where, dtype) not in done:
                    done[(where, dtype)] = measure(where, dtype, seconds=seconds, cpus=cpus)
                speeds.setdefault(key, {})[dtype] = float(f"{done[(where, dtype)]:.4g}")
            except Exception as exc:  # a dtype this device cannot run: say so, measure the rest
                errors[f"{key} {dtype}"] = f"{type(exc).__name__}: {exc}"[:500]
    return {"speeds": speeds, "torch": torch.__version__, "errors": errors}


def main() -> int:
    try:
        request = json.loads(sys.stdin.read())
        if not isinstance(request, dict):
            raise ValueError("the request must be a JSON object")
    except ValueError as exc:
        print(json.dumps({"error": f"bad probe request: {exc}"}))
        return 2
    print(json.dumps(run(request)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
