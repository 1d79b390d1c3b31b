"""The model registry: a COMPLETED job's model, kept in its job-table record. Pure.

A model's manifest names the base model, split, compression, LoRA, dtype, evaluation, and
where each stage shard is (node, folder inside the job folder, and the nodes holding copies)
with the sha256 of every file. Shards stay on the nodes that trained them (``swarm serve``
adds a standby copy of each); ``swarm export`` gathers them from any holder.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NotRequired, TypedDict, cast

from swarmp2p.errors import UserError

if TYPE_CHECKING:
    from swarmp2p.node.table.jobtable import JobEntry


class RegistryStage(TypedDict):
    """Where one stage's shard is: the node that trained it (and the copies made since), the
    folder in its job folder, its blocks and the sha256 of every file."""

    stage: int
    node: str
    folder: str
    layers: list[int]
    files: dict[str, str]
    weights_included: bool
    copies: NotRequired[list[str]]


class Manifest(TypedDict):
    """What a registered model is: base, split, compression, LoRA, dtype, evaluation, stages."""

    base: str
    split: list[list[int]]
    compression: list[object]
    lora: dict[str, object] | None
    finetune_mode: str
    dtype: str
    evaluation: dict[str, dict]
    stages: list[RegistryStage]


class ModelEntry(TypedDict):
    """A registered model (a COMPLETED job's ``model`` in the table; `swarm models` lists them)."""

    id: str
    job_id: str
    base: str
    manifest: Manifest


def unique_model_id(name: str, taken: Iterable[str]) -> str:
    """``name`` made a model id (``[A-Za-z0-9_.-]``) not in ``taken``: ``name``, ``name-2``..."""
    base = re.sub(r"[^\w.-]+", "-", name).strip("-") or "model"
    taken = set(taken)
    if base not in taken:
        return base
    n = 2
    while f"{base}-{n}" in taken:
        n += 1
    return f"{base}-{n}"


def model_entry(model_id: str, entry: JobEntry) -> ModelEntry:
    """The registry entry of a completed job's model."""
    job, plan = entry.job, entry.plan
    assert plan is not None
    stages: list[RegistryStage] = []
    for s in plan.stages:
        shard = entry.shards.get(str(s.index))
        manifest = shard.manifest if shard is not None else {}
        stages.append(
            {
                "stage": s.index,
                "node": shard.node if shard is not None else s.node_id,
                "folder": shard.folder if shard is not None else f"export/stage-{s.index}",
                "layers": list(s.layers),
                "files": manifest.get("files", {}),
                "weights_included": manifest.get("weights_included", True),
            }
        )
    lora = job.model.lora
    return {
        "id": model_id,
        "job_id": entry.job_id,
        "base": job.model.pretrained,
        "manifest": {
            "base": job.model.pretrained,
            "split": [list(s.layers) for s in plan.stages],
            "compression": [b.compression.spec for b in plan.boundaries],
            "lora": {"r": lora.r, "alpha": lora.alpha, "export": lora.export}
            if plan.finetune_mode == "lora"
            else None,
            "finetune_mode": plan.finetune_mode,
            "dtype": plan.dtype,
            "evaluation": dict(entry.evaluation),
            "stages": stages,
        },
    }


def holders(stage: RegistryStage) -> list[str]:
    """The nodes holding a registry stage's shard: the one that trained it, then the copies
    made since (``swarm serve`` keeps a standby copy of every shard)."""
    return [stage["node"], *(n for n in stage.get("copies", []) if n != stage["node"])]


def add_copy(model: ModelEntry, stage: int, node_id: str) -> ModelEntry | None:
    """``model`` with ``node_id`` listed as holding a copy of stage ``stage``'s shard; None
    when it is listed already. ValueError for a stage the model does not have."""
    import copy

    out = copy.deepcopy(model)
    stages = out["manifest"]["stages"]
    if not 0 <= stage < len(stages):
        raise ValueError(f"model {out['id']} has no stage {stage} (it has {len(stages)})")
    if node_id in holders(stages[stage]):
        return None
    stages[stage]["copies"] = [*stages[stage].get("copies", []), node_id]
    return out


def models(jobs: Mapping[str, JobEntry]) -> list[ModelEntry]:
    """Every registered model in a job table's jobs, by id."""
    # the table holds each as plain data (its schema field is a dict): a copy of each
    out = [cast(ModelEntry, dict(entry.model)) for entry in jobs.values() if entry.model]
    return sorted(out, key=lambda m: m["id"])


def find_model(jobs: Mapping[str, JobEntry], model_id: str) -> ModelEntry:
    """The model ``model_id``; ValueError listing the known ones."""
    known = models(jobs)
    for m in known:
        if m["id"] == model_id:
            return m
    ids = ", ".join(m["id"] for m in known) or "none yet"
    raise UserError(
        f"no model {model_id!r} in the registry (known: {ids}); see `swarm models`", code="no_model"
    )
