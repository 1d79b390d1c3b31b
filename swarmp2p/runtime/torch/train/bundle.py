"""A training stage's bundle: its module on its device, its compressor halves, what it trains.

``build_bundle`` places a stage, switches it to the ``swarm_sdpa`` attention
(``runtime/torch/model/attention.py``) and resolves its trainable parameters from the finetune mode;
``set_recompute`` turns activation checkpointing per block on or off. The training step
(``train``) and snapshots, export and evaluation all take the ``StageBundle`` it returns.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from swarmp2p.plan.job import FINETUNE_MODES
from swarmp2p.plan.split import StagePosition
from swarmp2p.runtime.torch.model.attention import use_swarm_sdpa
from swarmp2p.runtime.torch.model.hf_compat import set_block_checkpointing
from swarmp2p.runtime.torch.train.compression import Compressor


@dataclass(kw_only=True, eq=False)
class StageBundle(StagePosition):
    """One stage, ready to train: its module, its compressor halves, what it optimises."""

    index: int
    n_stages: int
    stage: nn.Module
    """``stage(x, position_ids=None)``: ids on the first stage, hidden states otherwise; hidden
    states out, logits on the last stage. ``stage.blocks`` is its decoder blocks."""
    recv_compressor: Compressor | None = None
    """The compressor of the boundary this stage reads from (it runs the receiver half)."""
    send_compressor: Compressor | None = None
    """The compressor of the boundary this stage writes to (it runs the sender half)."""
    finetune_mode: str = "full"
    trainable_parameters: list[nn.Parameter] = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    """The compute dtype: what arrives over a boundary is cast to it."""
    wire_v2: bool = True
    """Send a quantized payload as its codes (lossless); False sends the floats (wire v1)."""

    @property
    def stage_index(self) -> int:
        return self.index

    @property
    def send_codec(self) -> str:
        if self.send_compressor is None or not self.wire_v2:
            return "none"
        return self.send_compressor.payload_codec

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor from another stage on this stage's device, floats in its compute dtype."""
        if tensor.is_floating_point():
            return tensor.to(device=self.device, dtype=self.dtype)
        return tensor.to(self.device)

    def receive(self, payload: torch.Tensor) -> torch.Tensor:
        """The receiver half of the incoming boundary (identity without one)."""
        return payload if self.recv_compressor is None else self.recv_compressor.receiver()(payload)

    def send(self, hidden: torch.Tensor) -> torch.Tensor:
        """The sender half of the outgoing boundary (identity without one)."""
        return hidden if self.send_compressor is None else self.send_compressor.sender()(hidden)


def _compressor_parameters(bundle: StageBundle) -> list[nn.Parameter]:
    params: list[nn.Parameter] = []
    if bundle.recv_compressor is not None:
        params += list(bundle.recv_compressor.receiver().parameters())
    if bundle.send_compressor is not None:
        params += list(bundle.send_compressor.sender().parameters())
    return params


def build_bundle(
    stage: nn.Module,
    *,
    index: int,
    n_stages: int,
    recv_compressor: Compressor | None = None,
    send_compressor: Compressor | None = None,
    finetune_mode: str = "full",
    block_devices: Sequence[str] | None = None,
    wire_v2: bool = True,
    dtype: torch.dtype | None = None,
) -> StageBundle:
    """Place a stage's blocks on ``block_devices`` and resolve what it trains.

    ``trainable_parameters`` is never empty unless the mode is ``none``, or ``compressor_only`` on
    a stage with no learned bottleneck half (it only relays). For ``lora``, apply the adapters
    first (``lora.apply_lora``): the bundle trains the adapter weights inside the stage.
    ``dtype`` is the compute dtype (None: the stage's first floating-point parameter's).
    """
    if n_stages < 1 or not 0 <= index < n_stages:
        raise ValueError(
            f"stage index {index} of {n_stages} stages: need n_stages >= 1, 0 <= index < n"
        )
    if finetune_mode not in FINETUNE_MODES:
        raise ValueError(
            f"finetune_mode {finetune_mode!r} is not one of {', '.join(FINETUNE_MODES)}"
        )
    if (recv_compressor is None) != (index == 0):
        raise ValueError(f"stage {index}: a receive compressor exactly when the stage is not first")
    if (send_compressor is None) != (index == n_stages - 1):
        raise ValueError(f"stage {index}: a send compressor exactly when the stage is not last")
    blocks = list(stage.blocks)
    device = torch.device("cpu")
    if block_devices is not None:
        if len(block_devices) != len(blocks):
            raise ValueError(
                f"stage {index} has {len(blocks)} blocks but block_devices lists "
                f"{len(block_devices)}; give one device per block"
            )
        if len(set(block_devices)) > 1:
            raise ValueError(
                f"stage {index}: blocks on several devices {sorted(set(block_devices))} are not "
                "supported by this runtime yet; give one device"
            )
        device = torch.device(block_devices[0])
    stage.to(device)
    if getattr(stage, "config", None) is not None:
        use_swarm_sdpa(stage)  # long sequences on cards without Flash Attention (attention.py)
    for comp in (recv_compressor, send_compressor):
        if comp is not None:
            comp.to(device)

    compressor_params = _compressor_parameters(
        StageBundle(
            index=index,
            n_stages=n_stages,
            stage=stage,
            recv_compressor=recv_compressor,
            send_compressor=send_compressor,
        )
    )
    if finetune_mode == "full":
        params = [p for p in stage.parameters()] + compressor_params
    elif finetune_mode == "compressor_only":
        params = compressor_params
    elif finetune_mode == "lora":
        adapters = [p for n, p in stage.named_parameters() if "lora_" in n]
        if not adapters:
            raise ValueError(
                f"stage {index} has no LoRA adapters in its blocks: target_modules matched "
                "nothing here; check model.lora.target_modules"
            )
        params = adapters + compressor_params
    else:
        params = []
    trainable = {id(p) for p in params}
    for p in (*stage.parameters(), *_all_compressor_parameters(recv_compressor, send_compressor)):
        p.requires_grad_(id(p) in trainable)
    if not params and finetune_mode in ("full", "lora"):
        raise ValueError(f"stage {index} has nothing to train in finetune mode {finetune_mode!r}")
    embed = getattr(stage, "embed", None)
    if (
        isinstance(embed, nn.Embedding)
        and embed.weight.requires_grad
        and embed.weight.dtype == torch.float32
    ):
        embed.sparse = True  # a micro-batch touches few of its rows (dense_gradients); the CPU
        # cannot add sparse float16 gradients, so 16-bit tables stay dense
    # deduplicate (a tied head and embedding are one parameter)
    unique = list({id(p): p for p in params}.values())
    if dtype is None:
        floating = [p.dtype for p in stage.parameters() if p.is_floating_point()]
        dtype = floating[0] if floating else torch.float32
    return StageBundle(
        index=index,
        n_stages=n_stages,
        stage=stage,
        recv_compressor=recv_compressor,
        send_compressor=send_compressor,
        finetune_mode=finetune_mode,
        trainable_parameters=unique,
        device=device,
        dtype=dtype,
        wire_v2=wire_v2,
    )


def dense_gradients(params: Iterable[nn.Parameter]) -> None:
    """Make the sparse gradients of ``params`` dense (in place), once a step, before anything
    reads them. A trainable input embedding backs up sparse rows: a micro-batch touches a few
    hundred of its rows, and a dense gradient per micro-batch wrote and added the whole table
    (SmolLM2's 49152 x 576) each time: 0.26 s of a step's 4 micro-batches on one CPU thread
    against 0.06 s sparse, densified once."""
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            p.grad = p.grad.to_dense()


def _all_compressor_parameters(*comps: Compressor | None) -> list[nn.Parameter]:
    return [p for c in comps if c is not None for p in c.parameters()]


def set_recompute(stage: nn.Module, enabled: bool) -> None:
    """Activation checkpointing per block (transformers' ``GradientCheckpointingLayer``)."""
    for i, block in enumerate(stage.blocks):
        if not hasattr(type(block), "gradient_checkpointing"):
            raise ValueError(
                f"block {i} ({type(block).__name__}) does not support recompute; "
                "set train.recompute to false"
            )
        set_block_checkpointing(block, enabled, functools.partial(checkpoint, use_reentrant=False))
