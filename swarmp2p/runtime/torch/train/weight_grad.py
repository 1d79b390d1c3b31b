"""The split backward of the zero-bubble schedules: B now, W later (Qi et al., ICLR 2024).

A stage's backward under ``zb-h1``/``zb-h2`` computes the gradient of its input first (B), so
the stage before can go on, and defers the weight-gradient products of its blocks' trainable
linear layers (W) to an op the schedule places in its idle time. :func:`split_linears` turns
those layers into :class:`SplitLinear` (the same module, weight and state dict; only
``forward`` differs), whose backward, while a :class:`WeightGradStore` collects, returns the
input gradient and queues ``grad.T @ x`` (and the bias's row sum); ``store.apply(micro)`` runs
the queue and accumulates into ``.grad`` as autograd would. Outside a collection the layer's
backward computes everything at once, so evaluation and other schedules are unchanged.

What is deferred: plain and oneDNN (``packed.OneDnnLinear``) layers and LoRA's adapter layers
that train. Frozen layers (a LoRA or QLoRA base, half-stored weights) have no weight gradient;
norms, embeddings, compressors and the head (its deferred product would hold a chunk's float32
logits gradient until W) keep theirs in B. The products are the ones the layer's own class
runs (oneDNN on a float32 CPU stage), so the gradients equal the unsplit backward's within
float32 rounding (the order micro-batches add up in is unchanged).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from swarmp2p.runtime.torch.model.packed import OneDnnLinear, _product


class WeightGradStore:
    """One stage's deferred weight-gradient products, per micro-batch."""

    def __init__(self) -> None:
        self._collecting: list[Callable[[], None]] | None = None
        self._pending: dict[int, list[Callable[[], None]]] = {}

    @property
    def collecting(self) -> bool:
        return self._collecting is not None

    def defer(self, product: Callable[[], None]) -> None:
        assert self._collecting is not None
        self._collecting.append(product)

    def collect(self, micro: int, backward: Callable[[], None]) -> None:
        """Run ``backward`` (micro-batch ``micro``'s B), queueing its weight products."""
        if micro in self._pending:
            raise ValueError(f"micro-batch {micro}'s backward ran twice before its W")
        self._collecting = []
        try:
            backward()
            self._pending[micro] = self._collecting
        finally:
            self._collecting = None

    def apply(self, micro: int) -> None:
        """Micro-batch ``micro``'s W: its queued products, accumulated into the weights."""
        products = self._pending.pop(micro, None)
        if products is None:
            raise ValueError(f"W{micro} before B{micro}: the op list is out of order")
        for product in products:
            product()

    def pending(self) -> list[int]:
        return sorted(self._pending)

    def clear(self) -> None:
        self._pending.clear()


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store, onednn):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.onednn, ctx.has_bias = store, onednn, bias is not None
        ctx.bias = bias
        if onednn:
            return _product(x, weight, bias)
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _product(grad, weight.t(), None) if ctx.onednn else grad @ weight
        rows = grad.reshape(-1, grad.shape[-1])
        xs = x.reshape(-1, x.shape[-1])
        want_w, want_b = ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]

        def weight_grads():
            if ctx.onednn:
                gw = _product(rows.t(), xs.t(), None) if want_w else None
            else:
                gw = rows.t() @ xs if want_w else None
            gb = rows.sum(0) if want_b else None
            return gw, gb

        store: WeightGradStore = ctx.store
        if store.collecting:
            bias = ctx.bias

            def product() -> None:
                gw, gb = weight_grads()
                if gw is not None:
                    _accumulate(weight, gw)
                if gb is not None:
                    _accumulate(bias, gb)

            store.defer(product)
            return grad_x, None, None, None, None
        gw, gb = weight_grads()
        return grad_x, gw, gb, None, None


class SplitLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient a collecting :class:`WeightGradStore` defers."""

    split_store: WeightGradStore
    split_onednn: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous() if self.split_onednn else x
        return _SplitLinearFn.apply(x, self.weight, self.bias, self.split_store, self.split_onednn)


def split_linears(blocks: nn.Module, store: WeightGradStore) -> int:
    """Turn the trainable plain and oneDNN linear layers under ``blocks`` into
    :class:`SplitLinear` collecting into ``store``, in place; how many."""
    changed = 0
    for child in blocks.modules():
        kind = type(child)
        if kind is SplitLinear:
            child.split_store = store
            changed += 1
            continue
        if kind not in (nn.Linear, OneDnnLinear) or "forward" in vars(child):
            continue
        if not child.weight.requires_grad:
            continue
        child.split_onednn = kind is OneDnnLinear
        child.split_store = store
        child.__class__ = SplitLinear
        changed += 1
    return changed


__all__ = ["SplitLinear", "WeightGradStore", "split_linears"]
