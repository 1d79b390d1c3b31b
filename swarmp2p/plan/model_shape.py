"""A causal LM's shape from its `config.json` and safetensors headers, without torch.

`from_config(config, safetensors_index=None, headers=None)` is pure; `load(ref)` reads a local
folder, a Hub id already in the local Hugging Face cache (offline only), or "embedded"
(SmolLM2-135M-Instruct). Layer and head counts are read through `text_config` (multimodal
checkpoints such as Qwen3.5 keep the decoder's numbers there).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EMBEDDED = "embedded"
EMBEDDED_DIRNAME = "smollm2-135m-instruct"

EMBEDDED_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}
"""SmolLM2-135M-Instruct's config as converted from its GGUF (float32 checkpoint, ~134.5M)."""

SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
_CONFIG_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_HEADER_LIMIT = 100 * 2**20
_LAYER_RE = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """What the planner needs to know about a model: sizes per layer, embeddings, head, files."""

    name: str
    model_type: str
    n_layers: int
    hidden: int
    vocab: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    tie_embeddings: bool
    max_positions: int
    layer_params: tuple[int, ...]
    """Parameters of each decoder layer."""
    layer_active_params: tuple[int, ...]
    """Parameters each token runs through per layer (MoE: routed experts only); prices compute."""
    attn_params: int = 0
    """Attention and norm parameters of one layer (the rest of a layer is its MLP)."""
    moe_layers: tuple[bool, ...]
    num_experts: int = 0
    experts_per_token: int = 0
    embed_params: int
    """Input embeddings (plus learned positions), held by the first stage."""
    head_params: int
    """Output head (0 when tied to the embeddings) plus the final norm, held by the last stage."""
    checkpoint_dtype: str = "float32"
    layer_bytes: tuple[int, ...]
    """Checkpoint bytes of each layer's tensors (download share)."""
    embed_bytes: int
    head_bytes: int
    layer_files: tuple[tuple[str, ...], ...] = ()
    """Checkpoint files holding each layer's tensors (empty when unknown)."""
    embed_files: tuple[str, ...] = ()
    head_files: tuple[str, ...] = ()
    recurrent: bool = False
    """Some layer keeps a recurrent state (linear attention) instead of keys and values per
    token: a serving prefix cache cannot hold its prompts."""

    @property
    def total_params(self) -> int:
        return sum(self.layer_params) + self.embed_params + self.head_params

    @property
    def head_compute_params(self) -> int:
        """Weights the head's matmul runs per token: vocab x hidden even when tied."""
        return self.vocab * self.hidden

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model_type": self.model_type,
            "n_layers": self.n_layers,
            "hidden": self.hidden,
            "vocab": self.vocab,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "tie_embeddings": self.tie_embeddings,
            "params": self.total_params,
            "moe": any(self.moe_layers),
            "checkpoint_dtype": self.checkpoint_dtype,
        }


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    if isinstance(text, dict):
        merged = {k: v for k, v in config.items() if k != "text_config"}
        merged.update(text)
        return merged
    return config


def _first(cfg: dict[str, Any], keys: tuple[str, ...], default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _positive_int(cfg: dict[str, Any], keys: tuple[str, ...], default: Any = None) -> int:
    value = _first(cfg, keys, default)
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ValueError(
            f"config.json: {keys[0]} (or {', '.join(keys[1:]) or 'no alias'}) must be a "
            f"positive integer, got {value!r}"
        )
    return value


def _moe_layer_flags(cfg: dict[str, Any], n_layers: int, num_experts: int) -> tuple[bool, ...]:
    if num_experts <= 0:
        return (False,) * n_layers
    first_dense = cfg.get("first_k_dense_replace") or 0
    dense_list = set(cfg.get("mlp_only_layers") or ())
    step = cfg.get("decoder_sparse_step") or 1
    freq = cfg.get("moe_layer_freq") or 1
    flags = []
    for i in range(n_layers):
        moe = i >= first_dense and i not in dense_list and (i + 1) % step == 0
        if isinstance(freq, int) and freq > 1:
            moe = moe and (i - first_dense) % freq == 0
        flags.append(moe)
    return tuple(flags)


def from_config(
    config: dict[str, Any],
    safetensors_index: dict[str, Any] | None = None,
    headers: dict[str, dict[str, Any]] | None = None,
    *,
    name: str = "model",
) -> ModelShape:
    """A model's shape from its config; `headers` (file -> safetensors header) gives exact bytes.

    Parameter counts follow the Llama/GPT-2 family layouts: attention q/k/v/o, a gated MLP of
    3 x hidden x intermediate (GPT-2: 2 x hidden x 4 hidden), two norms per layer; MoE layers
    hold `num_experts` experts of `moe_intermediate_size`, a router, and any shared experts.
    `safetensors_index` (`model.safetensors.index.json`) names the file of each tensor.
    """
    if not isinstance(config, dict):
        raise ValueError(f"config.json: must be a JSON object, got {type(config).__name__}")
    cfg = _text_config(config)
    model_type = str(cfg.get("model_type") or "unknown")
    gpt2 = model_type in ("gpt2", "gpt_bigcode", "gpt_neo", "gptj")
    n_layers = _positive_int(cfg, ("num_hidden_layers", "n_layer", "num_layers", "n_layers"))
    hidden = _positive_int(cfg, ("hidden_size", "n_embd", "d_model", "dim"))
    vocab = _positive_int(cfg, ("vocab_size", "padded_vocab_size"))
    n_heads = _positive_int(cfg, ("num_attention_heads", "n_head", "num_heads"))
    n_kv = _positive_int(cfg, ("num_key_value_heads", "num_kv_heads", "n_head_kv"), n_heads)
    head_dim = _positive_int(cfg, ("head_dim",), hidden // n_heads or 1)
    default_inter = 4 * hidden
    intermediate = _positive_int(cfg, ("intermediate_size", "n_inner", "ffn_dim"), default_inter)
    max_pos = _positive_int(
        cfg, ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"), 2048
    )
    tie = bool(cfg.get("tie_word_embeddings", gpt2))
    num_experts = int(_first(cfg, ("num_experts", "num_local_experts", "n_routed_experts"), 0))
    top_k = int(_first(cfg, ("num_experts_per_tok", "experts_per_token", "moe_topk"), 0) or 0)
    expert_inter = int(_first(cfg, ("moe_intermediate_size",), intermediate))
    shared_inter = int(_first(cfg, ("shared_expert_intermediate_size",), 0) or 0)
    shared_inter += int(cfg.get("n_shared_experts") or 0) * expert_inter
    moe_flags = _moe_layer_flags(cfg, n_layers, num_experts)

    q_out = n_heads * head_dim
    kv_out = n_kv * head_dim
    attn = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    if gpt2:
        attn += q_out + 2 * kv_out + hidden  # biases
    elif cfg.get("attention_bias") or model_type.startswith("qwen2"):
        attn += q_out + 2 * kv_out
    norms = 4 * hidden if gpt2 else 2 * hidden
    dense_mlp = (
        2 * hidden * intermediate + intermediate + hidden if gpt2 else 3 * hidden * intermediate
    )
    expert = 3 * hidden * expert_inter
    shared = 3 * hidden * shared_inter
    layer_params: list[int] = []
    active: list[int] = []
    for moe in moe_flags:
        if moe:
            layer_params.append(attn + norms + num_experts * expert + hidden * num_experts + shared)
            active.append(attn + norms + max(top_k, 1) * expert + hidden * num_experts + shared)
        else:
            layer_params.append(attn + norms + dense_mlp)
            active.append(attn + norms + dense_mlp)
    embed = vocab * hidden + (max_pos * hidden if gpt2 else 0)
    final_norm = 2 * hidden if gpt2 else hidden
    head = final_norm + (0 if tie else vocab * hidden)

    dtype = str(_first(cfg, ("torch_dtype", "dtype"), "float32"))
    if dtype not in _CONFIG_DTYPE_BYTES:
        dtype = "float32"
    nbytes = _CONFIG_DTYPE_BYTES[dtype]
    layer_bytes = [p * nbytes for p in layer_params]
    embed_bytes, head_bytes = embed * nbytes, head * nbytes
    layer_files: list[set[str]] = [set() for _ in range(n_layers)]
    embed_files: set[str] = set()
    head_files: set[str] = set()

    weight_map = (safetensors_index or {}).get("weight_map") or {}
    if headers:
        layer_bytes = [0] * n_layers
        embed_bytes = head_bytes = 0
        counts: dict[str, int] = {}
        numel = [0] * n_layers
        embed_numel = head_numel = 0
        for fname, header in sorted(headers.items()):
            for tensor, info in header.items():
                if tensor == "__metadata__" or not isinstance(info, dict):
                    continue
                start, end = info.get("data_offsets", (0, 0))
                size = int(end) - int(start)
                n = math.prod(int(d) for d in info.get("shape", ()))
                kind = _tensor_kind(tensor)
                if kind == "other":
                    continue
                counts[info.get("dtype", "F32")] = counts.get(info.get("dtype", "F32"), 0) + size
                if kind == "layer":
                    _assign(tensor, fname, size, layer_bytes, layer_files, n_layers)
                    match = _LAYER_RE.search(tensor)
                    if match and int(match.group(1)) < n_layers:
                        numel[int(match.group(1))] += n
                elif kind == "embed":
                    embed_bytes += size
                    embed_numel += n
                    embed_files.add(fname)
                else:
                    head_bytes += size
                    head_numel += 0 if tie and tensor.endswith("lm_head.weight") else n
                    head_files.add(fname)
        if all(numel):
            # exact counts from the checkpoint; a MoE token still runs only its routed experts
            inactive = [p - a for p, a in zip(layer_params, active)]
            layer_params = numel
            active = [max(p - x, 1) for p, x in zip(numel, inactive)]
            embed, head = embed_numel or embed, head_numel or head
        if counts:
            top = max(sorted(counts), key=counts.__getitem__)
            dtype = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(top, dtype)
    elif weight_map:
        for tensor, fname in weight_map.items():
            kind = _tensor_kind(tensor)
            if kind == "layer":
                _assign(tensor, fname, 0, None, layer_files, n_layers)
            elif kind == "embed":
                embed_files.add(fname)
            elif kind == "head":
                head_files.add(fname)

    return ModelShape(
        name=name,
        model_type=model_type,
        n_layers=n_layers,
        hidden=hidden,
        vocab=vocab,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        intermediate=intermediate,
        tie_embeddings=tie,
        max_positions=max_pos,
        layer_params=tuple(layer_params),
        layer_active_params=tuple(active),
        attn_params=attn + norms,
        moe_layers=moe_flags,
        num_experts=num_experts,
        experts_per_token=top_k,
        embed_params=embed,
        head_params=head,
        checkpoint_dtype=dtype,
        layer_bytes=tuple(layer_bytes),
        embed_bytes=embed_bytes,
        head_bytes=head_bytes,
        layer_files=tuple(tuple(sorted(f)) for f in layer_files) if any(layer_files) else (),
        embed_files=tuple(sorted(embed_files)),
        head_files=tuple(sorted(head_files)),
        recurrent="linear_attention" in (cfg.get("layer_types") or ()),
    )


def stage_files(
    shape: ModelShape, start: int, end: int, first: bool, last: bool
) -> tuple[str, ...]:
    """The checkpoint files holding blocks ``[start, end)`` (and the embeddings on the first
    stage, the head on the last: a tied one is the embedding); empty when the shape does not
    know which file holds which block (every weight file then)."""
    if not shape.layer_files:
        return ()
    files: set[str] = set()
    for layer in range(start, end):
        files.update(shape.layer_files[layer])
    if first:
        files.update(shape.embed_files)
    if last:
        files.update(shape.head_files)
        files.update(shape.embed_files if shape.tie_embeddings else ())
    return tuple(sorted(files))


_OTHER_PARTS = ("visual", "vision", "mtp", "audio", "image_newline", "multi_modal_projector")


def _tensor_kind(tensor: str) -> str:
    """ "layer", "embed", "head", or "other" (a vision tower or MTP head no stage loads)."""
    if any(part in tensor for part in _OTHER_PARTS):
        return "other"
    if _LAYER_RE.search(tensor):
        return "layer"
    if "embed" in tensor or re.search(r"(^|\.)(wte|wpe)\.", tensor):
        return "embed"
    return "head"  # lm_head, the final norm (norm / ln_f), anything after the blocks


def _assign(
    tensor: str,
    fname: str,
    size: int,
    layer_bytes: list[int] | None,
    layer_files: list[set[str]],
    n_layers: int,
) -> None:
    match = _LAYER_RE.search(tensor)
    if match and int(match.group(1)) < n_layers:
        i = int(match.group(1))
        layer_files[i].add(fname)
        if layer_bytes is not None:
            layer_bytes[i] += size


def read_safetensors_header(path: str | Path) -> dict[str, Any]:
    """A safetensors file's JSON header: 8-byte little-endian length, then that much JSON."""
    path = Path(path)
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", raw)
        if length > _HEADER_LIMIT:
            raise ValueError(f"{path}: safetensors header of {length} bytes is implausibly large")
        data = fh.read(length)
    if len(data) != length:
        raise ValueError(f"{path}: truncated safetensors header ({len(data)} of {length} bytes)")
    try:
        header = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header must be a JSON object")
    return header


def from_folder(folder: str | Path, *, name: str | None = None) -> ModelShape:
    """Shape of a local checkpoint folder: config.json, the index, every safetensors header."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{folder}: no config.json; give a Hugging Face checkpoint folder")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{cfg_path}: not valid JSON: {exc}") from exc
    index = None
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text(encoding="utf-8"))
    headers = {p.name: read_safetensors_header(p) for p in sorted(folder.glob("*.safetensors"))}
    return from_config(config, index, headers or None, name=name or folder.name)


def cache_dir() -> Path:
    """swarmp2p's cache: `$XDG_CACHE_HOME/swarmp2p`, else `~/.cache/swarmp2p`."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says a relative (or empty) value is invalid and must be ignored.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "swarmp2p"


def embedded_dir() -> Path:
    """Where the converted SmolLM2-135M-Instruct lives (it may not exist yet)."""
    return cache_dir() / "models" / EMBEDDED_DIRNAME


def hub_cache_dir() -> Path:
    """The local Hugging Face hub cache (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "huggingface" / "hub"


def _cached_snapshot(repo_id: str) -> Path | None:
    repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = repo / "snapshots" / ref.read_text(encoding="utf-8").strip()
        if (snap / "config.json").is_file():
            return snap
    snaps = sorted(p for p in (repo / "snapshots").glob("*") if (p / "config.json").is_file())
    return snaps[-1] if snaps else None


def load(ref: str) -> ModelShape:
    """Shape of "embedded", a local folder, or a Hub id already in the local HF cache."""
    if ref == EMBEDDED:
        folder = embedded_dir()
        if (folder / "config.json").is_file():
            return from_folder(folder, name=EMBEDDED)
        return from_config(EMBEDDED_CONFIG, name=EMBEDDED)
    path = Path(ref).expanduser()
    if path.is_dir():
        return from_folder(path, name=ref)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", ref):
        snap = _cached_snapshot(ref)
        if snap is not None:
            return from_folder(snap, name=ref)
        from swarmp2p._install import hf_download

        raise ValueError(
            f"model.pretrained: {ref!r} is not in the local Hugging Face cache "
            f"({hub_cache_dir()}); download it first (`{hf_download(ref)}`) "
            f"or give a local checkpoint folder"
        )
    raise ValueError(
        f'model.pretrained: {ref!r} is neither "embedded", an existing folder, nor a Hub id '
        f'such as "HuggingFaceTB/SmolLM2-135M"'
    )
