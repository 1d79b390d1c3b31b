"""Half-precision storage of a frozen backbone: weights kept in 16 bits, arithmetic in the
compute dtype (the reference's ``weight_dtype``).

A plain ``weight.float()`` in forward would make autograd keep a float32 copy of every weight
until backward. The upcast here is an autograd function that saves the 16-bit weight and
upcasts it a block of rows at a time, in forward and again in backward, so a large head (a
248k-token vocabulary) never holds a whole float32 copy.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_CHUNK_ROWS = 4096
"""Rows of a weight upcast at once in backward; bounds the transient float32 copy."""

_HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class _UpcastLinear(torch.autograd.Function):
    """``y = x @ W.T + b`` with ``W`` stored in 16 bits and frozen; grads flow to ``x`` only."""

    @staticmethod
    def forward(ctx, x, weight, bias, chunk_rows):
        ctx.save_for_backward(weight)
        ctx.chunk_rows = chunk_rows
        rows = weight.shape[0]
        if rows <= chunk_rows:
            return F.linear(x, weight.to(x.dtype), bias)
        parts = [
            F.linear(
                x,
                weight[start : start + chunk_rows].to(x.dtype),
                None if bias is None else bias[start : start + chunk_rows],
            )
            for start in range(0, rows, chunk_rows)
        ]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad_out):
        (weight,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        rows = ctx.chunk_rows
        grad_x = None
        for start in range(0, weight.shape[0], rows):
            part = grad_out[..., start : start + rows] @ weight[start : start + rows].to(
                grad_out.dtype
            )
            grad_x = part if grad_x is None else grad_x + part
        return grad_x, None, None, None


def _linear_forward(self, x):
    return _UpcastLinear.apply(x, self.weight, self.bias, self.half_storage_chunk_rows)


def _conv1d_forward(self, x):
    # GPT-2's Conv1D keeps its weight as [in, out]: y = x @ W + b
    shape = (*x.shape[:-1], self.nf)
    out = _UpcastLinear.apply(
        x.view(-1, x.size(-1)), self.weight.t(), self.bias, self.half_storage_chunk_rows
    )
    return out.view(shape)


def _embedding_forward(self, ids):
    # a gather needs no weight in backward; only the rows looked up are upcast
    return F.embedding(
        ids,
        self.weight,
        self.padding_idx,
        self.max_norm,
        self.norm_type,
        self.scale_grad_by_freq,
        self.sparse,
    ).to(self.half_storage_compute_dtype)


def apply_half_storage(
    module: nn.Module,
    weight_dtype: str | torch.dtype,
    *,
    compute_dtype: torch.dtype = torch.float32,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> int:
    """Store the frozen weights of ``module``'s Linear, plain Embedding and GPT-2 Conv1D layers
    in ``weight_dtype`` and upcast them on the fly; returns how many weights were converted.

    Only frozen weights (``requires_grad=False``) change: freeze the backbone first (adapters
    stay trainable and untouched). Biases, norms and trainable layers stay in the compute dtype.
    A weight shared by two layers (a tied head) is converted once and stays shared.
    """
    from transformers.pytorch_utils import Conv1D

    if isinstance(weight_dtype, str):
        if weight_dtype not in _HALF:
            raise ValueError(f"weight_dtype {weight_dtype!r} must be 'float16' or 'bfloat16'")
        weight_dtype = _HALF[weight_dtype]
    if weight_dtype not in _HALF.values():
        raise ValueError(f"weight_dtype {weight_dtype} must be torch.float16 or torch.bfloat16")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")

    converted: dict[int, nn.Parameter] = {}
    for layer in module.modules():
        if type(layer) is nn.Linear:
            forward = _linear_forward
        elif type(layer) is nn.Embedding:
            forward = _embedding_forward
        elif isinstance(layer, Conv1D):
            forward = _conv1d_forward
        else:
            continue  # subclasses (a scaled embedding) keep their own forward, in full
        weight = layer.weight
        if weight.requires_grad:
            continue
        if id(weight) not in converted:
            converted[id(weight)] = nn.Parameter(
                weight.detach().to(weight_dtype), requires_grad=False
            )
        layer.weight = converted[id(weight)]
        bias = getattr(layer, "bias", None)
        if bias is not None and not bias.requires_grad:
            bias.data = bias.data.to(compute_dtype)
        layer.half_storage_chunk_rows = chunk_rows
        layer.half_storage_compute_dtype = compute_dtype
        layer.forward = types.MethodType(forward, layer)
    return len(converted)
