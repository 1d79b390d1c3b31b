"""Per-stage memory prices in bytes, and the peak a stage needs on its device.

Each price is a simple, documented estimate; fitting by these numbers is what the planner
checks before anything is downloaded. Sources:

- weights: parameters x bytes per parameter of the storage dtype or the quantization
  (`quantization.bytes_per_param`, scales included). The input embeddings and the output
  head stay in the compute dtype under quantization (the reference keeps the head in full
  precision by default; a tied head shares the embedding tensor). Learned compressor halves
  are in the compute dtype, like the stage.
- trainable state (the reference's "Which parameters train" table), per trainable parameter
  on top of its weight: AdamW's two fp32 moments 8 B and an fp32 gradient 4 B; a float16 or
  bfloat16 job steps an fp32 master copy (4 B more; the 16-bit gradient is dropped as its fp32
  copy is made; `runtime/torch/train/precision.py`), so 12 B in float32 and 16 B in half precision.
  `full` trains every parameter; `lora` trains adapters only (r x (in + out) per adapted
  projection), whose own weight (compute dtype) is priced here too: 16 B (float32) or 18 B
  (half); `compressor_only` trains the learned bottleneck halves on the stage; `none` trains
  nothing.
- activations saved for backward per layer and micro-batch: Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models", eq. 1 without tensor
  parallelism: s b h (34 + 5 a s / h) bytes at 16 bits; the 19 s b h of the MLP scales with
  the MLP's width against GPT's 4 h (MoE: the experts a token is routed to), the 5 a s^2 b
  attention scores vanish with efficient attention (Flash / memory-efficient SDPA; which one a
  card runs is ``plan/hardware.training_kernel``'s rule, priced per card), and
  float32 doubles it all. With recompute a layer keeps only its input (s b h values) and one
  block is recomputed at a time (the transient, paid once per device).
- loss: the last stage's float32 logits and their gradient, 2 x tokens x vocab x 4 B, or the
  same over `loss_chunk_tokens(vocab)` tokens with chunked loss.
- KV cache for serving: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes per token,
  times sessions x tokens; the prefix cache (``swarm serve --prefix-cache-mb``) is its budget
  on every stage, which holds at most that many bytes of cached prompt blocks.
- transient: one block run again under recompute, or one layer's checkpoint tensors held in
  full precision while a quantized stage loads (the reference quantizes one tensor at a time).
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from itertools import accumulate
from typing import Any

from swarmp2p.plan.hardware import DTYPE_BYTES
from swarmp2p.plan.model_shape import ModelShape
from swarmp2p.plan.quantization import QuantSpec, bytes_per_param
from swarmp2p.plan.split import Compression
from swarmp2p.schema import to_data

LOSS_CHUNK_BYTES = 64 * 2**20
"""Float32 logits one chunk of the chunked loss may hold."""
DEFAULT_LOSS_CHUNK_TOKENS = 2048
"""Tokens whose float32 logits a training job's last stage holds at once while scoring
(reference, "Long sequences"): the worker spec's default ``loss_chunk_tokens``."""

PREFIX_BLOCK_TOKENS = 16
"""Tokens per block of the serving prefix cache (vLLM's default block size): a block is cached,
reused and dropped whole (``serve.decoding.prefix``)."""

_MOMENTS_AND_GRAD_BYTES = 12
"""AdamW's two float32 moments and the float32 gradient of one trainable parameter."""
_MASTER_BYTES = 4
"""The float32 master copy a half-precision job steps for each trainable parameter."""
_LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def loss_chunk_tokens(vocab: int) -> int:
    """Tokens the chunked loss scores at once: LOSS_CHUNK_BYTES of float32 logits."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab))


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """What a stage runs: training micro-batches or serving sessions."""

    batch_size: int = 1
    seq_len: int = 128
    micro_batches: int = 1
    training: bool = True
    recompute: bool = False
    efficient_attention: bool = False
    chunked_loss: bool = False
    serving_sessions: int = 0
    serving_tokens: int = 0
    """Tokens of context each serving session keeps in its KV cache."""
    prefix_cache_bytes: int = 0
    """A serving stage's budget for cached prompt blocks (the prefix cache)."""
    draft_bytes: int = 0
    """Serving: the draft model the first stage holds (its weights and KV cache)."""

    @property
    def micro_tokens(self) -> int:
        return max(self.batch_size // self.micro_batches, 1) * self.seq_len


@dataclass(frozen=True, kw_only=True, slots=True)
class Pricing:
    """Job-level facts that price weights and trainable state."""

    dtype: str
    """Compute dtype."""
    finetune_mode: str = "full"
    quantization: QuantSpec | None = None
    weight_dtype: str | None = None
    """Storage of a frozen backbone (applied only when finetune_mode is not full)."""
    lora_r: int = 8
    lora_targets: tuple[str, ...] | None = None

    @property
    def layer_weight_bytes(self) -> float:
        if self.quantization is not None:
            return bytes_per_param(self.quantization)
        if self.weight_dtype and self.finetune_mode != "full":
            return float(DTYPE_BYTES[self.weight_dtype])
        return float(DTYPE_BYTES[self.dtype])

    @property
    def outer_weight_bytes(self) -> float:
        """Embeddings and head: the compute dtype under quantization, else the storage dtype."""
        if self.quantization is not None:
            return float(DTYPE_BYTES[self.dtype])
        return self.layer_weight_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMemory:
    """A stage's prices in bytes; `peak` is what its device must have free."""

    weights: int
    trainable_state: int
    activations: int
    loss: int
    kv_cache: int
    transient: int
    prefix_cache: int = 0
    """Serving: the cached prompt blocks' budget on this stage."""
    draft: int = 0
    """Serving, the first stage: the draft model of speculative decoding (weights, KV cache)."""
    peak: int = dataclass_field(init=False)
    """The sum of the above: what the stage's device must have free (derived)."""

    def __post_init__(self) -> None:
        total = (
            self.weights
            + self.trainable_state
            + self.activations
            + self.loss
            + self.kv_cache
            + self.transient
            + self.prefix_cache
            + self.draft
        )
        object.__setattr__(self, "peak", total)

    def to_dict(self) -> dict[str, Any]:
        return to_data(self)


def lora_params_per_layer(shape: ModelShape, r: int, targets: tuple[str, ...] | None) -> int:
    """Adapter parameters LoRA of rank r adds to one layer: r x (in + out) per projection."""
    h, q, kv = shape.hidden, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    inter = shape.intermediate
    sizes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
        "c_attn": (h, q + 2 * kv),
        "query_key_value": (h, q + 2 * kv),
        "qkv_proj": (h, q + 2 * kv),
        "Wqkv": (h, q + 2 * kv),
        "c_fc": (h, inter),
        "c_proj": (inter, h),
    }
    total = 0
    for name in targets or _LORA_DEFAULT_TARGETS:
        fan_in, fan_out = sizes.get(name, (h, h))
        total += r * (fan_in + fan_out)
    return total


def trained_params(
    shape: ModelShape, pricing: Pricing, start: int, end: int, *, first: bool, last: bool
) -> int:
    """Parameters a stage of layers [start, end) trains (its optimizer steps them; replicas sync
    them): every one in a full job, the adapters in a LoRA job, none otherwise (a learned
    bottleneck's few are left out)."""
    if pricing.finetune_mode == "full":
        outer = shape.embed_params if first else 0
        if last:
            outer += shape.head_params + (
                shape.embed_params if shape.tie_embeddings and not first else 0
            )
        return sum(shape.layer_params[start:end]) + outer
    if pricing.finetune_mode == "lora":
        return lora_params_per_layer(shape, pricing.lora_r, pricing.lora_targets) * (end - start)
    return 0


class StagePricer:
    """Prices any layer range of one model and job in O(1) (prefix sums per layer)."""

    def __init__(self, shape: ModelShape, pricing: Pricing, workload: Workload) -> None:
        self.shape, self.pricing, self.workload = shape, pricing, workload
        a = DTYPE_BYTES[pricing.dtype]
        h = shape.hidden
        t = workload.micro_tokens
        # by whether the stage's card holds the attention scores (no efficient kernel runs)
        acts: dict[bool, list[float]] = {False: [], True: []}
        for active in shape.layer_active_params:
            ffn_scale = max(active - shape.attn_params, 0) / (8 * h * h)
            per_token = (15 * h + 19 * h * ffn_scale) * a / 2
            acts[False].append(per_token * t)
            acts[True].append((per_token + 5 * shape.n_heads * workload.seq_len * a / 2) * t)
        self._scores = not workload.efficient_attention
        self._acts = acts
        self._act_sums = {k: [0.0, *accumulate(v)] for k, v in acts.items()}
        self._full_act = acts[self._scores]
        self._params = [0, *accumulate(shape.layer_params)]
        self._ckpt = [0, *accumulate(shape.layer_bytes)]
        self._input_act = t * h * a
        self._lora_layer = lora_params_per_layer(shape, pricing.lora_r, pricing.lora_targets)
        self._kv_layer = 2 * shape.n_kv_heads * shape.head_dim * a
        self._max_layer = max(shape.layer_params)
        self._max_act = {k: max(v) for k, v in acts.items()}

    def held_outer_params(self, first: bool, last: bool) -> int:
        """Embedding and head parameters the stage holds (a tied head needs the embedding)."""
        s = self.shape
        params = s.embed_params if first else 0
        if last:
            params += s.head_params
            if s.tie_embeddings and not first:
                params += s.embed_params
        return params

    def download_bytes(self, start: int, end: int, first: bool, last: bool) -> int:
        """Checkpoint bytes the stage reads: its layers, embeddings if first, head if last."""
        s = self.shape
        total = self._ckpt[end] - self._ckpt[start]
        total += s.embed_bytes if first else 0
        if last:
            total += s.head_bytes + (s.embed_bytes if s.tie_embeddings and not first else 0)
        return total

    def price(
        self,
        start: int,
        end: int,
        *,
        first: bool,
        last: bool,
        in_flight: int = 1,
        receive: Compression | None = None,
        send: Compression | None = None,
        scores: bool | None = None,
    ) -> StageMemory:
        """The memory of the stage holding layers [start, end). ``scores``: whether its card
        holds the seq x seq attention scores (None: unless the workload's efficient_attention;
        ``plan/hardware.training_kernel`` decides it per card)."""
        scores = self._scores if scores is None else scores
        s, p, w = self.shape, self.pricing, self.workload
        layer_params = self._params[end] - self._params[start]
        outer = self.held_outer_params(first, last)
        weights = layer_params * p.layer_weight_bytes + outer * p.outer_weight_bytes
        compressor = 0
        if receive is not None and receive.is_learned:
            k = receive.code_dim(s.hidden)
            compressor += k * s.hidden + s.hidden
        if send is not None and send.is_learned:
            k = send.code_dim(s.hidden)
            compressor += s.hidden * k + k
        compute = DTYPE_BYTES[p.dtype]
        weights += compressor * compute
        state = 0
        if w.training:
            mode = p.finetune_mode
            per = _MOMENTS_AND_GRAD_BYTES + (_MASTER_BYTES if compute < 4 else 0)
            if mode == "full":
                state = (layer_params + outer + compressor) * per
            elif mode == "lora":
                adapters = self._lora_layer * (end - start)
                state = adapters * (compute + per) + compressor * per
            elif mode == "compressor_only":
                state = compressor * per
        activations = loss = transient = kv = 0
        if w.training and p.finetune_mode != "none":
            if w.recompute:
                held = self._input_act * (end - start)
                transient = self._max_act_in(start, end, scores)
            else:
                sums = self._act_sums[scores]
                held = sums[end] - sums[start]
            activations = held * in_flight
            if last:
                tokens = w.micro_tokens
                if w.chunked_loss:
                    tokens = min(tokens, loss_chunk_tokens(s.vocab))
                loss = 2 * tokens * s.vocab * 4
        if w.serving_sessions:
            kv = self._kv_layer * (end - start) * w.serving_sessions * w.serving_tokens
        if p.quantization is not None:
            ckpt_bytes = DTYPE_BYTES.get(s.checkpoint_dtype, 4)
            transient = max(transient, self._max_layer * ckpt_bytes)
        return StageMemory(
            weights=int(weights),
            trainable_state=int(state),
            activations=int(activations),
            loss=int(loss),
            kv_cache=int(kv),
            transient=int(transient),
            prefix_cache=int(w.prefix_cache_bytes) if w.serving_sessions else 0,
            draft=int(w.draft_bytes) if w.serving_sessions and first else 0,
        )

    def prefix_block_bytes(self, start: int, end: int) -> int:
        """What one cached prompt block of layers [start, end) takes (keys and values)."""
        return self._kv_layer * (end - start) * PREFIX_BLOCK_TOKENS

    def _max_act_in(self, start: int, end: int, scores: bool) -> float:
        if end - start == len(self._full_act):
            return self._max_act[scores]
        return max(self._acts[scores][start:end])
