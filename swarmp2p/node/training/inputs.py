"""A job's inputs on this node. Never imports torch.

Where a job is submitted, ``resolve.resolve`` reads what it needs from this machine (the model's
shape, its files' names, sizes and sha256, the data file's sha256), and this node offers
them to its peers (``Inputs.offer``; kept in ``<state>/offers.json`` across restarts); a
``none`` job reads no data, so its data file is neither read nor offered. A stage's node then
makes local only what its stage reads (``Inputs.model_folder``: its layers'
files plus config and tokenizer, from its own copy at the same path when every file matches,
else fetched into ``<state>/models/<digest>``, sha256-checked, resumable, kept for the next job
or serve; a Hub model's through the Hub client) and stage 0's node the data file
(``Inputs.data_file``: ``<state>/inputs/<sha256><suffix>``). A peer reads only what this node
offers or holds, by content address: never a path it names.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from swarmp2p._atomic import write_atomic
from swarmp2p.errors import Failed, SwarmError, UserError
from swarmp2p.node.serving import model_files
from swarmp2p.node.training.resolve import HUB_ID, Listed, LocalModel, resolve, stage_names
from swarmp2p.paths import UnsafeName, confine
from swarmp2p.plan import Job, model_shape
from swarmp2p.plan.inputs import (
    DATA_SUFFIXES,
    MODEL_FILE,
    DataSource,
    InputFile,
    JobInputs,
    ModelSource,
)
from swarmp2p.plan.model_shape import EMBEDDED
from swarmp2p.schema import Data

if TYPE_CHECKING:
    from swarmp2p.node.context import NodeContext

log = logging.getLogger("swarmp2p.node.training.inputs")

CHUNK_BYTES = 1 << 20
"""The most one read of an offered or held input returns."""


# --- progress -------------------------------------------------------------------------------


class Fetch:
    """One fetch in progress (``swarm status`` shows it)."""

    def __init__(self, what: str, files: int, total: int, source: str) -> None:
        self.what, self.files, self.total, self.source = what, files, total, source
        self.files_done = 0
        self.done = 0
        self.started = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n

    def view(self, node_id: str) -> dict[str, Data]:
        return {
            "node": node_id,
            "what": self.what,
            "from": self.source,
            "files": [self.files_done, self.files],
            "bytes": [self.done, self.total],
            "seconds": round(time.monotonic() - self.started, 1),
        }


# --- this node's inputs -----------------------------------------------------------------------


class Inputs:
    """What this node offers its peers and what it fetched for its stages."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self._offers: dict[str, dict[str, str]] | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        self.fetching: dict[str, Fetch] = {}

    @property
    def root(self) -> Path:
        return self.ctx.state.root

    # --- offers (the submitting node) ---------------------------------------------------------

    def _offers_file(self) -> Path:
        return self.root / "offers.json"

    def offers(self) -> dict[str, dict[str, str]]:
        if self._offers is None:
            try:
                data = json.loads(self._offers_file().read_text())
                self._offers = {
                    "models": dict(data.get("models") or {}),
                    "data": dict(data.get("data") or {}),
                }
            except (OSError, ValueError, AttributeError):
                self._offers = {"models": {}, "data": {}}
        return self._offers

    def offer(self, inputs: JobInputs) -> None:
        """Lend this job's local model folder and data file to the peers (by content address)."""
        offers = self.offers()
        changed = False
        if inputs.model.kind == "folder" and inputs.model.node == self.ctx.node_id:
            changed |= offers["models"].get(inputs.model.digest) != inputs.model.path
            offers["models"][inputs.model.digest] = inputs.model.path
        if inputs.data is not None and inputs.data.node == self.ctx.node_id:
            changed |= offers["data"].get(inputs.data.sha256) != inputs.data.path
            offers["data"][inputs.data.sha256] = inputs.data.path
        if changed:
            write_atomic(self._offers_file(), json.dumps(offers, indent=1, sort_keys=True))

    async def submit(self, job: Job, cwd: str | None) -> tuple[Job, JobInputs]:
        """Resolve a job submitted here and offer its local files."""
        job, inputs = await asyncio.to_thread(resolve, job, cwd=cwd, node_id=self.ctx.node_id)
        await asyncio.to_thread(self.offer, inputs)
        return job, inputs

    # --- reads by peers -------------------------------------------------------------------------

    def _path(self, kind: str, key: str, file: str) -> Path:
        """The file a peer's read names, if this node offers or holds it; Failed else."""
        if kind == "data":
            offered = self.offers()["data"].get(key)
            candidates = [Path(offered)] if offered else []
            candidates += [self.root / "inputs" / (key + s) for s in DATA_SUFFIXES]
            for path in candidates:
                if path.is_file():
                    return path
            raise Failed(f"node {self.ctx.node_id} holds no data file {key[:12]}", code="no_file")
        if not MODEL_FILE.fullmatch(file):
            raise UserError(f"{file!r} is not a model file name", code="bad_field")
        offered = self.offers()["models"].get(key)
        for folder in ([Path(offered)] if offered else []) + [self.root / "models" / key]:
            try:
                path = confine(folder, file, what="model file")
            except UnsafeName as exc:
                raise UserError(str(exc), code="bad_field") from None
            if path.is_file():
                return path
        raise Failed(f"node {self.ctx.node_id} holds no {file} of model {key}", code="no_file")

    def read(self, kind: str, key: str, file: str, offset: int, size: int) -> tuple[bytes, int]:
        """A chunk of an offered or held input: (data, total bytes of the file)."""
        if size > CHUNK_BYTES:
            raise UserError(f"size must be in 1..{CHUNK_BYTES}", code="bad_field")
        path = self._path(kind, key, file)
        with open(path, "rb") as handle:
            total = os.fstat(handle.fileno()).st_size
            handle.seek(offset)
            return handle.read(size), total

    # --- fetching for a stage (the stage's node) ------------------------------------------------

    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    def _reader(self, node: str, kind: str, key: str) -> model_files.Reader:
        from swarmp2p.node.messages import InputRead

        if node == self.ctx.node_id:

            async def local(file: str, offset: int, size: int) -> tuple[bytes, int]:
                return await asyncio.to_thread(self.read, kind, key, file, offset, size)

            return local
        return model_files.rpc_reader(
            self.ctx.call_endpoint,
            self.ctx.endpoint_of(node),
            lambda f, o, n: InputRead(kind=kind, key=key, file=f, offset=o, size=n),
        )

    def _sources(self, first: str) -> list[str]:
        """Who may hold an input: its submitter first, then every other live node."""
        others = sorted(self.ctx.live_nodes() - {first, self.ctx.node_id})
        return [first, *others]

    async def model_folder(
        self,
        model: ModelSource,
        names: Sequence[str],
        *,
        what: str,
        readers: Sequence[tuple[str, model_files.Reader]] | None = None,
    ) -> str:
        """The folder this node loads ``names`` of ``model`` from: "embedded", its own copy
        at the same path when every file matches, else a copy fetched into
        ``<state>/models/<digest>`` (a Hub model: the Hub cache). ``readers``: where to fetch
        from (default: the submitter, then the other live nodes). Failed names the file."""
        if model.kind == "embedded":
            return EMBEDDED
        if model.kind == "hub":
            return await self._hub_files(model, names, what)
        listing = {n: [model.files[n].bytes, model.files[n].sha256] for n in names}
        cache = self.root / "models" / model.digest
        async with self._lock(str(cache)):
            for folder in (Path(model.path), cache):
                if await asyncio.to_thread(model_files.matches, folder, listing):
                    return str(folder)
            if model.node == self.ctx.node_id and Path(model.path) != cache:
                raise Failed(
                    f"node {self.ctx.node_id}: the model folder {model.path} changed since the "
                    "job was submitted (a file's sha256 differs); submit it again",
                    code="input_changed",
                )
            missing = [
                n
                for n in names
                if not await asyncio.to_thread(model_files.matches, cache, {n: listing[n]})
            ]
            sources = readers or [
                (n, self._reader(n, "model", model.digest))
                for n in self._sources(model.node)
                if self.ctx.is_alive(n)
            ]
            total = sum(listing[n][0] for n in missing)
            await self._pull(what, missing, listing, cache, sources, total, model.label)
        return str(cache)

    async def _pull(
        self,
        what: str,
        names: Sequence[str],
        listing: Mapping[str, Listed],
        dest: Path,
        sources: Sequence[tuple[str, model_files.Reader]],
        total: int,
        label: str,
    ) -> None:
        if not sources:
            raise Failed(
                f"node {self.ctx.node_id} lacks {', '.join(names)} of {label} and no node that "
                "holds them is alive",
                code="input_missing",
            )
        progress = Fetch(what, len(names), total, sources[0][0])
        self.fetching[what] = progress
        try:
            for name in names:
                errors = []
                for node, read in sources:
                    progress.source = node
                    try:
                        await model_files.pull_file(
                            read,
                            name,
                            dest / name,
                            listing[name][1],
                            CHUNK_BYTES,
                            progress=progress.add,
                            size=listing[name][0],
                        )
                        break
                    except (SwarmError, OSError, ValueError, asyncio.TimeoutError) as exc:
                        errors.append(f"{node}: {exc}")
                else:
                    raise Failed(
                        f"node {self.ctx.node_id} cannot fetch {name} of {label} ("
                        + "; ".join(errors)
                        + ")",
                        code="input_missing",
                    )
                progress.files_done += 1
        finally:
            self.fetching.pop(what, None)
        log.info("%s: fetched %d file(s), %.1f MB", what, len(names), progress.done / 1e6)

    async def _hub_files(self, model: ModelSource, names: Sequence[str], what: str) -> str:
        from swarmp2p.node import hub

        total = sum(model.files[n].bytes for n in names if n in model.files)
        progress = Fetch(what, len(names), total, "the Hub")
        self.fetching[what] = progress

        def fetch_all() -> str:
            folder = ""
            for name in names:
                folder = str(
                    Path(hub.download(model.repo, model.revision, name, progress.add)).parent
                )
                progress.files_done += 1
            return folder

        try:
            async with self._lock(f"hub:{model.repo}@{model.revision}"):
                return await asyncio.to_thread(fetch_all)
        except hub.HubError as exc:
            raise Failed(f"node {self.ctx.node_id}: {exc}", code="input_missing") from None
        finally:
            self.fetching.pop(what, None)

    async def data_file(self, data: DataSource, *, what: str) -> Path:
        """The job's data file on this node, content-addressed (fetched when missing)."""
        dest = self.root / "inputs" / data.name
        listing = {data.name: [data.bytes, data.sha256]}
        async with self._lock(str(dest)):
            own = Path(data.path)
            if data.node == self.ctx.node_id and await asyncio.to_thread(
                model_files.matches, own.parent, {own.name: listing[data.name]}
            ):
                return own
            if await asyncio.to_thread(model_files.matches, dest.parent, listing):
                return dest
            sources = [
                (n, self._reader(n, "data", data.sha256))
                for n in self._sources(data.node)
                if self.ctx.is_alive(n)
            ]
            renamed = [(n, _ignore_name(r)) for n, r in sources]
            await self._pull(
                what,
                [data.name],
                listing,
                dest.parent,
                renamed,
                data.bytes,
                f"data file {data.path} (on node {data.node})",
            )
        return dest

    # --- serving (the issuing node) --------------------------------------------------------------

    async def serve_model(
        self, ref: str, *, trained: JobInputs | None, local: Callable[[str], str]
    ) -> LocalModel:
        """What ``swarm serve`` serves for ``ref``: a folder or embedded model read here
        (``local`` resolves it, and the folder is offered to the stage nodes), a Hub model
        read through the Hub (only its config, headers and tokenizer come here), or a trained
        model's base, fetched from the swarm when this node lacks it."""
        from swarmp2p.plan.inputs import ALWAYS

        if trained is not None and trained.model.kind == "folder":
            model = trained.model
            listing = {k: [v.bytes, v.sha256] for k, v in model.files.items()}
            if not await asyncio.to_thread(model_files.matches, Path(model.path), listing):
                small = [n for n in ALWAYS if n in model.files]
                folder = await self.model_folder(model, small, what=f"serve {ref}: its base")
                self.offer_folder(model.digest, folder)
                return LocalModel(folder=folder, codec=folder, shape=trained.shape, files=listing)
        import re

        hub_id = re.fullmatch(HUB_ID, ref) and not ref.startswith((".", "/", "~"))
        if hub_id and not Path(ref).is_dir() and (trained is None or trained.model.kind == "hub"):
            from swarmp2p.node import hub

            try:
                shape, source = await asyncio.to_thread(hub.read_model, ref)
                names = [n for n in ALWAYS if n in source.files]
                codec = await self._hub_files(source, names, f"serve {ref}: config and tokenizer")
            except hub.HubError as exc:
                raise UserError(str(exc), code="bad_model") from None
            return LocalModel(folder=ref, codec=codec, shape=shape, revision=source.revision)
        folder = await asyncio.to_thread(local, ref)
        try:
            shape = await asyncio.to_thread(model_shape.load, folder)
            listing = (
                await asyncio.to_thread(model_files.folder_listing, folder)
                if Path(folder).is_dir()
                else None
            )
        except (OSError, ValueError) as exc:
            raise UserError(
                f"model {ref!r}: cannot read its shape from {folder}: {exc}", code="bad_model"
            ) from None
        if listing is not None:
            files = {k: InputFile(bytes=v[0], sha256=v[1]) for k, v in listing.items()}
            digest = ModelSource(
                kind="folder", node=self.ctx.node_id, path=folder, files=files
            ).digest
            self.offer_folder(digest, folder)
        return LocalModel(folder=folder, codec=folder, shape=shape, files=listing)

    def offer_folder(self, digest: str, folder: str) -> None:
        offers = self.offers()
        if offers["models"].get(digest) != folder:
            offers["models"][digest] = folder
            write_atomic(self._offers_file(), json.dumps(offers, indent=1, sort_keys=True))

    async def serve_stage_folder(
        self,
        model: str,
        files: Mapping[str, Listed] | None,
        *,
        issuer: str,
        revision: str,
        layers: tuple[int, int, bool, bool],
        what: str,
        first_reader: model_files.Reader | None = None,
        also: Sequence[Path] = (),
    ) -> str:
        """The folder a serve stage of blocks ``layers`` loads: only its files made local
        (from its own copy when it matches, else fetched: from the issuer, then any node
        that holds them; a Hub model's from the Hub). ``also``: folders of this node to use
        when they match (the embedded model)."""
        start, end, first, last = layers
        if files is None:
            if not revision or Path(model).is_dir() or model == EMBEDDED:
                return model  # embedded, or this node's own cache
            source = ModelSource(kind="hub", repo=model, revision=revision, files={})
            head = ["config.json"]
            folder = await self._hub_files(source, head, what)
            with contextlib.suppress(Exception):
                folder = await self._hub_files(source, ["model.safetensors.index.json"], what)
            listing = {"config.json": [0, ""]}
            index = Path(folder) / "model.safetensors.index.json"
            if index.is_file():
                listing.update(
                    {w: [0, ""] for w in json.loads(index.read_text())["weight_map"].values()}
                )
            else:
                listing["model.safetensors"] = [0, ""]
            names = stage_names(Path(folder), listing, start, end, first, last)
            for extra in ("generation_config.json",):
                with contextlib.suppress(Failed):
                    await self._hub_files(source, [extra], what)
            return await self._hub_files(source, [n for n in names if n in listing], what)
        checked = model_files.check_listing(files)
        source = ModelSource(
            kind="folder",
            node=issuer,
            path=model,
            files={k: InputFile(bytes=v[0], sha256=v[1]) for k, v in checked.items()},
        )
        for folder in also:
            if await asyncio.to_thread(model_files.matches, folder, checked):
                return str(folder)
        readers = None
        if first_reader is not None:
            readers = [(issuer, first_reader)] + [
                (n, self._reader(n, "model", source.digest))
                for n in self._sources(issuer)[1:]
                if self.ctx.is_alive(n)
            ]
        head = [n for n in ("config.json", "model.safetensors.index.json") if n in checked]
        folder = await self.model_folder(source, head, what=what, readers=readers)
        names = stage_names(Path(folder), checked, start, end, first, last)
        return await self.model_folder(source, names, what=what, readers=readers)

    def status(self) -> list[dict[str, Data]]:
        return [f.view(self.ctx.node_id) for f in self.fetching.values()]


def _ignore_name(read: model_files.Reader) -> model_files.Reader:
    """A data file is read by its sha256 alone: the local name does not travel."""

    async def by_key(file: str, offset: int, size: int) -> tuple[bytes, int]:
        return await read("", offset, size)

    return by_key


__all__ = ["CHUNK_BYTES", "Fetch", "Inputs"]
