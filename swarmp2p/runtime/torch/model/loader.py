"""Load one stage's slice of a checkpoint: only its tensors, only the files that hold them."""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from copy import deepcopy
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from swarmp2p.models import resolve_model_ref
from swarmp2p.runtime.torch.model import hf_compat
from swarmp2p.runtime.torch.model.introspect import Topology, introspect
from swarmp2p.runtime.torch.model.stage import Stage

if TYPE_CHECKING:
    from swarmp2p.plan.worker_spec import WorkerSpec
    from swarmp2p.serve.spec import ServeSpec

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DISK_HEADROOM_BYTES = 512 * 2**20
MAPPED_BYTES_PER_OPEN = 64 * 2**20
"""Bytes read through one safetensors handle before it is closed and the file mapped afresh:
the pages read stay resident while it is open (bench/shard_load.py measures the effect)."""
"""Free space kept on the cache's filesystem beyond the files a stage downloads (the reference)."""


"""A Hub model id: ``name`` or ``org/name``."""


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
        resolved = resolve_model_ref(ref)
        if Path(resolved).is_dir():
            self.folder = Path(resolved)
        else:
            self.repo_id = resolved
            self.folder = Path(self._fetch("config.json")).parent
        self.ref = ref
        self.weight_map = self._weight_map()

    def _fetch(self, filename: str) -> str:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        try:
            return hf_hub_download(self.repo_id, filename)
        except (LocalEntryNotFoundError, HfHubHTTPError) as error:
            raise FileNotFoundError(
                f"model {self.repo_id!r}: {filename} is neither in the local Hugging Face cache "
                f"nor reachable on the Hub ({type(error).__name__}); check the name, go online, "
                "or pass a local checkpoint folder"
            ) from error

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

    Returns ``{model_key: [(checkpoint_key, converter_pattern | None), ...]}`` for the wanted
    keys (sources in transformers' order: experts by index), and the converters by pattern.
    """
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters = _conversions(model)
    meta = model.state_dict()
    prefix = model.base_model_prefix
    renamed: dict[str, tuple[str, str | None]] = {}
    for key in sorted(checkpoint_keys, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        renamed[key] = (key, None) if target not in meta and key in meta else (target, pattern)

    plan: dict[str, list[tuple[str, str | None]]] = defaultdict(list)
    for key, (target, pattern) in renamed.items():
        if target in wanted:
            plan[target].append((key, pattern))
    head_key = f"{topology.names['head']}.weight"
    if topology.tied and head_key in wanted and head_key not in plan:
        # the checkpoint stores no head: it aliases the input embedding (the reference's rule)
        embed_key = f"{topology.names['embed']}.weight"
        plan[head_key] = [(k, p) for k, (target, p) in renamed.items() if target == embed_key]
    return dict(plan), {p: c for c in converters for p in c.source_patterns}


def _read(checkpoint: _Checkpoint, plan, build) -> tuple[str, ...]:
    """Read each planned checkpoint tensor once, one file open at a time, and hand every model
    key to ``build(model_key, {checkpoint_key: tensor})`` as soon as all its sources are read
    (a fused MoE weight waits for all its experts); returns the files read."""
    by_file: dict[str, set[str]] = defaultdict(set)
    waiting_on: dict[str, list[str]] = defaultdict(list)
    pending = {model_key: {key for key, _ in sources} for model_key, sources in plan.items()}
    for model_key, keys in pending.items():
        for key in keys:
            by_file[checkpoint.weight_map[key]].add(key)
            waiting_on[key].append(model_key)
    checkpoint.ensure_disk_for(set(by_file))
    held: dict[str, torch.Tensor] = {}
    for filename in sorted(by_file):
        path = checkpoint.path(filename)
        keys = sorted(by_file[filename])
        while keys:
            # safetensors maps the file: every page read stays resident until the handle
            # closes, so a long read is split into handles of at most MAPPED_BYTES_PER_OPEN
            mapped = 0
            with safe_open(path, framework="pt", device="cpu") as handle:
                while keys and mapped <= MAPPED_BYTES_PER_OPEN:
                    key = keys.pop(0)
                    held[key] = handle.get_tensor(key)
                    mapped += held[key].nbytes
                    for model_key in waiting_on[key]:
                        pending[model_key].discard(key)
                        if not pending[model_key]:
                            build(model_key, {k: held[k] for k, _ in plan[model_key]})
                    for done in [k for k in held if all(not pending[m] for m in waiting_on[k])]:
                        del held[done]  # one full-precision tensor at a time
    return tuple(sorted(by_file))


# ---------------------------------------------------------------------------------------------
# materialising


def _set_tensor(model: nn.Module, key: str, value: torch.Tensor) -> None:
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(value, nn.Module):  # an ExpertStack takes the fused parameter's place
        del module._parameters[name]
        module.add_module(name, value)
    elif name in module._parameters:
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

    plan = hf_compat.dtype_plan(model, dtype)  # the same plan from_pretrained builds
    if not plan:
        return lambda key, meta_dtype: meta_dtype
    alternation, by_group, _ = build_glob_alternation(list(plan))

    def pick(key: str, meta_dtype: torch.dtype) -> torch.dtype:
        match = alternation.search(key)
        return plan[by_group[match.lastgroup]] if match else meta_dtype

    return pick


def _empty_model(config, dtype: torch.dtype, attn_implementation: str | None = None):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    # buffers stay real: rotary tables and embedding scales are recomputed, not read
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation
        )
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
    *,
    attn_implementation: str | None = None,
) -> Stage:
    """Materialise blocks ``[layer_start, layer_end)`` of ``model_ref`` (a folder, a Hub id or
    ``"embedded"``) and nothing else: a meta-device model from the config, then only the stage's
    tensors read from only the files that hold them. The stage comes back in eval mode.

    ``attn_implementation`` is transformers' (``"sdpa"`` by default, ``"eager"``, ...); every
    block is handed the causal mask of its own layer type whichever it is."""
    from transformers import AutoConfig

    from swarmp2p.runtime.torch.model import quantization as _quant

    dtype = resolve_dtype(dtype)
    device = torch.device(device)
    spec = _quant.normalize_spec(quantization)
    checkpoint = _Checkpoint(model_ref)
    config = AutoConfig.from_pretrained(checkpoint.folder)
    model = _empty_model(config, dtype, attn_implementation)
    stored = introspect(model)  # where the checkpoint keeps each part; is the head tied
    quantizer = _quant.prepare(model, stored, spec) if spec is not None else None
    # bitsandbytes swaps every layer it quantizes for its own module, the head among them
    # unless skip_modules names it: the stage is cut from the model after the swap, or it
    # would hold the old meta-device head and leave it unloaded. A quantized tied head holds its
    # own quantized copy of the embedding matrix (the embedding itself stays full precision).
    topology = introspect(model) if quantizer is not None else stored
    stage = Stage(
        topology,
        layer_start=layer_start,
        layer_end=layer_end,
        is_first_stage=is_first_stage,
        is_last_stage=is_last_stage,
    )

    wanted = stage_keys(stage, topology)
    plan, converter_of = _plan_reads(model, stored, checkpoint.weight_map, wanted)
    meta = model.state_dict(keep_vars=True)
    params = {k for k, v in meta.items() if isinstance(v, nn.Parameter)}
    missing = sorted(k for k in wanted & params if k not in plan)
    if missing:
        raise NotLoadableByName(
            f"checkpoint {checkpoint.ref} has no tensor for {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''} of stage [{layer_start}, {layer_end}); "
            "it names its weights differently from transformers' model"
        )

    pick_dtype = _dtype_for(model, dtype)

    def build(model_key: str, pieces: dict[str, torch.Tensor]) -> None:
        sources = plan[model_key]
        if sources[0][1] is None:
            value = pieces[sources[0][0]]
        else:
            value = _convert(model, config, model_key, sources, pieces, converter_of)
        # straight to the device: a GPU stage holds one host tensor at a time, and bitsandbytes
        # quantizes on the card as from_pretrained does with a device map
        if quantizer is not None and quantizer.owns(model_key):
            value = quantizer.quantize(model_key, value.to(device=device, dtype=dtype))
        elif value.is_floating_point():
            value = value.to(device=device, dtype=pick_dtype(model_key, meta[model_key].dtype))
        else:
            value = value.to(device)
        _set_tensor(model, model_key, value)

    loaded_files = _read(checkpoint, plan, build)
    if topology.tied and stage.embed is not None and stage.head is not None:
        stage.head.weight = stage.embed.weight
    _check_materialised(stage, checkpoint.ref)
    stage.loaded_files = loaded_files
    stage.to(device)  # the recomputed buffers (rotary tables, embedding scales)
    # eval mode, as from_pretrained hands a model back (dropout off; bnb int8 differs in train);
    # a trainer calls stage.train() itself
    return stage.eval()


def load_spec_stage(spec: WorkerSpec | ServeSpec) -> Stage:
    """The stage a training or serve spec assigns: its blocks of ``spec.model`` in the plan's
    dtype and quantization, on ``spec.device``."""
    return load_stage_shard(
        spec.model,
        *spec.layers,
        spec.is_first,
        spec.is_last,
        dtype=spec.dtype,
        quantization=spec.quantization,
        device=spec.device,
    )


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
