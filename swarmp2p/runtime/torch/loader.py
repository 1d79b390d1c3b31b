"""Load one stage's slice of a checkpoint: only its tensors, only the files that hold them."""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from copy import deepcopy
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from swarmp2p.runtime.torch.introspect import Topology, introspect
from swarmp2p.runtime.torch.stage import Stage

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DISK_HEADROOM_BYTES = 512 * 2**20
"""Free space kept on the cache's filesystem beyond the files a stage downloads (the reference)."""


class NotLoadableByName(ValueError):
    """The checkpoint does not name a tensor the stage needs the way the model does."""


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``torch.bfloat16``; anything else is refused."""
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None) if isinstance(dtype, str) else None
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(
            f"dtype {dtype!r} is not a torch floating dtype; use float32, bfloat16 or float16"
        )
    return resolved


# ---------------------------------------------------------------------------------------------
# where the checkpoint lives


def check_free_disk(need_bytes: int, free_bytes: int, where: str) -> None:
    """Refuse a download whose files plus the headroom do not fit the free space."""
    if need_bytes + DISK_HEADROOM_BYTES > free_bytes:
        raise OSError(
            f"the stage needs {need_bytes / 1e9:.2f} GB of checkpoint files plus "
            f"{DISK_HEADROOM_BYTES / 1e9:.2f} GB headroom in {where}, which has "
            f"{free_bytes / 1e9:.2f} GB free; free some space or set HF_HUB_CACHE elsewhere"
        )


class _Checkpoint:
    """A safetensors checkpoint in a local folder or on the Hub (files fetched only when read)."""

    def __init__(self, model_ref: str | os.PathLike) -> None:
        self.repo_id: str | None = None
        ref = os.fspath(model_ref)
        if ref == "embedded":
            from swarmp2p.runtime.torch.embedded import ensure_embedded

            self.folder = Path(ensure_embedded())
        elif Path(ref).is_dir():
            self.folder = Path(ref)
        elif Path(ref).exists() or ref.startswith((".", "/", "~")) or ref.count("/") != 1:
            raise FileNotFoundError(
                f"model {ref!r} is neither a checkpoint folder, a Hub id (owner/name) nor "
                "'embedded'"
            )
        else:
            self.repo_id = ref
            self.folder = Path(self._fetch("config.json")).parent
        self.ref = ref
        self.weight_map = self._weight_map()

    def _fetch(self, filename: str) -> str:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(self.repo_id, filename)

    def _weight_map(self) -> dict[str, str]:
        index = self.folder / INDEX_FILE
        if self.repo_id is not None and not index.exists():
            try:
                index = Path(self._fetch(INDEX_FILE))
            except Exception:
                index = self.folder / INDEX_FILE
        if index.exists():
            return dict(json.loads(index.read_text())["weight_map"])
        single = self.path(SINGLE_FILE)
        with safe_open(single, framework="pt") as handle:
            return dict.fromkeys(handle.keys(), SINGLE_FILE)

    def path(self, filename: str) -> str:
        local = self.folder / filename
        if local.exists():
            return str(local)
        if self.repo_id is None:
            raise FileNotFoundError(
                f"checkpoint {self.ref}: {filename} is missing from {self.folder}"
            )
        return self._fetch(filename)

    def ensure_disk_for(self, filenames: set[str]) -> None:
        """Before downloading, check the Hub's sizes of the missing files against free disk."""
        if self.repo_id is None:
            return
        missing = sorted(f for f in filenames if not (self.folder / f).exists())
        if not missing:
            return
        try:
            from huggingface_hub import HfApi

            infos = HfApi().get_paths_info(self.repo_id, missing)
        except Exception:
            return
        need = sum(getattr(info, "size", 0) or 0 for info in infos)
        check_free_disk(need, shutil.disk_usage(self.folder).free, str(self.folder))


# ---------------------------------------------------------------------------------------------
# which tensors a stage owns


def _stage_parts(stage: Stage, topology: Topology) -> list[tuple[str, nn.Module]]:
    parts = [
        (topology.names[name], getattr(stage, attribute))
        for name, attribute in (
            ("embed", "embed"),
            ("position_embed", "position_embed"),
            ("final_norm", "final_norm"),
            ("head", "head"),
        )
        if getattr(stage, attribute) is not None
    ]
    parts += [
        (f"{topology.names['blocks']}.{i}", stage.blocks[j])
        for j, i in enumerate(stage.block_indices)
    ]
    return parts


def stage_keys(stage: Stage, topology: Topology) -> set[str]:
    """The model's state-dict keys a stage must load (a tied head on the last stage included)."""
    return {
        f"{prefix}.{key}"
        for prefix, module in _stage_parts(stage, topology)
        for key in module.state_dict(keep_vars=True)
    }


def _conversions(model):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    return renamings, converters


def _plan_reads(model, topology: Topology, checkpoint_keys, wanted: set[str]):
    """Map the checkpoint's keys to the model's with transformers' own renames and converters.

    Returns ``{model_key: [(checkpoint_key, converter_pattern | None), ...]}`` for wanted keys.
    """
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters = _conversions(model)
    meta = model.state_dict()
    prefix = model.base_model_prefix
    plan: dict[str, list[tuple[str, str | None]]] = defaultdict(list)
    for key in sorted(checkpoint_keys, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:
            renamed, pattern = key, None
        if renamed in wanted:
            plan[renamed].append((key, pattern))
    if topology.tied:
        head_key = f"{topology.names['head']}.weight"
        embed_key = f"{topology.names['embed']}.weight"
        if head_key in wanted and head_key not in plan:
            # the checkpoint stores no head: it aliases the input embedding (the reference's rule)
            plan[head_key] = [(key, None) for key, _ in plan.get(embed_key, [])] or [
                (key, pattern)
                for key in checkpoint_keys
                for renamed, pattern in [
                    rename_source_key(key, renamings, converters, prefix, meta)
                ]
                if renamed == embed_key
            ]
    return plan, {p: c for c in converters for p in c.source_patterns}


# ---------------------------------------------------------------------------------------------
# materialising


def _set_tensor(model: nn.Module, key: str, value: torch.Tensor) -> None:
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name)
    if name in module._parameters:
        old = module._parameters[name]
        if isinstance(value, nn.Parameter):
            module._parameters[name] = value
        else:
            module._parameters[name] = nn.Parameter(value, requires_grad=old.requires_grad)
    elif name in module._buffers:
        module._buffers[name] = value
    else:
        raise KeyError(f"{key} is neither a parameter nor a buffer of the model")


def _dtype_for(model, dtype: torch.dtype):
    """transformers' per-key dtype rule: ``_keep_in_fp32_modules`` stay float32, else ``dtype``."""
    from transformers.core_model_loading import build_glob_alternation

    plan = model._get_dtype_plan(dtype)  # the same plan from_pretrained builds
    if not plan:
        return lambda key, meta_dtype: meta_dtype
    alternation, by_group, _ = build_glob_alternation(list(plan))

    def pick(key: str, meta_dtype: torch.dtype) -> torch.dtype:
        match = alternation.search(key)
        return plan[by_group[match.lastgroup]] if match else meta_dtype

    return pick


def _empty_model(config, dtype: torch.dtype):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    # buffers stay real: rotary tables and embedding scales are recomputed, not read
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # from_pretrained ties after loading; introspection must see it now
    return model


def load_stage_shard(
    model_ref: str | os.PathLike,
    layer_start: int,
    layer_end: int,
    is_first_stage: bool,
    is_last_stage: bool,
    dtype: torch.dtype | str = torch.float32,
    quantization: dict | None = None,
    device: str | torch.device = "cpu",
) -> Stage:
    """Materialise blocks ``[layer_start, layer_end)`` of ``model_ref`` (a folder, a Hub id or
    ``"embedded"``) and nothing else: a meta-device model from the config, then only the stage's
    tensors read from only the files that hold them."""
    from transformers import AutoConfig

    from swarmp2p.runtime.torch import quantization as _quant

    dtype = resolve_dtype(dtype)
    spec = _quant.normalize_spec(quantization)
    checkpoint = _Checkpoint(model_ref)
    config = AutoConfig.from_pretrained(checkpoint.folder)
    model = _empty_model(config, dtype)
    topology = introspect(model)
    stage = Stage(
        topology,
        layer_start=layer_start,
        layer_end=layer_end,
        is_first_stage=is_first_stage,
        is_last_stage=is_last_stage,
    )
    quantizer = _quant.prepare(model, topology, spec) if spec is not None else None

    wanted = stage_keys(stage, topology)
    plan, converter_of = _plan_reads(model, topology, checkpoint.weight_map, wanted)
    meta = model.state_dict(keep_vars=True)
    params = {k for k, v in meta.items() if isinstance(v, nn.Parameter)}
    missing = sorted(k for k in wanted & params if k not in plan)
    if missing:
        raise NotLoadableByName(
            f"checkpoint {checkpoint.ref} has no tensor for {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''} of stage [{layer_start}, {layer_end}); "
            "it names its weights differently from transformers' model"
        )

    by_file: dict[str, list[str]] = defaultdict(list)
    for sources in plan.values():
        for key, _ in sources:
            by_file[checkpoint.weight_map[key]].append(key)
    checkpoint.ensure_disk_for(set(by_file))
    # one file open at a time; converters (fused MoE experts) need all of a key's sources first
    read: dict[str, torch.Tensor] = {}
    pick_dtype = _dtype_for(model, dtype)

    def finish(model_key: str, value: torch.Tensor) -> None:
        if quantizer is not None and quantizer.owns(model_key):
            value = quantizer.quantize(model_key, value.to(dtype))
        elif value.is_floating_point():
            value = value.to(pick_dtype(model_key, meta[model_key].dtype))
        _set_tensor(model, model_key, value)

    pending = {k: {key for key, _ in v} for k, v in plan.items()}
    waiting_on: dict[str, list[str]] = defaultdict(list)
    for model_key, keys in pending.items():
        for key in keys:
            waiting_on[key].append(model_key)
    for filename in sorted(by_file):
        with safe_open(checkpoint.path(filename), framework="pt", device="cpu") as handle:
            for key in sorted(set(by_file[filename])):
                read[key] = handle.get_tensor(key)
        for key in sorted(set(by_file[filename])):
            for model_key in waiting_on[key]:
                pending[model_key].discard(key)
                if pending[model_key]:
                    continue
                sources = plan[model_key]
                if sources[0][1] is None:
                    finish(model_key, read[sources[0][0]])
                else:
                    finish(
                        model_key, _convert(model, config, model_key, sources, read, converter_of)
                    )
        for key in list(read):
            if all(not pending[m] for m in waiting_on[key]):
                del read[key]

    if topology.tied and stage.embed is not None and stage.head is not None:
        stage.head.weight = stage.embed.weight
    _check_materialised(stage, checkpoint.ref)
    stage.loaded_files = tuple(sorted(by_file))
    stage.to(device)
    if quantizer is not None:
        stage.eval()  # as from_pretrained hands back a quantized model: bnb int8 differs in train
    return stage


def _convert(model, config, model_key, sources, read, converter_of) -> torch.Tensor:
    """Fuse one weight from its checkpoint pieces with transformers' own converter."""
    converter = deepcopy(converter_of[sources[0][1]])
    for key, pattern in sources:
        converter.add_tensor(model_key, key, pattern, lambda key=key: read[key])
    converted = converter.convert(model_key, model=model, config=config)
    if model_key not in converted:
        raise NotLoadableByName(
            f"converting {', '.join(k for k, _ in sources[:3])} gave {sorted(converted)}, "
            f"not {model_key}"
        )
    value = converted[model_key]
    return value[0] if isinstance(value, list) else value


def _check_materialised(stage: Stage, ref: str) -> None:
    left = [name for name, p in stage.named_parameters() if p.is_meta]
    left += [name for name, b in stage.named_buffers() if b.is_meta]
    if left:
        raise NotLoadableByName(
            f"checkpoint {ref} left {', '.join(left[:5])} of the stage unloaded"
        )
