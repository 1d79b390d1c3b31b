"""What ``swarm serve`` serves and where: the model a MODEL argument names (a folder, a Hub id,
``embedded``, or a trained model of the registry with the settings it was trained with) and
the stages' placement, a pure function of the model's shape and the live nodes' records.
Never imports torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from swarmp2p.plan.model_shape import EMBEDDED

if TYPE_CHECKING:
    from swarmp2p.node.jobtable import JobTable

DTYPES = ("float32", "bfloat16", "float16")


class ServeError(ValueError):
    """A serving request that cannot be met (bad field, no placement, a stage failed)."""


def _best_device(record: dict[str, Any]) -> tuple[str, int]:
    """(planner device name, usable bytes) of a node's roomiest device, GPUs first."""
    from swarmp2p.plan.placement import DEVICE_RESERVE

    devices = record.get("devices") or []
    gpus = [d for d in devices if d.get("kind") != "cpu"]
    pool = gpus or [d for d in devices if d.get("kind") == "cpu"]
    best = None
    for d in pool:
        usable = max(int(d.get("memory_free") or 0) - DEVICE_RESERVE.get(d.get("kind"), 0), 0)
        name = "cpu" if d.get("kind") == "cpu" else f"{d.get('kind')}:{d.get('index')}"
        if best is None or usable > best[1]:
            best = (name, usable)
    return best or ("cpu", 0)


def place_stages(
    shape: Any,
    records: list[dict[str, Any]],
    *,
    stages: int,
    max_sessions: int,
    max_context: int,
    dtype: str,
    quantization: dict | None = None,
    bounds: list[list[int]] | None = None,
    holders: list[list[str]] | None = None,
) -> list[dict[str, Any]]:
    """Stage placements first to last: ``{"node_id", "device", "layer_start", "layer_end",
    "memory"}``. ``stages`` 0 is one per node (at most one per block). Nodes with the most
    usable memory are chosen and kept in node-id order; more stages than nodes go round them.

    A trained model gives its ``bounds`` (the split it was trained with) and, per stage, the
    ``holders`` of its shard: a stage goes to the first live holder it fits on, else to the
    live node with the most room left (which then fetches the shard).
    ServeError names every stage that does not fit, with the bytes."""
    from swarmp2p.plan import Pricing, StagePricer, Workload, normalize_quantization
    from swarmp2p.serve.local import even_bounds

    if not records:
        raise ServeError("no live node to place a serving stage on")
    n = len(bounds) if bounds else stages or min(len(records), shape.n_layers)
    if not 1 <= n <= shape.n_layers:
        raise ServeError(f"stages: {n} is not in [1, {shape.n_layers}] (the model's blocks)")
    spans = [tuple(b) for b in bounds] if bounds else even_bounds(shape.n_layers, n)
    quant = normalize_quantization(quantization) if quantization else None
    pricer = StagePricer(
        shape,
        Pricing(dtype=dtype, finetune_mode="none", quantization=quant),
        Workload(training=False, serving_sessions=max_sessions, serving_tokens=max_context),
    )
    devices = {r["node_id"]: _best_device(r) for r in records}
    ranked = sorted(records, key=lambda r: (-devices[r["node_id"]][1], r["node_id"]))
    chosen = sorted(r["node_id"] for r in ranked[:n])
    left = {node: devices[node][1] for node in devices}
    out, problems = [], []
    for i, (start, end) in enumerate(spans):
        memory = pricer.price(start, end, first=i == 0, last=i == n - 1).peak
        if holders is None:
            node = chosen[i % len(chosen)]
        else:
            mine = [h for h in holders[i] if h in devices]
            others = sorted(
                (nd for nd in devices if nd not in mine), key=lambda nd: (-left[nd], nd)
            )
            fits = [nd for nd in (*mine, *others) if left[nd] >= memory]
            node = fits[0] if fits else (mine or others)[0]
        if memory > left[node]:
            problems.append(
                f"stage {i} (blocks {start}-{end - 1}) needs {memory / 2**20:.1f} MiB, node "
                f"{node} ({devices[node][0]}) has {left[node] / 2**20:.1f} MiB usable"
            )
        left[node] -= memory
        out.append(
            {
                "node_id": node,
                "device": devices[node][0],
                "layer_start": start,
                "layer_end": end,
                "memory": int(memory),
            }
        )
    if problems:
        raise ServeError(
            f"cannot place {n} serving stage(s) for {max_sessions} session(s) of "
            f"{max_context} tokens: "
            + "; ".join(problems)
            + "; lower --max-sessions/--max-context, quantize, or add nodes"
        )
    return out


# --- the model a MODEL argument names ---------------------------------------------------------


def trained_entry(table: JobTable, model: str) -> dict[str, Any] | None:
    """The registry entry of ``model`` (``swarm models``), with its job's quantization, or
    None when MODEL names no trained model."""
    from swarmp2p.node.registry import models as registry_models

    entry = next((m for m in registry_models(table.jobs) if m.get("id") == model), None)
    if entry is None or entry["job_id"] not in table.jobs:
        return None
    quant = table.jobs[entry["job_id"]].job.model.quantization
    return {**entry, "quantization": None if quant is None else quant.to_dict()}


def trained_settings(
    trained: dict[str, Any], stages: int, req: dict[str, Any], quantization: dict | None
) -> tuple[str, dict | None]:
    """(dtype, quantization) a trained model serves with: the split, the quantization and by
    default the dtype it was trained with."""
    manifest = trained["manifest"]
    split = manifest["split"]
    if stages and stages != len(split):
        raise ServeError(
            f"stages: {trained['id']} was trained in {len(split)} stages {split}; it is served "
            f"with that split (leave --stages out or give --stages {len(split)})"
        )
    theirs = trained.get("quantization")
    if quantization is not None and quantization != theirs:
        raise ServeError(
            f"quantization: {trained['id']} was trained with quantization {theirs}; its shards "
            "are served on the base they were trained on (leave --quantization out)"
        )
    missing = [s["stage"] for s in manifest["stages"] if not s.get("files")]
    if missing:
        raise ServeError(
            f"model {trained['id']}: stage(s) {missing} have no exported shard in the registry"
        )
    dtype = req.get("dtype") or manifest["dtype"]
    if dtype != manifest["dtype"]:
        raise ServeError(
            f"dtype: {trained['id']} was trained in {manifest['dtype']}; it is served in that "
            "dtype (leave --dtype out)"
        )
    return dtype, theirs


def resolve_model(model: str, trained: dict[str, Any] | None = None) -> str:
    """The folder (or Hub id) of a ``swarm serve MODEL`` argument (a trained model's base)
    on this node: its shape and tokenizer are read here."""
    from swarmp2p.runtime.models import EmbeddedModelMissing, ensure_embedded, resolve_model_ref

    what = f"the base model {model!r} of {trained['id']}" if trained else f"model {model!r}"
    if model == EMBEDDED:
        try:  # converted on first use, in a subprocess: the daemon never imports torch
            return str(ensure_embedded())
        except (EmbeddedModelMissing, RuntimeError) as exc:
            raise ServeError(f"{what} on this node: {exc}") from None
    try:
        return resolve_model_ref(model)
    except ValueError as exc:
        if trained:
            nodes = sorted({s["node"] for s in trained["manifest"]["stages"]})
            raise ServeError(
                f"{what} is not on this node ({exc}); serve it from a node that has its base "
                f"(it trained on {', '.join(nodes)})"
            ) from None
        raise ServeError(str(exc)) from None
