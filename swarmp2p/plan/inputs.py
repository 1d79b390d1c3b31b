"""What a job reads that lives where it was submitted: the model's shape, where the model's
files come from, and the data file. Pure, standard library only.

The submitting node resolves these once (``swarmp2p.node.training.inputs``) and the job's table record
carries them, so the leader plans and every stage's node checks the plan without the model,
and each stage's node fetches only the files its layers need (``stage_files``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Literal

from swarmp2p.plan.model_shape import ModelShape
from swarmp2p.schema import field

NODE_PATTERN = r"[a-z0-9][a-z0-9._-]{0,63}"
MODEL_FILE = re.compile(
    r"(config\.json|generation_config\.json|model\.safetensors\.index\.json|[\w.-]+\.safetensors"
    r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json"
    r"|vocab\.json|merges\.txt|tokenizer\.model|chat_template\.jinja)"
)
"""The files of a model folder a stage or a tokenizer reads (nothing else travels)."""
ALWAYS = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
"""Files every stage fetches when the model has them: the config and the tokenizer (a few MB)."""
DATA_SUFFIXES = (".txt", ".jsonl", ".npy")
"""Data files that travel to stage 0's node: text, JSON lines, or token ids."""


@dataclass(frozen=True, kw_only=True, slots=True)
class InputFile:
    """One file of a model: its size and (folder models) its sha256."""

    bytes: int = field(ge=0)
    sha256: str = field(default="", pattern=r"(|[0-9a-f]{64})")
    """Empty for a Hub file: the Hub client checks its own ETag."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSource:
    """Where a stage's node gets the model's files."""

    kind: Literal["embedded", "folder", "hub"]
    """``embedded``: every node converts its own copy of the packaged model; ``folder``: the
    submitting node lends the files of a folder; ``hub``: each node downloads its files."""
    node: str = field(default="", pattern=rf"(|{NODE_PATTERN})")
    """folder: the node that holds the folder (the submitter)."""
    path: str = field(default="", max_len=4096)
    """folder: the folder's path on that node (for messages; never opened elsewhere)."""
    repo: str = field(default="", max_len=256)
    revision: str = field(default="", pattern=r"(|[0-9a-f]{40})")
    """hub: the commit the submitter read, so every node downloads the same files."""
    files: dict[str, InputFile] = dataclasses.field(default_factory=dict)
    """The model's files (names matching ``MODEL_FILE``)."""

    def __post_init__(self) -> None:
        for name in self.files:
            if not MODEL_FILE.fullmatch(name):
                raise ValueError(f"files: {name!r} is not a model file name")
        if self.kind == "folder" and (not self.node or "config.json" not in self.files):
            raise ValueError("a folder model names its node and lists its config.json")
        if self.kind == "folder" and any(not f.sha256 for f in self.files.values()):
            raise ValueError("a folder model lists every file's sha256")
        if self.kind == "hub" and (not self.repo or not self.revision):
            raise ValueError("a Hub model names its repo and the commit it was read at")

    @property
    def digest(self) -> str:
        """A short name for this set of files: a fetched copy's folder (content-addressed)."""
        if self.kind == "hub":
            key: object = [self.repo, self.revision]
        else:
            key = sorted((k, v.bytes, v.sha256) for k, v in self.files.items())
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]

    @property
    def label(self) -> str:
        """The model as a message names it."""
        if self.kind == "folder":
            return f"{self.path} (on node {self.node})"
        if self.kind == "hub":
            return f"{self.repo}@{self.revision[:12]}"
        return "embedded"


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSource:
    """A data file on the submitting node, shipped to stage 0's node (content-addressed)."""

    node: str = field(pattern=NODE_PATTERN)
    path: str = field(min_len=1, max_len=4096)
    """Its path on that node (for messages)."""
    suffix: Literal[".txt", ".jsonl", ".npy"]
    bytes: int = field(ge=0)
    sha256: str = field(pattern=r"[0-9a-f]{64}")

    @property
    def name(self) -> str:
        """Its content-addressed name on the node that fetched it."""
        return self.sha256 + self.suffix


@dataclass(frozen=True, kw_only=True, slots=True)
class JobInputs:
    """A job's inputs as its submitter resolved them."""

    shape: ModelShape
    model: ModelSource
    data: DataSource | None = None


def stage_files(model: ModelSource, planned: tuple[str, ...]) -> list[str]:
    """The files a stage's node needs: the weight files its plan stage lists (every weight file
    when the plan knows none) plus the config and tokenizer the model has."""
    weights = [n for n in model.files if n.endswith(".safetensors")]
    wanted = set(planned) if planned else set(weights)
    unknown = sorted(wanted - set(model.files)) if model.files else []
    if unknown:
        raise ValueError(f"the plan names {', '.join(unknown)}, which the model does not list")
    extra = [n for n in ALWAYS if n in model.files]
    return sorted(wanted) + [n for n in extra if n not in wanted]


__all__ = [
    "ALWAYS",
    "DATA_SUFFIXES",
    "MODEL_FILE",
    "DataSource",
    "InputFile",
    "JobInputs",
    "ModelSource",
    "stage_files",
]
