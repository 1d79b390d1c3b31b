"""Training snapshots of one stage: trainable state, compressor halves, optimizer (with the float32
master copies of a half-precision stage), loss scale, step and RNG, written atomically (temp file
+ rename) and read back with ``weights_only=True``.

A run resumed from a snapshot continues exactly as the uninterrupted run: the data order is a
function of the step, and the snapshot restores everything else that changes between steps.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from swarmp2p._atomic import write_atomic
from swarmp2p.runtime.torch.train.bundle import StageBundle
from swarmp2p.runtime.torch.train.precision import LossScaler, StageOptimizer

_NAME = re.compile(r"^step-(\d{8})\.pt$")


def _named_state(bundle: StageBundle) -> dict[str, torch.Tensor]:
    """What changes while training: the trainable parameters and both compressor halves."""
    trainable = {id(p) for p in bundle.trainable_parameters}
    state = {
        f"stage.{name}": p.detach()
        for name, p in bundle.stage.named_parameters()
        if id(p) in trainable
    }
    for prefix, comp in (("recv.", bundle.recv_compressor), ("send.", bundle.send_compressor)):
        if comp is not None:
            state.update({prefix + k: v.detach() for k, v in comp.state_dict().items()})
    return state


def snapshot_path(folder: str | os.PathLike, stage: int, step: int) -> Path:
    return Path(folder) / f"stage-{stage}" / f"step-{step:08d}.pt"


def save_snapshot(
    folder: str | os.PathLike,
    bundle: StageBundle,
    optimizer: StageOptimizer | None,
    *,
    step: int,
    scaler: LossScaler | None = None,
) -> Path:
    """Write this stage's snapshot taken after ``step`` steps; return its path."""
    path = snapshot_path(folder, bundle.index, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "step": step,
        "stage": bundle.index,
        "state": {k: v.to("cpu").clone() for k, v in _named_state(bundle).items()},
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "rng": torch.get_rng_state(),
    }
    write_atomic(path, lambda tmp: torch.save(payload, tmp))
    return path


def latest_snapshot(folder: str | os.PathLike, stage: int) -> Path | None:
    """The newest snapshot of ``stage`` under ``folder`` (None when there is none)."""
    stage_dir = Path(folder) / f"stage-{stage}"
    if not stage_dir.is_dir():
        return None
    found = sorted(p for p in stage_dir.iterdir() if _NAME.match(p.name))
    return found[-1] if found else None


def load_snapshot(
    path: str | os.PathLike,
    bundle: StageBundle,
    optimizer: StageOptimizer | None,
    *,
    scaler: LossScaler | None = None,
) -> int:
    """Restore a snapshot into the bundle, optimizer and loss scaler; return the steps it had
    done."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("stage") != bundle.index:
        raise ValueError(f"snapshot {path} is of stage {payload.get('stage')}, not {bundle.index}")
    current = _named_state(bundle)
    saved = payload["state"]
    if set(saved) != set(current):
        missing, extra = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
        raise ValueError(
            f"snapshot {path} does not fit this stage (missing {missing[:3]}, unexpected "
            f"{extra[:3]}); was it written by another job configuration?"
        )
    with torch.no_grad():
        for name, tensor in current.items():
            if tensor.shape != saved[name].shape:
                raise ValueError(
                    f"snapshot {path}: {name} has shape {tuple(saved[name].shape)}, "
                    f"the stage has {tuple(tensor.shape)}"
                )
            tensor.copy_(saved[name])
    if optimizer is not None:
        if payload["optimizer"] is None:
            raise ValueError(f"snapshot {path} holds no optimizer state")
        state = payload["optimizer"]
        if "by_name" in state:  # re-sliced onto new cuts (``reslice``): back in this order
            from swarmp2p.runtime.torch.train.reslice import positional

            state = positional(state, bundle)
        optimizer.load_state_dict(state)
    if scaler is not None and payload.get("loss_scaler") is not None:
        scaler.load_state_dict(payload["loss_scaler"])
    torch.set_rng_state(payload["rng"])
    return int(payload["step"])
