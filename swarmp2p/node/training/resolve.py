"""Resolving a job's inputs where it is submitted. Never imports torch.

``resolve`` reads what a job needs from this machine: the model's shape (config.json and
safetensors headers; a Hub model's through the Hub), the model's files (a local folder's
names, sizes and sha256) and the data file (its sha256, within ``MAX_DATA_BYTES``);
``stage_names`` lists the files one stage reads; ``LocalModel`` is a model to serve as the
issuing node resolved it. Making the inputs local on a stage's node is ``inputs.Inputs``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from swarmp2p.errors import UserError
from swarmp2p.node.serving import model_files
from swarmp2p.plan import Job, model_shape
from swarmp2p.plan.inputs import DATA_SUFFIXES, DataSource, InputFile, JobInputs, ModelSource
from swarmp2p.plan.model_shape import EMBEDDED, ModelShape
from swarmp2p.plan.worker_spec import reads_data

Listed = list[int | str]
"""A folder model's file as ``serve.stage_start`` lists it: ``[bytes, sha256]``."""

MAX_DATA_BYTES = 4 * 2**30
"""The largest data file `swarm train` ships to stage 0's node (``SWARM_MAX_DATA_BYTES``):
beyond it, put the file on that node, or tokenize it first (a .npy of token ids is ~4x smaller)."""
MAX_DATA_ENV = "SWARM_MAX_DATA_BYTES"
HUB_ID = r"[\w.-]+/[\w.-]+"


# --- resolving, where the job is submitted ------------------------------------------------


def _max_data_bytes() -> int:
    value = os.environ.get(MAX_DATA_ENV, "")
    return int(value) if value.isdigit() else MAX_DATA_BYTES


def _here(ref: str, cwd: str | None) -> Path:
    path = Path(ref).expanduser()
    if not path.is_absolute() and cwd:
        path = Path(cwd) / path
    return path.resolve()


def resolve_model(
    ref: str, *, cwd: str | None, node_id: str
) -> tuple[str, ModelShape, ModelSource]:
    """(the reference as peers see it, the shape, where its files come from) of a job's
    ``model.pretrained`` on this node; UserError naming what is wrong."""
    import re

    if ref == EMBEDDED:
        return ref, model_shape.load(EMBEDDED), ModelSource(kind="embedded")
    folder = _here(ref, cwd)
    if folder.is_dir():
        try:
            shape = model_shape.from_folder(folder, name=ref)
            listing = model_files.folder_listing(folder)
        except (OSError, ValueError) as exc:
            raise UserError(f"model.pretrained: {exc}", code="bad_model") from None
        files = {k: InputFile(bytes=v[0], sha256=v[1]) for k, v in listing.items()}
        source = ModelSource(kind="folder", node=node_id, path=str(folder), files=files)
        return str(folder), shape, source
    if re.fullmatch(HUB_ID, ref) and not ref.startswith((".", "/", "~")):
        from swarmp2p.node import hub

        try:
            shape, source = hub.read_model(ref)
        except hub.HubError as exc:
            raise UserError(str(exc), code="bad_model") from None
        return ref, shape, source
    raise UserError(
        f'model.pretrained: {ref!r} is neither "embedded", a folder on this node '
        f'({folder} does not exist), nor a Hub id such as "HuggingFaceTB/SmolLM2-135M"',
        code="bad_model",
    )


def resolve_data(source: str, *, cwd: str | None, node_id: str) -> tuple[str, DataSource | None]:
    """(the source as peers see it, the file to ship or None) of a job's ``data.source``."""
    from swarmp2p.data.sources import EMBEDDED_CORPUS, HF_PREFIX

    if source in ("random", EMBEDDED_CORPUS) or source.startswith(HF_PREFIX):
        return source, None
    path = _here(source, cwd)
    if not path.is_file():
        raise UserError(
            f"data.source: {source!r} is not a file on this node ({path}); give a .txt, "
            f'.jsonl or .npy file here, "embedded", "random" or "hf:NAME"',
            code="bad_data",
        )
    suffix = path.suffix.lower()
    if suffix not in DATA_SUFFIXES:
        raise UserError(
            f"data.source: {path} is a {suffix or 'suffix-less'} file; give a "
            f"{', '.join(DATA_SUFFIXES)} file",
            code="bad_data",
        )
    size = path.stat().st_size
    cap = _max_data_bytes()
    if size > cap:
        raise UserError(
            f"data.source: {path} is {size / 2**30:.2f} GiB, over the {cap / 2**30:.2f} GiB a "
            f"job ships to its first stage's node; tokenize it to a .npy of token ids, copy it "
            f"to that node and name it there, or raise {MAX_DATA_ENV}",
            code="data_too_large",
        )
    sha = model_files.sha256_file(path)
    data = DataSource(node=node_id, path=str(path), suffix=suffix, bytes=size, sha256=sha)  # type: ignore[arg-type]
    return str(path), data


def resolve(job: Job, *, cwd: str | None, node_id: str) -> tuple[Job, JobInputs]:
    """The job with its local paths made absolute, and its inputs, as this node sees them.
    A ``none`` job reads no data: its ``data.source`` is left as written, never opened."""
    pretrained, shape, model = resolve_model(job.model.pretrained, cwd=cwd, node_id=node_id)
    source, data = job.data.source, None
    if reads_data(job):
        source, data = resolve_data(job.data.source, cwd=cwd, node_id=node_id)
    job = replace(
        job,
        model=replace(job.model, pretrained=pretrained),
        data=replace(job.data, source=source),
    )
    return job, JobInputs(shape=shape, model=model, data=data)


def stage_names(
    folder: Path, listing: Mapping[str, Listed], start: int, end: int, first: bool, last: bool
) -> list[str]:
    """The files of ``listing`` a stage of blocks ``[start, end)`` reads, from the config and
    index already in ``folder``: its blocks' weight files plus config and tokenizer."""
    from swarmp2p.plan.inputs import stage_files

    config = json.loads((folder / "config.json").read_text())
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else None
    shape = model_shape.from_config(config, index)
    source = ModelSource(
        kind="hub",
        repo="x/x",
        revision="0" * 40,
        files={
            k: InputFile(bytes=int(v[0]) if isinstance(v, (list, tuple)) else 0)
            for k, v in listing.items()
        },
    )
    return stage_files(source, model_shape.stage_files(shape, start, end, first, last))


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalModel:
    """A model to serve, as the issuing node resolved it."""

    folder: str
    """What every stage's spec names: a folder here, or a Hub id."""
    codec: str
    """The folder this node reads the tokenizer from."""
    shape: ModelShape
    files: dict[str, Listed] | None = None
    """A folder model's ``{name: [bytes, sha256]}``: stage nodes fetch theirs against it."""
    revision: str = ""
    """A Hub model's commit: every stage downloads the same files."""


__all__ = [
    "HUB_ID",
    "MAX_DATA_BYTES",
    "MAX_DATA_ENV",
    "Listed",
    "LocalModel",
    "resolve",
    "resolve_data",
    "resolve_model",
    "stage_names",
]
