"""Serving a trained stage in place: the base slice, then the stage's exported shard on top.

The shard is what ``export.export_stage`` wrote: ``weights.safetensors`` under whole-model names
(when ``weights_included``), the LoRA ``adapter/`` of an ``adapters`` export (kept unmerged, as
training computed it; QLoRA cannot merge into NF4 anyway), and the boundary compressors. A
learned bottleneck serves with its halves: this stage runs the sender half of the boundary
after it and the receiver half of the boundary before it, so only the k-dim rounded code
crosses the link. ``none``, ``fp16`` and ``fixed_intN`` boundaries use the serving rule instead
(``serve.apply_boundary``): fixed_intN quantizes per token when serving (training used one
scale per tensor); per token is never coarser, and each token's boundary then does not depend
on how many tokens cross together, so a failover replay gives the same tokens.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarmp2p.runtime.torch.model.stage import Stage
from swarmp2p.runtime.torch.train.compression import LearnedBottleneck, compressor_from_spec
from swarmp2p.runtime.torch.train.export import (
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    WEIGHTS,
    _model_names,
    _rename,
    read_manifest,
)

SERVED_COMPRESSIONS = ("none", "fp16", *(f"fixed_int{n}" for n in range(2, 9)), "learned")
"""What ``TrainedStage.send_compression`` may be."""

_ADAPTER_PREFIX = "base_model.model."
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainedStage:
    """A stage loaded from its base and its exported shard, ready to serve."""

    stage: Stage
    """The stage in eval mode, with the shard's weights and (unmerged) adapters."""
    receiver: nn.Module | None
    """Receive half of the learned bottleneck before this stage (None for any other boundary)."""
    sender: nn.Module | None
    """Send half of the learned bottleneck after this stage (None for any other boundary)."""
    send_codec: str
    """Lossless wire codec of ``sender``'s output ("tokint8", "fp16", ...); "none" without one."""
    send_compression: str
    """The boundary after this stage as served: "none", "fp16", "fixed_intN" or "learned"
    ("none" on the last stage)."""
    manifest: dict[str, Any]


def load_trained_stage(
    base: str | os.PathLike,
    shard_dir: str | os.PathLike,
    *,
    layer_start: int,
    layer_end: int,
    is_first: bool,
    is_last: bool,
    dtype: str | torch.dtype = "float32",
    quantization: dict | None = None,
    device: str | torch.device = "cpu",
    tied_head: str | os.PathLike | None = None,
) -> TrainedStage:
    """Blocks ``[layer_start, layer_end)`` of ``base`` with the shard in ``shard_dir`` applied
    (checked against its manifest's sha256s first); ValueError naming what disagrees."""
    from swarmp2p.runtime.torch import (
        decoder_config,
        load_stage_shard,
        normalize_spec,
        resolve_dtype,
    )

    shard = Path(shard_dir)
    manifest = read_manifest(shard)
    _check_position(manifest, shard, layer_start, layer_end, is_first, is_last)
    spec = normalize_spec(quantization)
    quantized = spec is not None and spec.bits in (4, 8)
    weights_included = bool(manifest.get("weights_included", True))
    if weights_included and quantized:
        raise ValueError(
            f"shard {shard} holds full weights (weights_included: true) but the base is "
            f"quantized ({quantization}); plain weights cannot be loaded into a bitsandbytes "
            "stage: serve it without quantization, or train with LoRA on the quantized base"
        )
    trained_dtype = manifest.get("dtype")
    if (
        weights_included
        and trained_dtype in _FLOAT_DTYPES
        and trained_dtype != str(resolve_dtype(dtype)).removeprefix("torch.")
    ):
        raise ValueError(
            f"shard {shard} was trained in {trained_dtype}, the stage spec asks for dtype "
            f"{dtype}; serve it in the dtype it was trained in"
        )
    if tied_head is not None and not (is_last and weights_included):
        raise ValueError(
            f"tied_head {tied_head} is only for the last stage of a tied-embedding model whose "
            f"shard holds its weights; shard {shard} is stage {manifest['stage']} with "
            f"weights_included {weights_included}"
        )

    stage = load_stage_shard(
        base,
        layer_start,
        layer_end,
        is_first,
        is_last,
        dtype=dtype,
        quantization=quantization,
        device=device,
    )
    if weights_included:
        _load_weights(stage, shard, tied_head)
    lora = manifest.get("lora")
    if lora is not None and lora.get("export") == "adapters":
        _load_adapters(stage, shard, lora)
    elif (shard / ADAPTER_DIR).exists():
        raise ValueError(
            f"shard {shard} has an {ADAPTER_DIR}/ folder but its manifest's lora export is "
            f"{None if lora is None else lora.get('export')!r}, not 'adapters'"
        )

    hidden = decoder_config(stage.config).hidden_size
    index, n_stages = manifest["stage"], manifest["n_stages"]
    compression = manifest.get("compression", [])
    present = [side for side, on in (("recv", index > 0), ("send", not is_last)) if on]
    receiver = sender = None
    send_compression, send_codec = "none", "none"
    float_dtype = resolve_dtype(dtype)
    if index > 0:
        comp = _compressor(compression[index - 1], hidden, index - 1, shard, "recv", present)
        if isinstance(comp, LearnedBottleneck):
            receiver = comp.to(device=device, dtype=float_dtype).receiver()
    if index < n_stages - 1:
        comp = _compressor(compression[index], hidden, index, shard, "send", present)
        if isinstance(comp, LearnedBottleneck):
            comp = comp.to(device=device, dtype=float_dtype)
            sender, send_codec, send_compression = comp.sender(), comp.payload_codec, "learned"
        else:
            send_compression = _method(compression[index])
    for module in (stage, receiver, sender):
        if module is not None:
            module.eval()
    return TrainedStage(
        stage=stage,
        receiver=receiver,
        sender=sender,
        send_codec=send_codec,
        send_compression=send_compression,
        manifest=manifest,
    )


def _check_position(
    manifest: Mapping[str, Any], shard: Path, start: int, end: int, is_first: bool, is_last: bool
) -> None:
    layers, index, n_stages = (
        manifest.get("layers"),
        manifest.get("stage"),
        manifest.get("n_stages"),
    )
    n_layers, compression = manifest.get("n_layers"), manifest.get("compression")
    if not (
        isinstance(layers, list)
        and len(layers) == 2
        and all(type(v) is int for v in (*layers, index, n_stages, n_layers))
        and isinstance(compression, list)
        and len(compression) == n_stages - 1
    ):
        raise ValueError(
            f"shard {shard}: its manifest lacks a valid stage, n_stages, layers, n_layers or "
            f"one compression per boundary (stage={index!r}, n_stages={n_stages!r}, "
            f"layers={layers!r}, n_layers={n_layers!r}, compression={compression!r})"
        )
    theirs = (layers[0], layers[1], index == 0, index == n_stages - 1)
    ours = (start, end, is_first, is_last)
    if theirs != ours or (layers[1] == n_layers) != is_last:
        raise ValueError(
            f"shard {shard} is stage {index} of {n_stages} with layers [{layers[0]}, "
            f"{layers[1]}) of {n_layers}, but the stage spec asks for layers [{start}, {end}) "
            f"with is_first_stage={is_first}, is_last_stage={is_last}; serve each shard at "
            "the position it was trained in"
        )


def _load_weights(stage: Stage, shard: Path, tied_head: str | os.PathLike | None) -> None:
    """The shard's whole-model tensors into the stage; every stage tensor must be covered."""
    from safetensors.torch import load_file

    mapping = _model_names(stage)
    own = stage.state_dict()
    wanted = {_rename(name, mapping): name for name in own}
    weights = load_file(shard / WEIGHTS)
    unknown = sorted(set(weights) - set(wanted))
    if unknown:
        raise ValueError(
            f"shard {shard}: {WEIGHTS} holds tensors that are not this stage's: "
            f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}"
        )
    head = f"{mapping['head']}.weight" if stage.head is not None else None
    tied = bool(getattr(stage.config, "tie_word_embeddings", False))
    embed = f"{mapping['embed']}.weight" if stage.embed is not None else None
    if head is not None and head not in weights and tied and embed in weights:
        weights[head] = weights[embed]  # one stage: its tied head is its own embedding
    elif head is not None and head not in weights and tied and not stage.is_first_stage:
        if tied_head is None:
            raise ValueError(
                f"shard {shard} is the last stage of a tied-embedding model and holds no "
                f"output head ({head}): export stores the tied head once, as the first "
                "stage's embedding; pass tied_head (a safetensors file with that one tensor)"
            )
        weights[head] = _tied_head_tensor(tied_head, own[wanted[head]].shape, _embed_name(stage))
    elif tied_head is not None:
        raise ValueError(
            f"tied_head {tied_head} was given, but shard {shard} is not the last stage of a "
            "tied-embedding model missing its head"
        )
    missing = sorted(set(wanted) - set(weights))
    if missing:
        raise ValueError(
            f"shard {shard}: {WEIGHTS} lacks tensors of this stage: "
            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    with torch.no_grad():
        for full, name in wanted.items():
            target, value = own[name], weights[full]
            if tuple(target.shape) != tuple(value.shape):
                raise ValueError(
                    f"shard {shard}: {full} has shape {tuple(value.shape)}, the stage's "
                    f"{name} has {tuple(target.shape)}; was it trained from another base?"
                )
            target.copy_(value)


def _tied_head_tensor(path: str | os.PathLike, shape: torch.Size, embed: str) -> torch.Tensor:
    """The head from ``path``: its one tensor, or the tensor named ``embed`` (the first stage's
    embedding under its whole-model name, e.g. in a copy of the first stage's weights file)."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as exc:  # OSError, or safetensors' own SafetensorError
        raise ValueError(f"tied_head {path} is not a readable safetensors file: {exc}") from None
    with handle:
        names = list(handle.keys())
        if len(names) == 1 or embed in names:
            name = names[0] if len(names) == 1 else embed
            value = handle.get_tensor(name)
        else:
            raise ValueError(
                f"tied_head {path} must hold one tensor, or the first stage's embedding as "
                f"{embed}; it holds {len(names)}: {sorted(names)[:5]}"
            )
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"tied_head {path}: {name} has shape {tuple(value.shape)}, the head needs "
            f"{tuple(shape)}"
        )
    return value


def _embed_name(stage: Stage) -> str:
    """The embedding's weight under its whole-model name (from a meta-device model)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from swarmp2p.runtime.torch.model.introspect import introspect

    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(stage.config)
    return f"{introspect(meta).names['embed']}.weight"


def _load_adapters(stage: Stage, shard: Path, lora: Mapping[str, Any]) -> None:
    """LoRA with the manifest's settings, then the shard's adapter tensors (unmerged)."""
    from safetensors.torch import load_file

    from swarmp2p.plan.job import LoraConfig
    from swarmp2p.runtime.torch.model.lora import apply_lora
    from swarmp2p.schema import SchemaError, parse

    path = shard / ADAPTER_DIR / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ValueError(
            f"shard {shard}: its manifest says lora export 'adapters' but {path} is missing"
        )
    missing = [k for k in ("r", "alpha", "dropout") if k not in lora]
    if missing:
        raise ValueError(
            f"shard {shard}: the manifest's lora settings are incomplete: {', '.join(missing)} missing"
        )
    try:  # the job's record, with job.json's checks
        settings = parse(
            LoraConfig,
            {
                "r": lora["r"],
                "alpha": lora["alpha"],
                "dropout": lora["dropout"],
                "target_modules": lora.get("target_modules") or None,
                "export": "adapters",
            },
            title=f"shard {shard}: the manifest's lora settings are invalid",
        )
    except SchemaError as exc:
        raise ValueError(str(exc)) from None
    mapping = _model_names(stage)  # before injection: block paths do not change
    fingerprint = apply_lora(stage, settings)
    expected = lora.get("fingerprint")
    if expected is not None and expected != fingerprint:
        raise ValueError(
            f"shard {shard}: LoRA fingerprint {expected} in the manifest, but its settings give "
            f"{fingerprint} on this base; was it trained from another base?"
        )
    wanted = {
        _ADAPTER_PREFIX + _rename(name.replace(".default", ""), mapping): param
        for name, param in stage.named_parameters()
        if "lora_A" in name or "lora_B" in name
    }
    tensors = load_file(path)
    unknown = sorted(set(tensors) - set(wanted))
    missing = sorted(set(wanted) - set(tensors))
    if unknown or missing:
        raise ValueError(
            f"shard {shard}: the adapter does not match this stage's LoRA layers "
            f"(missing {missing[:3]}, unknown {unknown[:3]})"
        )
    with torch.no_grad():
        for name, param in wanted.items():
            if tuple(param.shape) != tuple(tensors[name].shape):
                raise ValueError(
                    f"shard {shard}: adapter tensor {name} has shape "
                    f"{tuple(tensors[name].shape)}, this stage's has {tuple(param.shape)}"
                )
            param.copy_(tensors[name])


def _method(spec: Any) -> str:
    if spec is None:
        return "none"
    if isinstance(spec, Mapping):
        spec = spec.get("method")
    if spec not in SERVED_COMPRESSIONS or spec == "learned":
        raise ValueError(
            f"compression {spec!r} cannot be served; use none, fp16, fixed_int2..fixed_int8 "
            "or a learned_bottleneck"
        )
    return spec


def _compressor(
    spec: Any, hidden: int, boundary: int, shard: Path, side: str, present: list[str]
) -> nn.Module | None:
    """The learned bottleneck of ``boundary`` with the shard's state, or None for a boundary
    that serves by name (the shard's compressor state for it is empty)."""
    comp = compressor_from_spec(spec, hidden, boundary)
    if not isinstance(comp, LearnedBottleneck):
        _method(spec)
        return None
    name = "compressor.pt" if len(present) == 1 else f"compressor-{side}.pt"
    path = shard / name
    if not path.is_file():
        raise ValueError(
            f"shard {shard}: boundary {boundary} is a learned bottleneck but {name} is missing"
        )
    state = torch.load(path, map_location="cpu", weights_only=True)
    try:
        comp.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(
            f"shard {shard}: {name} does not fit boundary {boundary}'s bottleneck {spec}: {exc}"
        ) from None
    return comp
