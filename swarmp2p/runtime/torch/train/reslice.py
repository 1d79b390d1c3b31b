"""Snapshots re-sliced by global block index: a stage on new cuts, cut from the snapshots the
stages of the old cuts took at the same step (a job re-split over the nodes left after a loss).

A stage's snapshot names its blocks ``stage.blocks.<k>.…`` from its first block; here ``k``
becomes the global index and then the new stage's own. The embeddings come from the old first
stage, the final norm and head from the old last one. The optimizer state (positional in the
snapshot, in the order ``_named_state`` lists the trainable parameters) travels by name, and
``positional`` puts it back in the new stage's own order when its worker resumes. Learned
bottlenecks are never re-sliced (their halves were trained on the old cuts).

``python -m swarmp2p.runtime.torch.train.reslice OUT STAGE START END FIRST LAST TIED SRC...`` with
each SRC ``PATH:START:END:FIRST:LAST`` (FIRST/LAST/TIED 0 or 1) is how a stage's node runs it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmp2p._module_main import run_main

_BLOCK = re.compile(r"^stage\.blocks\.(\d+)\.(.+)$")
_FIRST = ("stage.embed.", "stage.position_embed.", "stage.embed_dropout.")
"""Parameters only the first stage holds; every other non-block one is the last stage's."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    """One old stage's snapshot and where its blocks were."""

    path: Path
    start: int
    end: int
    first: bool
    last: bool


def _by_name(optimizer: Any, names: list[str], path: Path) -> tuple[dict, dict] | None:
    """(name -> per-parameter state, the group's settings) of a snapshot's optimizer."""
    if optimizer is None:
        return None
    inner = optimizer.get("adamw", optimizer)  # a StageOptimizer's, or a plain AdamW's
    groups = inner["param_groups"]
    order = [i for g in groups for i in g["params"]]
    if len(order) != len(names):
        raise ValueError(
            f"snapshot {path}: its optimizer holds {len(order)} parameters, its state "
            f"{len(names)}; it cannot be re-sliced"
        )
    state = inner["state"]
    by_name = {names[k]: state[pos] for k, pos in enumerate(order) if pos in state}
    return by_name, {k: v for k, v in groups[0].items() if k != "params"}


def _renamed(
    name: str, src: Source, start: int, end: int, first: bool, last: bool, tied: bool
) -> str | None:
    """The new stage's name of an old stage's parameter, or None when it does not hold it."""
    match = _BLOCK.match(name)
    if match:
        block = src.start + int(match.group(1))
        return f"stage.blocks.{block - start}.{match.group(2)}" if start <= block < end else None
    if name.startswith(_FIRST):
        return name if first and src.first else None
    if not (last and src.last):
        return None
    if tied and first and name.startswith("stage.head."):
        return None  # one stage holds a tied head as its embedding: one parameter
    return name


def reslice(
    sources: Sequence[Source],
    *,
    stage: int,
    start: int,
    end: int,
    first: bool,
    last: bool,
    tied: bool = False,
) -> dict[str, Any]:
    """The snapshot of new stage ``stage`` (blocks ``[start, end)``) cut from ``sources``."""
    state: dict[str, torch.Tensor] = {}
    by_name: dict[str, Any] = {}
    settings: dict[str, Any] | None = None
    step = rng = scaler = None
    with_optimizer = True
    for src in sources:
        payload = torch.load(src.path, map_location="cpu", weights_only=True)
        names = [k for k in payload["state"] if k.startswith("stage.")]
        others = [k for k in payload["state"] if not k.startswith("stage.")]
        if others:
            raise ValueError(
                f"snapshot {src.path} holds a learned boundary's halves ({others[0]}, ...): "
                "they were trained on the old cuts and cannot be re-sliced"
            )
        if step is None:
            step = int(payload["step"])
        elif int(payload["step"]) != step:
            raise ValueError(f"snapshot {src.path} is of step {payload['step']}, not {step}")
        optimizer = _by_name(payload.get("optimizer"), names, src.path)
        with_optimizer = with_optimizer and optimizer is not None
        for name in names:
            new = _renamed(name, src, start, end, first, last, tied)
            if new is None:
                continue
            state[new] = payload["state"][name]
            if optimizer is not None and name in optimizer[0]:
                by_name[new] = optimizer[0][name]
        if optimizer is not None and settings is None:
            settings = optimizer[1]
        if src.start <= start < src.end or rng is None:
            rng = payload["rng"]
        scaler = scaler or payload.get("loss_scaler")  # every stage agreed on one scale
    if step is None:
        raise ValueError("no snapshot to re-slice")
    return {
        "step": step,
        "stage": stage,
        "state": state,
        "optimizer": {"by_name": by_name, "settings": settings} if with_optimizer else None,
        "rng": rng,
        "loss_scaler": scaler,
    }


def positional(optimizer: dict[str, Any], bundle: Any) -> dict[str, Any]:
    """A re-sliced optimizer state (by name) as the stage's optimizer loads it: positional,
    in the order of ``bundle.trainable_parameters``."""
    name_of = {id(p): f"stage.{n}" for n, p in bundle.stage.named_parameters()}
    names = [name_of.get(id(p)) for p in bundle.trainable_parameters]
    if None in names:
        raise ValueError("a re-sliced snapshot cannot restore a learned boundary's optimizer")
    by_name = optimizer["by_name"]
    return {
        "state": {i: by_name[n] for i, n in enumerate(names) if n in by_name},
        "param_groups": [{**(optimizer["settings"] or {}), "params": list(range(len(names)))}],
    }


def main(argv: list[str]) -> int:
    from swarmp2p._atomic import write_atomic

    out, stage, start, end, first, last, tied, *specs = argv
    sources = []
    for spec in specs:
        path, s, e, f, la = spec.rsplit(":", 4)
        sources.append(
            Source(path=Path(path), start=int(s), end=int(e), first=f == "1", last=la == "1")
        )
    payload = reslice(
        sources,
        stage=int(stage),
        start=int(start),
        end=int(end),
        first=first == "1",
        last=last == "1",
        tied=tied == "1",
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(out), lambda tmp: torch.save(payload, tmp))
    return 0


if __name__ == "__main__":
    run_main(main, errors=(ValueError, OSError, KeyError))
