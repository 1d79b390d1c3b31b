"""What ``swarm serve MODEL`` serves: the model a MODEL argument names (a folder, a Hub id,
``embedded``, or a trained model of the registry with the settings it was trained with).
Where it runs is ``plan.serve.plan_serve``'s. Never imports torch."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from swarmp2p.errors import Failed, UserError
from swarmp2p.plan.model_shape import EMBEDDED
from swarmp2p.plan.quantization import QuantSpec

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext
    from swarmp2p.node.serving.ring import Served
    from swarmp2p.node.table.jobtable import JobTable
    from swarmp2p.node.training.stages import StageHost
    from swarmp2p.plan.model_shape import ModelShape
    from swarmp2p.plan.serve import ServeRequest

TrainedEntry = dict[str, Any]
"""A trained model's registry entry (``node/table/registry.py``'s record, ``swarm models``)."""

# --- the model a MODEL argument names ---------------------------------------------------------


def trained_entry(table: JobTable, model: str) -> TrainedEntry | None:
    """The registry entry of ``model`` (``swarm models``), with its job's quantization, or
    None when MODEL names no trained model."""
    from swarmp2p.node.table.registry import models as registry_models

    entry = next((m for m in registry_models(table.jobs) if m.get("id") == model), None)
    if entry is None or entry["job_id"] not in table.jobs:
        return None
    quant = table.jobs[entry["job_id"]].job.model.quantization
    return {**entry, "quantization": None if quant is None else quant.to_dict()}


def trained_settings(
    trained: TrainedEntry, stages: int, dtype: str | None, quantization: QuantSpec | None
) -> tuple[str, QuantSpec | None]:
    """(dtype, quantization) a trained model serves with: the split, the quantization and by
    default the dtype it was trained with."""
    from swarmp2p.plan.quantization import parse_quantization

    manifest = trained["manifest"]
    split = manifest["split"]
    if stages and stages != len(split):
        raise UserError(
            f"stages: {trained['id']} was trained in {len(split)} stages {split}; it is served "
            f"with that split (leave --stages out or give --stages {len(split)})",
            code="bad_field",
        )
    theirs = parse_quantization(trained.get("quantization"))
    if quantization is not None and quantization != theirs:
        raise UserError(
            f"quantization: {trained['id']} was trained with quantization "
            f"{None if theirs is None else theirs.to_dict()}; its shards are served on the base "
            "they were trained on (leave --quantization out)",
            code="bad_field",
        )
    missing = [s["stage"] for s in manifest["stages"] if not s.get("files")]
    if missing:
        raise Failed(
            f"model {trained['id']}: stage(s) {missing} have no exported shard in the registry",
            code="no_file",
        )
    if dtype is not None and dtype != manifest["dtype"]:
        raise UserError(
            f"dtype: {trained['id']} was trained in {manifest['dtype']}; it is served in that "
            "dtype (leave --dtype out)",
            code="bad_field",
        )
    dtype = manifest["dtype"]
    return dtype, theirs


def resolve_model(model: str, trained: TrainedEntry | None = None) -> str:
    """The folder (or Hub id) of a ``swarm serve MODEL`` argument (a trained model's base)
    on this node: its shape and tokenizer are read here."""
    from swarmp2p.models import EmbeddedModelMissing, ensure_embedded, resolve_model_ref

    what = f"the base model {model!r} of {trained['id']}" if trained else f"model {model!r}"
    if model == EMBEDDED:
        try:  # converted on first use, in a subprocess: the daemon never imports torch
            return str(ensure_embedded())
        except (EmbeddedModelMissing, RuntimeError) as exc:
            raise Failed(f"{what} on this node: {exc}", code="no_model") from None
    try:
        return resolve_model_ref(model)
    except ValueError as exc:
        if trained:
            nodes = sorted({s["node"] for s in trained["manifest"]["stages"]})
            raise UserError(
                f"{what} is not on this node ({exc}); serve it from a node that has its base "
                f"(it trained on {', '.join(nodes)})",
                code="no_model",
            ) from None
        raise UserError(str(exc), code="no_model") from None


def _a_bare_name(model: str) -> bool:
    """A MODEL that names no folder here and is no 'org/name' Hub id: a trained model's
    name mistyped, most likely."""
    return model != EMBEDDED and "/" not in model and not os.path.exists(model)


def unknown_model(table: JobTable, model: str) -> UserError:
    """One line for a MODEL that names nothing, with the names it could have meant."""
    from swarmp2p.node.table.registry import models as registry_models

    names = sorted(str(m["id"]) for m in registry_models(table.jobs))
    trained = f"trained: {', '.join(names)}" if names else "none trained yet"
    return UserError(
        f"no model {model!r}: not a trained model of this swarm ({trained}; `swarm models` "
        f"lists them), not a folder on this node, and not a Hub id 'org/name'; or serve "
        f"{EMBEDDED!r}",
        code="no_model",
    )


async def resolve_served(
    ctx: NodeContext, stage_host: StageHost, request: ServeRequest, serve_id: str
) -> Served:
    """What this node serves for ``request``: the model read here (a trained model's base
    and registry entry, its dtype and quantization checked against its training)."""
    from swarmp2p.node.serving import ring as serve_ring
    from swarmp2p.node.table.registry import holders

    serve_ring.check_request(request)
    model = request.model
    trained = trained_entry(ctx.table, model)
    model_arg = model
    if trained is None and request.cwd and model != EMBEDDED and not os.path.isabs(model):
        here = os.path.join(request.cwd, os.path.expanduser(model))
        model_arg = os.path.abspath(here) if os.path.isdir(here) else model
    dtype, quantization = request.dtype, request.quantization
    if trained is not None:
        dtype, quantization = trained_settings(trained, request.stages, dtype, quantization)
    job = ctx.table.jobs.get(str(trained["job_id"])) if trained else None
    # a Hub model, or a trained model's base this node lacks, is read from elsewhere
    try:
        here = await stage_host.inputs.serve_model(
            trained["base"] if trained else model_arg,
            trained=job.inputs if job is not None else None,
            local=lambda ref: resolve_model(ref, trained),
        )
    except UserError as exc:
        if trained is None and exc.code in ("bad_model", "no_model") and _a_bare_name(model_arg):
            raise unknown_model(ctx.table, model) from None
        raise
    folder, shape = here.folder, here.shape
    draft, draft_shape = _draft_of(request, here.codec)
    return serve_ring.Served(
        request=request,
        serve_id=serve_id,
        folder=folder,
        shape=shape,
        dtype=dtype,
        quantization=quantization,
        trained=trained,
        holders=[holders(st) for st in trained["manifest"]["stages"]] if trained else [],
        embedded=model == EMBEDDED or (trained is not None and trained["base"] == EMBEDDED),
        files=here.files,
        local=here,
        draft=draft,
        draft_shape=draft_shape,
    )


def _draft_of(request: ServeRequest, codec: str) -> tuple[str | None, ModelShape | None]:
    """The request's draft model as every node names it (a folder's absolute path, or
    "embedded") and its shape, checked against the served model's tokenizer (in ``codec``)
    here, before any stage loads: UserError naming both models."""
    from swarmp2p.models import resolve_model_ref
    from swarmp2p.plan import model_shape
    from swarmp2p.serve.decoding.draft import check_draft_compatible

    if request.draft is None:
        if request.speculate == "draft":
            raise UserError(
                "speculate: 'draft' needs a draft model (--draft MODEL)", code="bad_field"
            )
        return None, None
    ref = request.draft
    if request.cwd and ref != EMBEDDED and not os.path.isabs(ref):
        here = os.path.join(request.cwd, os.path.expanduser(ref))
        ref = os.path.abspath(here) if os.path.isdir(here) else ref
    try:
        folder = resolve_model_ref(ref)
        if not os.path.isdir(folder):
            raise ValueError(f"draft model {ref!r}: a draft model is a folder or {EMBEDDED!r}")
        check_draft_compatible(codec, folder)
        shape = model_shape.load(folder)
    except (ValueError, OSError) as exc:
        raise UserError(str(exc), code="bad_field") from None
    return (EMBEDDED if ref == EMBEDDED else folder), shape
