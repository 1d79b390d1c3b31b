"""A Hub model read with huggingface_hub, lazily (no torch): its shape from the config and the
safetensors headers (a few KB through HTTP range requests), and the files one stage needs.

``HF_ENDPOINT`` points the client at a mirror (the system tests run a small local one);
``HF_HUB_CACHE``/``HF_HOME`` choose the cache, as for every Hugging Face tool.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from swarmp2p.plan import model_shape
from swarmp2p.plan.inputs import MODEL_FILE, InputFile, ModelSource
from swarmp2p.plan.model_shape import ModelShape
from swarmp2p.schema import Data

if TYPE_CHECKING:
    from huggingface_hub.utils import SafetensorsFileMetadata

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HubError(ValueError):
    """The Hub (or its mirror) cannot give what was asked; the message names repo and file."""


def _hub() -> ModuleType:
    try:
        import huggingface_hub
    except ImportError:  # pragma: no cover - tokenizers depends on it
        raise HubError(
            "a Hub model needs huggingface_hub on this node: pip install huggingface_hub"
        ) from None
    return huggingface_hub


def _errors() -> tuple[type[BaseException], ...]:
    """What the client raises for a missing repo or file, a bad name, or a network failure
    (its own errors, and its HTTP library's, which share no base class with them)."""
    return (Exception,)


def _explain(repo: str, what: str, exc: BaseException) -> HubError:
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return HubError(
        f"Hub model {repo!r}: cannot read {what} from {endpoint} ({first}); check the name and "
        "the network, or give a local folder"
    )


def _header(info: SafetensorsFileMetadata) -> dict[str, Data]:
    """A ``SafetensorsFileMetadata`` as the raw safetensors header ``from_config`` reads."""
    out: dict[str, Data] = {}
    for name, tensor in info.tensors.items():
        out[name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": list(tensor.data_offsets),
        }
    return out


def read_model(repo: str) -> tuple[ModelShape, ModelSource]:
    """The shape of Hub model ``repo`` and its files at the commit read now (a few KB)."""
    hub = _hub()
    api = hub.HfApi()
    try:
        info = api.model_info(repo, files_metadata=True)
    except _errors() as exc:
        snap = cached(repo)
        if snap is None:
            raise _explain(repo, "its file list", exc) from None
        return _from_cache(repo, snap)
    revision = str(info.sha or "")
    files = {
        s.rfilename: InputFile(bytes=int(s.size or 0))
        for s in info.siblings or ()
        if MODEL_FILE.fullmatch(s.rfilename)
    }
    if "config.json" not in files:
        raise HubError(f"Hub model {repo!r} has no config.json; it is not a transformers model")
    try:
        config = json.loads(Path(download(repo, revision, "config.json")).read_text())
        index = None
        if INDEX in files:
            index = json.loads(Path(download(repo, revision, INDEX)).read_text())
        weights = sorted(set((index or {}).get("weight_map", {}).values())) or (
            [SINGLE] if SINGLE in files else []
        )
        headers = {
            f: _header(api.parse_safetensors_file_metadata(repo, f, revision=revision))
            for f in weights
        }
    except HubError:
        raise
    except _errors() as exc:
        raise _explain(repo, "its config and safetensors headers", exc) from None
    shape = model_shape.from_config(config, index, headers or None, name=repo)
    return shape, ModelSource(kind="hub", repo=repo, revision=revision, files=files)


def download(
    repo: str, revision: str, filename: str, progress: Callable[[int], None] | None = None
) -> str:
    """One file of ``repo`` at ``revision`` in the local Hugging Face cache (downloaded if
    missing, resumed if partial); its path. ``progress(n)`` is told of every n bytes read."""
    hub = _hub()
    kwargs: dict[str, type] = {}
    if progress is not None:
        kwargs["tqdm_class"] = _counting_tqdm(progress)
    try:
        return hub.hf_hub_download(repo, filename, revision=revision, **kwargs)
    except _errors() as exc:
        raise _explain(repo, filename, exc) from None


def fetch(
    source: ModelSource, names: Iterable[str], progress: Callable[[str, int], None] | None = None
) -> str:
    """The snapshot folder holding ``names`` of a Hub model (only these are downloaded)."""
    folder = ""
    for name in names:
        report = (lambda n, f=name: progress(f, n)) if progress is not None else None
        folder = str(Path(download(source.repo, source.revision, name, report)).parent)
    return folder


def _counting_tqdm(progress: Callable[[int], None]) -> type:
    from tqdm.auto import tqdm

    class Counting(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if n:
                progress(int(n))
            return super().update(n)

    return Counting


def _from_cache(repo: str, snap: Path) -> tuple[ModelShape, ModelSource]:
    """A complete cached snapshot (the Hub unreachable): its shape and files."""
    files = {
        p.name: InputFile(bytes=p.stat().st_size)
        for p in sorted(snap.iterdir())
        if p.is_file() and MODEL_FILE.fullmatch(p.name)
    }
    shape = model_shape.from_folder(snap, name=repo)
    return shape, ModelSource(kind="hub", repo=repo, revision=snap.name, files=files)


def cached(repo: str) -> Path | None:
    """A complete snapshot of ``repo`` in the local cache (every weight file its index lists),
    when the Hub cannot be reached; None else."""
    snap = model_shape._cached_snapshot(repo)
    if snap is None:
        return None
    index = snap / INDEX
    if index.is_file():
        weights = set(json.loads(index.read_text()).get("weight_map", {}).values())
    else:
        weights = {SINGLE}
    return snap if all((snap / w).is_file() for w in weights) else None


__all__ = ["HubError", "cached", "download", "fetch", "read_model"]
